"""halfstep.torch.FusedAdamW on CPU tensors (halfstep's host backend: the kernels' arithmetic), against PyTorch."""

import io
import math
import warnings

import pytest

torch = pytest.importorskip("torch")

import halfstep  # noqa: E402
from halfstep.torch import FusedAdamW  # noqa: E402

from helpers import (U, first_nonfinite, fresh_params, gradscaler_rule, halfstep_entry, scaled_grads,  # noqa: E402
                     unscaled_clipped, with_halfstep_entry)

SHAPES = [(7, 5), (33,), (4, 4, 3), (1,)]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def masters(opt):
    return [s["master"] for s in opt.state_dict()["state"].values()]


def set_grads(params, grads):
    """New gradient tensors, as every backward pass after zero_grad(set_to_none=True) makes them."""
    for p, g in zip(params, grads):
        p.grad = g.clone()


# Where the 100-step trajectory puts an inf or NaN: (step, tensor, element, value) at the first,
# middle and last element of the first, a middle and the last tensor.
INJECT = [(9, 0, 0, math.inf), (23, 1, 16, -math.inf), (37, 3, 0, math.nan), (51, 0, 34, math.nan),
          (52, 2, 0, math.inf), (70, 2, 47, -math.inf), (71, 1, 32, math.nan), (88, 3, 0, -math.inf)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_100_steps_match_torch_adamw_in_float64(dtype, max_norm):
    params = fresh_params(SHAPES, dtype, seed=1)
    groups = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, weight_decay=0.0)]
    opt = FusedAdamW([dict(params=params[:2], **groups[0]), dict(params=params[2:], **groups[1])],
                     betas=(0.9, 0.999), eps=1e-8, max_grad_norm=max_norm,
                     scaler=dict(init_scale=2.0 ** 10, growth_interval=7))
    ref_params = [p.detach().double().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW([dict(params=ref_params[:2], **groups[0]), dict(params=ref_params[2:], **groups[1])],
                            betas=(0.9, 0.999), eps=1e-8)
    # A scheduler from torch.optim.lr_scheduler, stepped after every attempt: float64 AdamW takes
    # the rate each halfstep step was given.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1.0 + 0.02 * k))
    # How far halfstep's fp32 masters may be from float64 AdamW, per element, accumulated over the
    # steps. The host backend runs the kernels' fp32 arithmetic (adamw_update). Per applied step,
    # the master is rounded three times: the decay 1 − lr·λ to fp32 (u/2 of a number below 1),
    # the decayed weight p·decay (u·|w|), and the update's fma (u·|w|): 2.5u·|w| < 3u·|w|. The
    # update lr·Δ, Δ = m̂/(√v̂ + ε), is computed from an m and v that carry earlier roundings: m's
    # relative error stays below 2u/(1−β1) = 20u (two roundings a step, shrunk by β1 each step),
    # v's below 2u·min(t, 1/(1−β2)) ≤ 200u over 100 steps, so Δ's below 20u + 100u + a few u for
    # √, the denominator's fma, the division and step_size (lr/bc1 rounded once); with
    # |Δ| ≤ (1−β1)/√(1−β2) ≈ 3.2 (Adam's step bound for these betas) the update's error is below
    # lr·3.2·128u < lr·2^-15. (β1 and β2 are the fp32 values of 0.9 and 0.999 in both m and v and in
    # the bias corrections, so their own rounding cancels in m̂ and v̂ up to the same order.)
    # Earlier master errors are only scaled by (1 − lr·λ) ≤ 1 after that: they add up, never grow.
    bound = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    gen = torch.Generator().manual_seed(2)
    skips = 0
    for step in range(100):
        scale = float(opt.loss_scale)  # (fp32 gradients here come from a scaled loss too)
        magnitude = 10.0 ** (-3 + 3 * torch.rand((), generator=gen).item())
        _, grads = scaled_grads(SHAPES, dtype, scale, gen, magnitude)
        for at, t, i, value in INJECT:
            if at == step:
                grads[t].view(-1)[i] = value
        set_grads(params, grads)
        lrs = [g["lr"] for g in opt.param_groups]
        opt.step()
        sched.step()
        r = opt.last_report()
        bad = first_nonfinite(grads)  # an injection, or g·S past the format's range
        if bad >= 0:
            skips += 1
            assert r["outcome"] == "skipped_overflow" and r["reason"] == "nonfinite_gradient", (step, r)
            assert r["first_nonfinite_tensor"] == bad
            assert r["nonfinite_count"] == sum(int((~torch.isfinite(g)).sum()) for g in grads)
        else:
            assert r["outcome"] == "applied", (step, r)
            g64, norm = unscaled_clipped(grads, scale, max_norm)
            assert r["grad_norm"] == pytest.approx(norm, rel=1e-12)
            for rp, g in zip(ref_params, g64):
                rp.grad = g
            for rg, lr in zip(ref.param_groups, lrs):
                rg["lr"] = lr
            ref.step()
            group_lr = [lrs[0]] * 2 + [lrs[1]] * 2
            for b, rp, lr in zip(bound, ref_params, group_lr):
                b += 3 * U * rp.detach().abs() + lr * 2.0 ** -15
        assert r["scale_used"] == scale and r["attempt"] == step + 1 and r["step"] == step + 1 - skips
        assert int(opt.applied_steps) == step + 1 - skips
        for m, rp, b, p in zip(masters(opt), ref_params, bound, params):
            err = (m.double() - rp.detach()).abs()
            assert bool((err <= b).all()), (step, float((err - b).max()))
            assert torch.equal(p.detach(), m.to(dtype)), "the parameters are the masters rounded"
    assert skips >= len(INJECT)


def test_loss_scale_follows_gradscalers_rules():
    growth, backoff, interval = 2.0, 0.5, 3
    params = fresh_params([(5,), (3, 2)], torch.float16, seed=3)
    opt = FusedAdamW(params, lr=1e-3, scaler=dict(init_scale=2.0 ** 8, growth_factor=growth, backoff_factor=backoff,
                                                  growth_interval=interval, hysteresis=1))
    overflow_at = {2, 3, 9, 10, 11, 17, 25, 26, 33}
    scale, tracker = 2.0 ** 8, 0
    for step in range(40):
        assert float(opt.loss_scale) == scale, step
        grads = [torch.full_like(p, 0.125) for p in params]
        if step in overflow_at:
            grads[step % 2].view(-1)[-1] = math.inf
        set_grads(params, grads)
        opt.step()
        scale, tracker = gradscaler_rule(scale, tracker, step in overflow_at, growth, backoff, interval)
        assert opt.last_report()["scale_next"] == scale
    assert float(opt.loss_scale) == scale
    assert int(opt.applied_steps) == 40 - len(overflow_at)


def test_param_groups_keep_their_own_rates_and_decay():
    params = fresh_params([(6,), (6,)], torch.bfloat16, seed=4)
    before = [p.detach().float().clone() for p in params]
    opt = FusedAdamW([dict(params=[params[0]], lr=0.1, weight_decay=0.5), dict(params=[params[1]], lr=0.01)],
                     weight_decay=0.0)
    set_grads(params, [torch.ones_like(p) * opt.loss_scale.item() * 1e-3 for p in params])
    opt.step()
    after = masters(opt)
    # First Adam step: w·(1 − lr·λ) − lr·sign(g) (|g| ≫ ε).
    assert torch.allclose(after[0], before[0] * (1 - 0.1 * 0.5) - 0.1, atol=1e-6)
    assert torch.allclose(after[1], before[1] - 0.01, atol=1e-6)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]


