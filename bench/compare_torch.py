#!/usr/bin/env python3
"""Side-by-side: PyTorch's best equivalent pipeline against halfstep's fused step, in one process.

PyTorch (fp16 gradients, fp32 masters, as a GradScaler + clip + fused AdamW trainer runs it):
  upcast the fp16 gradients to fp32, torch._amp_foreach_non_finite_check_and_unscale_,
  torch.nn.utils.clip_grad_norm_(foreach=True), torch.optim.AdamW(fused=True) told found_inf the
  way GradScaler tells it (the step is skipped on the device), copy the masters to the fp16 model.
halfstep: FusedAdamW through the halfstep Python package (the C API) on the same gradients.

Checks, then times:
  1. agreement: same start, same gradients, overflows injected at chosen steps: identical skip
     decisions; masters and moments within a bound derived below;
  2. the loss scale: torch.amp.GradScaler's update (torch._amp_update_scale_) and halfstep's
     scaler on the same overflow schedule give identical scale sequences;
  3. time per step of each pipeline (CUDA events, median), and the ratio.
Exits non-zero if a check fails. Needs PyTorch with CUDA and a GPU; --device cpu runs the same on
CPU tensors (halfstep's host backend against PyTorch's CPU kernels, PyTorch 2.x), where the checks
are what counts (a CTest runs them) and the times are the CPU's.

usage: compare_torch.py [--lib build/gpu/libhalfstep.so] [--model gpt2-xl|small] [--steps N] [--device cuda|cpu]"""
import argparse
import math
import os
import statistics
import sys

import torch

import benchlib


def import_halfstep(lib):
    """The halfstep package: installed (pip install .), or the tree's python/ with the library
    `lib` (--lib, or HALFSTEP_LIBRARY)."""
    if lib:
        os.environ["HALFSTEP_LIBRARY"] = lib
    try:
        import halfstep
    except ImportError:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
        import halfstep
    return halfstep


# --- the parameter sets ------------------------------------------------------------------------


def shapes(name):
    if name == "small":  # a few tensors, for a quick check
        return [4096 * 1024, 1024, 1024 * 1024 + 3, 7, 0, 33]
    d, vocab, ctx = 1600, 50257, 1024  # GPT-2 1.5B-like: 580 tensors
    s = [vocab * d, ctx * d]
    for _ in range(48):
        s += [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return s + [d, d]


LR, BETA1, BETA2, EPS, WD, MAX_NORM = 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0
DEVICE = "cuda"  # --device
M_START, V_START, G_MAX = 1e-3, 1e-6, 0.01  # |m|, v and the unscaled |g| are at most these (below)


def synchronize():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def stream_of():
    """The stream argument of halfstep's step: PyTorch's current stream on a GPU, none on the CPU."""
    return torch.cuda.current_stream().cuda_stream if DEVICE == "cuda" else 0


class State:
    """Masters, moments, fp16 model copies and fp16 gradients for one pipeline."""

    def __init__(self, sizes, gen):
        dev = DEVICE
        self.master = [torch.empty(n, device=dev).uniform_(-1, 1, generator=gen) for n in sizes]
        self.m = [torch.empty(n, device=dev).uniform_(-M_START, M_START, generator=gen) for n in sizes]
        self.v = [torch.empty(n, device=dev).uniform_(1e-8, V_START, generator=gen) for n in sizes]
        self.model = [p.half() for p in self.master]

    def clone(self):
        c = State.__new__(State)
        c.master = [t.clone() for t in self.master]
        c.m = [t.clone() for t in self.m]
        c.v = [t.clone() for t in self.v]
        c.model = [t.clone() for t in self.model]
        return c


def fill_grads(grads, scale, gen):
    for g in grads:  # finite, never zero: sign · 2^U(-8, 0) · G_MAX · scale
        mag = torch.exp2(torch.empty(g.numel(), device=DEVICE).uniform_(-8, 0, generator=gen))
        sign = torch.where(torch.rand(g.numel(), device=DEVICE, generator=gen) < 0.5, -1.0, 1.0)
        g.copy_((sign * mag * G_MAX * scale).half())


class TorchPipeline:
    def __init__(self, state, grads16):
        self.s = state
        self.params = [torch.nn.Parameter(p, requires_grad=True) for p in state.master]
        self.grads32 = [torch.empty_like(p) for p in state.master]
        for p, g in zip(self.params, self.grads32):
            p.grad = g
        self.grads16 = grads16
        self.opt = torch.optim.AdamW(self.params, lr=LR, betas=(BETA1, BETA2), eps=EPS,
                                     weight_decay=WD, fused=True)
        for p, m, v in zip(self.params, state.m, state.v):  # start from the shared moments
            st = self.opt.state[p]
            st["step"] = torch.tensor(0.0, device=DEVICE)
            st["exp_avg"] = m
            st["exp_avg_sq"] = v
        # Zero-dimensional, as GradScaler makes them: the fused step subtracts found_inf from each
        # zero-dimensional step count in place (PyTorch 2.11 refuses a shape [1] there).
        self.found_inf = torch.zeros((), device=DEVICE)
        self.inv_scale = torch.ones((), device=DEVICE)

    def step(self, scale):
        self.inv_scale.fill_(1.0 / scale)
        self.found_inf.zero_()
        torch._foreach_copy_(self.grads32, self.grads16)                      # upcast
        torch._amp_foreach_non_finite_check_and_unscale_(self.grads32, self.found_inf, self.inv_scale)
        torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM, foreach=True)
        self.opt.grad_scale = None             # already unscaled (GradScaler's UNSCALED stage)
        self.opt.found_inf = self.found_inf    # skip on the device, as GradScaler arranges it
        self.opt.step()
        del self.opt.grad_scale, self.opt.found_inf
        torch._foreach_copy_(self.s.model, self.s.master)                      # fp16 model copy


