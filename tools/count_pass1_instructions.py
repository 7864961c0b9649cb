#!/usr/bin/env python3
"""Counts the instructions per gradient element in pass 1's vector loop, for each gradient format:
compiles kernels/check_and_norm.cu for sm_90, finds the main loop (the loop that issues four
16-byte loads and the squares' fp64 arithmetic: 32 elements an iteration per thread for f16 and
bf16, 16 for f32) and divides its instruction count by its elements. PTX always; SASS (what the
GPU issues) when cuobjdump is on PATH or in .venv (tools/install_deps.sh installs PyPI's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm, which it calls, there).

The budget: pass 1 reads an H200's 4.8 TB/s at 2.4e12 16-bit or 1.2e12 fp32 gradients a second;
132 SMs x 128 lanes x 1.98 GHz issue 3.3e13 instructions a second, so pass 1 stays bound by
memory, not by instruction issue, below about 14 instructions per 16-bit element and 28 per fp32
one. The CTest budgets (f16 <= 16, bf16 <= 17, f32 <= 31) leave the measured loop a little room
above that, for tuning that trades instructions for latency; bench/RESULTS.md has the counts.

With --base REV the kernels of git revision REV are counted too, for a before/after table. With
--at-most f16=X,bf16=Y,f32=Z the script fails unless the SASS counts are at most those (exit code
77, "skipped", when there is no cuobjdump).

usage: tools/count_pass1_instructions.py [--kernels DIR] [--nvcc NVCC] [--base REV] [--at-most ...]"""
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
    return "bf16" if "DTypeE1E" in name else "f16" if "DTypeE0E" in name else "f32" if "DTypeE2E" in name else name


# Gradient elements in one iteration of the main loop: four 16-byte loads.
ELEMENTS = {"f16": 32, "bf16": 32, "f32": 16}


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
            fp64 = sum(".f64" in x for x in body)  # the main loop squares; the re-reads do not
            if fp64 and (best is None or fp64 > best[0]):
                best = (fp64, count)
        fmt = fmt_of(m.group(1))
        if best is not None and fmt in ELEMENTS:
            out[fmt] = best[1] / ELEMENTS[fmt]
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
            if sum("LDG.E.128" in t for t in body) != 4:
                continue
            fp64 = sum(re.search(r"\bD(FMA|ADD)\b", t) is not None for t in body)  # the main loop squares
            if fp64 and (best is None or fp64 > best[0]):
                best = (fp64, len(body))
        fmt = fmt_of(name)
        if best is not None and fmt in ELEMENTS:
            out[fmt] = best[1] / ELEMENTS[fmt]
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
    ap.add_argument("--at-most", help="fail unless the SASS counts are at most these: f16=X,bf16=Y,f32=Z")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump()
    if args.at_most and not cuobjdump:
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
    if args.at_most:
        for part in args.at_most.split(","):
            fmt, limit = part.split("=")
            got = now["sass"].get(fmt)
            if got is None or got > float(limit):
                sys.exit(f"pass 1, {fmt}: {got} SASS instructions per element, more than {limit}")
        print(f"at most {args.at_most}")


if __name__ == "__main__":
    main()
