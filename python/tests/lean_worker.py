"""One rank of test_lean.py: FusedAdamW with lean state (bfloat16 parameters with int16 remainders,
or without a master, bfloat16 moments rounded stochastically) over a process group, on gloo (CPU).

usage: lean_worker.py RANK WORLD MODE INIT_FILE OUT_FILE [CHECKPOINT_DIR [OTHER_CHECKPOINT_DIR]]

MODE zero: plain bfloat16 parameters, ZeRO-1 (shard=True) and replicated (shard=False), STEPS steps
of the same gradients on every rank (an inf in one step), with remainders, without a master, and
with 8-bit moments (ZeRO-1's cuts, and the replicated ones, moved to block starts).
MODE fsdp: a bfloat16 model under FSDP2 (fully_shard) on a 1-D mesh of WORLD ranks, STEPS steps on
the same batch everywhere in every format, the remainder and the master-free states saved with
torch.distributed.checkpoint into CHECKPOINT_DIR/<format> and, given OTHER_CHECKPOINT_DIR (written
on another number of ranks), loaded from there: the remainder state into optimizers of every
format, the master-free one and the 8-bit one into their own, the 8-bit one into fp32 too.
"""

import sys

import torch
import torch.distributed as dist

from halfstep.torch import FusedAdamW

from helpers import fresh_params, leave_process_group, scaled_grads

# (20, 300): 6000 elements in rows of 300, block8's codes in two blocks a row (256 and 44); the
# others keep fp32 moments under block8.
SHAPES = [(7, 5), (33,), (4, 4, 3), (1,), (40, 3), (20, 300)]
STEPS = 8
LEAN = dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, seed=11)
MASTERLESS = dict(master_weight_dtype=None, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, seed=11)
# 8-bit moments without a master: the leanest state (6 bytes a parameter with bf16 gradients).
BLOCK8 = dict(master_weight_dtype=None, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, seed=11)
FORMATS = {"lean": LEAN, "f32": {},
           "bf16 moments": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, seed=11),
           "masterless": MASTERLESS, "block8": BLOCK8,
           "block8 masters": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, seed=11)}
SAVED = ("lean", "masterless", "block8")  # the formats whose checkpoints load on another number of ranks


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


def zero_block8_resume(out):
    """ZeRO-1 with 8-bit moments: a rank's state_dict (its pieces' codes and scales) resumes bit for
    bit on the same rank, and a rebuild (add_param_group) carries every rank's codes and scales."""
    params = fresh_params(SHAPES, torch.bfloat16, seed=5)
    opt = make(params, dist.group.WORLD, True, **BLOCK8)
    train(params, opt, range(4))
    saved, at_save = opt.state_dict(), [p.detach().clone() for p in params]
    straight = train(params, opt, range(4, 7))
    fresh = [torch.nn.Parameter(t.clone()) for t in at_save]
    again = make(fresh, dist.group.WORLD, True, **BLOCK8)
    again.load_state_dict(saved)
    resumed = train(fresh, again, range(4, 7))
    out["block8 resume"] = dict(same_reports=resumed == straight,
                                same_params=all(torch.equal(a, b) for a, b in zip(params, fresh)))
    held = [v for p in fresh for k, v in again.state[p].items() if isinstance(v, torch.Tensor) and k != "step"]
    out["block8 held codes"] = sum(int(v.dtype == torch.uint8) for v in held)
    # The whole state (every rank's pieces gathered) before and after a rebuild over one more
    # parameter, whose ranges cut the flat space elsewhere.
    before = again._layout.carried()
    again.add_param_group(dict(params=[torch.nn.Parameter(torch.zeros(300, 20, dtype=torch.bfloat16))], lr=1e-3))
    after = again._layout.carried()
    out["block8 carried"] = all(torch.equal(v, after[p][k]) for p, e in before.items() for k, v in e.items())
    out["block8 carried codes"] = sum(int(v.dtype == torch.uint8) for e in before.values() for v in e.values())


IN, HIDDEN, OUT, BATCH = 300, 24, 5, 8  # the first weight, 24 x 300, holds block8 codes


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
                ("masterless from masterless", MASTERLESS, "masterless"), ("block8 from block8", BLOCK8, "block8"),
                ("f32 from block8", FORMATS["f32"], "block8")]:
            fresh = sharded(mesh, seed=11)
            fresh_opt = FusedAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.8, **kw)
            # torch.distributed.checkpoint fills the state_dict it is given, in its dtypes and keys:
            # a block8 checkpoint (codes and scales) loads into an optimizer of its own format,
            # whose state_dict then converts into another (so do fp32 or bf16 ones into block8).
            block8 = (kw.get("exp_avg_dtype") is torch.uint8) != (source == "block8")
            into = FusedAdamW(fresh.parameters(), lr=1e-2, **FORMATS[source]) if block8 else fresh_opt
            target = {"model": fresh.state_dict(), "optim": into.state_dict()}
            dcp.load(target, checkpoint_id=other + "/" + source)
            fresh.load_state_dict(target["model"])
            into.load_state_dict(target["optim"])
            if block8:
                fresh_opt.load_state_dict(into.state_dict())
            out["loaded"][name] = dict(refused=refused_cast(mesh, other + "/" + source, kw, source) if block8 else None,
                state={i: {k: full(v) for k, v in e.items()} for i, e in fresh_opt.state_dict()["state"].items()},
                next=train_model(fresh, fresh_opt, range(STEPS, STEPS + 3)),
                params=[full(p) for p in fresh.parameters()])


def refused_cast(mesh, checkpoint, kw, source):
    """The message of load_state_dict refusing what torch.distributed.checkpoint gives when it fills
    an optimizer of another block8-ness: codes cast to values, or values to codes (allowed with a
    partial load, which leaves the keys the checkpoint lacks as they were)."""
    import torch.distributed.checkpoint as dcp
    model = sharded(mesh, seed=11)
    opt = FusedAdamW(model.parameters(), lr=1e-2, **kw)
    target = {"optim": opt.state_dict()}
    dcp.load(target, checkpoint_id=checkpoint, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    try:
        opt.load_state_dict(target["optim"])
    except ValueError as e:
        return str(e)
    return None


def main():
    rank, world, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[4], rank=rank, world_size=world)
    out = {}
    if mode == "zero":
        zero(out, world)
        zero_block8_resume(out)
    else:
        fsdp(out, world, sys.argv[6], sys.argv[7] if len(sys.argv) > 7 else None)
    torch.save(out, sys.argv[5])
    leave_process_group()


if __name__ == "__main__":
    main()
