"""One rank of test_protocol_ranks.py: the protocol between FusedAdamW's ranks on gloo (CPU).

usage: protocol_worker.py RANK WORLD MODE DTYPE INIT_FILE OUT_FILE

MODE set: a set of parameters with a process group; zeroload: ZeRO-1, weights loaded in place on
every rank, then rank 1 refuses its step; moved: rank 0 alone moves its parameters' storage before
the first step (p.data = loaded), then broadcasts them, sharded and replicated; rank0saves:
shard=False, rank 0's state_dict loaded on every rank; torchscaler: torch.amp.GradScaler drives
each rank's step and rank 1 refuses one; dcpapi: FSDP2, torch.distributed.checkpoint's
get_optimizer_state_dict / set_optimizer_state_dict across a save and a load; gradpresence:
rank 1 alone drops one parameter's gradient (p.grad = None) for one step, sharded and replicated.
"""

import os
import sys

import torch
import torch.distributed as dist

from halfstep.torch import FusedAdamW

from helpers import fresh_params, leave_process_group, scaled_grads

SHAPES = [(7, 5), (33,), (4, 4, 3), (1,)]


def make(params, shard, **kw):
    return FusedAdamW([dict(params=params[:2], lr=1e-2, weight_decay=0.1), dict(params=params[2:], lr=3e-3)],
                      max_grad_norm=0.5, process_group=dist.group.WORLD if shard is not None else None,
                      shard=shard if shard is not None else None, **kw)