def test_lr_changes_reach_the_step_and_a_device_schedule_can_follow_applied_steps():
    # At S = 1 with a constant g of 64, Adam moves every weight by exactly lr·bc-corrected
    # m̂/(√v̂ + ε) = lr·(1 − 1.6e-10) per applied step: the step's rate can be read off the masters.
    params = fresh_params([(8,)], torch.float16, seed=5)
    opt = FusedAdamW(params, lr=0.0, weight_decay=0.0, scaler=dict(init_scale=1.0))
    grads = [torch.full_like(params[0], 64.0)]

    def moved(nan=False):
        before = masters(opt)[0].clone()
        assert float(opt.loss_scale) == 1.0  # (fp16: the step wants the scale read)
        g = [x.clone() for x in grads]
        if nan:
            g[0][3] = math.nan
        set_grads(params, g)
        opt.step()
        return float((before - masters(opt)[0]).mean())

    assert moved() == 0.0, "lr 0 moves nothing"
    opt.param_groups[0]["lr"] = 0.25  # as a scheduler writes it
    assert moved() == pytest.approx(0.25, rel=1e-6)
    # A warm-up on applied steps, computed on the device from the counter: no host read of it.
    lr = opt.lr_tensor(0)
    used = []
    for step in range(6):
        lr.copy_(0.01 * torch.clamp(opt.applied_steps.float() / 4, max=1.0))
        used.append(moved(nan=step in (1, 2)))
    # Applied before the loop: 2. The skipped attempts (1, 2) moved nothing and did not advance
    # the warm-up.
    assert used == pytest.approx([0.005, 0.0, 0.0, 0.0075, 0.01, 0.01], rel=1e-6)
    assert int(opt.applied_steps) == 6 and opt.scaler_state()["attempts"] == 8
    assert opt.param_groups[0]["lr"] == 0.25, "a device-side rate does not rewrite param_groups"


