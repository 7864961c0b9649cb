#!/usr/bin/env python3
"""Which 8-bit map for block-wise AdamW moments: the candidates measured against float64 on the
gradient sequences of a real small language model.

Capture: bench/lean_lm.py's GPT-2-style model (about 3.3M parameters, byte-level Python standard
library, bf16 autocast, clip 1.0, lr 2e-3) trained STEPS steps with torch.optim.AdamW; every step's
clipped gradient is recorded for 8 blocks of 256 elements spread over each tensor of at least 4096
elements ("large"), and for every element of the smaller tensors (biases, LayerNorm; "small").

Replay: AdamW's moment recurrences (beta1 0.9, beta2 0.999, eps 1e-8) over those gradients, once
in float64 (the truth) and once per storage format, the stored state decoded, updated in fp32 and
encoded again every step as a fused step would:
- 8-bit codes, one fp32 absmax per block of 256 elements: a dynamic map (seven decades, the linear
  resolution within a decade halving per decade down, as in the 8-bit-optimizers paper), a linear
  map, and FP8 E4M3 (scaled so that the absmax is 448); signed for exp_avg, unsigned for exp_avg_sq
  (E4M3 has no unsigned form: half its codes are unused for exp_avg_sq); each rounded to the
  nearest code and stochastically;
- bf16 moments (halfstep's "Lean state I"), both roundings, as the point of comparison;
- exp_avg linear and exp_avg_sq dynamic (each moment in the map that suits it best alone),
  exp_avg_sq stored as the 8-bit codes of its square root (the update divides by sqrt(v)), and
  exp_avg dynamic with exp_avg_sq's square root dynamic.

For each format, over the last half of the steps: exp_avg_sq's relative error |v/v64 - 1| and its
median ratio v/v64 (a bias), also among the elements four or more decades below their block's
largest exp_avg_sq; exp_avg's error relative to the RMS of float64's exp_avg over the tensor's
recorded elements; the share of elements whose exp_avg_sq decodes to 0 while float64's is not (an
update of m / eps follows); and the error of the update m^ / (sqrt(v^) + eps) against float64's, in
units of the RMS of float64's update over the tensor's recorded elements. Writes
RESULTS_DIR/moment_quantization.json (with --synthetic, moment_quantization_synthetic.json: see
synthetic()) and, with matplotlib, a plot of the update errors.

usage: bench/moment_quantization.py [--steps 300] [--out DIR] [--capture FILE] [--synthetic] [--plot-only]
"""

import os
import sys
import time

import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK, MIN_8BIT, BLOCKS_PER_TENSOR = 256, 4096, 8
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


# ---------------------------------------------------------------------------------------------
# The maps: 256 sorted values in [-1, 1] (signed) or [0, 1] (unsigned), as a code decodes them.

def dynamic_map(signed):
    """Seven decades: within decade k (k = 0 the lowest, [1e-7, 1e-6]) magnitudes at the midpoints of
    a linear grid over [0.1, 1] * 10^(k-6) of 2^k (signed) or 2^(k+1) (unsigned) cells, so from
    about 5.5e-7 up; plus 0 and 1: 2 + 2 * 127 values signed, 2 + 254 unsigned. The signed map has
    +1 and no -1: a block whose absmax is negative stores it as -0.993 (as bitsandbytes' map does)."""
    values = {0.0, 1.0}
    for k in range(7):
        cells = 2 ** k if signed else 2 ** (k + 1)
        for i in range(cells):
            magnitude = (0.1 + 0.9 * (i + 0.5) / cells) * 10.0 ** (k - 6)
            values.add(magnitude)
            if signed:
                values.add(-magnitude)
    assert len(values) == 256, len(values)
    return sorted(values)


def linear_map(signed):
    """k/127, k = -127 .. 127 (signed, one code unused) or k/255, k = 0 .. 255 (unsigned)."""
    return [k / 127.0 for k in range(-127, 128)] if signed else [k / 255.0 for k in range(256)]


