"""halfstep.torch.FusedAdamW on a CUDA device: the fused kernels from PyTorch, eager and captured in
a CUDA graph with the forward and backward passes. Skipped where PyTorch sees no GPU;
bench/gpu_check.sh runs them where it does."""

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("PyTorch sees no CUDA device", allow_module_level=True)

from halfstep.torch import FusedAdamW, GradScaler  # noqa: E402

from helpers import first_nonfinite, fresh_params, scaled_grads  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(300, 7), (1,), (4097,), (64, 33)]


def _step_both(cpu, gpu, cpu_params, gpu_params, grads, injected):
    """One step of `cpu` and `gpu` on the same gradients, `injected` (tensor, element, value) or
    None written into them first; returns both reports."""
    if injected is not None:
        t, i, value = injected
        grads[t].view(-1)[i] = value
    for p, q, g in zip(cpu_params, gpu_params, grads):
        p.grad = g.clone()
        q.grad = g.to("cuda")
    cpu.step()
    gpu.step()
    return cpu.last_report(), gpu.last_report()


def _assert_same_state(cpu, gpu, cpu_params, gpu_params, step):
    """Every state entry (masters, moments, codes, block scales) and every parameter, bit for bit."""
    for x, y in zip(cpu.state_dict()["state"].values(), gpu.state_dict()["state"].values()):
        assert sorted(x) == sorted(y)
        for key, value in x.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, y[key].cpu()), (step, key)
    for p, q in zip(cpu_params, gpu_params):
        assert torch.equal(p.detach(), q.detach().cpu()), step


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_step_agrees_with_the_cpu_step(dtype):
    # The same start and gradients on both backends: identical decisions, scales and norms (the
    # norm is exact on both), and the same bits in every master, moment and parameter: CPU tensors
    # run the host backend, the kernels' own fp32 arithmetic without contraction.
    cpu_params = fresh_params(SHAPES, dtype, seed=21)
    gpu_params = fresh_params(SHAPES, dtype, seed=21, device="cuda")
    kw = dict(lr=1e-2, weight_decay=0.05, max_grad_norm=0.5, scaler=dict(init_scale=2.0 ** 12, growth_interval=5))
    cpu, gpu = FusedAdamW(cpu_params, **kw), FusedAdamW(gpu_params, **kw)
    gen = torch.Generator().manual_seed(22)
    inject = {4: (0, 0), 9: (1, 0), 13: (2, 2048), 17: (3, 64 * 33 - 1)}
    for step in range(24):
        scale = float(cpu.loss_scale)
        assert float(gpu.loss_scale) == scale
        _, grads = scaled_grads(SHAPES, dtype, scale, gen, 10.0 ** (-4 + step % 4))
        injected = inject[step] + ([math.inf, -math.inf, math.nan][step % 3],) if step in inject else None
        a, b = _step_both(cpu, gpu, cpu_params, gpu_params, grads, injected)
        for key in ("outcome", "reason", "scale_used", "scale_next", "first_nonfinite_tensor", "nonfinite_count",
                    "subnormal_count", "zero_count", "numel", "step", "attempt"):
            assert a[key] == b[key], (step, key, a[key], b[key])
        assert (first_nonfinite(grads) >= 0) == (a["outcome"] != "applied")
        if a["outcome"] == "applied":
            assert a["grad_norm"] == b["grad_norm"], "the exact norm has the same bits on both backends"
        _assert_same_state(cpu, gpu, cpu_params, gpu_params, step)
    assert int(gpu.applied_steps) == int(cpu.applied_steps) == 24 - len(inject)