def test_zero_grad_as_torch_optim_and_gradients_wherever_pytorch_puts_them():
    torch.manual_seed(6)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    x = torch.randn(5, 4).to(torch.bfloat16)
    model(x).float().sum().backward()
    once = [p.grad.clone() for p in model.parameters()]
    model(x).float().sum().backward()  # autograd accumulates into the .grad it made
    assert all(torch.equal(p.grad, (o.float() * 2).to(torch.bfloat16)) for p, o in zip(model.parameters(), once))
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not bool(p.grad.any()) for p in model.parameters())
    opt.zero_grad()  # set_to_none=True, as torch.optim since 2.0
    assert all(p.grad is None for p in model.parameters())
    # A .grad that is a new tensor every step (the module's zero_grad, as HF Trainer calls it): the
    # step reads each; no gradient at all is a step that moves nothing.
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.last_report()["numel"] == 0 and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(x).float().sum().backward()
        opt.step()
        assert opt.last_report()["outcome"] == "applied" and opt.last_report()["numel"] == 15
    # A parameter without a gradient is left alone, as torch.optim skips it.
    model.zero_grad(set_to_none=True)
    model(x).float().sum().backward()
    model.bias.grad = None
    bias = model.bias.detach().clone()
    opt.step()
    assert torch.equal(model.bias, bias) and opt.last_report()["numel"] == 12


def test_a_gradient_of_the_wrong_dtype_shape_or_layout_is_refused_by_name():
    params = fresh_params([(4,), (4, 2)], torch.float16, seed=7)
    opt = FusedAdamW(params, lr=1e-3)
    for bad, match in ((torch.ones(4, dtype=torch.float32), r"parameter 0's \.grad is torch.float32"),
                       (torch.ones(2, dtype=torch.float16), r"parameter 0's \.grad is torch.float16 \(2,\)")):
        params[0].grad = torch.ones(4, dtype=torch.float16)
        params[0].grad.data = bad  # (assigning .grad directly is checked by PyTorch itself)
        params[1].grad = torch.ones(4, 2, dtype=torch.float16)
        with pytest.raises(RuntimeError, match=match):
            float(opt.loss_scale)
            opt.step()
    params[0].grad = torch.ones(4, dtype=torch.float16)
    params[1].grad = torch.ones(2, 4, dtype=torch.float16).t()
    with pytest.raises(RuntimeError, match="parameter 1's .grad is not contiguous"):
        opt.step()
    assert opt.scaler_state()["attempts"] == 0, "nothing ran"
    params[1].grad = params[1].grad.contiguous()
    opt.step()
    assert opt.scaler_state()["attempts"] == 1


