#!/usr/bin/env python3
"""Reads the generated code of the host backend's passes (src/host_passes.cpp's object) and fails
unless the compiler vectorised them: each AVX2 entry point's code must hold 256-bit vector
arithmetic and each AVX-512 entry point's 512-bit arithmetic — pass 2 (apply) packed-single fused
multiply-adds, square roots and divisions, and the gathers of the 8-bit block step (vgatherdps
decoding codes through a code table, vpgatherdq fetching the encoder's table entries); pass 1
(measure) packed-double fused multiply-adds —
and the baseline entry points none of AVX's instructions (they run on any x86-64). Skipped
(exit 77) where the library has no vector variants (not x86-64) or objdump is missing.

usage: check_host_vectorised.py OBJECT..."""
import re
import shutil
import subprocess
import sys


def functions(text):
    out, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            name = m.group(1)
            out[name] = []
        elif name is not None and "\t" in line:
            out[name].append(line.split("\t")[-1])
    return out


def main():
    objects = [o for o in sys.argv[1:] if o.endswith("host_passes.cpp.o") or o.endswith("host_passes.cpp.obj")]
    if not objects or not shutil.which("objdump"):
        print("SKIPPED: no host_passes object or no objdump")
        sys.exit(77)
    text = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", objects[0]], check=True,
                          capture_output=True, text=True).stdout
    funcs = functions(text)
    failed = []
    for isa, reg in (("avx2", "ymm"), ("avx512", "zmm")):
        entries = {n: body for n, body in funcs.items() if re.search(r"\b%s_(apply|measure)_(f16|bf16|f32)\b" % isa, n)}
        if not entries:
            if isa == "avx2":
                print("SKIPPED: this build has no vector variants")
                sys.exit(77)
            failed.append("no %s variant beside the AVX2 one" % isa)
            continue
        for kind in ("apply", "measure"):
            for fmt in ("f16", "bf16", "f32"):
                name = next((n for n in entries if re.search(r"\b%s_%s_%s\b" % (isa, kind, fmt), n)), None)
                body = entries.get(name, [])
                wide = sum(reg in i for i in body)
                need = ([r"vfmadd\w*ps.*" + reg, r"vsqrtps.*" + reg, r"vdivps.*" + reg,
                         r"vgatherdps.*" + reg, r"vpgatherdq.*" + reg] if kind == "apply"
                        else [r"vfmadd\w*pd.*" + reg])
                missing = [p for p in need if not any(re.search(p, i) for i in body)]
                print("%s, pass %s, %s gradients: %d instructions, %d on %s registers%s" % (
                    isa, "2" if kind == "apply" else "1", fmt, len(body), wide, reg,
                    "" if not missing else "; missing " + ", ".join(missing)))
                if wide < 50 or missing:
                    failed.append("%s %s %s" % (isa, kind, fmt))
    for n, body in funcs.items():
        if re.search(r"baseline_(apply|measure)_(f16|bf16|f32)\b", n) and any("ymm" in i or i.startswith("v") for i in body):
            failed.append("baseline %s uses AVX" % n)
    if failed:
        sys.exit("not vectorised as required: " + "; ".join(failed))
    print("the host passes are vectorised")


if __name__ == "__main__":
    main()
