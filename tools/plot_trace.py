#!/usr/bin/python3
"""Plots a halfstep-train --trace CSV on one step axis: the loss with the learning rate, the loss
scale (log2) with overflow and spike markers, the unscaled gradient norm, and the shares of
gradient elements that underflowed (subnormal, zero) on a log axis. The title says what was run.

usage: plot_trace.py TRACE.csv -o TRACE.png [--title TEXT]
(installed as halfstep-plot; runs with Debian's python3 and python3-matplotlib)"""
import argparse
import csv
import math
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    """The trace's rows, and the run it came from (its '# ' comment lines)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    comments = [line[2:] for line in lines if line.startswith("# ")]
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    return rows, comments


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--title", default=None, help="default: the run recorded in the trace")
    args = ap.parse_args()

    rows, comments = read(args.trace)
    if not rows:
        raise SystemExit(f"{args.trace}: empty trace")
    x = [int(r["attempt"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    lr = [float(r["lr"]) for r in rows]
    scale = [math.log2(float(r["scale_used"])) for r in rows]
    norm = [float(r["grad_norm"]) for r in rows]
    numel = [max(int(r["numel"]), 1) for r in rows]
    sub = [100 * int(r["subnormal_count"]) / n for r, n in zip(rows, numel)]
    zero = [100 * int(r["zero_count"]) / n for r, n in zip(rows, numel)]
    over = [(a, s) for a, s, r in zip(x, scale, rows) if r["outcome"] == "skipped_overflow"]
    spikes = [(a, s) for a, s, r in zip(x, scale, rows) if r["spike"] == "1"]
    finite_norm = [(a, g) for a, g in zip(x, norm) if math.isfinite(g) and g > 0]

    fig, ax = plt.subplots(4, 1, sharex=True, figsize=(9, 10), constrained_layout=True)
    title = args.title or (comments[0] if comments else args.trace)
    fig.suptitle(textwrap.fill(title, 100), fontsize=9)

    ax[0].plot(x, loss, lw=0.8, color="tab:blue", label="loss")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("loss (MSE)", color="tab:blue")
    lr_ax = ax[0].twinx()
    lr_ax.plot(x, lr, lw=1.0, color="tab:brown", ls="--", label="learning rate")
    lr_ax.set_yscale("log")
    lr_ax.set_ylabel("learning rate", color="tab:brown")

    ax[1].step(x, scale, where="post", lw=1.0, color="tab:green", label="loss scale")
    if over:
        ax[1].scatter(*zip(*over), marker="x", color="tab:red", s=18, zorder=3,
                      label=f"overflow, step skipped ({len(over)})")
    if spikes:
        ax[1].scatter(*zip(*spikes), marker="o", facecolors="none", edgecolors="tab:orange",
                      s=60, zorder=3, label=f"gradient spike ({len(spikes)})")
    ax[1].set_ylabel("log2 loss scale")
    ax[1].legend(loc="best", fontsize=8)

    if finite_norm:
        ax[2].plot(*zip(*finite_norm), lw=0.6, color="tab:olive")
    ax[2].set_yscale("log")
    ax[2].set_ylabel("gradient norm\n(unscaled, before clipping)")

    ax[3].plot(x, sub, lw=0.8, color="tab:purple", label="subnormal")
    ax[3].plot(x, zero, lw=0.8, color="tab:gray", label="zero")
    ax[3].set_yscale("symlog", linthresh=1e-3)  # shares from 0 to 100% over many decades
    ax[3].set_ylim(0, 100)
    ax[3].set_ylabel("gradient elements (%)")
    ax[3].set_xlabel("step (attempt)")
    ax[3].legend(loc="best", fontsize=8)
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