def test_refuses_what_it_cannot_step():
    half = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.float16))  # noqa: E731
    with pytest.raises(TypeError, match="float32 parameters.*or float16 or bfloat16"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(TypeError, match="one dtype.*model.float\\(\\) with torch.autocast"):
        FusedAdamW([half(3), torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(TypeError, match="one dtype"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3)), half(3)])
    with pytest.raises(ValueError, match="not contiguous"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float16).t())])
    base = torch.zeros(10, dtype=torch.float16)
    with pytest.raises(ValueError, match="parameters 0 and 1 share storage"):
        FusedAdamW([torch.nn.Parameter(base[:6]), torch.nn.Parameter(base[4:])])
    with pytest.raises(ValueError, match="unknown scaler option"):
        FusedAdamW([half(3)], scaler=dict(init_scal=1.0))
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        FusedAdamW([half(3)], process_group=object())
    # Bad hyperparameters raise ValueError, as in every torch.optim optimizer.
    for kwargs, match in ((dict(lr=-1.0), "Invalid learning rate"), (dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
                          (dict(betas=(0.9, -0.1)), "beta parameter at index 1"), (dict(eps=-1e-8), "epsilon"),
                          (dict(eps=0.0), "torch.optim.AdamW also takes 0"), (dict(weight_decay=-0.1), "weight_decay"),
                          (dict(lr=math.nan), "learning rate"), (dict(lr="0.5"), "Invalid lr"),
                          (dict(lr=2.0, weight_decay=0.5), "lr \\* weight_decay"),
                          (dict(max_grad_norm=-1.0), "max_grad_norm")):
        with pytest.raises(ValueError, match=match):
            FusedAdamW([half(3)], **kwargs)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        FusedAdamW([dict(params=[half(3)], lr=-2.0)])
    assert FusedAdamW([half(3)]).defaults["weight_decay"] == 1e-2, "torch.optim.AdamW's default"
    opt = FusedAdamW([half(3)], lr=1e-3)
    opt.param_groups[0]["lr"] = torch.tensor([1e-3, 2e-3])  # torch.optim takes 1-element tensors
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        opt.step()
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()


def _weights_only_supported():
    # PyTorch 2's weights_only loader reads every type a state_dict holds (1.13's reads no floats).
    return int(torch.__version__.split(".")[0]) >= 2


def _run(opt, params, dtype, steps, gen):
    reports = []
    for k in range(steps):
        _, grads = scaled_grads([p.shape for p in params], dtype, float(opt.loss_scale), gen, 1e-2)
        if k % 4 == 3:
            grads[k % len(grads)].view(-1)[0] = math.nan
        set_grads(params, grads)
        opt.step()
        reports.append(opt.last_report())
    return reports


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_dict_round_trip_resumes_bitwise(dtype):
    shapes = [(5, 3), (17,)]

    def make(seed):
        params = fresh_params(shapes, dtype, seed=seed)
        return params, FusedAdamW([dict(params=params[:1], lr=2e-3), dict(params=params[1:], lr=1e-3, weight_decay=0.01)],
                                  max_grad_norm=1.0, scaler=dict(init_scale=2.0 ** 12, growth_interval=3, hysteresis=2),
                                  spike=dict(enabled=True, warmup_steps=2))
    params, opt = make(8)
    _run(opt, params, dtype, 10, torch.Generator().manual_seed(9))
    opt.param_groups[1]["lr"] = 5e-4  # changed after the last step: the next step pushes it
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    tail = _run(opt, params, dtype, 10, torch.Generator().manual_seed(10))

    params2, opt2 = make(11)  # other weights: load_state_dict brings the saved ones
    blob.seek(0)
    opt2.load_state_dict(torch.load(blob, **({"weights_only": True} if _weights_only_supported() else {})))
    tail2 = _run(opt2, params2, dtype, 10, torch.Generator().manual_seed(10))
    same = lambda r: {k: ("nan" if v != v else v) for k, v in r.items()}  # noqa: E731 (NaN == NaN here)
    assert [same(r) for r in tail2] == [same(r) for r in tail]
    assert all(torch.equal(a, b) for a, b in zip(params2, params))
    for a, b in zip(opt2.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in ("master", "exp_avg", "exp_avg_sq"))
    assert opt2.scaler_state() == opt.scaler_state()
    assert [g["lr"] for g in opt2.param_groups] == [2e-3, 5e-4]


def test_load_state_dict_refuses_a_mismatch_and_changes_nothing():
    params = fresh_params([(4,), (6,)], torch.float16, seed=12)
    opt = FusedAdamW(params, lr=1e-3)
    _run(opt, params, torch.float16, 3, torch.Generator().manual_seed(13))
    good = opt.state_dict()
    before = (opt.scaler_state(), [m.clone() for m in masters(opt)], [p.detach().clone() for p in params])

    def refused(sd, error, match):
        with pytest.raises(error, match=match):
            opt.load_state_dict(sd)
        after = (opt.scaler_state(), masters(opt), [p.detach() for p in params])
        assert after[0] == before[0]
        assert all(torch.equal(a, b) for a, b in zip(after[1] + after[2], before[1] + before[2]))

    refused({"state": {}}, ValueError, "not a halfstep")
    other = FusedAdamW(fresh_params([(4,), (6,)], torch.bfloat16, seed=12), lr=1e-3).state_dict()
    refused(other, ValueError, "written for bfloat16 parameters; this optimizer's are float16")
    library_dtype = with_halfstep_entry(good, optimizer_state=halfstep_entry(other)["optimizer_state"])
    refused(library_dtype, halfstep.HalfstepError, "grad_dtype is bf16 in the checkpoint and f16 here")
    shorter = FusedAdamW(fresh_params([(4,), (5,)], torch.float16, seed=12), lr=1e-3).state_dict()
    refused(shorter, ValueError, r"written for 2 parameters of other shapes; this optimizer's 2 are \[\(4,\), \(6,\)\]")
    wrong_shape = dict(good, state={0: good["state"][0], 1: dict(good["state"][1], master=torch.zeros(5))})
    refused(wrong_shape, ValueError, r"state\[1\]\['master'\] must be a float32 tensor of shape \(6,\)")
    two_groups = FusedAdamW([dict(params=[p]) for p in fresh_params([(4,), (6,)], torch.float16, seed=1)]).state_dict()
    refused(two_groups, ValueError, "2 parameter groups, this optimizer has 1")
    betas = dict(good, param_groups=[dict(good["param_groups"][0], betas=(1.5, 0.9))])
    refused(betas, ValueError, "Invalid beta parameter at index 0")
    nan = dict(good, state={0: good["state"][0], 1: dict(good["state"][1], exp_avg=torch.full((6,), math.nan))})
    refused(nan, ValueError, r"state\[1\]\['exp_avg'\] holds inf or NaN")
    corrupt = with_halfstep_entry(good, optimizer_state=halfstep_entry(good)["optimizer_state"][:-3].clone())
    refused(corrupt, halfstep.HalfstepError, "halfstep state checkpoint")
    opt.load_state_dict(good)


def test_device_handles_outlive_the_optimizer_and_its_memory_is_freed_with_it():
    import gc
    import weakref
    params = fresh_params([(3,)], torch.float16, seed=14)
    opt = FusedAdamW(params, lr=1e-3, scaler=dict(init_scale=512.0))
    scale, lr, applied = opt.loss_scale, opt.lr_tensor(0), opt.applied_steps
    owner = weakref.ref(opt._opt)
    del opt
    gc.collect()
    junk = [bytearray(64) for _ in range(10000)]  # reuse of freed memory would show here
    assert owner() is None, "the library's memory is freed with the optimizer: nothing handed out views it"
    assert (float(scale), float(lr), int(applied)) == (512.0, pytest.approx(1e-3), 0)
    del junk


def test_storage_moved_before_the_first_step_is_followed_and_after_it_refused():
    params = fresh_params([(4,), (5,)], torch.bfloat16, seed=15)
    opt = FusedAdamW(params, lr=1e-3)
    # Before the first step (.to(), .data assignments, a framework wrapping the model): the
    # optimizer is rebuilt over the new storage, its values the weights.
    params[1].data = torch.full_like(params[1], 0.5)
    for p in params:
        p.grad = torch.ones_like(p)  # bf16: no loss scaling; Adam's first step is -lr everywhere
    opt.step()
    assert opt.last_report()["outcome"] == "applied"
    assert torch.allclose(opt.state[params[1]]["master"], torch.full((5,), 0.5 * (1 - 1e-5) - 1e-3), atol=1e-6)
    assert torch.equal(params[1], opt.state[params[1]]["master"].to(torch.bfloat16))
    # After it, moved storage is refused (the optimizer holds the addresses it steps).
    old = params[1].data
    params[1].data = torch.zeros_like(old)
    with pytest.raises(RuntimeError, match="parameter 1 now has other storage"):
        opt.step()
    params[1].data = old
    params[0].grad = torch.zeros_like(params[0])
    params[0].grad.resize_(400)
    with pytest.raises(RuntimeError, match=r"parameter 0's \.grad is torch.bfloat16 \(400,\)"):
        opt.step()
    assert opt.scaler_state()["attempts"] == 1, "nothing more ran"


def test_weights_written_into_the_parameters_become_the_masters():
    # torch.optim continues from whatever the parameters hold; so does halfstep: everything
    # written before the first step (a pretrained state_dict, DDP's broadcast), and in-place
    # edits later.
    torch.manual_seed(16)
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    opt = FusedAdamW(model.parameters(), lr=0.5, weight_decay=0.0)
    model.load_state_dict({"weight": torch.full((2, 3), 4.0), "bias": torch.full((2,), -2.0)})
    for p in model.parameters():
        p.grad = torch.full_like(p, opt.loss_scale.item())  # g = +1 everywhere: Adam's first step is -lr
    opt.step()
    assert torch.equal(model.weight, torch.full((2, 3), 3.5, dtype=torch.bfloat16))
    assert torch.equal(model.bias, torch.full((2,), -2.5, dtype=torch.bfloat16))
    with torch.no_grad():
        model.bias.fill_(10.0)
    opt.step()
    m = masters(opt)
    assert torch.allclose(m[1], torch.full((2,), 9.5), atol=1e-6), "the edited bias took one more step"
    assert torch.allclose(m[0], torch.full((2, 3), 3.0), atol=1e-6), "the weight went on from its master"


def test_cannot_be_copied_and_refuses_odd_input_by_name():
    import copy
    import pickle
    half = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=torch.float16))  # noqa: E731
    opt = FusedAdamW([half(3)])
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)
    with pytest.raises(ValueError, match="no parameters"):
        FusedAdamW([{"params": []}])
    z = half(0)
    with warnings.catch_warnings():  # PyTorch warns of (later versions: refuse) the duplicate itself
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="parameters 0 and 1 are the same tensor|duplicate parameters"):
            FusedAdamW([z, z])
    with pytest.raises(ValueError, match="Invalid betas"):
        FusedAdamW([half(3)], betas=(0.9,))
    with pytest.raises(ValueError, match="growth_interval = 4294967301 does not fit"):
        FusedAdamW([half(3)], scaler=dict(growth_interval=2 ** 32 + 5))
    with pytest.raises(ValueError, match="warmup_steps = 2147483648 does not fit"):
        FusedAdamW([half(3)], spike=dict(warmup_steps=2 ** 31))


