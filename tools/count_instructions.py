#!/usr/bin/env python3
"""Counts the instructions per element in the vector loops of the step's two passes, compiled for
sm_90 (PTX always for pass 1; SASS, what the GPU issues, when cuobjdump is on PATH or in .venv:
tools/install_deps.sh installs PyPI's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm there).

Both budgets come from one balance: an H200's 132 SMs x 128 lanes x 1.98 GHz issue 3.3e13
instructions a second while its 4.8 TB/s move B bytes per element, so a pass that moves B bytes
per element stays bound by memory, not by instruction issue, below 3.3e13 x B / 4.8e12 = 6.9 B
instructions per element.

Pass 1 (kernels/check_and_norm.cu): the main loop issues four 16-byte loads and the squares' fp64
arithmetic, 32 elements an iteration per thread for f16 and bf16, 16 for f32. It reads 2 or 4
bytes per element: about 14 instructions per 16-bit element and 28 per fp32 one. The CTest
budgets (f16 <= 16, bf16 <= 17, f32 <= 31) leave the loop a little room above that, for tuning
that trades instructions for latency.

Pass 2 (kernels/apply.cu), one kernel per gradient, model, master and moment format, and in each a
loop per rounding (stochastic rounding draws random bits; rounding to nearest does not): the loop
with the 8- and 16-byte stores, kW elements an iteration (8 for 16-bit gradients, 4 for fp32),
counted along its costliest path (block8 moments: the vector loop over blocks, a warp each, 8
elements a lane with 8- and 16-byte accesses, for tensors that are quantized, beside the fp32 loop
for those that are not): the longest path through the body's forward branches, where a branch
around an out-of-line call (the slow paths of IEEE division and square root, for operands near the
ends of fp32's range: at most CALL_REGION instructions with a CALL) is always taken. It does not
depend on how the compiler lays the branches out, and it counts the rare path that keeps a held
element's model copy. Its
budget is 6.9 x the bytes pass 2 moves per element: the gradient (2 or 4), the master read and
written (8; a remainder 4, and the model copy it is half of read, 2; without a master the model
copy, the weight, read, 2), each moment read and written
(8, or 4 in bf16), the model copy written (2; none counted for fp32 gradients, whose parameters
are usually their own masters, which gives the smaller budget). --pass2-within-budget fails
unless every loop is within its budget, but for block8's vector block loops, most of which are over
theirs (issue-bound) and must stay under BLOCK8_CEILING. bench/RESULTS.md has the counts.

With --base REV the kernels of git revision REV are counted too, for a before/after table. With
--at-most f16=X,bf16=Y,f32=Z the script fails unless pass 1's SASS counts are at most those. Both
checks exit with code 77 ("skipped") when there is no cuobjdump.

usage: tools/count_instructions.py [--kernels DIR] [--nvcc NVCC] [--base REV] [--at-most ...]
                                   [--pass2-within-budget]"""
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


ISSUE_RATE = 132 * 128 * 1.98e9  # instructions a second
BANDWIDTH = 4.8e12                # bytes a second
GRADS = {"0": ("f16", 2), "1": ("bf16", 2), "2": ("f32", 4)}
MODELS = {"0": "f16", "1": "bf16"}
MASTERS = {"0": "f32", "1": "bf16_remainder", "2": "none"}
# What a master costs pass 2 per element besides the model copy's write: an fp32 master read and
# written; a remainder read and written, and the model copy read; without a master the model copy
# (the weight) read.
MASTER_BYTES = {"f32": 8, "bf16_remainder": 4 + 2, "none": 2}
MOMENTS = {"0": ("f32", 8), "1": ("bf16", 4), "2": ("block8", 2)}


# The block8 loops (a warp per block of 8-bit moments) are not within their bandwidth budgets but
# for fp32 masters with an fp16 model to nearest: 109-145 SASS instructions per element against
# budgets of 70-112 (bench/RESULTS.md). Decoding, AdamW with its IEEE square root and
# division, the master's codec and two 8-bit encodes with their block reductions issue more than the
# 10-16 bytes an element moves allow, so those steps are bound by instruction issue, not memory.
# The CTest holds every block loop under this ceiling, so that they can only get faster.
BLOCK8_CEILING = 150


