#!/usr/bin/env python3
"""The accuracy of halfstep's state formats on a real small language model: a GPT-2-style
transformer built from a configuration (transformers' GPT2Config, random weights, about 3.3M
parameters), trained byte-level on the Python standard library's own sources (every machine with
Python has them) for a few hundred steps on the CPU (or, with --device cuda, on a GPU).

Runs, the same seed (weights, batches) unless noted:
- "torch fp32 AdamW, seed S": torch.optim.AdamW on an fp32 model under bf16 autocast with
  clip_grad_norm_, seeds 0, 1, 2 (their spread is the seed-to-seed spread);
- halfstep.torch.FusedAdamW on the model in bfloat16 (parameters, activations, gradients), one run
  per state format: fp32 masters and moments (the default), remainders (store_param_remainders),
  bf16 moments rounded stochastically and to nearest, and all lean (remainders + bf16 moments,
  stochastic); fp32 and all lean again on seeds 1 and 2, to tell a cost from noise; no master (bf16
  weights rounded stochastically, bf16 moments) on seeds 0, 1 and 2, and rounded to nearest; 8-bit
  block-wise moments with an fp32 master and without one, on seeds 0, 1 and 2.

Each run records the training loss every step and the loss on held-out files at the end (the same
batches for every run). Writes RESULTS_DIR/lean_lm.json; with matplotlib, the curves in
RESULTS_DIR/lean_lm.png (--plot-only redraws them from the JSON).

usage: bench/lean_lm.py [--steps 300] [--out DIR] [--runs "NAME;..."] [--held-out-batches 16] [--resume]
                        [--device cpu|cuda] [--plot-only]
"""

import glob
import json
import os
import sys
import sysconfig
import time

import benchlib

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


def train(torch, name, spec, steps, train_data, held_data, held_batches=16, device="cpu"):
    seed = spec.get("seed", 0)
    if spec["kind"] == "torch":
        model = model_of(torch, seed, torch.float32).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    else:
        from halfstep.torch import FusedAdamW
        model = model_of(torch, seed, torch.bfloat16).to(device)
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=WD, max_grad_norm=CLIP, **spec.get("options", {}))
    losses, started = [], time.time()
    for x, y in batches(torch, train_data, 1000 + seed, steps):
        x, y = x.to(device), y.to(device)
        if spec["kind"] == "torch":
            with torch.autocast(device, dtype=torch.bfloat16):
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
        for x, y in batches(torch, held_data, 7, held_batches):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=spec["kind"] == "torch"):
                held.append(float(loss_of(torch, model, x.to(device), y.to(device))))
    result = {"losses": losses, "held_out": sum(held) / len(held), "seconds": time.time() - started,
              "final_train": sum(losses[-20:]) / 20,
              "parameters": sum(p.numel() for p in model.parameters())}
    if spec["kind"] == "halfstep":
        result["weights"] = [p.detach().float().cpu() for p in model.parameters()]
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
    for s in (1, 2):  # the same pair on other seeds: is lean state's difference a cost or noise?
        out["halfstep fp32 master + moments, seed %d" % s] = {"kind": "halfstep", "seed": s}
        out["halfstep lean, seed %d" % s] = dict(out["halfstep lean (remainders + bf16 moments)"], seed=s)
    # No master: the bf16 weights updated with stochastic rounding (and bf16 moments), on the same
    # three seeds; and rounded to nearest, which loses every update below half a bf16 ulp.
    no_master = dict(master_weight_dtype=None, exp_avg_dtype=bf16, exp_avg_sq_dtype=bf16)
    out["halfstep no master + bf16 moments"] = {"kind": "halfstep", "options": no_master}
    for s in (1, 2):
        out["halfstep no master, seed %d" % s] = {"kind": "halfstep", "options": no_master, "seed": s}
    out["halfstep no master, nearest"] = {"kind": "halfstep", "options": dict(no_master, rounding="nearest")}
    # 8-bit block-wise moments (exp_avg_dtype=torch.uint8), with an fp32 master and without one
    # (the leanest state: 2 B of bf16 weights and about 2 B of moments a parameter), on the same
    # three seeds.
    u8 = torch.uint8
    block8 = dict(exp_avg_dtype=u8, exp_avg_sq_dtype=u8)
    for s in (0, 1, 2):
        out["halfstep 8-bit moments, seed %d" % s] = {"kind": "halfstep", "options": block8, "seed": s}
        out["halfstep no master + 8-bit moments, seed %d" % s] = {
            "kind": "halfstep", "options": dict(block8, master_weight_dtype=None), "seed": s}
    return out