def test_load_state_dict_refuses_rates_and_masters_the_model_cannot_take():
    params = fresh_params([(4,)], torch.float16, seed=17)
    opt = FusedAdamW(params, lr=1e-3)
    good = opt.state_dict()
    for lr, error in ((None, ValueError), (math.nan, ValueError), (-1.0, ValueError), (torch.tensor([1e-3, 0.1]), ValueError)):
        sd = dict(good, param_groups=[dict(good["param_groups"][0], lr=lr)])
        with pytest.raises(error, match=r"Invalid lr|Invalid learning rate|Tensor lr must be 1-element"):
            opt.load_state_dict(sd)
    sd = dict(good, state={0: dict(good["state"][0], master=torch.full((4,), 1e6))})
    with pytest.raises(ValueError, match="past float16's range"):
        opt.load_state_dict(sd)
    sd = dict(good, param_groups=[{k: v for k, v in good["param_groups"][0].items() if k != "betas"}])
    with pytest.raises(ValueError, match="must be a dict with params, lr, betas"):
        opt.load_state_dict(sd)
    params[0].grad = (torch.full(params[0].shape, 0.01) * opt.loss_scale.item()).to(torch.float16)
    opt.step()
    assert opt.last_report()["outcome"] == "applied"


def test_in_place_writes_of_the_same_values_keep_the_masters_precision():
    # A norm-limited embedding renormalises its weight in place on every forward; where the limit
    # does not bind the values stay, and so must the fp32 masters (only elements that differ from
    # their rounded master are taken).
    torch.manual_seed(18)
    emb = torch.nn.Embedding(10, 4, max_norm=100.0).to(torch.bfloat16)
    plain = torch.nn.Embedding(10, 4).to(torch.bfloat16)
    plain.load_state_dict(emb.state_dict())
    opts = [FusedAdamW(m.parameters(), lr=1e-4) for m in (emb, plain)]
    idx = torch.arange(10)
    for _ in range(20):
        for m, opt in zip((emb, plain), opts):
            (m(idx).float().sum() * opt.loss_scale).backward()
            opt.step()
            opt.zero_grad()
    assert emb.weight._version > 20, "the embedding did write its weight in place"
    assert torch.equal(masters(opts[0])[0], masters(opts[1])[0])


