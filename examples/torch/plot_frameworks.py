#!/usr/bin/python3
"""Draws what examples/torch/frameworks.py measured: for each framework run, halfstep's loss curve
over the standard pipeline's (Trainer, accelerate, Trainer under FSDP2), and for the GradScaler
loop both losses with both loss scales (log2) and the steps each skipped. Runs with Debian's
python3 and python3-matplotlib.

usage: examples/torch/plot_frameworks.py RESULTS.json [MORE.json ...] -o OUT.png"""

import argparse
import json
import math
import sys

TITLES = {"trainer": "Hugging Face Trainer, bf16 autocast (GPT-2 shape)",
          "accelerate": "accelerate's loop, bf16 autocast (Llama shape)",
          "trainer-ddp": "Trainer on %s ranks, DDP (GPT-2 shape)",
          "trainer-fsdp": "Trainer on FSDP2 shards, %s ranks (Llama shape)",
          "gradscaler": "fp16 autocast with a GradScaler (GPT-2 shape)"}
ORDER = ("trainer", "accelerate", "trainer-fsdp", "gradscaler")  # what the README's figure shows


def load(paths):
    runs, versions = {}, None
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "versions" not in data:
            raise ValueError("%s: not the JSON examples/torch/frameworks.py --out writes" % path)
        versions = versions or data["versions"]
        for name, pair in data.items():
            if name in TITLES:
                runs[name] = pair
    if not runs:
        raise ValueError("no runs in %s" % ", ".join(paths))
    return runs, versions


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()
    try:
        runs, versions = load(args.results)
    except (OSError, ValueError, KeyError) as e:
        print("plot_frameworks: %s" % e, file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ORDER if n in runs]
    cols = 2
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(12, 4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        pair = runs[name]
        a, b = pair["halfstep"], pair["standard"]
        steps = range(1, len(a["loss"]) + 1)
        ax.plot(steps, b["loss"], color="tab:gray", lw=3, alpha=0.6, label="standard pipeline")
        ax.plot(steps, a["loss"], color="tab:blue", lw=1.2, label="halfstep")
        worst = max(abs(x - y) / abs(y) for x, y in zip(a["loss"], b["loss"]))
        title = TITLES[name] % pair.get("world", "") if "%s" in TITLES[name] else TITLES[name]
        ax.set_title("%s\nlargest loss difference %.1e relative" % (title, worst), fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        if "scale" in a:
            for side, color, mark in ((a, "tab:blue", "x"), (b, "tab:gray", "o")):
                skipped = [i + 1 for i, s in enumerate(side["skipped"]) if s]
                ax.plot(skipped, [side["loss"][i - 1] for i in skipped], mark, color=color, ms=7, mfc="none",
                        label="skipped (%s)" % ("halfstep" if side is a else "standard"))
            twin = ax.twinx()
            twin.step(steps, [math.log2(s) for s in b["scale"]], where="post", color="tab:orange", lw=3, alpha=0.5,
                      label="loss scale, standard")
            twin.step(steps, [math.log2(s) for s in a["scale"]], where="post", color="tab:red", lw=1,
                      label="loss scale, halfstep")
            twin.set_ylabel("log2 loss scale")
            twin.legend(loc="upper center", fontsize=8)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle("halfstep next to the standard pipeline (GradScaler, clip_grad_norm_, torch.optim.AdamW): the same "
                 "model, data and seed\ntorch %s, transformers %s, accelerate %s, halfstep %s, on %s" % (
                     versions["torch"], versions["transformers"], versions["accelerate"], versions["halfstep"],
                     "the CPU" if versions.get("device", "cpu") == "cpu" else "the GPU"),
                 fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(args.output, dpi=90)
    except OSError as e:
        print("plot_frameworks: %s: %s" % (args.output, e.strerror), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
