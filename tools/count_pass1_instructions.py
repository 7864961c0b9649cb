#!/usr/bin/env python3
"""Counts the instructions per gradient element in pass 1's vector loop, for each gradient format:
compiles kernels/check_and_norm.cu for sm_90, finds the loop that issues the four 16-byte loads
(32 elements an iteration per thread) and divides its instruction count by 32. PTX always; SASS
(what the GPU issues) when cuobjdump is on PATH or in .venv (tools/install_deps.sh installs
PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm, which it calls, there). Pass 1 is bound by instruction issue on an H200 once it needs
more than about 16 per element (132 SMs x 128 lanes x 1.98 GHz / 2.15e12 elements/s).

With --base REV the kernels of git revision REV are counted too, for a before/after table. With
--sass-below f16=X,bf16=Y the script fails unless the SASS counts are below those (exit code 77,
"skipped", when there is no cuobjdump).

usage: tools/count_pass1_instructions.py [--kernels DIR] [--nvcc NVCC] [--base REV] [--sass-below ...]"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fmt_of(name):
    return "bf16" if "DTypeE1E" in name else "f16" if "DTypeE0E" in name else name


def ptx_loops(ptx):
    """{format: instructions per element} of each kernel's vector loop in PTX."""
    out = {}
    for entry in re.split(r"\n(?=(?:\.visible )?\.entry )", ptx):
        m = re.match(r"(?:\.visible )?\.entry (\S+)\(", entry)
        if not m:
            continue
        lines = entry.split("\n")
        labels = {l.strip().rstrip(":"): i for i, l in enumerate(lines) if re.match(r"^\$L__BB\d+_\d+:$", l.strip())}
        best = None
        for i, l in enumerate(lines):
            b = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", l)
            if not b or b.group(1) not in labels or labels[b.group(1)] >= i:
                continue  # not a backward branch
            body = lines[labels[b.group(1)]:i + 1]
            if sum("ld.global.nc.v4" in x for x in body) != 4:
                continue
            count = sum(1 for x in body if x.strip() and not x.strip().startswith(("//", "$", ".", "{", "}")))
            best = count if best is None else min(best, count)
        if best is not None:
            out[fmt_of(m.group(1))] = best / 32.0
    return out


def sass_loops(sass):
    """{format: instructions per element} of each kernel's vector loop in SASS."""
    out = {}
    for func in re.split(r"\n\s*Function : ", sass)[1:]:
        name = func.split("\n")[0]
        ins = []
        for l in func.split("\n"):
            m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", l)
            if m:
                ins.append((int(m.group(1), 16), m.group(2).strip()))
        best = None
        for off, txt in ins:
            m = re.search(r"BRA.*?0x([0-9a-f]+)", txt)
            if not m or int(m.group(1), 16) >= off:
                continue
            body = [t for o, t in ins if int(m.group(1), 16) <= o <= off]
            if sum("LDG.E.128" in t for t in body) == 4:
                best = len(body) if best is None else min(best, len(body))
        if best is not None:
            out[fmt_of(name)] = best / 32.0
    return out


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    hits = glob.glob(os.path.join(ROOT, ".venv", "lib", "python3*", "site-packages", "nvidia", "*", "bin", "cuobjdump"))
    if hits:  # cuobjdump runs nvdisasm, which sits next to it
        os.environ["PATH"] = os.path.dirname(hits[0]) + os.pathsep + os.environ.get("PATH", "")
        return hits[0]
    return None


def count(kernels, include, src, nvcc, cuobjdump, tmp):
    source = os.path.join(kernels, "check_and_norm.cu")
    flags = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-I" + include, "-I" + src, "-I" + kernels, source]
    ptx = os.path.join(tmp, "pass1.ptx")
    subprocess.run(flags[:5] + ["-ptx", "-o", ptx] + flags[5:], check=True)
    result = {"ptx": ptx_loops(open(ptx).read())}
    if cuobjdump:
        cubin = os.path.join(tmp, "pass1.cubin")
        subprocess.run(flags[:5] + ["-cubin", "-o", cubin] + flags[5:], check=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
        result["sass"] = sass_loops(sass)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=os.path.join(ROOT, "kernels"))
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--base", help="also count the kernels of this git revision")
    ap.add_argument("--sass-below", help="fail unless the SASS counts are below these: f16=X,bf16=Y")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump()
    if args.sass_below and not cuobjdump:
        print("SKIPPED: no cuobjdump to count SASS with (tools/install_deps.sh installs one into .venv)")
        sys.exit(77)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        now = count(args.kernels, os.path.join(ROOT, "include"), os.path.join(ROOT, "src"), args.nvcc, cuobjdump, tmp)
        if args.base:
            base_dir = os.path.join(tmp, "base")
            os.makedirs(base_dir)
            archive = subprocess.run(["git", "-C", ROOT, "archive", args.base, "kernels", "include", "src"],
                                     check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", base_dir], input=archive, check=True)
            base = count(os.path.join(base_dir, "kernels"), os.path.join(base_dir, "include"),
                         os.path.join(base_dir, "src"), args.nvcc, cuobjdump, tmp)
    if not now["ptx"]:
        sys.exit("no vector loop with four 16-byte loads found")
    for kind in ("ptx", "sass"):
        if kind not in now:
            print("sass: no cuobjdump (tools/install_deps.sh installs one into .venv)")
            continue
        for fmt in sorted(now[kind]):
            line = f"pass 1 vector loop, {fmt} gradients: {now[kind][fmt]:.2f} {kind.upper()} instructions per element"
            if args.base and fmt in base.get(kind, {}):
                line += f" (was {base[kind][fmt]:.2f} at {args.base})"
            rows.append(line)
    print("\n".join(rows))
    if args.sass_below:
        for part in args.sass_below.split(","):
            fmt, limit = part.split("=")
            got = now["sass"].get(fmt)
            if got is None or got >= float(limit):
                sys.exit(f"pass 1, {fmt}: {got} SASS instructions per element, not below {limit}")
        print(f"below {args.sass_below}")


if __name__ == "__main__":
    main()