def plot(results, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(12, 5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors + plt.cm.tab20b.colors)  # a colour per run
    window = max(10, results["steps"] // 40)
    for name, r in results["runs"].items():
        losses = r["losses"]
        smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
                  for i in range(len(losses))]
        style = ":" if name.startswith("torch") else "-"
        ax.plot(range(1, len(losses) + 1), smooth, style, label="%s (held-out %.3f)" % (name, r["held_out"]))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte, mean of %d steps)" % window)
    ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
    where = "on a GPU" if results.get("device", "cpu") != "cpu" else "on the CPU"
    ax.set_title("GPT-2-style LM, %.1fM parameters, bytes of the Python standard library, %d steps %s" %
                 (next(iter(results["runs"].values()))["parameters"] / 1e6, results["steps"], where))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    benchlib.write_figure(fig, path)


def main():
    def extra(ap):
        ap.add_argument("--runs", help="only these runs (names separated by ';')")
        ap.add_argument("--held-out-batches", type=int, default=16,
                        help="batches of held-out files the final loss is measured on (default 16)")
        ap.add_argument("--resume", action="store_true", help="keep the runs already in the JSON file; train the rest")
        ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model and the step run")
    args = benchlib.arguments(__doc__, "lean_lm", 300, extra)
    json_path = args.json
    if benchlib.redraw(args, plot):
        return
    import torch
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    train_data, held_data = corpus()
    wanted = runs(torch)
    if args.runs:
        names = args.runs.split(";")
        unknown = [n for n in names if n not in wanted]
        if unknown:
            sys.exit("--runs: no run named %s; the runs are: %s" % (", ".join(map(repr, unknown)), "; ".join(wanted)))
        wanted = {k: v for k, v in wanted.items() if k in names}
    results = {"steps": args.steps, "config": CONFIG, "batch": BATCH, "context": CONTEXT, "lr": LR,
               "weight_decay": WD, "clip": CLIP, "torch": torch.__version__, "corpus_bytes": len(train_data),
               "held_out_batches": args.held_out_batches, "device": args.device, "runs": {}}
    if args.resume and os.path.exists(json_path):
        with open(json_path) as f:
            saved = json.load(f)
        same = all(saved.get(k) == results[k] for k in ("steps", "batch", "context", "lr", "weight_decay", "clip",
                                                        "corpus_bytes"))
        same = same and saved.get("held_out_batches", 16) == args.held_out_batches
        same = same and saved.get("device", "cpu") == args.device
        if not same:
            sys.exit("--resume: %s was written with other settings; remove it or drop --resume" % json_path)
        results = saved
    weights_dir = os.path.join(args.out, "lean_lm_weights")
    os.makedirs(weights_dir, exist_ok=True)
    for name, spec in wanted.items():
        if name in results["runs"]:
            print("%-32s kept from %s" % (name, json_path))
            continue
        result = train(torch, name, spec, args.steps, train_data, held_data, args.held_out_batches, args.device)
        if "weights" in result:
            torch.save(result.pop("weights"), os.path.join(weights_dir, name.replace(" ", "_") + ".pt"))
        results["runs"][name] = result
        with open(json_path, "w") as f:  # after every run, so that a killed run loses only itself
            json.dump(results, f, indent=1)

    def weights_of(name):
        path = os.path.join(weights_dir, name.replace(" ", "_") + ".pt")
        return torch.load(path) if os.path.exists(path) else None
    # remainders are exact: with them, a run's weights are bitwise those of the run with fp32 masters
    for key, masters, remainders in (
            ("remainders_bitwise_like_fp32_masters", "halfstep fp32 master + moments", "halfstep remainders"),
            ("lean_bitwise_like_fp32_masters_with_bf16_moments", "halfstep bf16 moments, stochastic",
             "halfstep lean (remainders + bf16 moments)")):
        base, rem = weights_of(masters), weights_of(remainders)
        if base is not None and rem is not None:
            results[key] = all(torch.equal(a, b) for a, b in zip(base, rem))
            print(key.replace("_", " ") + ":", results[key])
    seeds = [r["held_out"] for k, r in results["runs"].items() if k.startswith("torch fp32 AdamW")]
    if len(seeds) > 1:
        results["seed_spread"] = max(seeds) - min(seeds)
    benchlib.save(results, args, plot)


if __name__ == "__main__":
    main()
