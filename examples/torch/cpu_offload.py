#!/usr/bin/env python3
"""FSDP2 with CPU-offloaded state: halfstep.torch.FusedAdamW steps the sharded parameters and
gradients where FSDP2 keeps them, in host memory, on halfstep's host backend (the kernels' own
arithmetic, vectorised, on --threads threads): the check, the exact global norm across the ranks,
the clip and AdamW in one fused step, the same bits on any number of threads.

Run it with one process per rank (gloo on a machine without GPUs, NCCL with them):

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/torch/cpu_offload.py

Each rank trains its shard of a small transformer-like MLP stack on its own batches; rank 0 prints
the loss, the global gradient norm and what the step did every --every steps.

usage: examples/torch/cpu_offload.py [--steps 40] [--threads N] [--every 10] [--width 256]"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

try:
    import halfstep.torch as hst
except ImportError:  # running from the source tree without pip install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    import halfstep.torch as hst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="host threads of the step (default: torch's)")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--width", type=int, default=256)
    args = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(w, 4 * w), torch.nn.GELU(), torch.nn.Linear(4 * w, w))
                                  for _ in range(3)], torch.nn.Linear(w, 16))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=cuda)  # pinned memory needs a GPU
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    # The parameters FSDP2 hands the optimizer are fp32 DTensor shards in host memory.
    opt = hst.FusedAdamW(model.parameters(), lr=2e-3, weight_decay=0.01, max_grad_norm=1.0,
                         compute_dtype=torch.bfloat16, threads=args.threads)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    gen = torch.Generator().manual_seed(1000 + rank)
    target = torch.nn.Linear(w, 16)
    applied = 0
    for step in range(1, args.steps + 1):
        x = torch.randn(32, w, generator=gen)
        with torch.no_grad():
            y = target(x)
        loss = torch.nn.functional.mse_loss(model(x.to(device)).float(), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        report = opt.last_report()
        applied += report["outcome"] == "applied"
        if rank == 0 and (step % args.every == 0 or step == 1):
            print("step %4d  loss %.4e  |g| %.3e  %s" % (step, loss.item(), report["grad_norm"], report["outcome"]),
                  flush=True)
    if rank == 0:
        p = next(model.parameters())
        print("halfstep: %d applied of %d on %d ranks, parameters on %s (%s shards), step on %d host threads" %
              (applied, args.steps, world, p.to_local().device, type(p).__name__, opt.threads), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
