"""One rank of test_lean.py: FusedAdamW with lean state (bfloat16 parameters with int16 remainders,
or without a master, bfloat16 moments rounded stochastically) over a process group, on gloo (CPU).

usage: lean_worker.py RANK WORLD MODE INIT_FILE OUT_FILE [CHECKPOINT_DIR [OTHER_CHECKPOINT_DIR]]

MODE zero: plain bfloat16 parameters, ZeRO-1 (shard=True) and replicated (shard=False), STEPS steps
of the same gradients on every rank (an inf in one step), with remainders and without a master.
MODE fsdp: a bfloat16 model under FSDP2 (fully_shard) on a 1-D mesh of WORLD ranks, STEPS steps on
the same batch everywhere in every format, the remainder and the master-free states saved with
torch.distributed.checkpoint into CHECKPOINT_DIR/<format> and, given OTHER_CHECKPOINT_DIR (written
on another number of ranks), loaded from there: the remainder state into optimizers of every
format, the master-free one into its own.
"""

import sys

import torch
import torch.distributed as dist

from halfstep.torch import FusedAdamW

from helpers import fresh_params, leave_process_group, scaled_grads

SHAPES = [(7, 5), (33,), (4, 4, 3), (1,), (40, 3)]
STEPS = 8
LEAN = dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, seed=11)
MASTERLESS = dict(master_weight_dtype=None, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, seed=11)
FORMATS = {"lean": LEAN, "f32": {},
           "bf16 moments": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, seed=11),
           "masterless": MASTERLESS}
SAVED = ("lean", "masterless")  # the formats whose checkpoints load on another number of ranks


def make(params, pg, shard, **kw):
    return FusedAdamW([dict(params=params[:2], lr=1e-2, weight_decay=0.1), dict(params=params[2:], lr=3e-3)],
                      max_grad_norm=0.5, process_group=pg, shard=shard if pg is not None else None, **kw)


def train(params, opt, steps=range(STEPS)):
    """The same gradients on every rank (an inf in step 3); the reports."""
    reports = []
    for k in steps:
        gen = torch.Generator().manual_seed(300 + k)
        for p, g in zip(params, scaled_grads(SHAPES, torch.bfloat16, 1.0, gen, 1e-2)[1]):
            p.grad = g.clone()
        if k == 3:
            params[2].grad.view(-1)[5] = float("inf")
        opt.step()
        reports.append(opt.last_report())
    return reports


def zero(out, world):
    for name in SAVED:
        for shard in (True, False):
            params = fresh_params(SHAPES, torch.bfloat16, seed=5)
            opt = make(params, dist.group.WORLD, shard, **FORMATS[name])
            out[name, shard] = dict(reports=train(params, opt), params=[p.detach().clone() for p in params])


IN, HIDDEN, OUT, BATCH = 16, 24, 5, 8


def model_of(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, OUT)).bfloat16()


def sharded(mesh, seed=3):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model = model_of(seed)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def train_model(model, opt, steps):
    reports = []
    for k in steps:
        g = torch.Generator().manual_seed(900 + k)
        x, y = torch.randn(BATCH, IN, generator=g).bfloat16(), torch.randn(BATCH, OUT, generator=g)
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        reports.append(opt.last_report())
    return reports


def full(t):
    return t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()


def fsdp(out, world, checkpoint, other):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    for name, kw in FORMATS.items():
        model = sharded(mesh)
        opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.8, **kw)
        reports = train_model(model, opt, range(STEPS))
        state = opt.state_dict()
        out[name] = dict(reports=reports, params=[full(p) for p in model.parameters()],
                         saved={i: {k: full(v) for k, v in e.items()} for i, e in state["state"].items()})
        if name in SAVED:
            dcp.save({"model": model.state_dict(), "optim": state}, checkpoint_id=checkpoint + "/" + name)
            out[name]["next"] = train_model(model, opt, range(STEPS, STEPS + 3))
            out[name]["next_params"] = [full(p) for p in model.parameters()]
    if other:
        # The remainder checkpoint of another number of ranks, into an optimizer of each format
        # here; the master-free one into its own format ("masterless from masterless").
        out["loaded"] = {}
        for name, kw, source in [(n, kw, "lean") for n, kw in FORMATS.items()] + [
                ("masterless from masterless", MASTERLESS, "masterless")]:
            fresh = sharded(mesh, seed=11)
            fresh_opt = FusedAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.8, **kw)
            target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
            dcp.load(target, checkpoint_id=other + "/" + source)
            fresh.load_state_dict(target["model"])
            fresh_opt.load_state_dict(target["optim"])
            out["loaded"][name] = dict(
                state={i: {k: full(v) for k, v in e.items()} for i, e in fresh_opt.state_dict()["state"].items()},
                next=train_model(fresh, fresh_opt, range(STEPS, STEPS + 3)),
                params=[full(p) for p in fresh.parameters()])


def main():
    rank, world, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[4], rank=rank, world_size=world)
    out = {}
    if mode == "zero":
        zero(out, world)
    else:
        fsdp(out, world, sys.argv[6], sys.argv[7] if len(sys.argv) > 7 else None)
    torch.save(out, sys.argv[5])
    leave_process_group()


if __name__ == "__main__":
    main()