def e4m3_map(signed):
    """Every finite float8_e4m3fn value over its largest, 448 (bias 7, no infinities, 0x7F NaN)."""
    positive = []
    for bits in range(0x7F):
        e, m = bits >> 3, bits & 7
        positive.append((m / 8.0) * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
    positive = [v / 448.0 for v in positive]
    return sorted(set(positive + ([-v for v in positive] if signed else [])))


MAPS = {"dynamic": dynamic_map, "linear": linear_map, "e4m3": e4m3_map}


# ---------------------------------------------------------------------------------------------

def quantize(torch, x, table, stochastic, gen):
    """x: [blocks, 256] fp32 -> (codes as indices into table, absmax per block)."""
    absmax = x.abs().amax(dim=1, keepdim=True)
    y = torch.where(absmax > 0, x / torch.where(absmax > 0, absmax, torch.ones_like(absmax)), torch.zeros_like(x))
    y = y.clamp(float(table[0]), float(table[-1]))
    if stochastic:
        lo = (torch.searchsorted(table, y.contiguous(), right=True) - 1).clamp(0, table.numel() - 2)
        a, b = table[lo], table[lo + 1]
        p = ((y - a) / (b - a)).clamp(0, 1)
        codes = lo + (torch.rand(y.shape, generator=gen) < p).long()
    else:
        mids = (table[1:] + table[:-1]) / 2
        codes = torch.searchsorted(mids, y.contiguous())
    return codes, absmax


def bf16_round(torch, x, stochastic, gen):
    if not stochastic:
        return x.to(torch.bfloat16).float()
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, generator=gen, dtype=torch.int32)
    return ((bits + noise) & ~0xFFFF).view(torch.float32)  # finite moments: no carry into inf here


class Store:
    """One moment in one format: holds the decoded fp32 value (what the next step reads)."""

    def __init__(self, torch, fmt, signed, shape, gen):
        self.torch, self.fmt, self.gen = torch, fmt, gen
        self.stochastic = fmt.endswith("stochastic")
        self.kind = fmt.split(",")[0]
        self.root = self.kind.startswith("sqrt ")  # exp_avg_sq stored as the codes of its square root
        self.kind = self.kind[len("sqrt "):] if self.root else self.kind
        if self.kind in MAPS:
            self.table = torch.tensor(MAPS[self.kind](signed), dtype=torch.float32)
        self.value = torch.zeros(shape, dtype=torch.float32)

    def write(self, x):
        torch = self.torch
        if self.kind == "fp32":
            self.value = x.clone()
        elif self.kind == "bf16":
            self.value = bf16_round(torch, x, self.stochastic, self.gen)
        else:
            codes, absmax = quantize(torch, x.sqrt() if self.root else x, self.table, self.stochastic, self.gen)
            self.value = self.table[codes] * absmax
            if self.root:
                self.value = self.value * self.value