# Every state format on bfloat16 parameters (the lean formats need a bf16 model copy), with 8-bit
# moments on the tensors whose shape has blocks: (4097,) one row of 17 blocks, the last of one
# element, and (40, 300) rows of two blocks (256 + 44); the others keep fp32 moments.
FORMATS = {
    "fp32 state": {},
    "bf16 moments": dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16),
    "remainders": dict(store_param_remainders=True),
    "no master": dict(master_weight_dtype=None),
    "8-bit moments": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8),
    "8-bit moments, remainders": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
                                      store_param_remainders=True),
    "8-bit moments, no master": dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8,
                                     master_weight_dtype=None),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_cuda_state_formats_step_bitwise_like_the_cpu_step(name):
    # The host backend runs the kernels' per-element code on CPU tensors, so the device must give
    # the same bits in every state entry (codes and block scales too), parameter and report, also
    # across skipped steps: inf/NaN at the first element of the first tensor, the middle of the
    # middle one and the last element of the last.
    shapes = SHAPES + [(40, 300)]
    bf16 = torch.bfloat16
    cpu_params = fresh_params(shapes, bf16, seed=41)
    gpu_params = fresh_params(shapes, bf16, seed=41, device="cuda")
    kw = dict(lr=1e-2, weight_decay=0.05, max_grad_norm=0.5, seed=7, **FORMATS[name])
    cpu, gpu = FusedAdamW(cpu_params, **kw), FusedAdamW(gpu_params, **kw)
    gen = torch.Generator().manual_seed(42)
    inject = {3: (0, 0), 7: (2, 2048), 11: (4, 40 * 300 - 1)}
    for step in range(16):
        _, grads = scaled_grads(shapes, bf16, 1.0, gen, 10.0 ** (-3 + step % 3))
        injected = inject[step] + ([math.inf, -math.inf, math.nan][step % 3],) if step in inject else None
        a, b = _step_both(cpu, gpu, cpu_params, gpu_params, grads, injected)
        for key in ("outcome", "reason", "grad_norm", "first_nonfinite_tensor", "nonfinite_count", "step"):
            assert a[key] == b[key] or (a[key] != a[key] and b[key] != b[key]), (step, key, a[key], b[key])
        assert (a["outcome"] == "applied") == (step not in inject), step
        _assert_same_state(cpu, gpu, cpu_params, gpu_params, step)
    if "8-bit" in name:
        assert gpu.state[gpu_params[4]]["exp_avg"].dtype == torch.uint8
        assert gpu.state[gpu_params[0]]["exp_avg"].dtype == torch.float32  # (300, 7): 2100 elements
    assert int(gpu.applied_steps) == 16 - len(inject)

def _model(dtype, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward_and_step_captured_in_a_cuda_graph(dtype):
    torch.manual_seed(23)
    x = torch.randn(32, 64, device="cuda").to(dtype)
    y = torch.randn(32, 64, device="cuda").to(dtype)
    poison = torch.ones((), device="cuda")  # set to inf to make one replay overflow
    models = [_model(dtype, 24), _model(dtype, 24)]
    opts = [FusedAdamW(m.parameters(), lr=1e-3, max_grad_norm=1.0, scaler=dict(init_scale=2.0 ** 10, growth_interval=4))
            for m in models]

    def train_step(model, opt):
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        (loss * opt.loss_scale * poison).backward()
        opt.step()
        return loss

    # Eager steps must not synchronise with the host: PyTorch raises where one of its own ops would.
    eager_model, eager_opt = models[0], opts[0]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            train_step(eager_model, eager_opt)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    # Capture (after warm-up steps on a side stream, as torch.cuda.graph asks).
    model, opt = models[1], opts[1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step(model, opt)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = train_step(model, opt)

    # Replays against eager steps, with one overflow in the middle.
    losses = []
    for k in range(12):
        poison.fill_(math.inf if k == 5 else 1.0)
        graph.replay()
        eager = train_step(eager_model, eager_opt)
        torch.cuda.synchronize()
        r, e = opt.last_report(), eager_opt.last_report()
        assert r["outcome"] == e["outcome"] == ("skipped_overflow" if k == 5 else "applied"), (k, r, e)
        # Capturing ran nothing: the warm-up's 3 attempts, then one per replay.
        assert r["scale_used"] == e["scale_used"] and r["attempt"] == e["attempt"] == 3 + k + 1
        losses.append((float(static_loss), float(eager)))
    assert float(opt.loss_scale) == float(eager_opt.loss_scale)
    assert int(opt.applied_steps) == int(eager_opt.applied_steps) == 3 + 12 - 1
    # Forward and backward may pick other cuBLAS kernels when captured: losses and weights agree to
    # the model format's precision, not bit for bit.
    for captured, eager in losses:
        assert captured == pytest.approx(eager, rel=2e-2)
    assert losses[-1][0] < losses[0][0], "the captured steps train"
    for p, q in zip(model.parameters(), eager_model.parameters()):
        assert torch.allclose(p.float(), q.float(), rtol=5e-2, atol=5e-3)
    # The graph replays the optimizer it captured: a rebuild is refused from now on.
    extra = torch.nn.Parameter(torch.zeros(4, device="cuda", dtype=dtype))
    with pytest.raises(RuntimeError, match="a CUDA graph captured this optimizer's step"):
        opt.add_param_group(dict(params=[extra]))
    graph.replay()
    torch.cuda.synchronize()
    assert opt.last_report()["attempt"] == 3 + 12 + 1


def test_autocast_with_fp32_parameters_and_the_grad_scaler_never_synchronises():
    # The recipe PyTorch's AMP documentation teaches, with halfstep's GradScaler: no host
    # synchronisation per step, and the overflow a poisoned step makes is skipped.
    torch.manual_seed(25)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    opt = FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    scaler = GradScaler(init_scale=2.0 ** 12, growth_interval=4)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    poison = torch.ones((), device="cuda")

    def train_step():
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x), y) * poison
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    train_step()  # the first step binds the scaler (a rebuild, before anything ran)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(8):
            poison.fill_(math.inf if k == 3 else 1.0)
            train_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.scaler_state()["overflows"] >= 1 and int(opt.applied_steps) >= 7


