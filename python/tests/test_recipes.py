"""halfstep.torch in the loops PyTorch users already run, each against the standard pipeline in
float64 (torch.optim.AdamW, GradScaler's rules, clip_grad_norm_'s coefficient) on the gradients
the loop computed: fp32 parameters under torch.autocast (bf16; fp16 where the CPU has it), fp16
and bf16 parameters; an HF-Trainer-style loop, a timm/accelerate-style GradScaler loop with
unscale_ and clip_grad_norm_, torch.amp.GradScaler itself driving the fused step, OneCycleLR and
CyclicLR cycling the betas, a Lightning-style unfreeze by add_param_group, the optimizer hooks,
opt.state, and the refusal of an fp16 loop that never scales its loss."""

import math
import warnings

import pytest

torch = pytest.importorskip("torch")

from halfstep.torch import FusedAdamW, GradScaler  # noqa: E402

from helpers import U, gradscaler_rule  # noqa: E402

TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def cpu_autocast(dtype):
    """Whether torch.autocast runs on the CPU in `dtype` (PyTorch 1.13's does bf16 only)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.autocast("cpu", dtype=dtype):
                return torch.nn.functional.linear(torch.ones(2, 2), torch.ones(2, 2)).dtype == dtype
    except Exception:  # noqa: BLE001 (a warning raised as an error, or an error)
        return False


def cpu_half_matmul():
    """Whether fp16 matrix products run on the CPU (PyTorch 1.13's do not)."""
    try:
        torch.nn.functional.linear(torch.ones(2, 2, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16))
        return True
    except RuntimeError:
        return False


def cpu_grad_scaler():
    """torch.amp.GradScaler on the CPU (PyTorch >= 2.3), or None."""
    try:
        return torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=7)
    except Exception:  # noqa: BLE001
        return None


def mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, 16, generator=g), torch.randn(64, 8, generator=g)) for _ in range(n)]


# Where a run puts an inf or NaN into a gradient after the backward pass: (step, parameter,
# element, value) at the first, middle and last elements of the first, a middle and the last of
# the MLP's parameters (W1 32x16, b1 32, W2 8x32, b2 8).
INJECT = [(9, 0, 0, math.inf), (23, 1, 16, -math.inf), (37, 3, 0, math.nan), (51, 0, 511, math.nan),
          (52, 2, 0, math.inf), (70, 2, 128, -math.inf), (71, 1, 31, math.nan), (88, 3, 7, -math.inf)]


class Reference:
    """The standard pipeline in float64: torch.optim.AdamW on float64 copies of the masters,
    stepped with the gradients the loop computed, unscaled and clipped as GradScaler and
    clip_grad_norm_ do, skipping a step whose gradients are not finite.

    The bound on halfstep's fp32 masters: per applied step, the master's roundings 3u·|w| and the
    update's, lr·2^-15 (test_torch.py derives both for the kernels' fp32 arithmetic, which CPU
    tensors run on the host backend). Earlier errors are only scaled by 1 - lr·λ <= 1."""

    def __init__(self, masters, **hyper):
        self.params = [m.detach().double().clone().requires_grad_() for m in masters]
        self.opt = torch.optim.AdamW(self.params, **hyper)
        self.bound = [torch.zeros_like(p) for p in self.params]
        # GradScaler's own decisions where the CPU has it: it checks the same scaled gradients and
        # steps an SGD of rate 0 (which moves nothing) or skips it.
        self.checked = [p.detach().clone().requires_grad_() for p in self.params]
        self.checker = torch.optim.SGD(self.checked, lr=0.0)

    def step(self, grads, scale=1.0, max_norm=0.0):
        """One step from the scaled gradients `grads`; returns (applied, unscaled norm)."""
        g = [x.double() / scale for x in grads]
        if not all(bool(torch.isfinite(x).all()) for x in g):
            return False, math.nan
        norm = math.sqrt(sum(float((x * x).sum()) for x in g))
        coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
        for p, x in zip(self.params, g):
            p.grad = x * coef
        self.opt.step()
        lr_of = {id(p): group["lr"] for group in self.opt.param_groups for p in group["params"]}
        for b, p in zip(self.bound, self.params):
            b += 3 * U * p.detach().abs() + lr_of[id(p)] * 2.0 ** -15
        return True, norm

    def grad_scaler_scale(self, scaler, grads):
        """torch.amp.GradScaler's next scale after these scaled gradients."""
        scaler.scale(torch.ones(()))
        for p, g in zip(self.checked, grads):
            p.grad = g.double()
        scaler.step(self.checker)
        scaler.update()
        return scaler.get_scale()

    def check(self, masters, where):
        for m, p, b in zip(masters, self.params, self.bound):
            err = (m.detach().double() - p.detach()).abs()
            assert bool((err <= b).all()), (where, float((err - b).max()))


