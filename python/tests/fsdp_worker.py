"""One rank of test_fsdp.py: halfstep.torch.FusedAdamW over FSDP2 (fully_shard) and DDP models, on
gloo (CPU).

usage: fsdp_worker.py RANK WORLD INIT_FILE OUT_FILE MODE [CHECKPOINT_DIR [OTHER_CHECKPOINT_DIR]]

MODE fsdp: a fully_shard model (fp32 sharded parameters, bf16 compute, fp32 reduction) trained by
FusedAdamW: EXACT_STEPS steps on the same batch on every rank (an inf injected into the last rank's
shard of one parameter at INF_STEP), then MIXED_STEPS on each rank's own batch, recording for those
the float64 norm of the full reduced gradient; then the model and optimizer state saved with
torch.distributed.checkpoint into CHECKPOINT_DIR and, given OTHER_CHECKPOINT_DIR (written on another
number of ranks), loaded from there into a new model and optimizer. The same steps on a 2-D mesh
(Replicate() over the mesh's first dimension: HSDP) when WORLD is 2.
MODE offload: the same model with FSDP2's CPUOffloadPolicy, stepped on 1 and 2 host threads.
MODE ddp: DistributedDataParallel models (gradient_as_bucket_view off and on) under bf16 autocast,
each with FusedAdamW over the group (ZeRO-1 and replicated), EXACT_STEPS steps on the same batch.
"""

import sys

import torch
import torch.distributed as dist

from halfstep.torch import FusedAdamW

from helpers import leave_process_group

EXACT_STEPS = 6
INF_STEP = 3
INF_PARAM = 2
MIXED_STEPS = 3
IN, HIDDEN, OUT, BATCH = 16, 24, 5, 8


def model_of(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT))


def batch(step, rank=0):
    g = torch.Generator().manual_seed(1000 + 7919 * rank + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def optimizer(params, **kw):
    return FusedAdamW(params, lr=1e-2, weight_decay=0.1, max_grad_norm=0.8, compute_dtype=torch.bfloat16, **kw)


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).float(), y)


def shard(model, mesh, compute=torch.bfloat16, offload=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    kw = {}
    if offload:  # sharded parameters, gradients and the optimizer's state in host memory
        from torch.distributed.fsdp import CPUOffloadPolicy
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy, **kw)
    fully_shard(model, mesh=mesh, mp_policy=policy, **kw)
    return model


def sharded(mesh, seed=3, compute=torch.bfloat16):
    return shard(model_of(seed), mesh, compute)


def full(t):
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def train_exact(model, opt, rank, world, inject=True, scaler=None, grads=None):
    """EXACT_STEPS steps on the same batch everywhere (the loss scaled by `scaler`, a GradScaler);
    the reports, and into `grads` the full reduced gradients."""
    reports = []
    for step in range(EXACT_STEPS):
        loss = loss_of(model, *batch(step))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if inject and step == INF_STEP and rank == world - 1:
            local = list(model.parameters())[INF_PARAM].grad._local_tensor
            assert local.numel() > 0, "the last rank holds none of the parameter"
            local.view(-1)[-1] = float("inf")
        if grads is not None:
            grads.append([full(p.grad) for p in model.parameters()])
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            reports.append((opt.last_report(), float(scaler.get_scale())))
        else:
            opt.step()
            reports.append(opt.last_report())
        opt.zero_grad()
    return reports