def test_lean_state_on_cuda_remainders_exact_and_captured_in_a_cuda_graph():
    # bfloat16 parameters on the device: remainders with bf16 moments step bitwise like fp32 masters
    # with bf16 moments (the same kernels' arithmetic; stochastic rounding keyed alike), the moments
    # within a bf16 rounding of the CPU step's, and the lean step captured in a CUDA graph replays
    # like eager steps, bit for bit (the optimizer step alone: the gradients are given).
    bf16 = torch.bfloat16
    moments = dict(exp_avg_dtype=bf16, exp_avg_sq_dtype=bf16, seed=5)
    kw = dict(lr=1e-2, weight_decay=0.05, max_grad_norm=0.5)
    runs = {}
    for name, extra in (("fp32 masters", {}), ("remainders", dict(store_param_remainders=True)),
                        ("captured", dict(store_param_remainders=True))):
        params = fresh_params(SHAPES, bf16, seed=31, device="cuda")
        opt = FusedAdamW(params, **kw, **moments, **extra)
        grads = [torch.zeros_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        gen = torch.Generator().manual_seed(32)
        steps = [scaled_grads(SHAPES, bf16, 1.0, gen, 3e-2)[1] for _ in range(10)]
        steps[4][1].view(-1)[0] = math.inf
        reports = []
        if name == "captured":
            for g, new in zip(grads, steps[0]):
                g.copy_(new)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                opt.step()  # the first step (warm-up), eager
            torch.cuda.current_stream().wait_stream(side)
            reports.append(opt.last_report())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                opt.step()
            for new_grads in steps[1:]:
                for g, new in zip(grads, new_grads):
                    g.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                reports.append(opt.last_report())
        else:
            for new_grads in steps:
                for g, new in zip(grads, new_grads):
                    g.copy_(new)
                opt.step()
                reports.append(opt.last_report())
        runs[name] = ([r["outcome"] for r in reports], [p.detach().clone() for p in params],
                      [opt.state[p]["exp_avg_sq"].clone() for p in params])
    base = runs["fp32 masters"]
    assert base[0].count("applied") == 9
    for name in ("remainders", "captured"):
        assert runs[name][0] == base[0], name
        assert all(torch.equal(a, b) for a, b in zip(runs[name][1], base[1])), name
        assert all(torch.equal(a, b) for a, b in zip(runs[name][2], base[2])), name
