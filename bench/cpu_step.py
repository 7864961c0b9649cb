#!/usr/bin/env python3
"""The optimizer step on the CPU: halfstep's host backend (halfstep.torch.FusedAdamW on CPU tensors:
check + exact norm + clip + AdamW + model copy, fused) against PyTorch's CPU pipelines, side by side
in one run on the same machine, with the machine's copy bandwidth measured in the same run.

Rows, for one parameter tensor of N elements (1M to 100M; N/1000 rows of 1000, a weight matrix's
shape: 8-bit moments quantize blocks of rows, and a one-dimensional tensor would keep fp32 moments) in fp32 (the autocast recipe: fp32
parameters and gradients) and bf16, on 1 thread and on all of them:
- halfstep: FusedAdamW(max_grad_norm=1.0); fp32 parameters are their own masters, bf16 ones get
  fp32 masters and moments; and with 8-bit moments (exp_avg_dtype=exp_avg_sq_dtype=torch.uint8),
  with an fp32 master and without one (bf16); and, bf16 parameters with bf16 moments and no master,
  the state torch keeps for bf16 parameters (halfstep rounds it stochastically, torch to nearest);
- torch fused: clip_grad_norm_ + AdamW(fused=True) (on bf16 parameters torch keeps no master, and
  bf16 moments: half the bytes of the bf16 row's fp32 master and moments, the same as the bf16
  row without a master);
- torch foreach: clip_grad_norm_ + AdamW(foreach=True);
- torch fp16 recipe (fp32 parameters): GradScaler("cpu").unscale_ + clip_grad_norm_ + step + update;
- copy: a STREAM-style copy (dst.copy_(src), torch's own parallel copy) of the bytes halfstep's
  step must move (state_bytes: pass 1 reads the gradients, pass 2 reads them and the state and
  writes the state and the model copy), the time that traffic takes at this machine's bandwidth.

Each time is the median of --repeats steps after two warm-up steps. halfstep and torch's fused
pipeline run in turns, step by step (benchlib.paired_ms), so that the machine's changing speed (a
shared host's other tenants) weighs on both alike; their ratio is the median of the ratios of the
steps run side by side. Writes RESULTS_DIR/cpu_step.json
and, with matplotlib, RESULTS_DIR/cpu_step.png (the thread scaling of the largest size and the
copy-bandwidth line). --new-user also times the step of a GPT-2-style model of 842,496 parameters
(transformers' GPT2Config, 4 layers of width 128) on one thread, as a new user would.

usage: bench/cpu_step.py [--sizes 1e6,1e7,1e8] [--threads 1,2] [--repeats 11] [--out DIR]
                         [--new-user] [--plot-only]
"""

import json
import os
import sys

import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))


median_ms = benchlib.median_ms


def moved_bytes(halfstep, **config):
    """Bytes per parameter one applied step moves (state_bytes(config).moved)."""
    return halfstep.state_bytes(halfstep.config(**config), model_copy=config.get("dtype") != "float32")["moved"]