def test_model_state_dict_loaded_after_the_optimizers_resumes_bitwise():
    params = fresh_params([(6,), (3,)], torch.bfloat16, seed=19)
    opt = FusedAdamW(params, lr=1e-2)
    _run(opt, params, torch.bfloat16, 5, torch.Generator().manual_seed(20))
    saved_opt, saved_params = opt.state_dict(), [p.detach().clone() for p in params]
    tail = _run(opt, params, torch.bfloat16, 5, torch.Generator().manual_seed(21))
    params2 = fresh_params([(6,), (3,)], torch.bfloat16, seed=22)
    opt2 = FusedAdamW(params2, lr=1e-2)
    opt2.load_state_dict(saved_opt)
    with torch.no_grad():  # the model's own state_dict, loaded second
        for p, v in zip(params2, saved_params):
            p.copy_(v)
    tail2 = _run(opt2, params2, torch.bfloat16, 5, torch.Generator().manual_seed(21))
    same = lambda r: {k: ("nan" if v != v else v) for k, v in r.items()}  # noqa: E731
    assert [same(r) for r in tail2] == [same(r) for r in tail]
    assert all(torch.equal(a, b) for a, b in zip(masters(opt2), masters(opt)))


def test_resync_weights_takes_writes_step_cannot_see():
    params = fresh_params([(4,)], torch.float16, seed=23)
    opt = FusedAdamW(params, lr=1e-3)
    _run(opt, params, torch.float16, 2, torch.Generator().manual_seed(24))
    params[0].data.fill_(2.0)  # through .data: PyTorch's version counter does not move
    opt.resync_weights()
    assert torch.equal(masters(opt)[0], torch.full((4,), 2.0))