def masters_of(opt, params):
    """halfstep's fp32 masters: the parameters themselves for fp32 ones."""
    if params[0].dtype == torch.float32:
        return list(params)
    return [s["master"].view_as(p) for s, p in zip(opt.state_dict()["state"].values(), params)]


RECIPES = ["fp32-autocast-bf16", "fp32-autocast-fp16", "fp16-params", "bf16-params"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_100_steps_of_each_recipe_match_the_standard_pipeline(recipe):
    if recipe == "fp32-autocast-fp16" and not cpu_autocast(torch.float16):
        pytest.skip("this PyTorch has no fp16 autocast on the CPU")
    if recipe == "fp16-params" and not cpu_half_matmul():
        pytest.skip("this PyTorch has no fp16 matrix products on the CPU")
    fp16 = recipe in ("fp32-autocast-fp16", "fp16-params")
    param_dtype = {"fp16-params": torch.float16, "bf16-params": torch.bfloat16}.get(recipe, torch.float32)
    autocast = {"fp32-autocast-bf16": torch.bfloat16, "fp32-autocast-fp16": torch.float16}.get(recipe)
    model = mlp(param_dtype)
    params = list(model.parameters())
    max_norm = 1.0
    opt = FusedAdamW(params, lr=3e-3, max_grad_norm=max_norm)
    # fp16 computes need loss scaling (GradScaler's protocol, halfstep's scaler); bf16 ones do not,
    # and halfstep does not scale them by default (the scale stays 1).
    scaler = GradScaler(init_scale=2.0 ** 10, growth_interval=7) if fp16 else None
    torch_scaler = cpu_grad_scaler() if fp16 else None  # the real GradScaler on the reference
    ref = Reference(masters_of(opt, params), lr=3e-3, weight_decay=1e-2)
    scale, tracker, skips = 2.0 ** 10 if fp16 else 1.0, 0, 0
    for step, (x, y) in enumerate(batches(100)):
        if autocast is not None:
            with torch.autocast("cpu", dtype=autocast):
                out = model(x)
        else:
            out = model(x.to(param_dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        for at, t, i, value in INJECT:
            if at == step:
                params[t].grad.view(-1)[i] = value
        grads = [p.grad.clone() for p in params]
        assert all(g.dtype == param_dtype for g in grads)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        r = opt.last_report()
        applied, norm = ref.step(grads, scale, max_norm)
        assert r["scale_used"] == scale, step
        assert (r["outcome"] == "applied") == applied, (step, r)
        if applied:
            assert r["grad_norm"] == pytest.approx(norm, rel=1e-12)
        else:
            skips += 1
            assert r["reason"] == "nonfinite_gradient"
        if fp16:  # GradScaler's rules, restated, and GradScaler itself where the CPU has it
            scale, tracker = gradscaler_rule(scale, tracker, not applied, 2.0, 0.5, 7)
            if torch_scaler is not None:
                assert ref.grad_scaler_scale(torch_scaler, grads) == scale, step
        assert r["scale_next"] == scale, step
        ref.check(masters_of(opt, params), step)
        if param_dtype != torch.float32:
            assert all(torch.equal(p.detach(), m.to(param_dtype)) for p, m in zip(params, masters_of(opt, params)))
    assert skips >= len(INJECT)
    assert int(opt.applied_steps) == 100 - skips


def test_an_hf_trainer_style_loop_runs_correctly():
    # Trainer (bf16=True on the CPU): fp32 parameters, autocast, loss.backward() with no loss
    # multiplication, clip_grad_norm_, a scheduler stepped per step, model.zero_grad() (which sets
    # every .grad to None: each backward makes new gradient tensors).
    model = mlp()
    params = list(model.parameters())
    opt = FusedAdamW(params, lr=5e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 5) * (1 - k / 40))
    ref = Reference(params, lr=5e-4, weight_decay=0.01)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref.opt, lambda k: min(1.0, (k + 1) / 5) * (1 - k / 40))
    for step, (x, y) in enumerate(batches(30)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads = [p.grad.clone() for p in params]
        opt.step()
        sched.step()
        model.zero_grad(set_to_none=True)  # (the default since PyTorch 2.0)
        assert all(p.grad is None for p in params)
        assert ref.step(grads)[0]
        ref_sched.step()
        r = opt.last_report()
        assert r["outcome"] == "applied" and r["scale_used"] == 1.0, (step, r)
        ref.check(params, step)
    assert opt.param_groups[0]["lr"] == pytest.approx(ref.opt.param_groups[0]["lr"])


def fp16_backward(model, scale=None):
    """Gradients of the fp16 model's loss (scaled by `scale`): through an fp32 copy where the CPU
    has no fp16 matrix products, cast to fp16 as an fp16 backward pass would store them."""
    x, y = batches(1)[0]
    if cpu_half_matmul():
        loss = torch.nn.functional.mse_loss(model(x.half()).float(), y)
        (loss if scale is None else loss * scale).backward()
        return
    twin = mlp()
    twin.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    loss = torch.nn.functional.mse_loss(twin(x), y)
    (loss if scale is None else loss * scale.float()).backward()
    for p, q in zip(model.parameters(), twin.parameters()):
        p.grad = q.grad.half()


def test_an_fp16_loop_that_never_scales_its_loss_is_refused_bf16_and_fp32_are_not_scaled():
    model = mlp(torch.float16)
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    fp16_backward(model)
    with pytest.raises(RuntimeError, match="float16 gradients need a scaled loss.*halfstep.torch.GradScaler"):
        opt.step()
    assert opt.scaler_state()["attempts"] == 0
    opt.zero_grad()
    fp16_backward(model, opt.loss_scale)  # reads the scale
    opt.step()
    assert opt.scaler_state()["attempts"] == 1
    # Without loss scaling on purpose: a constant scale of 1.
    plain = FusedAdamW(mlp(torch.float16).parameters(), lr=1e-3, scaler=dict(init_scale=1, min_scale=1, max_scale=1))
    plain.step()
    for dtype in (torch.bfloat16, torch.float32):
        o = FusedAdamW(mlp(dtype).parameters(), lr=1e-3)
        assert float(o.loss_scale) == 1.0
        o.step()
        assert o.last_report()["scale_next"] == 1.0


def test_a_timm_style_grad_scaler_loop_with_unscale_and_clip_grad_norm():
    # timm / accelerate: scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_;
    # scaler.step(opt); scaler.update(). unscale_ really divides the gradients, so the clip sees
    # unscaled ones; the step then unscales by 1.
    compute = torch.float16 if cpu_autocast(torch.float16) else torch.bfloat16
    model = mlp()
    params = list(model.parameters())
    opt = FusedAdamW(params, lr=2e-3)
    scaler = GradScaler(init_scale=2.0 ** 12, growth_interval=5)
    ref = Reference(params, lr=2e-3, weight_decay=1e-2)
    scale, tracker = 2.0 ** 12, 0
    for step, (x, y) in enumerate(batches(40)):
        with torch.autocast("cpu", dtype=compute):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in (7, 19):
            params[step % 4].grad.view(-1)[0] = math.inf
        scaler.unscale_(opt)
        with pytest.raises(RuntimeError, match="already been called"):
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        grads = [p.grad.clone() for p in params]  # unscaled and clipped: what the step reads
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        r = opt.last_report()
        applied, _ = ref.step(grads)
        assert (r["outcome"] == "applied") == applied == (step not in (7, 19)), (step, r)
        assert r["scale_used"] == scale
        scale, tracker = gradscaler_rule(scale, tracker, not applied, 2.0, 0.5, 5)
        assert scaler.get_scale() == scale
        ref.check(params, step)
    # GradScaler's state_dict, and back.
    sd = scaler.state_dict()
    assert sd == {"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5,
                  "_growth_tracker": tracker}
    scaler.update(new_scale=64.0)
    assert scaler.get_scale() == 64.0
    scaler.load_state_dict(sd)
    assert scaler.state_dict() == sd


def test_unscale_refuses_fp16_gradients_as_grad_scaler_does():
    model = mlp(torch.float16)
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    scaler = GradScaler(init_scale=2.0 ** 10)
    fp16_backward(model, scaler.scale(torch.ones(())))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients.*max_grad_norm"):
        scaler.unscale_(opt)
    scaler.step(opt)  # fused, without unscale_: fine
    scaler.update()
    assert opt.last_report()["outcome"] == "applied"
    with pytest.raises(ValueError, match="one GradScaler per optimizer"):
        GradScaler().step(opt)


@pytest.mark.skipif(cpu_grad_scaler() is None, reason="this PyTorch has no torch.amp.GradScaler for the CPU")
@pytest.mark.parametrize("unscale", [False, True], ids=["fused", "unscale_and_clip"])
def test_torch_amp_grad_scaler_drives_the_fused_step(unscale):
    # A loop written for torch.amp.GradScaler, with the GradScaler itself: FusedAdamW says
    # _step_supports_amp_scaling, so GradScaler.step hands it its scale (or None after unscale_)
    # instead of synchronising on found_inf; the fused step unscales by it and skips what it must.
    model = mlp()
    params = list(model.parameters())
    opt = FusedAdamW(params, lr=2e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=4)
    ref = Reference(params, lr=2e-3, weight_decay=1e-2)
    expected, tracker = 2.0 ** 10, 0
    for step, (x, y) in enumerate(batches(30)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in (5, 6, 17):
            params[step % 4].grad.view(-1)[-1] = math.nan
        scale = scaler.get_scale()
        if unscale:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 0.5)
        grads = [p.grad.clone() for p in params]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        r = opt.last_report()
        applied, _ = ref.step(grads, 1.0 if unscale else scale)
        assert (r["outcome"] == "applied") == applied == (step not in (5, 6, 17)), (step, r)
        if not unscale:
            assert r["scale_used"] == scale
        expected, tracker = gradscaler_rule(expected, tracker, not applied, 2.0, 0.5, 4)
        assert scaler.get_scale() == expected
        ref.check(params, step)


def test_onecyclelr_with_its_defaults_cycles_the_betas():
    model = mlp()
    params = list(model.parameters())
    opt = FusedAdamW(params, lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=40)  # cycle_momentum=True
    ref = Reference(params, lr=1e-3, weight_decay=1e-2)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref.opt, max_lr=1e-2, total_steps=40)
    for step, (x, y) in enumerate(batches(40)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        grads = [p.grad.clone() for p in params]
        assert opt.param_groups[0]["betas"] == ref.opt.param_groups[0]["betas"]
        opt.step()
        sched.step()
        opt.zero_grad()
        ref.step(grads)
        ref_sched.step()
        ref.check(params, step)
    assert opt.param_groups[0]["betas"][0] != 0.9, "the schedule moved beta1"


def test_cycliclr_cycles_rate_and_betas_where_pytorch_lets_it():
    model = mlp()
    params = list(model.parameters())
    opt = FusedAdamW(params, lr=1e-3)
    ref = Reference(params, lr=1e-3, weight_decay=1e-2)
    try:
        ref_sched = torch.optim.lr_scheduler.CyclicLR(ref.opt, 1e-4, 1e-2, step_size_up=5)
    except ValueError as e:  # PyTorch 1.13 cycles only 'momentum'
        with pytest.raises(ValueError):
            torch.optim.lr_scheduler.CyclicLR(opt, 1e-4, 1e-2, step_size_up=5)
        pytest.skip("this PyTorch's CyclicLR refuses optimizers with betas: %s" % e)
    sched = torch.optim.lr_scheduler.CyclicLR(opt, 1e-4, 1e-2, step_size_up=5)
    for step, (x, y) in enumerate(batches(20)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad.clone() for p in params]
        opt.step()
        sched.step()
        opt.zero_grad()
        ref.step(grads)
        ref_sched.step()
        assert opt.param_groups[0]["betas"] == ref.opt.param_groups[0]["betas"]
        ref.check(params, step)


def test_a_lightning_style_unfreeze_adds_a_param_group_and_keeps_the_others_state():
    # The backbone is frozen (outside the optimizer) for 10 steps, then unfrozen with
    # add_param_group (Lightning's BackboneFinetuning): the head's masters and moments carry on,
    # and the backbone's bias corrections count from its own first step, as torch.optim's do.
    torch.manual_seed(3)
    backbone = torch.nn.Linear(16, 32)
    head = torch.nn.Linear(32, 8)
    for p in backbone.parameters():
        p.requires_grad_(False)
    opt = FusedAdamW(head.parameters(), lr=3e-3)
    ref = Reference(list(head.parameters()), lr=3e-3, weight_decay=1e-2)
    for step, (x, y) in enumerate(batches(25)):
        if step == 10:
            for p in backbone.parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(backbone.parameters()), "lr": 1e-3})
            extra = [p.detach().double().clone().requires_grad_() for p in backbone.parameters()]
            ref.opt.add_param_group({"params": extra, "lr": 1e-3})
            ref.params += extra
            ref.bound += [torch.zeros_like(p) for p in extra]
            assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == 1e-2
        loss = torch.nn.functional.mse_loss(head(torch.relu(backbone(x))), y)
        loss.backward()
        live = list(head.parameters()) + (list(backbone.parameters()) if step >= 10 else [])
        grads = [p.grad.clone() for p in live]
        opt.step()
        opt.zero_grad()
        ref.step(grads)
        ref.check(live, step)
    assert int(opt.applied_steps) == 25
    # The added group is refused where it cannot be (a parameter already there), nothing changed.
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group|more than one"):
        opt.add_param_group({"params": [head.weight]})
    assert len(opt.param_groups) == 2


