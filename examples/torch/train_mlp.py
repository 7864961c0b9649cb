#!/usr/bin/env python3
"""A small MLP trained two ways, side by side, on the same data from the same weights:

  halfstep: the model in fp16 (bf16 on the CPU), halfstep.torch.FusedAdamW keeping the fp32
            masters, its loss scale on the device, and a warm-up + cosine learning rate that
            follows *applied* steps only, computed on the device (no host synchronisation);
  PyTorch:  the usual recipe: fp32 parameters, autocast to the same format, GradScaler (where this
            PyTorch has one for the device), clip_grad_norm_, AdamW (fused on CUDA), a LambdaLR
            stepped once per iteration (skipped steps advance it too).

An overflow is injected at --overflow-at (the loss times inf on both sides): both skip that step.
Prints loss, loss scale and skips of each every --every steps.

usage: examples/torch/train_mlp.py [--steps 300] [--device cpu|cuda] [--dtype float16|bfloat16]"""

import argparse
import math
import os
import sys

import torch

try:
    import halfstep
    import halfstep.torch as hst
except ImportError:  # running from the source tree without pip install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    import halfstep
    import halfstep.torch as hst


def make_model(width):
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.GELU(), torch.nn.Linear(width, 4))


def lr_at(applied, base, warmup, total):
    """Warm-up then cosine, as a function of the applied-step count (works on tensors)."""
    t = applied.float() if isinstance(applied, torch.Tensor) else torch.tensor(float(applied))
    warm = torch.clamp(t / warmup, max=1.0)
    cos = 0.5 * (1 + torch.cos(math.pi * torch.clamp((t - warmup) / max(total - warmup, 1), 0.0, 1.0)))
    return base * torch.where(t < warmup, warm, cos)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default=None,
                    help="model format (default: float16 on CUDA, bfloat16 on the CPU)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--overflow-at", type=int, default=120)
    ap.add_argument("--every", type=int, default=25)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("float16" if dev.type == "cuda" else "bfloat16"))
    warmup = max(args.steps // 10, 1)
    try:
        torch.ones(1, 1, device=dev, dtype=dtype) @ torch.ones(1, 1, device=dev, dtype=dtype)
    except RuntimeError:
        sys.exit(f"this PyTorch has no {str(dtype)[6:]} matrix product on {dev}: use --dtype bfloat16")

    torch.manual_seed(0)
    teacher = make_model(32).to(dev)
    start = make_model(args.width).to(dtype)  # the starting weights, in the model format

    # halfstep: the model in fp16/bf16, the optimizer keeps the fp32 masters.
    model = make_model(args.width).to(dev, dtype)
    model.load_state_dict(start.state_dict())
    opt = hst.FusedAdamW(model.parameters(), lr=0.0, weight_decay=0.01, max_grad_norm=1.0,
                         scaler=dict(init_scale=2.0 ** 16, growth_interval=100))
    lr = opt.lr_tensor(0)

    # PyTorch: fp32 parameters from the same (rounded) weights, autocast, GradScaler, AdamW.
    ref = make_model(args.width).to(dev)
    ref.load_state_dict({k: v.float() for k, v in start.state_dict().items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=args.lr, weight_decay=0.01,
                                **({"fused": True} if dev.type == "cuda" else {}))
    sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda k: float(lr_at(k, 1.0, warmup, args.steps)))
    scaler = None
    if dev.type == "cuda":
        scaler = torch.cuda.amp.GradScaler(init_scale=2.0 ** 16, growth_interval=100)
    elif hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler"):
        try:
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=100)
        except (TypeError, RuntimeError):
            scaler = None

    print(f"halfstep {halfstep.version()} with torch {torch.__version__} on {dev}, model {str(dtype)[6:]}, "
          f"{sum(p.numel() for p in model.parameters())} parameters; "
          f"PyTorch side: fp32 + autocast {'+ GradScaler' if scaler else '(this PyTorch has no GradScaler here)'}")
    print(f"{'step':>5} | {'halfstep loss':>13} {'scale':>8} {'skips':>5} {'lr':>9} | "
          f"{'PyTorch loss':>12} {'scale':>8} {'skips':>5} {'lr':>9}")
    gen = torch.Generator(device="cpu").manual_seed(1)
    skips = ref_skips = 0
    for step in range(args.steps):
        x = torch.randn(64, 16, generator=gen).to(dev)
        with torch.no_grad():
            y = teacher(x)
        boom = math.inf if step == args.overflow_at else 1.0

        # halfstep: the schedule reads the applied-step counter on the device.
        lr.copy_(lr_at(opt.applied_steps, args.lr, warmup, args.steps))
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        (loss * opt.loss_scale * boom).backward()
        opt.step()
        opt.zero_grad()
        report = opt.last_report()  # waits for this step only; a training loop need not ask
        skips += report["outcome"] != "applied"

        # PyTorch.
        with torch.autocast(dev.type, dtype=dtype):
            ref_loss = torch.nn.functional.mse_loss(ref(x).float(), y)
        ref_lr = ref_opt.param_groups[0]["lr"]
        if scaler is not None:
            before = scaler.get_scale()
            scaler.scale(ref_loss * boom).backward()
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            scaler.step(ref_opt)
            scaler.update()
            ref_skips += scaler.get_scale() < before
            ref_scale = f"{scaler.get_scale():8.0f}"
        else:
            (ref_loss * boom).backward()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            if torch.isfinite(norm):
                ref_opt.step()
            else:
                ref_skips += 1
            ref_scale = f"{'-':>8}"
        ref_opt.zero_grad(set_to_none=True)
        sched.step()

        if step % args.every == 0 or step == args.steps - 1 or step == args.overflow_at:
            print(f"{step:5d} | {float(loss):13.5f} {report['scale_used']:8.0f} {skips:5d} {float(lr):9.2e} | "
                  f"{float(ref_loss):12.5f} {ref_scale} {ref_skips:5d} {ref_lr:9.2e}"
                  + ("   <- overflow injected" if step == args.overflow_at else ""))
    print(f"halfstep: {int(opt.applied_steps)} applied of {args.steps}; its schedule followed applied steps, "
          f"PyTorch's LambdaLR counted every iteration")


if __name__ == "__main__":
    main()
