#!/usr/bin/env python3
"""How well bf16 moments track fp32 ones under each rounding: halfstep's own step (the Python
package, the CPU step) on N elements for STEPS steps with lr = 0 (the masters stay put, so the
moments see the same gradients in every run), fp32 moments against bf16 ones rounded to nearest
and stochastically, for gradients whose scale is stationary, drifting up, drifting down, and
switching down once.

For each run: exp_avg_sq's tracking error |v_bf16 / v_fp32 - 1| (median and 99th percentile over
the elements, at the end and averaged over the last half of the run), exp_avg's relative to its
RMS, and the update m / sqrt(v) it leads to. Writes a JSON file and a plot.

usage: bench/moment_rounding.py [--steps 10000] [--numel 4096] [--out DIR] [--plot-only]
"""

import os
import sys

import torch

import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
from halfstep.torch import FusedAdamW  # noqa: E402



KINDS = ("stationary", "drifting up", "drifting down", "switching down")


def sigma(kind, t, steps):
    """The gradient scale at step t."""
    if kind == "stationary":
        return 1e-3
    if kind == "drifting up":  # x100 over the run
        return 1e-3 * 100.0 ** (t / steps)
    if kind == "drifting down":  # /100 over the run
        return 1e-3 * 0.01 ** (t / steps)
    return 1e-3 if t < steps // 2 else 1e-4  # switching down: /10 at half time


def run(kind, dtype, rounding, steps, numel, seed):
    p = torch.nn.Parameter(torch.zeros(numel))
    opt = FusedAdamW([p], lr=0.0, weight_decay=0.0, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, rounding=rounding,
                     seed=seed)
    gen = torch.Generator().manual_seed(seed)
    history = []
    for t in range(steps):
        p.grad = torch.randn(numel, generator=gen) * sigma(kind, t, steps)
        opt.step()
        if t % max(1, steps // 200) == 0 or t == steps - 1:
            history.append((t, opt.state[p]["exp_avg"].float().clone(), opt.state[p]["exp_avg_sq"].float().clone()))
    return history


def errors(low, wide):
    """Tracking errors of a bf16 run against the fp32 run (lists of (t, m, v) at the same steps)."""
    out = {"t": [], "v_median": [], "v_p99": [], "m_rms": [], "update_median": []}
    for (t, m, v), (_, m32, v32) in zip(low, wide):
        rel = (v / v32 - 1).abs()
        out["t"].append(t)
        out["v_median"].append(float(rel.median()))
        out["v_p99"].append(float(rel.quantile(0.99)))
        out["m_rms"].append(float((m - m32).pow(2).mean().sqrt() / m32.pow(2).mean().sqrt()))
        u, u32 = m / (v.sqrt() + 1e-12), m32 / (v32.sqrt() + 1e-12)
        out["update_median"].append(float((u - u32).abs().median() / u32.abs().median()))
    half = len(out["t"]) // 2
    summary = {k: out[k][-1] for k in ("v_median", "v_p99", "m_rms", "update_median")}
    summary.update({k + "_late_mean": sum(out[k][half:]) / len(out[k][half:]) for k in ("v_median", "update_median")})
    # v's median drift: below 1 means the bf16 v stayed under the fp32 one (frozen), above: over.
    summary["v_ratio_median"] = float((low[-1][2] / wide[-1][2]).median())
    return out, summary


def main():
    args = benchlib.arguments(__doc__, "moment_rounding", 10000,
                              lambda ap: ap.add_argument("--numel", type=int, default=4096))
    if benchlib.redraw(args, plot):
        return
    torch.set_num_threads(1)
    results, curves = {}, {}
    for kind in KINDS:
        wide = run(kind, torch.float32, "nearest", args.steps, args.numel, 7)
        for rounding in ("nearest", "stochastic"):
            curve, summary = errors(run(kind, torch.bfloat16, rounding, args.steps, args.numel, 7), wide)
            results["%s / %s" % (kind, rounding)] = summary
            curves["%s / %s" % (kind, rounding)] = curve
            print("%-15s %-10s  v: median %.4f  p99 %.4f  ratio %.3f  late mean %.4f | m rms %.4f | update median "
                  "%.4f" % (kind, rounding, summary["v_median"], summary["v_p99"], summary["v_ratio_median"],
                            summary["v_median_late_mean"], summary["m_rms"], summary["update_median"]), flush=True)
    benchlib.save({"steps": args.steps, "numel": args.numel, "beta2": 0.999, "summary": results, "curves": curves},
                  args, plot)


def plot(results, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(KINDS), figsize=(4 * len(KINDS), 3.4), sharey=True)
    for ax, kind in zip(axes, KINDS):
        for rounding, style in (("nearest", "-"), ("stochastic", "--")):
            c = results["curves"]["%s / %s" % (kind, rounding)]
            ax.plot(c["t"], c["v_median"], style, label="bf16 %s" % rounding)
        ax.set_title(kind)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("median |v_bf16 / v_fp32 - 1|")
    axes[0].legend()
    fig.suptitle("exp_avg_sq in bf16 against fp32 (beta2 = 0.999, %d elements, halfstep's step)" % results["numel"])
    benchlib.write_figure(fig, path)


if __name__ == "__main__":
    main()