def grads_of(step, dtype, scale):
    """The gradients of `step` (the same on every rank, as after DistributedDataParallel's reduction)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return scaled_grads(SHAPES, dtype, scale, gen, 1e-2)[1]


def iterate(params, opt, dtype, step):
    for p, g in zip(params, grads_of(step, dtype, float(opt.loss_scale))):
        p.grad = g.clone()
    opt.step()
    return opt.last_report()


def copy(params):
    return [p.detach().clone() for p in params]


def broadcast(params):
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.detach().view(-1).view(torch.uint8), 0)  # (gloo has no bf16)


def main():
    rank, world, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dtype = getattr(torch, sys.argv[4])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[5], rank=rank, world_size=world)
    out = {}
    if mode == "set":
        params = fresh_params(SHAPES, dtype, seed=1)
        for what, arg in (("set", set(params)), ("group set", [dict(params=set(params))])):
            try:
                FusedAdamW(arg, process_group=dist.group.WORLD)
            except TypeError as e:
                out[what] = str(e)
    elif mode == "zeroload":
        params = fresh_params(SHAPES, dtype, seed=1)
        opt = make(params, True, scaler=dict(init_scale=2.0 ** 10))
        for k in range(3):
            iterate(params, opt, dtype, k)
        pretrained = fresh_params(SHAPES, dtype, seed=7)
        with torch.no_grad():  # model.load_state_dict(pretrained) on every rank, in place
            for p, w in zip(params, pretrained):
                p.copy_(w)
        for p, g in zip(params, grads_of(3, dtype, float(opt.loss_scale))):
            p.grad = g.clone()
        if rank == 1:
            params[1].grad.resize_(3)  # not the parameter's shape: this rank's step() refuses it
        try:
            opt.step()
        except RuntimeError as e:
            out["refused"] = str(e)
        out["report"] = opt.last_report()
        out["after_refused"] = copy(params)
        out["pretrained"] = copy(pretrained)
        out["reports"] = [iterate(params, opt, dtype, k) for k in (4, 5)]
        out["params"] = copy(params)
    elif mode == "moved":
        for shard in (True, False):
            params = fresh_params(SHAPES, dtype, seed=1 + rank)
            opt = make(params, shard, scaler=dict(init_scale=2.0 ** 10))
            if rank == 0:  # rank 0 alone loads a checkpoint by swapping the storage
                for p, w in zip(params, fresh_params(SHAPES, dtype, seed=7)):
                    p.data = w.detach().clone()
            broadcast(params)
            out[shard] = dict(reports=[iterate(params, opt, dtype, k) for k in range(4)], params=copy(params))
    elif mode == "rank0saves":
        params = fresh_params(SHAPES, dtype, seed=1)
        opt = make(params, False, scaler=dict(init_scale=2.0 ** 10, growth_interval=2))
        for k in range(3):
            iterate(params, opt, dtype, k)
        box = [opt.state_dict() if rank == 0 else None]  # rank 0 saves ...
        dist.broadcast_object_list(box, 0)
        rest = [iterate(params, opt, dtype, k) for k in range(3, 6)]
        other = fresh_params(SHAPES, dtype, seed=9)
        resumed = make(other, False, scaler=dict(init_scale=2.0 ** 10, growth_interval=2))
        resumed.load_state_dict(box[0])  # ... and every rank loads
        out.update(rest=rest, again=[iterate(other, resumed, dtype, k) for k in range(3, 6)], params=copy(params),
                   resumed=copy(other))
    elif mode == "torchscaler":
        params = fresh_params(SHAPES, torch.float32, seed=1)
        opt = make(params, True, compute_dtype=torch.bfloat16)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        reports = []
        for k in range(8):
            loss = sum(((p.float() * (k + 1)) ** 2).sum() for p in params) * 1e-3
            scaler.scale(loss).backward()
            if rank == 1 and k == 2:
                opt.param_groups[0]["lr"] = -1.0  # this rank's step() refuses it
                try:
                    scaler.step(opt)
                except ValueError as e:
                    out["refused"] = str(e)
                opt.param_groups[0]["lr"] = 1e-2
            else:
                scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            reports.append(opt.last_report())
        out.update(reports=reports, params=copy(params), scales=scaler.get_scale())
    elif mode == "zeroextras":
        params = fresh_params(SHAPES, dtype, seed=1)
        opt = make(params, True, scaler=dict(init_scale=2.0 ** 10))
        for k in range(2):
            iterate(params, opt, dtype, k)
        for i, p in enumerate(params):
            opt.state[p]["ema"] = torch.full((2,), float(10 * rank + i))
        sd = opt.state_dict()
        other = fresh_params(SHAPES, dtype, seed=9)
        resumed = make(other, True, scaler=dict(init_scale=2.0 ** 10))
        resumed.load_state_dict(sd)
        out["ema"] = [resumed.state[p]["ema"].clone() for p in other]
        out["rest"] = [iterate(params, opt, dtype, k) for k in range(2, 4)]
        out["again"] = [iterate(other, resumed, dtype, k) for k in range(2, 4)]
        out.update(params=copy(params), resumed=copy(other))
    elif mode == "scalerrefuse":
        from halfstep.torch import GradScaler
        params = fresh_params(SHAPES, torch.float32, seed=1)
        opt = make(params, True)
        scaler = GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)

        def scaled_step(o, sc, ps, k):
            loss = sum(((p.float() * (k + 1)) ** 2).sum() for p in ps) * 1e-3
            sc.scale(loss).backward()
            if k == 1:
                ps[1].grad.view(-1)[0] = float("inf")  # the scale backs off to 512
            sc.step(o)
            sc.update()
            o.zero_grad()
            return o.last_report()
        for k in range(3):
            scaled_step(opt, scaler, params, k)
        saved, saved_scaler = opt.state_dict(), scaler.state_dict()
        other = fresh_params(SHAPES, torch.float32, seed=9)
        resumed = make(other, True)
        resumed.load_state_dict(saved)
        fresh = GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        if rank == 0:
            fresh.load_state_dict(saved_scaler)  # rank 1 forgets: its first scale() uses 1024, not 512
        try:
            scaled_step(resumed, fresh, other, 3)
        except RuntimeError as e:
            out["refused"] = str(e)
        out["report"] = resumed.last_report()
    elif mode == "dcpapi":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))

        def model_and_opt(seed):
            torch.manual_seed(seed)
            model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))
            for layer in (model[0], model[2], model):
                fully_shard(layer, mesh=mesh)
            return model, FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5,
                                     scaler=dict(init_scale=2.0 ** 8, growth_interval=2))

        def train(model, opt, steps):
            reports = []
            for k in steps:
                g = torch.Generator().manual_seed(500 + k)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
                (torch.nn.functional.mse_loss(model(x), y) * opt.loss_scale).backward()
                if k == 1:
                    list(model.parameters())[0].grad._local_tensor.view(-1)[0] = float("inf")
                opt.step()
                opt.zero_grad()
                reports.append(opt.last_report())
            return reports

        def full(model):
            return [p.full_tensor().detach().clone() for p in model.parameters()]

        model, opt = model_and_opt(3)
        train(model, opt, range(3))
        path = sys.argv[5] + ".dcp"  # one checkpoint, every rank's shards
        dcp.save({"optim": get_optimizer_state_dict(model, opt), "model": model.state_dict()}, checkpoint_id=path)
        out["rest"] = train(model, opt, range(3, 6))
        out["params"] = full(model)
        fresh, fresh_opt = model_and_opt(11)
        target = {"optim": get_optimizer_state_dict(fresh, fresh_opt), "model": fresh.state_dict()}
        dcp.load(target, checkpoint_id=path)
        fresh.load_state_dict(target["model"])
        set_optimizer_state_dict(fresh, fresh_opt, target["optim"])
        out["attempts"] = fresh_opt.scaler_state()["attempts"]
        out["again"] = train(fresh, fresh_opt, range(3, 6))
        out["resumed"] = full(fresh)
    elif mode == "gradpresence":
        for shard in (True, False):
            params = fresh_params(SHAPES, dtype, seed=1)
            opt = make(params, shard, scaler=dict(init_scale=2.0 ** 10))
            reports = []
            for k in range(4):
                for p, g in zip(params, grads_of(k, dtype, float(opt.loss_scale))):
                    p.grad = g.clone()
                if k == 2 and rank == 1:
                    params[3].grad = None  # this rank alone steps without it
                opt.step()
                reports.append(opt.last_report())
            out[shard] = dict(reports=reports, params=copy(params))
    torch.save(out, sys.argv[6])
    leave_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