def fsdp(rank, world, out, checkpoint, other):
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed.checkpoint as dcp
    mesh = init_device_mesh("cpu", (world,))
    model = sharded(mesh)
    opt = optimizer(model.parameters())
    out["grads"] = []
    out["reports"] = train_exact(model, opt, rank, world, grads=out["grads"])
    out["params"] = [full(p) for p in model.parameters()]
    out["norms"] = []
    for step in range(MIXED_STEPS):  # each rank its own batch
        loss_of(model, *batch(EXACT_STEPS + step, rank)).backward()
        reduced = torch.cat([full(p.grad).double().reshape(-1) for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        out["norms"].append((opt.last_report()["grad_norm"], float(torch.linalg.vector_norm(reduced))))
    state = opt.state_dict()
    out["saved"] = {i: {k: full(v) for k, v in e.items()} for i, e in state["state"].items()}
    out["saved_scaler"] = opt.scaler_state()
    out["saved_params"] = [full(p) for p in model.parameters()]
    dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=checkpoint)
    if other:
        # A new model and optimizer on this number of ranks, from a checkpoint of another number.
        fresh = sharded(mesh, seed=11)
        fresh_opt = optimizer(fresh.parameters())
        target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        dcp.load(target, checkpoint_id=other)
        fresh.load_state_dict(target["model"])
        fresh_opt.load_state_dict(target["optim"])
        out["loaded"] = {i: {k: full(v) for k, v in e.items()} for i, e in fresh_opt.state_dict()["state"].items()}
        out["loaded_scaler"] = fresh_opt.scaler_state()
        out["loaded_params"] = [full(p) for p in fresh.parameters()]
        loss_of(fresh, *batch(50)).backward()
        fresh_opt.step()
        out["loaded_next"] = fresh_opt.last_report()
    # An optimizer built over the plain model, whose parameters are then swapped for their
    # fully_shard-ed DTensors, as accelerate's FSDP2 preparation (and so Trainer's) does.
    plain = model_of(3)
    swapped_opt = optimizer(plain.parameters())
    pointers = {name: p.data_ptr() for name, p in plain.named_parameters()}
    swapped = dict(shard(plain, mesh).named_parameters())
    by_pointer = {pointers[name]: p for name, p in swapped.items()}
    for group in swapped_opt.param_groups:
        group["params"] = [by_pointer[p.data_ptr()] for p in group["params"]]
    out["swapped_reports"] = train_exact(plain, swapped_opt, rank, world)
    # fp16 compute under loss scaling: halfstep's GradScaler, and torch's ShardedGradScaler driving
    # the fused step (it checks the gradients itself and hands the step its scale).
    from halfstep.torch import GradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    for name, make in (("halfstep", lambda: GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)),
                       ("sharded", lambda: ShardedGradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2))):
        m16 = sharded(mesh, compute=torch.float16)
        o16 = optimizer(m16.parameters())
        out["fp16_" + name] = train_exact(m16, o16, rank, world, scaler=make())
    # What the optimizer refuses, and where.
    out["refused"] = {}
    for what, call in (("mixed", lambda: optimizer(list(model.parameters()) + [torch.nn.Parameter(torch.zeros(3))])),
                       ("shard", lambda: optimizer(model.parameters(), shard=True))):
        try:
            call()
        except ValueError as e:
            out["refused"][what] = str(e)
    if world == 2:
        # HSDP: the parameters replicated over the mesh's first dimension, sharded over its second.
        mesh2 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        model2 = sharded(mesh2)
        opt2 = optimizer(model2.parameters())
        out["hsdp_placements"] = str(next(model2.parameters()).placements)
        out["hsdp_reports"] = train_exact(model2, opt2, rank, world)
        out["hsdp_params"] = [full(p) for p in model2.parameters()]


def offload(rank, world, out):
    """FSDP2 with CPUOffloadPolicy: the step runs on the CPU over the sharded parameters and
    gradients in host memory (halfstep's host backend), on `world` ranks and threads 1 and 2."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    for threads in (1, 2):
        model = shard(model_of(3), mesh, offload=True)
        assert all(p.device.type == "cpu" for p in model.parameters())
        opt = optimizer(model.parameters(), threads=threads)
        assert opt.threads == threads
        grads = []
        out[("reports", threads)] = train_exact(model, opt, rank, world, grads=grads)
        out[("grads", threads)] = grads
        out[("params", threads)] = [full(p) for p in model.parameters()]


def ddp(rank, world, out):
    from torch.nn.parallel import DistributedDataParallel
    out["ddp"] = {}
    for bucket_view in (False, True):
        for shard in (False, True):
            model = model_of(3)
            wrapped = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
            opt = optimizer(model.parameters(), process_group=dist.group.WORLD, shard=shard)
            reports = []
            for step in range(EXACT_STEPS):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = loss_of(wrapped, *batch(step))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=not bucket_view)
                reports.append(opt.last_report())
            out["ddp"][(bucket_view, shard)] = (reports, [p.detach().clone() for p in model.parameters()])


def main():
    rank, world, init, out_file, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    out = {}
    if mode == "fsdp":
        fsdp(rank, world, out, sys.argv[6], sys.argv[7] if len(sys.argv) > 7 else None)
    elif mode == "offload":
        offload(rank, world, out)
    else:
        ddp(rank, world, out)
    torch.save(out, out_file)
    leave_process_group()


if __name__ == "__main__":
    main()
