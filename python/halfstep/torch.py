"""halfstep.torch: a torch.optim optimizer for mixed-precision training, and the GradScaler protocol.

    model = model.float()                                      # fp32 parameters: the masters
    opt = halfstep.torch.FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    scaler = halfstep.torch.GradScaler()                      # only for fp16 autocast
    for x, y in data:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()                          # the scale lives on the device
        scaler.step(opt)                                       # check, unscale, clip, AdamW: fused
        scaler.update()
        opt.zero_grad()

FusedAdamW takes fp32 parameters (they are the masters, updated in place: the autocast recipe), or
fp16 or bf16 parameters (it keeps their fp32 masters itself and writes the rounded masters into
them). It reads the gradients wherever PyTorch put them (`.grad`, a new tensor every step or a
bucket view), needs no host synchronisation per step on CUDA tensors (the step runs halfstep's
fused kernels on the current stream and can be captured in a CUDA graph), and runs halfstep's
host backend on CPU tensors (the kernels' own arithmetic, vectorised, on `threads` threads: the
same bits as on a GPU). torch.amp.GradScaler drives it too.

The package's parts: _optim (FusedAdamW), _layouts (where each storage strategy keeps the state),
_scaling (the GradScaler protocol), _checkpoint (state_dict), _hyper (hyperparameter rules),
_ranks, _sharding and _dtensor (process groups and device meshes).
"""

from ._optim import FusedAdamW
from ._scaling import GradScaler

__all__ = ["FusedAdamW", "GradScaler"]