def capture(torch, steps):
    sys.path.insert(0, HERE)
    import lean_lm
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    train_data, _ = lean_lm.corpus()
    model = lean_lm.model_of(torch, 0, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lean_lm.LR, weight_decay=lean_lm.WD)
    picks = []
    for name, p in model.named_parameters():
        n = p.numel()
        if n >= MIN_8BIT:
            blocks = n // BLOCK
            starts = [BLOCK * ((i * blocks) // BLOCKS_PER_TENSOR) for i in range(BLOCKS_PER_TENSOR)]
            index = torch.cat([torch.arange(s, s + BLOCK) for s in starts])
            picks.append((name, "large", p, index))
        else:
            picks.append((name, "small", p, torch.arange(n)))
    grads = {name: [] for name, _, _, _ in picks}
    started = time.time()
    for x, y in lean_lm.batches(torch, train_data, 1000, steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lean_lm.loss_of(torch, model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), lean_lm.CLIP)
        for name, _, p, index in picks:
            grads[name].append(p.grad.reshape(-1)[index].clone())
        opt.step()
        opt.zero_grad()
    print("captured %d steps in %.0f s (last loss %.3f)" % (steps, time.time() - started, loss.item()), flush=True)
    return {"steps": steps, "tensors": [{"name": name, "size": kind, "numel": p.numel(), "shape": list(p.shape),
                                         "grads": torch.stack(grads[name])} for name, kind, p, _ in picks]}


def synthetic(torch, steps):
    """Gradients without the model (no transformers needed; for a quick check of the script):
    Student-t noise (3 degrees of freedom: heavy tails, as real gradients have) whose scale differs
    by up to 100x between blocks and 1000x between the elements of a block (so exp_avg_sq spans six
    decades inside a block), drifting down 10x over the run. Long runs of it show what 300 steps of
    the model cannot: a bias that builds up over 1 / (1 - beta2) steps."""
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(1234)  # StudentT draws from the global generator: a stream replay()'s rounding does not use
    tensors = []
    for name, kind, n in (("weight", "large", BLOCKS_PER_TENSOR * BLOCK), ("bias", "small", 300)):
        block_scale = 10.0 ** (-2 * torch.rand(((n + BLOCK - 1) // BLOCK,), generator=gen))
        scale = block_scale.repeat_interleave(BLOCK)[:n] * 1e-3 * 10.0 ** (-3 * torch.rand((n,), generator=gen))
        t = torch.distributions.StudentT(3.0).sample((steps, n))
        drift = 0.1 ** (torch.arange(steps, dtype=torch.float32) / steps)
        tensors.append({"name": name, "size": kind, "numel": n, "shape": [n],
                        "grads": t * scale * drift[:, None]})
    return {"steps": steps, "tensors": tensors}


def replay(torch, tensors, fmt, seed=20261202):  # a seed no data source uses
    """The errors of one format over every captured tensor; for 'small' tensors the blocks are the
    tensor's own consecutive 256 elements (the last one shorter, padded with zeros). fmt: one format
    for both moments, or "exp_avg's format | exp_avg_sq's format"."""
    m_fmt, v_fmt = (fmt.split(" | ") + [fmt])[:2]
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for size in ("large", "small"):
        group = [t for t in tensors if t["size"] == size]
        series = {"v_rel": [], "m_rel": [], "update": [], "v_zero": [], "v_ratio": [], "v_ratio_low": []}
        per_step = []
        for t in group:
            g = t["grads"].float()
            steps, n = g.shape
            pad = (-n) % BLOCK
            g = torch.nn.functional.pad(g, (0, pad)).reshape(steps, -1, BLOCK)
            valid = torch.ones(n + pad, dtype=torch.bool)
            valid[n:] = False
            valid = valid.reshape(-1, BLOCK)
            m64 = torch.zeros(g.shape[1:], dtype=torch.float64)
            v64 = torch.zeros_like(m64)
            m = Store(torch, m_fmt, True, g.shape[1:], gen)
            v = Store(torch, v_fmt, False, g.shape[1:], gen)
            for s in range(steps):
                gs = g[s]
                m64 = BETA1 * m64 + (1 - BETA1) * gs.double()
                v64 = BETA2 * v64 + (1 - BETA2) * gs.double() ** 2
                mn = BETA1 * m.value + (1 - BETA1) * gs  # the step's arithmetic: fp32 on the decoded state
                vn = BETA2 * v.value + (1 - BETA2) * gs * gs
                bc1, bc2 = 1 - BETA1 ** (s + 1), 1 - BETA2 ** (s + 1)
                u64 = (m64 / bc1) / ((v64 / bc2).sqrt() + EPS)
                u = (mn.double() / bc1) / ((vn.double() / bc2).sqrt() + EPS)
                m.write(mn)
                v.write(vn)
                if s < steps // 2:
                    continue
                # the errors of what the next step reads (the stored state) and of this step's update
                live = valid & (v64 > 0)
                rms_u = u64[live].pow(2).mean().sqrt()
                rms_m = m64[live].pow(2).mean().sqrt()
                err_u = ((u - u64).abs() / rms_u)[live]
                series["update"].append(err_u)
                ratio = v.value.double() / v64
                series["v_rel"].append((ratio - 1).abs()[live])
                series["v_ratio"].append(ratio[live])  # its median: a bias, which |v/v64 - 1| hides
                low = live & (v64 < 1e-4 * v64.amax(dim=1, keepdim=True))  # 4+ decades below the block's largest
                series["v_ratio_low"].append(ratio[low])
                series["m_rel"].append(((m.value.double() - m64).abs() / rms_m)[live])
                series["v_zero"].append(((v.value == 0) & live).sum().item() / max(1, live.sum().item()))
                if t is group[0]:
                    per_step.append(float(err_u.median()))
        cat = {k: torch.cat(series[k]).float() for k in ("v_rel", "m_rel", "update", "v_ratio", "v_ratio_low")}

        def q(x, p):  # quantile of a large tensor (torch.quantile is limited to 16M elements)
            if x.numel() == 0:
                return float("nan")
            x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))[:1 << 22]]
            return float(x.quantile(p))
        out[size] = {"elements": int(sum(t["grads"].shape[1] for t in group)),
                     "v_rel_median": q(cat["v_rel"], 0.5), "v_rel_p99": q(cat["v_rel"], 0.99),
                     "m_rel_median": q(cat["m_rel"], 0.5), "m_rel_p99": q(cat["m_rel"], 0.99),
                     "update_median": q(cat["update"], 0.5), "update_p99": q(cat["update"], 0.99),
                     "update_max": float(cat["update"].max()),
                     "v_ratio_median": q(cat["v_ratio"], 0.5), "v_ratio_low_median": q(cat["v_ratio_low"], 0.5),
                     "v_low_share": cat["v_ratio_low"].numel() / max(1, cat["v_ratio"].numel()),
                     "v_zero_share": sum(series["v_zero"]) / len(series["v_zero"]),
                     "first_tensor_update_median_by_step": per_step}
    return out


FORMATS = ["fp32"] + ["%s, %s" % (k, r) for k in ("bf16", "dynamic", "linear", "e4m3")
                      for r in ("nearest", "stochastic")] + [
    "linear, nearest | dynamic, stochastic", "linear, stochastic | dynamic, stochastic",
    "linear, nearest | sqrt dynamic, stochastic", "linear, nearest | sqrt linear, stochastic",
    "linear, nearest | sqrt linear, nearest",
    "dynamic, nearest | sqrt dynamic, stochastic", "dynamic, stochastic | sqrt dynamic, stochastic"]


def plot(results, path):
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5), sharey=True)
    for ax, size in zip(axes, ("large", "small")):
        names = [f for f in results["formats"] if f != "fp32"]
        med = [results["formats"][f][size]["update_median"] for f in names]
        p99 = [results["formats"][f][size]["update_p99"] for f in names]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], med, 0.4, label="median")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="99th percentile")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_title("%s tensors (%d elements)" % (size, results["formats"]["fp32"][size]["elements"]))
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("|update - float64's| / RMS update (last half of the steps)")
    axes[0].legend(fontsize=8)
    fig.suptitle("AdamW moments stored in 8 bits (blocks of 256) and bf16, %d steps of a small LM" % results["steps"])
    benchlib.write_figure(fig, path)