def test_hooks_run_on_every_pytorch_that_has_them():
    model = mlp()
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    calls = []
    if hasattr(opt, "register_step_pre_hook"):  # PyTorch >= 2.0
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("step_pre"))
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append("step_post"))
    if hasattr(opt, "register_state_dict_pre_hook"):  # PyTorch >= 2.1
        opt.register_state_dict_pre_hook(lambda o: calls.append("sd_pre"))

        def post(o, sd):
            calls.append("sd_post")
            sd["extra"] = 7
            return sd
        opt.register_state_dict_post_hook(post)

        def load_pre(o, sd):
            calls.append("load_pre")
            assert sd["extra"] == 7
            return {k: v for k, v in sd.items() if k != "extra"}
        opt.register_load_state_dict_pre_hook(load_pre)
        opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    x, y = batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.load_state_dict(opt.state_dict())
    expected = []
    if hasattr(opt, "register_step_pre_hook"):
        expected += ["step_pre", "step_post"]
    if hasattr(opt, "register_state_dict_pre_hook"):
        expected += ["sd_pre", "sd_post", "load_pre", "load_post"]
    assert calls == expected
    if not TORCH2:
        assert expected == []


def test_opt_state_holds_views_of_the_masters_and_moments_and_the_step_count():
    model = mlp(torch.bfloat16)
    opt = FusedAdamW(model.parameters(), lr=1e-3)
    x, y = batches(1)[0]
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()
    p = model[0].weight
    state = opt.state[p]
    assert set(state) >= {"step", "master", "exp_avg", "exp_avg_sq"}
    assert int(state["step"]) == 3
    assert state["exp_avg"].shape == p.shape and state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["master"].to(torch.bfloat16), p.detach())
    # Views: what the optimizer holds. Writing the moments writes the optimizer's state ...
    saved = opt.state_dict()["state"][0]
    assert torch.equal(saved["exp_avg"], state["exp_avg"]) and torch.equal(saved["exp_avg_sq"], state["exp_avg_sq"])
    state["exp_avg"].zero_()
    assert not bool(opt.state_dict()["state"][0]["exp_avg"].any())
    # ... the step count is a copy the step refreshes: writing it changes nothing.
    state["step"].fill_(100)
    torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    opt.step()
    assert int(opt.state[p]["step"]) == 4 and int(opt.applied_steps) == 4
    # fp32 parameters are their own masters.
    m32 = mlp()
    o32 = FusedAdamW(m32.parameters(), lr=1e-3)
    assert o32.state[m32[0].weight]["master"].data_ptr() == m32[0].weight.data_ptr()
