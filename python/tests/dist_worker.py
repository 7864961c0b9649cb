"""One rank of test_distributed.py: FusedAdamW over a gloo process group on the CPU.

usage: dist_worker.py RANK WORLD SHARD(0|1) DTYPE INIT_FILE OUT_FILE [MODE]

MODE train (default): 12 steps from weights that rank 0 broadcasts after the optimizer was built
(as DistributedDataParallel does); mismatch: rank 1 builds another optimizer; badarg: rank 1
passes an argument its own checks refuse; badload: a state_dict that rank 0 alone refuses;
mixedsteps: each rank loads a state_dict of another step; lronerank: rank 1 alone changes a
learning rate before step 5; refuse: rank 1's step() refuses a gradient of the wrong shape at step 4; resume: a state_dict taken right after rank 0's weights were
broadcast (before any step) is loaded into a new optimizer on other weights, and both train on."""

import sys

import torch
import torch.distributed as dist

from halfstep.torch import FusedAdamW

from helpers import fresh_params, leave_process_group, scaled_grads

SHAPES = [(7, 5), (33,), (4, 4, 3), (1,)]
STEPS = 12


def flat_position(flat):
    """(tensor, element) of an index of the flat parameter space."""
    for t, s in enumerate(SHAPES):
        n = torch.Size(s).numel()
        if flat < n:
            return t, flat
        flat -= n
    raise IndexError(flat)


def injections(world):
    """(step, rank that holds it, flat index, value): an inf on the last rank only and a NaN on
    rank 0 only, each inside the range that rank owns (under ZeRO-1 the other ranks never read it)."""
    total = sum(torch.Size(s).numel() for s in SHAPES)
    chunk = -(-total // world)
    last = world - 1
    return [(3, last, last * chunk + (total - last * chunk) // 2, float("inf")),
            (6, 0, chunk // 3, float("nan")),
            (9, last, total - 1, float("-inf"))]


def make(dtype, process_group=None, shard=True, seed=1, max_grad_norm=0.5):
    params = fresh_params(SHAPES, dtype, seed=seed)
    opt = FusedAdamW([dict(params=params[:2], lr=1e-2, weight_decay=0.1), dict(params=params[2:], lr=3e-3)],
                     max_grad_norm=max_grad_norm, scaler=dict(init_scale=2.0 ** 10, growth_interval=4),
                     process_group=process_group, shard=shard)
    return params, opt


def train(params, opt, dtype, rank, world, lr_change=None, refuse=None, refusals=None):
    gen = torch.Generator().manual_seed(2)
    reports = []
    for step in range(STEPS):
        if lr_change is not None and step == lr_change:
            opt.param_groups[0]["lr"] *= 0.5
        _, grads = scaled_grads(SHAPES, dtype, float(opt.loss_scale), gen, 1e-2)  # as after DDP: the same everywhere
        for at, holder, flat, value in injections(world):
            if at == step and holder == rank:
                t, i = flat_position(flat)
                grads[t].view(-1)[i] = value
        for p, g in zip(params, grads):
            p.grad = g.clone()
        if refuse is not None and step == refuse:
            params[1].grad.resize_(3)  # not the parameter's shape: this rank's step() refuses it
            try:
                opt.step()
            except RuntimeError as e:
                refusals.append((step, str(e)))
        else:
            opt.step()
        reports.append(opt.last_report())
    return reports


def main():
    rank, world, shard = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    dtype = getattr(torch, sys.argv[4])
    mode = sys.argv[7] if len(sys.argv) > 7 else "train"
    dist.init_process_group("gloo", init_method="file://" + sys.argv[5], rank=rank, world_size=world)
    out = {}
    if mode in ("mismatch", "badarg"):
        try:
            if mode == "mismatch":
                make(dtype, dist.group.WORLD, shard, max_grad_norm=0.5 if rank != 1 else 1.0)
            else:  # an argument only rank 1's checks refuse
                make(dtype, dist.group.WORLD, shard, max_grad_norm=0.5 if rank != 1 else -1.0)
        except Exception as e:  # noqa: BLE001
            out["refused"] = "%s: %s" % (type(e).__name__, e)
    elif mode == "resume":
        params, opt = make(dtype, dist.group.WORLD, shard, seed=1 + rank)
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.detach().view(-1).view(torch.uint8), 0)
        sd = opt.state_dict()  # before any step: the masters must be the broadcast weights
        other, resumed = make(dtype, dist.group.WORLD, shard, seed=50 + rank)
        resumed.load_state_dict(sd)
        out["loaded"] = [p.detach().clone() for p in other]
        out["broadcast"] = [p.detach().clone() for p in params]
        out["reports"] = train(params, opt, dtype, rank, world)
        out["resumed_reports"] = train(other, resumed, dtype, rank, world)
        out.update(params=[p.detach() for p in params], resumed_params=[p.detach() for p in other])
    elif mode == "mixedsteps":
        params, opt = make(dtype, dist.group.WORLD, shard)
        for k in range(4):  # every rank takes every step (collectives); rank r saves after 2 + r
            float(opt.loss_scale)  # (no gradients: a step that moves nothing, its scale read)
            opt.step()
            if k == 1 + rank:
                sd = opt.state_dict()
        before = opt.scaler_state()
        try:
            opt.load_state_dict(sd)
        except ValueError as e:
            out["refused"] = str(e)
        out["unchanged"] = opt.scaler_state() == before
    else:
        # Each rank starts from its own weights; rank 0's reach every rank after the optimizer was
        # built (DistributedDataParallel's broadcast): the step takes them as the masters.
        params, opt = make(dtype, dist.group.WORLD, shard, seed=1 + rank)
        with torch.no_grad():
            for p in params:
                dist.broadcast(p.detach().view(-1).view(torch.uint8), 0)  # (gloo has no bf16)
        if mode == "badload":
            train(params, opt, dtype, rank, world)
            sd = opt.state_dict()
            if rank == 0:
                sd["state"][0]["exp_avg"][0] = float("nan")
            try:
                opt.load_state_dict(sd)
            except ValueError as e:
                out["refused"] = str(e)
            out["state_after"] = opt.state_dict()["state"]
            out["expected"] = sd["state"] if rank != 0 else None
        out["refusals"] = []
        out["reports"] = train(params, opt, dtype, rank, world,
                               lr_change=5 if mode == "lronerank" and rank == 1 else None,
                               refuse=4 if mode == "refuse" and rank == 1 else None, refusals=out["refusals"])
        out.update(params=[p.detach() for p in params], scaler=opt.scaler_state(), applied=int(opt.applied_steps))
    torch.save(out, sys.argv[6])
    leave_process_group()


if __name__ == "__main__":
    main()