def pass2_format(name):
    """(grad, model, master, exp_avg, exp_avg_sq, bytes pass 2 moves per element) of an apply_kernel."""
    m = re.search(r"DTypeE(\d)ELS\d+_(\d)ELNS_12MasterFormatE(\d)ELNS_12MomentFormatE(\d)ELS\d+_(\d)E", name)
    if not m:
        return None
    g, model, master, ea, eas = m.groups()
    grad, grad_bytes = GRADS[g]
    model_bytes = 2 if grad != "f32" or MASTERS[master] != "f32" else 0
    moved = grad_bytes + MASTER_BYTES[MASTERS[master]] + MOMENTS[ea][1] + MOMENTS[eas][1] + model_bytes
    return grad, MODELS[model], MASTERS[master], MOMENTS[ea][0], MOMENTS[eas][0], moved


def wide_format(fmt):
    """A block8 kernel's loop for tensors that keep fp32 moments: the format of fp32 moments."""
    moved = fmt[5] - 2 * MOMENTS["2"][1] + 2 * MOMENTS["0"][1]
    return fmt[:3] + ("f32", "f32", moved)


def sass_instructions(func):
    ins = []
    for l in func.split("\n"):
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", l)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    return ins


# The most instructions a branch around an out-of-line call skips: the call and the moves of its
# arguments and result. A conditional branch over more is a branch of the loop's own logic.
CALL_REGION = 12


def common_path(body):
    """Instructions along a loop body's costliest path (see the module's docstring): the longest
    path from the body's first instruction to its closing branch through the forward branches,
    where a branch around an out-of-line call (at most CALL_REGION instructions holding a CALL:
    the IEEE slow paths) is always taken. The longest path does not depend on which side of a
    branch the compiler lays out as the fall-through, and it counts every element's costlier arm
    (a finite update, a held element's kept model copy, the encodes of a block)."""
    at = {o: i for i, (o, _) in enumerate(body)}
    n = len(body)
    dist = [None] * n
    dist[0] = 1
    for i in range(n - 1):
        if dist[i] is None:
            continue
        off, txt = body[i]
        succ = []
        m = re.match(r"(@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+0x([0-9a-f]+)", txt)
        if m:
            target = int(m.group(2), 16)
            if target > off and target in at:
                skipped = [t for _, t in body[i + 1:at[target]]]
                succ.append(at[target])
                call = len(skipped) <= CALL_REGION and any(t.startswith("CALL") for t in skipped)
                if m.group(1) and not call:
                    succ.append(i + 1)
            elif m.group(1):
                succ.append(i + 1)  # a conditional branch out of the body: the body goes on
        elif not txt.startswith(("EXIT", "RET")):
            succ.append(i + 1)
        for j in succ:
            dist[j] = dist[i] + 1 if dist[j] is None else max(dist[j], dist[i] + 1)
    if dist[n - 1] is None:
        sys.exit("a loop body whose closing branch no path reaches")
    return dist[n - 1]


