#!/usr/bin/env python3
"""Plants known bugs in a copy of kernels/, one at a time, and shows which schedules of the
emulated device catch each: the GPU suite (with the case matrix) runs on the mutated kernels under
every schedule the test suite uses. Every mutation must be caught by at least one schedule; the
script exits non-zero otherwise (or when the unmutated kernels fail).

usage: tools/mutation_check.py [--build-dir DIR] [--only NAME ...] [--timeout SECONDS]

It configures its own build directory (default build/mutants) with HALFSTEP_EMU_KERNEL_DIR
pointing at the mutated copy, so the normal build is untouched. Takes about 3 minutes a mutation
on 2 cores.
"""
import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, file, text to replace (must occur exactly once), replacement, what it plants
MUTATIONS = [
    ("drop-reduce-barrier", "block_reduce.cuh",
     "    for (int w = 1; w < kWarps; ++w) value = op(value, scratch[w]);\n  }\n  __syncthreads();\n",
     "    for (int w = 1; w < kWarps; ++w) value = op(value, scratch[w]);\n  }\n",
     "the trailing barrier of the block reduction is dropped"),
    ("pass2-tail-short", "apply.cu",
     "for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len; i += kPassThreads) {\n    float p = master[i]",
     "for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len - 1; i += kPassThreads) {\n    float p = master[i]",
     "pass 2's scalar tail skips the last element of a chunk"),
    ("pass1-tail-short", "check_and_norm.cu",
     "for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len; i += kPassThreads) {",
     "for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len - 1; i += kPassThreads) {",
     "pass 1's scalar tail skips the last element of a chunk"),
    ("vector-if-grad-aligned", "apply.cu",
     "if (tensor.all_vec) {",
     "if (tensor.grad_vec) {",
     "pass 2 takes the vector path when only the gradient is 16-byte aligned"),
    ("last-bad-chunk", "finalize.cu",
     "if (q.nonfinite != 0 && first_bad == kNone) first_bad = i;",
     "if (q.nonfinite != 0) first_bad = i;",
     "finalize keeps the last instead of the first bad chunk a thread folds"),
    ("swap-model-lanes", "apply.cu",
     "        store16(model + at, pack8(out));",
     "        const std::uint16_t lane2 = out[2];\n        out[2] = out[3];\n        out[3] = lane2;\n"
     "        store16(model + at, pack8(out));",
     "pass 2 swaps lanes 2 and 3 of the vectorised model copy"),
    ("vector-past-chunk", "check_and_norm.cu",
     "    const int n_vec = chunk.len / kVecElems;",
     "    const int n_vec = chunk.len / kVecElems + 1;",
     "pass 1 reads one vector past the end of its chunk"),
    ("finalize-no-barrier", "finalize.cu",
     "    applied_step = state.step;\n  }\n  __syncthreads();\n",
     "    applied_step = state.step;\n  }\n",
     "finalize reads the decision from shared memory without waiting for thread 0 to write it"),
]


def read_schedules():
    """The schedules tests/emulator/CMakeLists.txt registers (label, HALFSTEP_EMU)."""
    text = open(os.path.join(ROOT, "tests/emulator/CMakeLists.txt")).read()
    block = text[text.index("set(HALFSTEP_EMU_SCHEDULES"):]
    block = block[:block.index(")")]
    return [tuple(m.split("|")) for m in re.findall(r'"([^"]+\|[^"]+)"', block)]