def test_a_rate_written_on_the_device_survives_a_checkpoint():
    params = fresh_params([(4,)], torch.float16, seed=25)
    opt = FusedAdamW(params, lr=1e-3)
    opt.lr_tensor(0).fill_(0.1)
    _run(opt, params, torch.float16, 2, torch.Generator().manual_seed(26))
    saved = opt.state_dict()
    opt2 = FusedAdamW(fresh_params([(4,)], torch.float16, seed=27), lr=1e-3)
    opt2.load_state_dict(saved)
    float(opt2.loss_scale)
    opt2.step()
    assert float(opt2.lr_tensor(0)) == pytest.approx(0.1), "the next step did not push the stale group rate"
    with pytest.raises(IndexError, match=r"group_index must be in \[0, 1\)"):
        opt.lr_tensor(2 ** 32)


def test_step_refuses_before_it_changes_anything():
    params = fresh_params([(4,)], torch.bfloat16, seed=28)
    opt = FusedAdamW([dict(params=params, lr=0.1)])
    opt.param_groups[0]["lr"] = 0.5
    opt.param_groups[0]["eps"] = -1e-3
    with torch.no_grad():
        params[0].fill_(3.0)
    with pytest.raises(ValueError, match="Invalid epsilon value"):
        opt.step()
    # (the masters themselves: state_dict() would take the written weights, as the next step will)
    assert float(opt.lr_tensor(0)) == pytest.approx(0.1) and not bool((opt.state[params[0]]["master"] == 3.0).any())
    opt.param_groups[0]["eps"] = 1e-8
    params[0].data = params[0].data[:2]
    with pytest.raises(RuntimeError, match="parameter 0 now has other storage"):
        opt.step()