def pass2_loops(sass):
    """[(format tuple, 'stochastic' or 'nearest', instructions per element)] of pass 2's vector loops."""
    out = []
    for func in re.split(r"\n\s*Function : ", sass)[1:]:
        fmt = pass2_format(func.split("\n")[0])
        if fmt is None:
            continue
        ins = sass_instructions(func)
        loops, blocks = [], []
        for off, txt in ins:
            m = re.search(r"BRA.*?0x([0-9a-f]+)", txt)
            if not m or int(m.group(1), 16) >= off:
                continue
            body = [(o, t) for o, t in ins if int(m.group(1), 16) <= o <= off]
            if any(re.search(r"\bSHFL\b", t) for _, t in body):
                # block8: the loop over blocks, a warp each (its shuffles find the scales), 8
                # elements a lane, closed by a conditional branch (the unconditional ones jump
                # back from the out-of-line paths of divergent shuffles); the vector loop (8-byte
                # code stores) is counted, the scalar one for unaligned pieces is not
                if txt.startswith("@") and any(re.search(r"\bST\.E\.64\b", t) for _, t in body):
                    blocks.append(body)
            elif any(re.search(r"\bST\.E\.(128|64)\b", t) for _, t in body):
                loops.append(body)
        if fmt[3] == "block8":
            if len(blocks) != 2:
                sys.exit("pass 2, %s: found %d block loops, expected 2" % (fmt, len(blocks)))
            blocks.sort(key=len, reverse=True)
            for body, rounding in zip(blocks, ("stochastic", "nearest")):
                out.append((fmt, rounding, common_path(body) / 8))
            fmt = wide_format(fmt)
        width = 4 if fmt[0] == "f32" else 8
        narrow = "bf16" in fmt[3:5] or fmt[2] == "none"  # a rounded moment, or a weight without a master
        if len(loops) != (2 if narrow else 1):
            sys.exit("pass 2, %s: found %d vector loops, expected %d" % (fmt, len(loops), 2 if narrow else 1))
        # The stochastic loop comes first (the kernel's `stochastic ? ... : ...`); it is the longer.
        loops.sort(key=len, reverse=True)
        for body, rounding in zip(loops, ("stochastic", "nearest") if narrow else ("-",)):
            out.append((fmt, rounding, common_path(body) / width))
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
    flags = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-I" + include, "-I" + src, "-I" + kernels, "--fmad=false",
             source]
    ptx = os.path.join(tmp, "pass1.ptx")
    subprocess.run(flags[:5] + ["-ptx", "-o", ptx] + flags[5:], check=True)
    result = {"ptx": ptx_loops(open(ptx).read())}
    if cuobjdump:
        cubin = os.path.join(tmp, "pass1.cubin")
        subprocess.run(flags[:5] + ["-cubin", "-o", cubin] + flags[5:], check=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
        result["sass"] = sass_loops(sass)
    return result


def count_pass2(kernels, include, src, nvcc, cuobjdump, tmp):
    cubin = os.path.join(tmp, "pass2.cubin")
    subprocess.run([nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-I" + include, "-I" + src, "-I" + kernels, "--fmad=false",
                    "-cubin", "-o", cubin, os.path.join(kernels, "apply.cu")], check=True)
    sass = subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    return pass2_loops(sass)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default=os.path.join(ROOT, "kernels"))
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--base", help="also count the kernels of this git revision")
    ap.add_argument("--at-most", help="fail unless pass 1's SASS counts are at most these: f16=X,bf16=Y,f32=Z")
    ap.add_argument("--pass2-within-budget", action="store_true",
                    help="fail unless every pass 2 loop is within its bandwidth budget")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump()
    if (args.at_most or args.pass2_within_budget) and not cuobjdump:
        print("SKIPPED: no cuobjdump to count SASS with (tools/install_deps.sh installs one into .venv)")
        sys.exit(77)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        now = count(args.kernels, os.path.join(ROOT, "include"), os.path.join(ROOT, "src"), args.nvcc, cuobjdump, tmp)
        pass2 = count_pass2(args.kernels, os.path.join(ROOT, "include"), os.path.join(ROOT, "src"), args.nvcc,
                            cuobjdump, tmp) if cuobjdump else []
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
    over = []
    for fmt, rounding, per_element in pass2:
        budget = ISSUE_RATE * fmt[5] / BANDWIDTH
        block8 = fmt[3] == "block8"
        rows.append("pass 2 %s loop, %s gradients, %s model, %s master, %s/%s moments%s: %.1f SASS instructions "
                    "per element (budget %.0f for %d bytes%s)" % (
                        "block" if block8 else "vector", fmt[0], fmt[1], fmt[2], fmt[3], fmt[4],
                        "" if rounding == "-" else ", " + rounding, per_element, budget, fmt[5],
                        "; not yet within it, held under %d" % BLOCK8_CEILING if block8 and per_element > budget else ""))
        if per_element > (BLOCK8_CEILING if block8 else budget):
            over.append(rows[-1])
    print("\n".join(rows))
    if args.pass2_within_budget:
        if not pass2 or over:
            sys.exit("pass 2 loops over their budget:\n" + "\n".join(over) if over else "no pass 2 loops found")
        print("pass 2: every loop within its budget")
    if args.at_most:
        for part in args.at_most.split(","):
            fmt, limit = part.split("=")
            got = now["sass"].get(fmt)
            if got is None or got > float(limit):
                sys.exit(f"pass 1, {fmt}: {got} SASS instructions per element, more than {limit}")
        print(f"at most {args.at_most}")


if __name__ == "__main__":
    main()