def run(cmd, **kw):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def first_failure(output):
    m = re.search(r"-{70,}\n(.+?)\n-{70,}", output, re.S)  # Catch's header of a failed case
    if m:
        return " ".join(m.group(1).split())
    for line in output.splitlines():
        if "FAULT" in line:
            return line.strip()[:120]
    return output.strip().splitlines()[-1][:120] if output.strip() else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "mutants"))
    ap.add_argument("--only", nargs="*", help="mutation names to run (default: all)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per suite run")
    args = ap.parse_args()

    build = os.path.abspath(args.build_dir)
    mutant_dir = os.path.join(build, "kernels-mutant")
    pristine = os.path.join(ROOT, "kernels")
    os.makedirs(build, exist_ok=True)

    def reset_kernels():
        # Rewrite only files that differ from kernels/: each gets a fresh modification time, so
        # the build recompiles exactly what the last mutation touched.
        os.makedirs(mutant_dir, exist_ok=True)
        for name in os.listdir(pristine):
            src, dst = os.path.join(pristine, name), os.path.join(mutant_dir, name)
            want = open(src).read()
            if not os.path.exists(dst) or open(dst).read() != want:
                with open(dst, "w") as f:
                    f.write(want)

    reset_kernels()
    env = dict(os.environ)
    env["PATH"] = env.get("PATH", "") + ":/usr/local/cuda/bin"
    cfg = run(["cmake", "-S", ROOT, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
               "-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DHALFSTEP_BUILD_EXAMPLES=OFF",
               "-DHALFSTEP_BUILD_BENCH=OFF", "-DHALFSTEP_EMU_KERNEL_DIR=" + mutant_dir], env=env)
    if cfg.returncode != 0:
        print(cfg.stdout)
        sys.exit("configure failed")
    binary = os.path.join(build, "tests", "emulator", "halfstep_emulated_gpu_tests")
    schedules = read_schedules()

    def build_and_run(label):
        b = run(["cmake", "--build", build, "--target", "halfstep_emulated_gpu_tests"], env=env)
        if b.returncode != 0:
            print(b.stdout[-3000:])
            sys.exit(f"{label}: the mutated kernels do not compile")
        results = {}
        for name, spec in schedules:
            e = dict(env, HALFSTEP_EMU=spec)
            t0 = time.time()
            try:
                r = run([binary], env=e, timeout=args.timeout)
                caught = r.returncode not in (0, 77)
                detail = first_failure(r.stdout) if caught else ""
            except subprocess.TimeoutExpired:
                caught, detail = True, f"timed out after {args.timeout} s"
            results[name] = (caught, detail, time.time() - t0)
            print(f"  {label:24s} {name:12s} {'CAUGHT' if caught else 'missed':7s} "
                  f"{results[name][2]:6.1f} s  {detail}", flush=True)
        return results

    print("unmutated kernels:")
    base = build_and_run("unmutated")
    if any(c for c, _, _ in base.values()):
        sys.exit("the unmutated kernels fail the emulated suite: fix that first")

    selected = [m for m in MUTATIONS if not args.only or m[0] in args.only]
    table = []
    for name, file, old, new, what in selected:
        reset_kernels()
        path = os.path.join(mutant_dir, file)
        text = open(path).read()
        if text.count(old) != 1:
            sys.exit(f"{name}: the text to mutate occurs {text.count(old)} times in kernels/{file}; "
                     "update MUTATIONS to the current kernels")
        open(path, "w").write(text.replace(old, new))
        print(f"{name}: {what}")
        table.append((name, what, build_and_run(name)))
    reset_kernels()
    run(["cmake", "--build", build, "--target", "halfstep_emulated_gpu_tests"], env=env)

    labels = [n for n, _ in schedules]
    print("\n| mutation | " + " | ".join(labels) + " | caught by |")
    print("|---|" + "---|" * len(labels) + "---|")
    uncaught = []
    for name, what, res in table:
        cells = ["caught" if res[l][0] else "—" for l in labels]
        n = sum(res[l][0] for l in labels)
        print(f"| {what} (`{name}`) | " + " | ".join(cells) + f" | {n} of {len(labels)} |")
        if n == 0:
            uncaught.append(name)
    if uncaught:
        print("\nNOT CAUGHT: " + ", ".join(uncaught))
        sys.exit(1)
    print(f"\nevery one of {len(table)} planted bugs was caught")


if __name__ == "__main__":
    main()
