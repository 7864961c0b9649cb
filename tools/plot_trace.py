#!/usr/bin/env python3
"""Plots a halfstep-train --trace CSV: the loss, the loss scale (log2) with overflow and spike
markers, and the share of gradient elements that underflowed (subnormal, zero), on one step axis.

usage: plot_trace.py TRACE.csv -o TRACE.png [--title TEXT]"""
import argparse
import csv
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--title", default=None)
    args = ap.parse_args()

    with open(args.trace, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"{args.trace}: empty trace")
    x = [int(r["attempt"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    scale = [math.log2(float(r["scale_used"])) for r in rows]
    numel = [max(int(r["numel"]), 1) for r in rows]
    sub = [100 * int(r["subnormal_count"]) / n for r, n in zip(rows, numel)]
    zero = [100 * int(r["zero_count"]) / n for r, n in zip(rows, numel)]
    over = [(a, s) for a, s, r in zip(x, scale, rows) if r["outcome"] == "skipped_overflow"]
    spikes = [(a, s) for a, s, r in zip(x, scale, rows) if r["spike"] == "1"]

    fig, ax = plt.subplots(3, 1, sharex=True, figsize=(9, 8), constrained_layout=True)
    ax[0].plot(x, loss, lw=0.8, color="tab:blue")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("loss (MSE)")
    ax[0].set_title(args.title or args.trace)

    ax[1].step(x, scale, where="post", lw=1.0, color="tab:green", label="loss scale")
    if over:
        ax[1].scatter(*zip(*over), marker="x", color="tab:red", s=18, zorder=3,
                      label=f"overflow, step skipped ({len(over)})")
    if spikes:
        ax[1].scatter(*zip(*spikes), marker="o", facecolors="none", edgecolors="tab:orange",
                      s=60, zorder=3, label=f"gradient spike ({len(spikes)})")
    ax[1].set_ylabel("log2 loss scale")
    ax[1].legend(loc="best", fontsize=8)

    ax[2].plot(x, sub, lw=0.8, color="tab:purple", label="subnormal")
    ax[2].plot(x, zero, lw=0.8, color="tab:gray", label="zero")
    ax[2].set_ylabel("gradient elements (%)")
    ax[2].set_xlabel("step (attempt)")
    ax[2].legend(loc="best", fontsize=8)
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
