"""Loads a checkpoint halfstep wrote with Python's safetensors package and checks every tensor
against what halfstep says it wrote (dtype, elements, an FNV-1a hash of the bytes) and the
metadata; then writes the same tensors and metadata back with safetensors' own writer, for
halfstep to resume from.

usage: check_safetensors.py DIR     (DIR holds halfstep.safetensors and expected.txt)
"""
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file


def fnv(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def main(folder: str) -> int:
    path = f"{folder}/halfstep.safetensors"
    tensors = load_file(path)
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
    want = {}
    for line in open(f"{folder}/expected.txt"):
        parts = line.split()
        if parts[0] == "meta":
            if meta.get(parts[1]) != parts[2]:
                print(f"metadata {parts[1]}: {meta.get(parts[1])!r}, want {parts[2]!r}")
                return 1
            continue
        want[parts[0]] = (parts[1], int(parts[2]), int(parts[3]))
    if set(tensors) != set(want):
        print(f"tensors {sorted(tensors)}, want {sorted(want)}")
        return 1
    dtypes = {"F32": np.float32, "F16": np.float16}
    for name, (dtype, numel, digest) in want.items():
        t = tensors[name]
        if t.dtype != dtypes[dtype] or t.shape != (numel,) or fnv(t.tobytes()) != digest:
            print(f"{name}: {t.dtype} {t.shape}, want {dtype} ({numel},) with the written bytes")
            return 1
    for key in ("halfstep.version", "halfstep.optimizer_state"):
        if key not in meta:
            print(f"metadata lacks {key}")
            return 1
    save_file(tensors, f"{folder}/from_python.safetensors", metadata=meta)
    print(f"safetensors read {len(tensors)} tensors and the metadata halfstep wrote; rewrote them")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