def copy_ms(torch, nbytes, repeats):
    """A copy that reads and writes `nbytes` in all (half each way)."""
    half = max(1, nbytes // 2)
    src = torch.ones(half, dtype=torch.uint8)
    dst = torch.empty(half, dtype=torch.uint8)
    return median_ms(lambda: dst.copy_(src), repeats)


ROW = 1000  # elements in a row of the benchmark's parameter (every size is a multiple)


def parameter(torch, n, dtype):
    """A weight matrix of n elements (n / ROW rows) and its gradient."""
    p = torch.nn.Parameter(torch.randn(n // ROW, ROW, dtype=torch.float32).mul_(0.02).to(dtype))
    p.grad = torch.randn(n // ROW, ROW, dtype=torch.float32).mul_(1e-3).to(dtype)
    return p


def halfstep_step(torch, n, dtype, threads, **kw):
    """halfstep's step on a new parameter, and a check to call after timing it."""
    from halfstep.torch import FusedAdamW
    p = parameter(torch, n, dtype)
    opt = FusedAdamW([p], lr=1e-4, weight_decay=0.01, max_grad_norm=1.0, threads=threads, **kw)

    def check():
        assert opt.last_report()["outcome"] == "applied", opt.last_report()
        # The row times what it claims: 8-bit moments held as codes and block scales, and no master
        # where none was asked for.
        state = opt.state[p]
        if kw.get("exp_avg_dtype") in (torch.uint8, torch.bfloat16):
            assert state["exp_avg"].dtype == kw["exp_avg_dtype"], sorted(state)
        if kw.get("exp_avg_dtype") == torch.uint8:
            assert state["exp_avg"].dtype == torch.uint8 and "exp_avg_scale" in state, sorted(state)
            assert state["exp_avg_sq"].dtype == torch.uint8 and "exp_avg_sq_scale" in state, sorted(state)
        if "master_weight_dtype" in kw and kw["master_weight_dtype"] is None:
            assert "master_weight" not in state, sorted(state)
    return opt.step, check


def halfstep_ms(torch, n, dtype, repeats, threads, **kw):
    step, check = halfstep_step(torch, n, dtype, threads, **kw)
    ms = median_ms(step, repeats)
    check()
    return ms


def torch_step(torch, n, dtype, fused, recipe=False):
    """torch's pipeline on a new parameter: clip_grad_norm_ and AdamW(fused or foreach), and with
    `recipe` GradScaler's unscale_, step and update around them."""
    p = parameter(torch, n, dtype)
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=fused, foreach=not fused)
    if recipe:
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(torch.ones(()))  # as a training loop's scaler.scale(loss) would, once

        def step():
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([p], 1.0)
            scaler.step(opt)
            scaler.update()
    else:
        def step():
            torch.nn.utils.clip_grad_norm_([p], 1.0)
            opt.step()
    return step


def torch_ms(torch, n, dtype, repeats, fused, recipe=False):
    return median_ms(torch_step(torch, n, dtype, fused, recipe), repeats)


def new_user(torch, repeats):
    """The step of a GPT-2-style model (842,496 parameters) on one thread, fp32 and bf16 parameters."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from halfstep.torch import FusedAdamW
    torch.set_num_threads(1)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=128, n_layer=4, n_head=4)).to(dtype)
        params = list(model.parameters())
        x = torch.randint(0, 256, (4, 128))
        model(input_ids=x, labels=x).loss.backward()
        row = {"parameters": sum(p.numel() for p in params)}
        opt = FusedAdamW(params, lr=1e-4, weight_decay=0.01, max_grad_norm=1.0, threads=1)
        row["halfstep"] = median_ms(opt.step, repeats)
        for label, fused in (("torch", False), ("torch fused", True)):
            t = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=fused, foreach=not fused)

            def step():
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                t.step()
            row[label] = median_ms(step, repeats)
        out[name] = row
        print("new user, %s parameters (%d): halfstep %.2f ms, torch AdamW + clip %.2f ms, AdamW(fused) + clip %.2f ms" %
              (name, row["parameters"], row["halfstep"], row["torch"], row["torch fused"]), flush=True)
    return out


def plot(results, path):
    plt = benchlib.pyplot()
    if plt is None or not results.get("scaling"):
        return
    fig, axes = plt.subplots(1, len(results["scaling"]), figsize=(5 * len(results["scaling"]), 4), squeeze=False)
    for ax, (label, rows) in zip(axes[0], results["scaling"].items()):
        threads = [r["threads"] for r in rows]
        for key, style in (("halfstep", "o-"), ("torch fused", "s--"), ("torch foreach", "^:"), ("copy", "k-")):
            if all(key in r for r in rows):
                ax.plot(threads, [r[key] for r in rows], style,
                        label="copy of the same bytes (bandwidth bound)" if key == "copy" else key)
        ax.set_xlabel("threads")
        ax.set_ylabel("ms per step")
        ax.set_title(label)
        ax.set_xticks(threads)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("optimizer step on the CPU (%s)" % results.get("cpu", "this machine"))
    benchlib.write_figure(fig, path)


def main():
    def extra(ap):
        ap.add_argument("--sizes", default="1e6,1e7,1e8", help="parameters per run (comma-separated)")
        ap.add_argument("--threads", default="1,%d" % (os.cpu_count() or 1), help="thread counts (comma-separated)")
        ap.add_argument("--repeats", type=int, default=11)
        ap.add_argument("--new-user", action="store_true", help="also time a 842k-parameter GPT-2-style model's step")
    args = benchlib.arguments(__doc__, "cpu_step", 0, extra)
    if benchlib.redraw(args, plot):
        return
    import torch
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import halfstep
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    if any(n < ROW or n % ROW for n in sizes):
        sys.exit("--sizes: each size must be a positive multiple of %d (the parameter's rows)" % ROW)
    thread_counts = sorted({int(t) for t in args.threads.split(",")})
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    results = {"torch": torch.__version__, "cpu": "%s, %d threads" % (cpu, os.cpu_count() or 1), "rows": [],
               "scaling": {}}
    kinds = [
        # label, parameter dtype, FusedAdamW's state arguments, moved_bytes' format, timed beside torch
        ("fp32", torch.float32, {}, dict(dtype="float32"), True),
        ("bf16", torch.bfloat16, {}, dict(dtype="bfloat16"), True),
        ("bf16, no master, bf16 moments", torch.bfloat16,
         dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, master_weight_dtype=None),
         dict(dtype="bfloat16", master="none", exp_avg="bf16", exp_avg_sq="bf16"), True),
        ("bf16, 8-bit moments", torch.bfloat16, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
         dict(dtype="bfloat16", exp_avg="block8", exp_avg_sq="block8"), False),
        ("bf16, no master, 8-bit moments", torch.bfloat16,
         dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8, master_weight_dtype=None),
         dict(dtype="bfloat16", master="none", exp_avg="block8", exp_avg_sq="block8"), False),
    ]
    print("%-32s %10s %7s %10s %10s %7s %10s %10s %10s %7s" % ("format", "params", "threads", "halfstep", "torch fused",
                                                                "ratio", "foreach", "fp16 rec.", "copy", "x copy"))
    for n in sizes:
        for label, dtype, kw, cfg, beside_torch in kinds:
            moved = moved_bytes(halfstep, **cfg)
            for threads in thread_counts:
                torch.set_num_threads(threads)
                row = {"format": label, "parameters": n, "threads": threads, "moved_bytes_per_param": moved}
                if beside_torch:  # torch has no master-less fp32 state nor 8-bit moments to compare
                    # halfstep and torch's fused pipeline in turns, each on its own parameter
                    step, check = halfstep_step(torch, n, dtype, threads, **kw)
                    row["halfstep"], row["torch fused"], row["halfstep / torch fused"] = benchlib.paired_ms(
                        step, torch_step(torch, n, dtype, fused=True), args.repeats)
                    check()
                    del step, check
                    row["torch foreach"] = torch_ms(torch, n, dtype, args.repeats, fused=False)
                    if dtype == torch.float32:
                        row["torch fp16 recipe"] = torch_ms(torch, n, dtype, args.repeats, fused=True, recipe=True)
                else:
                    row["halfstep"] = halfstep_ms(torch, n, dtype, args.repeats, threads, **kw)
                row["copy"] = copy_ms(torch, moved * n, args.repeats)
                row["x copy"] = row["halfstep"] / row["copy"]
                results["rows"].append(row)
                print("%-32s %10d %7d %10.2f %10s %7s %10s %10s %10.2f %7.2f" % (
                    label, n, threads, row["halfstep"], "%.2f" % row["torch fused"] if "torch fused" in row else "-",
                    "%.2f" % row["halfstep / torch fused"] if "torch fused" in row else "-",
                    "%.2f" % row["torch foreach"] if "torch foreach" in row else "-",
                    "%.2f" % row["torch fp16 recipe"] if "torch fp16 recipe" in row else "-", row["copy"], row["x copy"]),
                    flush=True)
    # The thread scaling of the largest size: every thread count up to the machine's, halfstep and
    # torch's fused pipeline in turns as in the table.
    largest = max(sizes)
    for label, dtype, kw, cfg, _ in kinds[:2]:
        rows = []
        moved = moved_bytes(halfstep, **cfg)
        for threads in range(1, (os.cpu_count() or 1) + 1):
            torch.set_num_threads(threads)
            step, check = halfstep_step(torch, largest, dtype, threads, **kw)
            row = {"threads": threads}
            row["halfstep"], row["torch fused"], row["halfstep / torch fused"] = benchlib.paired_ms(
                step, torch_step(torch, largest, dtype, fused=True), args.repeats)
            check()
            del step, check
            row["copy"] = copy_ms(torch, moved * largest, args.repeats)
            rows.append(row)
        results["scaling"]["%s, %.0e parameters" % (label, largest)] = rows
    if args.new_user:
        results["new_user"] = new_user(torch, max(args.repeats, 21))
    benchlib.save(results, args, plot)


if __name__ == "__main__":
    main()