def make_halfstep(hs, state, grads16, scale):
    tensors = [dict(master=p.data_ptr(), grad=g.data_ptr(), exp_avg=m.data_ptr(), exp_avg_sq=v.data_ptr(),
                    model=md.data_ptr(), numel=p.numel(), group=0)
               for p, g, m, v, md in zip(state.master, grads16, state.m, state.v, state.model)]
    cfg = hs.config(max_grad_norm=MAX_NORM, backend=DEVICE if DEVICE == "cuda" else "host",
                    scaler=dict(init_scale=scale, min_scale=scale, max_scale=scale, growth_interval=2**31 - 1))
    group = hs.group(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD)
    return hs.Optimizer(tensors, [group], cfg)


def check_agreement(hs, sizes, steps, inject_at):
    """Same start, same gradients: identical skip decisions; masters and moments within a bound.

    Bound: both sides compute the same formula in fp32 from identical inputs. They differ in
    (1) the clip coefficient: PyTorch's fp32 norm against halfstep's fp32-per-thread, fp64-across
    norm, a relative difference dc <= 1e-5 (a fp32 reduction over up to 2^31 terms in a tree has
    error ~ log2(n) u); and (2) rounding: each fp32 operation of the update rounds (u = 2^-24),
    about 20 of them per element. A relative difference d in the gradient moves an update of size
    <= lr·|m/sqrt(v)| by at most d times it, m and v carry it on for ~1/(1 - beta1) = 10 steps,
    and each step's stored master rounds once more on either side. So after k applied steps:
        |p_torch - p_halfstep| <= k·(10·(dc + 20u)·lr·R + 2 ulp(p)),   R = max|m_hat/sqrt(v_hat)|,
    with R <= 1/sqrt(1 - beta2) ~ 31.6 for Adam. The moments: each step's terms beta1·m and
    (1 - beta1)·g (beta2·v and (1 - beta2)·g^2) carry those relative errors, the earlier ones shrunk
    by beta1 (beta2) a step, so after k steps |dm| <= 10·k·(dc + 20u)·(|m| + A), A the largest
    |m| or |g| any step saw, here at most M_START + G_MAX (m is a weighted mean of its start and the
    gradients: it may cancel to near zero, where its own size bounds nothing); v adds positive terms
    only, so |dv| <= 10·k·(2dc + 20u)·|v| (g^2 doubles the gradient's relative difference)."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    scale = 1024.0
    start = State(sizes, gen)
    grads16 = [torch.empty(n, device=DEVICE, dtype=torch.half) for n in sizes]
    a, b = start.clone(), start.clone()
    torch_side = TorchPipeline(a, grads16)
    opt = make_halfstep(hs, b, grads16, scale)
    stream = stream_of()
    ok = True
    applied = 0
    for k in range(steps):
        fill_grads(grads16, scale, gen)
        if k in inject_at:
            grads16[len(grads16) // 2].view(-1)[k % max(grads16[len(grads16) // 2].numel(), 1)] = math.inf
        torch_side.step(scale)
        opt.step(stream)
        synchronize()
        skipped_torch = bool(torch_side.found_inf.item() > 0)
        skipped_hs = opt.last_report()["outcome"] == "skipped_overflow"
        same = skipped_torch == skipped_hs == (k in inject_at)
        ok &= same
        applied += 0 if skipped_hs else 1
        if not same:
            print(f"  step {k}: torch skipped={skipped_torch}, halfstep skipped={skipped_hs}")
    u = 2.0 ** -24
    dc = 1e-5
    R = 1.0 / math.sqrt(1 - BETA2)
    worst_p = worst_m = 0.0
    for pa, pb, ma, mb, va, vb in zip(a.master, b.master, a.m, b.m, a.v, b.v):
        if pa.numel() == 0:
            continue
        ulp = torch.abs(pb) * 2 * u + 1e-45
        bound_p = applied * (10 * (dc + 20 * u) * LR * R + 2 * ulp)
        worst_p = max(worst_p, float(torch.max(torch.abs(pa - pb) / bound_p)))
        rel = 10 * applied * (dc + 20 * u)
        worst_m = max(worst_m, float(torch.max(torch.abs(ma - mb) / (rel * (torch.abs(mb) + M_START + G_MAX)))),
                      float(torch.max(torch.abs(va - vb) / (10 * applied * (2 * dc + 20 * u) * torch.abs(vb)))))
    print(f"  skip decisions identical on {steps} steps ({len(inject_at)} injected overflows): {ok}")
    print(f"  masters: largest |difference| / bound = {worst_p:.3f}; moments: {worst_m:.3f}")
    opt.close()
    return ok and worst_p <= 1.0 and worst_m <= 1.0


def check_scaler(hs):
    """torch.amp.GradScaler's update rule and halfstep's scaler on one overflow schedule."""
    init, growth, backoff, interval = 2.0 ** 10, 2.0, 0.5, 3
    schedule = [k % 7 == 3 or k in (20, 21, 22) for k in range(60)]
    scale = torch.full((1,), init, device=DEVICE)
    tracker = torch.zeros(1, device=DEVICE, dtype=torch.int32)
    torch_scales = []
    for overflow in schedule:
        found = torch.full((1,), 1.0 if overflow else 0.0, device=DEVICE)
        torch._amp_update_scale_(scale, tracker, found, growth, backoff, interval)
        torch_scales.append(float(scale.item()))
    # halfstep: a one-element tensor whose gradient is inf on the overflow steps.
    p, m, v = (torch.zeros(1, device=DEVICE) for _ in range(3))
    g = torch.zeros(1, device=DEVICE, dtype=torch.half)
    cfg = hs.config(backend=DEVICE if DEVICE == "cuda" else "host",
                    scaler=dict(init_scale=init, growth_factor=growth, backoff_factor=backoff,
                                growth_interval=interval, min_scale=1.0, max_scale=2.0 ** 24))
    opt = hs.Optimizer([dict(master=p.data_ptr(), grad=g.data_ptr(), exp_avg=m.data_ptr(), exp_avg_sq=v.data_ptr(),
                             model=0, numel=1, group=0)], [hs.group()], cfg)
    ours = []
    for overflow in schedule:
        g.fill_(math.inf if overflow else 1.0)
        synchronize()
        opt.step(stream_of())
        ours.append(opt.loss_scale())
    opt.close()
    same = ours == torch_scales
    print(f"  scale sequences over {len(schedule)} steps identical: {same} "
          f"(min 2^{math.log2(min(ours)):.0f}, max 2^{math.log2(max(ours)):.0f})")
    return same


def median_ms(fn, repeats):
    if DEVICE != "cuda":  # the CPU: a host clock (each step returns when it is done)
        return benchlib.median_ms(fn, repeats, warmup=3)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description="PyTorch's pipeline against halfstep's fused step")
    ap.add_argument("--lib", default=None,
                    help="libhalfstep.so to use (default: the installed package's, or HALFSTEP_LIBRARY)")
    ap.add_argument("--model", default="gpt2-xl", choices=["gpt2-xl", "small"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("SKIPPED: PyTorch sees no CUDA device")
        return 77
    hs = import_halfstep(args.lib)
    sizes = shapes(args.model)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "the CPU (halfstep's host backend)"
    print(f"compare_torch: {args.model}, {len(sizes)} tensors, {sum(sizes) / 1e9:.3f}e9 parameters, "
          f"torch {torch.__version__}, {where}")
    print("1. agreement (small parameter set):")
    ok = check_agreement(hs, shapes("small"), args.steps, inject_at={3, 7})
    print("2. loss scale against torch.amp.GradScaler's update:")
    ok &= check_scaler(hs)

    print(f"3. time per step ({args.model}):")
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    scale = 1024.0
    grads16 = [torch.empty(n, device=DEVICE, dtype=torch.half) for n in sizes]
    fill_grads(grads16, scale, gen)
    state = State(sizes, gen)
    torch_side = TorchPipeline(state, grads16)
    t_torch = median_ms(lambda: torch_side.step(scale), args.repeats)
    del torch_side, state
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    state = State(sizes, gen)
    opt = make_halfstep(hs, state, grads16, scale)
    stream = stream_of()
    t_hs = median_ms(lambda: opt.step(stream), args.repeats)
    applied = opt.last_report()["outcome"] == "applied"
    opt.close()
    n = sum(sizes)
    print(f"  PyTorch pipeline : {t_torch:8.3f} ms  ({n * 30 / t_torch / 1e6:7.0f} GB/s of the 30 B/param work)")
    print(f"  halfstep fused   : {t_hs:8.3f} ms  ({n * 30 / t_hs / 1e6:7.0f} GB/s)")
    print(f"  ratio            : {t_torch / t_hs:.2f}x faster (target >= 2x)")
    print(f"RESULT torch_ms={t_torch:.3f} halfstep_ms={t_hs:.3f} ratio={t_torch / t_hs:.2f} checks={'pass' if ok and applied else 'FAIL'}")
    return 0 if ok and applied else 1


if __name__ == "__main__":
    sys.exit(main())
