"""The resume matrix: a run checkpointed at step K and resumed in every order a loop may restore its
objects, with each kind of loss scaler, on one process, on two with ZeRO-1 and on two with FSDP2.

usage (one rank of a two-process topology): resume_worker.py RANK WORLD TOPOLOGY INIT_FILE OUT_FILE

TOPOLOGY single (no process group), zero (FusedAdamW's ZeRO-1 over gloo) or fsdp (FSDP2's DTensor
shards over gloo). matrix() returns, per (scaler, order), what the resumed run did and what the
run it must equal did: the reports of steps K..N-1 and the final weights; or the refusal.
"""

import io
import os
import sys

import torch

from halfstep.torch import FusedAdamW, GradScaler

N, K = 8, 4
INF_STEPS = (1, 5)


def _torch_cpu_scaler():
    try:
        torch.amp.GradScaler("cpu")
        return True
    except Exception:  # noqa: BLE001 (PyTorch < 2.3 has none on the CPU)
        return False


SCALERS = ("halfstep", "torch", "none") if _torch_cpu_scaler() else ("halfstep", "none")
ORDERS = ("optimizer only", "scaler only", "both, optimizer first", "both, scaler first", "scaler created after load")
# What each cell must equal (besides a refusal): the uninterrupted run, or the uninterrupted run in
# which the object a resume did not restore was replaced at step K by a new one, as the resume
# builds it (a fresh optimizer over the model's weights; a GradScaler from its constructor).
EXPECTED = {
    ("halfstep", "optimizer only"): "refused until attached, then the uninterrupted run",
    ("halfstep", "scaler only"): "the run whose optimizer restarted at K",
    ("torch", "optimizer only"): "the run whose GradScaler restarted at K",
    ("torch", "scaler only"): "the run whose optimizer restarted at K",
    ("none", "optimizer only"): "the uninterrupted run",
}
for _s in ("halfstep", "torch"):
    for _o in ORDERS[2:]:
        EXPECTED[(_s, _o)] = "the uninterrupted run"


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False) if int(torch.__version__.split(".")[0]) >= 2 else torch.load(buf)


class Setup:
    """A model, its FusedAdamW and its loss scaler on one topology."""

    def __init__(self, topology, scaler, rank, world, seed=3):
        self.topology, self.kind, self.rank, self.world = topology, scaler, rank, world
        self.model = self.new_model(seed)
        self.opt = self.new_optimizer()
        self.scaler = self.new_scaler()

    def new_model(self, seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 5))
        if self.topology == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (self.world,))
            for layer in (model[0], model[2], model):
                fully_shard(layer, mesh=mesh)
        return model

    def new_optimizer(self):
        import torch.distributed as dist
        group = dist.group.WORLD if self.topology == "zero" else None
        return FusedAdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5,
                          process_group=group, compute_dtype=torch.bfloat16)

    def new_scaler(self):
        if self.kind == "halfstep":
            return GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        if self.kind == "torch":
            if self.topology == "fsdp":  # its found_inf is all-reduced over the shards
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
                return ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
            return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
        return None

    def iterate(self, k):
        g = torch.Generator().manual_seed(500 + k)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if k in INF_STEPS:
            grad = list(self.model.parameters())[2].grad
            # Plain tensors: the gradients are reduced already, the same on every rank. FSDP2: the
            # last rank's shard.
            if self.topology != "fsdp":
                grad.view(-1)[3] = float("inf")
            elif self.rank == self.world - 1:
                grad._local_tensor.view(-1)[-1] = float("inf")
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()
        return self.opt.last_report()

    def weights(self):
        return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in self.model.parameters()]

    def checkpoint(self):
        return _roundtrip({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                           "scaler": self.scaler.state_dict() if self.scaler is not None else None})


def reference(topology, kind, rank, world, restart=None):
    """The uninterrupted run, or with the optimizer or the scaler replaced at step K."""
    s = Setup(topology, kind, rank, world)
    for k in range(K):
        s.iterate(k)
    if restart == "scaler":
        s.scaler = s.new_scaler()
    elif restart == "optimizer":
        s.opt = s.new_optimizer()
        if kind == "halfstep":  # a GradScaler drives one optimizer: a new one carries the scale
            saved = s.scaler.state_dict()
            s.scaler = s.new_scaler()
            s.scaler.load_state_dict(saved)
    return [s.iterate(k) for k in range(K, N)], s.weights()


def resumed(topology, kind, rank, world, order, attach=False):
    s = Setup(topology, kind, rank, world)
    for k in range(K):
        s.iterate(k)
    saved = s.checkpoint()
    r = Setup(topology, kind, rank, world, seed=11)  # new objects, other weights
    r.model.load_state_dict(saved["model"])
    if order in ("optimizer only", "both, optimizer first", "scaler created after load"):
        r.opt.load_state_dict(saved["opt"])
    if order in ("scaler only", "both, optimizer first", "both, scaler first"):
        r.scaler.load_state_dict(saved["scaler"])
    if order == "both, scaler first":
        r.opt.load_state_dict(saved["opt"])
    if order == "scaler created after load":
        r.scaler = r.new_scaler()
        r.scaler.load_state_dict(saved["scaler"])
    if attach:
        r.scaler.attach(r.opt)
    try:
        reports = [r.iterate(K)]
    except RuntimeError as e:
        return {"refused": str(e)}
    reports += [r.iterate(k) for k in range(K + 1, N)]
    return {"reports": reports, "weights": r.weights()}


def matrix(topology, rank=0, world=1):
    out = {}
    refs = {}
    for kind in SCALERS:
        for order in ORDERS:
            if kind == "none" and order != "optimizer only":
                continue
            expected = EXPECTED[(kind, order)]
            restart = "optimizer" if "optimizer restarted" in expected else \
                "scaler" if "GradScaler restarted" in expected else None
            if (kind, restart) not in refs:
                refs[(kind, restart)] = reference(topology, kind, rank, world, restart)
            cell = {"expected": expected, "want": refs[(kind, restart)]}
            cell["got"] = resumed(topology, kind, rank, world, order)
            if "refused" in cell["got"] and "attached" in expected:
                cell["attached"] = resumed(topology, kind, rank, world, order, attach=True)
            out[(kind, order)] = cell
    return out


def main():
    import torch.distributed as dist
    rank, world, topology = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + sys.argv[4], rank=rank, world_size=world)
    torch.save(matrix(topology, rank, world), sys.argv[5])
    from helpers import leave_process_group
    leave_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