def main():
    def extra(ap):
        ap.add_argument("--capture", help="keep the captured gradients in this file (reused when it exists)")
        ap.add_argument("--synthetic", action="store_true", help="heavy-tailed random gradients, not the model's")
    args = benchlib.arguments(__doc__, "moment_quantization", 300, extra)
    if benchlib.redraw(args, plot):
        return
    import torch
    torch.manual_seed(0)
    if args.synthetic:
        captured = synthetic(torch, args.steps)
        args.json, args.png = (path.replace("moment_quantization.", "moment_quantization_synthetic.")
                               for path in (args.json, args.png))
    elif args.capture and os.path.exists(args.capture):
        captured = torch.load(args.capture)
    else:
        captured = capture(torch, args.steps)
        if args.capture:
            torch.save(captured, args.capture)
    results = {"steps": captured["steps"], "gradients": "synthetic" if args.synthetic else "model", "block": BLOCK, "min_8bit_numel": MIN_8BIT, "torch": torch.__version__,
               "maps": {k: {"signed": MAPS[k](True), "unsigned": MAPS[k](False)} for k in MAPS}, "formats": {}}
    print("%-40s %-6s %9s %9s %9s %9s %9s %9s %8s %9s %9s" % (
        "format", "tensors", "v med", "v p99", "m med", "m p99", "upd med", "upd p99", "v->0", "v/v64", "low v/v64"))
    for fmt in FORMATS:
        r = replay(torch, captured["tensors"], fmt)
        results["formats"][fmt] = r
        for size in ("large", "small"):
            e = r[size]
            print("%-40s %-6s %9.2e %9.2e %9.2e %9.2e %9.2e %9.2e %7.3f%% %9.3f %9.3f" % (
                fmt, size, e["v_rel_median"], e["v_rel_p99"], e["m_rel_median"], e["m_rel_p99"], e["update_median"],
                e["update_p99"], 100 * e["v_zero_share"], e["v_ratio_median"], e["v_ratio_low_median"]), flush=True)
    benchlib.save(results, args, plot)


if __name__ == "__main__":
    main()
