"""How the ranks of a process group agree before they act together: each says whether its own
checks passed and a fingerprint of what it is about to do; one all-reduce tells every rank
whether all passed and all fingerprints are the same, so that every rank raises or none does
(rather than let later collectives hang or mix up data)."""

import hashlib as _hashlib

import torch
import torch.distributed as _dist


def fingerprint(data):
    """56 bits of a hash of `data` (bytes), for ranks to compare. Not a CRC: the library's state
    ends with its own CRC-32, and a CRC over a message and its CRC is the same for every message."""
    return int.from_bytes(_hashlib.blake2b(data, digest_size=7).digest(), "little")


def agree(group, device, ok, data):
    """All-reduces, over `group`, whether this rank's checks passed (`ok`) and the fingerprint of
    `data` (ignored when not ok). Returns (every rank passed, every rank's fingerprint is the
    same). `device` is where the group's backend reduces (CUDA for NCCL, the CPU for gloo)."""
    mine = fingerprint(data) if ok else 0
    flags = torch.tensor([0 if ok else 1, mine, -mine], dtype=torch.int64, device=device)
    _dist.all_reduce(flags, op=_dist.ReduceOp.MAX, group=group)
    failed, high, low = flags.tolist()
    return not failed, high == mine and -low == mine
