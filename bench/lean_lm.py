#!/usr/bin/env python3
"""The accuracy of halfstep's state formats on a real small language model: a GPT-2-style
transformer built from a configuration (transformers' GPT2Config, random weights, about 3.3M
parameters), trained byte-level on the Python standard library's own sources (every machine with
Python has them) for a few hundred steps on the CPU.

Runs, the same seed (weights, batches) unless noted:
- "torch fp32 AdamW, seed S": torch.optim.AdamW on an fp32 model under bf16 autocast with
  clip_grad_norm_, seeds 0, 1, 2 (their spread is the seed-to-seed spread);
- halfstep.torch.FusedAdamW on the model in bfloat16 (parameters, activations, gradients), one run
  per state format: fp32 masters and moments (the default), remainders (store_param_remainders),
  bf16 moments rounded stochastically and to nearest, and all lean (remainders + bf16 moments,
  stochastic).

Each run records the training loss every step and the loss on held-out files at the end (the same
batches for every run). Writes RESULTS_DIR/lean_lm.json; with matplotlib, the curves in
RESULTS_DIR/lean_lm.png (--plot-only redraws them from the JSON).

usage: bench/lean_lm.py [--steps 300] [--out DIR] [--runs NAME,...] [--plot-only]
"""

import argparse
import glob
import json
import os
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONTEXT, BATCH, LR, WD, CLIP = 128, 16, 2e-3, 0.1, 1.0
CONFIG = dict(vocab_size=256, n_positions=CONTEXT, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0)


def corpus():
    """The standard library's .py files (sorted, this Python's own): every tenth file held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True) if "test" not in f)
    train, held = [], []
    for i, f in enumerate(files):
        with open(f, "rb") as fh:
            (held if i % 10 == 0 else train).append(fh.read())
    return b"".join(train), b"".join(held)


def batches(torch, data, seed, count):
    gen = torch.Generator().manual_seed(seed)
    data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for _ in range(count):
        starts = torch.randint(0, data.numel() - CONTEXT - 1, (BATCH,), generator=gen)
        x = torch.stack([data[s:s + CONTEXT + 1] for s in starts.tolist()]).long()
        yield x[:, :-1], x[:, 1:]


def model_of(torch, seed, dtype):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**CONFIG)).to(dtype)


def loss_of(torch, model, x, y):
    logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))


def train(torch, name, spec, steps, train_data, held_data):
    seed = spec.get("seed", 0)
    if spec["kind"] == "torch":
        model = model_of(torch, seed, torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    else:
        from halfstep.torch import FusedAdamW
        model = model_of(torch, seed, torch.bfloat16)
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=CLIP, **spec.get("options", {}))
    losses, started = [], time.time()
    for x, y in batches(torch, train_data, 1000 + seed, steps):
        if spec["kind"] == "torch":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(torch, model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        else:
            loss = loss_of(torch, model, x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        held = []
        for x, y in batches(torch, held_data, 7, 16):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec["kind"] == "torch"):
                held.append(float(loss_of(torch, model, x, y)))
    result = {"losses": losses, "held_out": sum(held) / len(held), "seconds": time.time() - started,
              "final_train": sum(losses[-20:]) / 20,
              "parameters": sum(p.numel() for p in model.parameters())}
    if spec["kind"] == "halfstep":
        result["weights"] = [p.detach().float().clone() for p in model.parameters()]
    print("%-32s held-out loss %.4f  train (last 20) %.4f  %.0f s" % (name, result["held_out"], result["final_train"],
                                                                      result["seconds"]), flush=True)
    return result


def runs(torch):
    bf16 = torch.bfloat16
    out = {"torch fp32 AdamW, seed %d" % s: {"kind": "torch", "seed": s} for s in (0, 1, 2)}
    out.update({
        "halfstep fp32 master + moments": {"kind": "halfstep"},
        "halfstep remainders": {"kind": "halfstep", "options": dict(store_param_remainders=True)},
        "halfstep bf16 moments, stochastic": {"kind": "halfstep", "options": dict(exp_avg_dtype=bf16,
                                                                                  exp_avg_sq_dtype=bf16)},
        "halfstep bf16 moments, nearest": {"kind": "halfstep", "options": dict(exp_avg_dtype=bf16, exp_avg_sq_dtype=bf16,
                                                                               rounding="nearest")},
        "halfstep lean (remainders + bf16 moments)": {"kind": "halfstep", "options": dict(
            store_param_remainders=True, exp_avg_dtype=bf16, exp_avg_sq_dtype=bf16)},
    })
    return out


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (rerun with --plot-only where it is)")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results["runs"].items():
        losses = r["losses"]
        smooth = [sum(losses[max(0, i - 9):i + 1]) / len(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        style = ":" if name.startswith("torch") else "-"
        ax.plot(range(1, len(losses) + 1), smooth, style, label="%s (held-out %.3f)" % (name, r["held_out"]))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, mean of 10 steps)")
    ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
    ax.set_title("GPT-2-style LM, %.1fM parameters, bytes of the Python standard library" %
                 (next(iter(results["runs"].values()))["parameters"] / 1e6))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--runs", help="only these runs (comma-separated names)")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    json_path, png_path = os.path.join(args.out, "lean_lm.json"), os.path.join(args.out, "lean_lm.png")
    if args.plot_only:
        with open(json_path) as f:
            plot(json.load(f), png_path)
        return
    import torch
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    train_data, held_data = corpus()
    wanted = runs(torch)
    if args.runs:
        wanted = {k: v for k, v in wanted.items() if k in args.runs.split(",")}
    results = {"steps": args.steps, "config": CONFIG, "batch": BATCH, "context": CONTEXT, "lr": LR,
               "weight_decay": WD, "clip": CLIP, "torch": torch.__version__, "corpus_bytes": len(train_data),
               "runs": {}}
    for name, spec in wanted.items():
        results["runs"][name] = train(torch, name, spec, args.steps, train_data, held_data)
    weights = {k: r.pop("weights") for k, r in results["runs"].items() if "weights" in r}
    base = weights.get("halfstep fp32 master + moments")
    if base is not None and "halfstep remainders" in weights:
        results["remainders_bitwise_like_fp32_masters"] = all(
            torch.equal(a, b) for a, b in zip(base, weights["halfstep remainders"]))
        print("remainders bitwise like fp32 masters:", results["remainders_bitwise_like_fp32_masters"])
    seeds = [r["held_out"] for k, r in results["runs"].items() if k.startswith("torch fp32 AdamW")]
    if len(seeds) > 1:
        results["seed_spread"] = max(seeds) - min(seeds)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", json_path)
    plot(results, png_path)


if __name__ == "__main__":
    main()
