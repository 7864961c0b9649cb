"""The protocol between FusedAdamW, the scalers that drive it and the conventions of torch.optim,
one process: each case below was a silent wrong result or a refusal of something right before its
fix (the safety round's list), and is checked against what the right behaviour gives — usually a
run without the disturbance, bit for bit."""

import collections
import copy
import io
import math
import struct
import warnings
import zlib

import pytest

torch = pytest.importorskip("torch")

import halfstep  # noqa: E402
from halfstep.torch import FusedAdamW, GradScaler  # noqa: E402

from helpers import halfstep_entry, with_halfstep_entry, without  # noqa: E402

TORCH2 = int(torch.__version__.split(".")[0]) >= 2


def torch_cpu_grad_scaler(**kw):
    """torch.amp.GradScaler on the CPU (PyTorch >= 2.3), or None."""
    try:
        return torch.amp.GradScaler("cpu", **kw)
    except Exception:  # noqa: BLE001
        return None


needs_torch_scaler = pytest.mark.skipif(torch_cpu_grad_scaler() is None,
                                        reason="torch.amp.GradScaler runs on the CPU from PyTorch 2.3")


def mlp(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 5)).to(dtype)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)


def loss_of(model, step):
    """The loss on batch `step`, computed in fp32 from parameters of any dtype (PyTorch 1.13 has no
    fp16 matrix product on the CPU); the gradients come back in the parameters' dtype."""
    x, y = batch(step)
    w1, b1, w2, b2 = (p.float() for p in model.parameters())
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
    return torch.nn.functional.mse_loss(torch.nn.functional.linear(h, w2, b2), y)


INF_STEPS = (1, 5)


def inject(model, step):
    if step in INF_STEPS:
        list(model.parameters())[2].grad.view(-1)[3] = math.inf


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def reports_equal(a, b):
    return [without(r, "held_elements") for r in a] == [without(r, "held_elements") for r in b]


def roundtrip(obj):
    """obj through torch.save and torch.load, as a checkpoint on disk."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False) if TORCH2 else torch.load(buf)


def halfstep_iteration(model, opt, scaler, step):
    scaler.scale(loss_of(model, step)).backward()
    inject(model, step)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return opt.last_report()


def torch_iteration(model, opt, scaler, step):
    scaler.scale(loss_of(model, step)).backward()
    inject(model, step)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return opt.last_report()


def build(dtype, seed=0, **kw):
    model = mlp(dtype, seed)
    return model, FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, **kw)


def hs_scaler(growth_interval=2):
    return GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=growth_interval)


# -- the GradScaler protocol ----------------------------------------------------------------------

@needs_torch_scaler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_run_torch_amp_grad_scaler_drives_checkpoints_and_resumes_bitwise(dtype):
    # Before: opt.state_dict() raised (the optimizer had taken torch's scale into its own scaler,
    # whose rules allowed only 1). torch's GradScaler owns its scale; the optimizer's own scaler
    # stays as it was, and each step divides by the scale torch hands it.
    model, opt = build(dtype)
    scaler = torch_cpu_grad_scaler(init_scale=2.0 ** 10, growth_interval=2)
    reports = [torch_iteration(model, opt, scaler, k) for k in range(4)]
    assert [r["outcome"] for r in reports] == ["applied", "skipped_overflow", "applied", "applied"]
    assert [r["scale_used"] for r in reports] == [1024.0, 1024.0, 512.0, 512.0]
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()})
    assert opt.scaler_state()["scale"] == 1.0, "the optimizer's own scaler was left alone"
    rest = [torch_iteration(model, opt, scaler, k) for k in range(4, 8)]
    resumed_model, resumed = build(dtype, seed=9)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["opt"])
    resumed_scaler = torch_cpu_grad_scaler(init_scale=2.0 ** 10, growth_interval=2)
    resumed_scaler.load_state_dict(saved["scaler"])
    again = [torch_iteration(resumed_model, resumed, resumed_scaler, k) for k in range(4, 8)]
    assert reports_equal(again, rest) and same(weights(resumed_model), weights(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("order", ["optimizer first", "scaler first"])
def test_the_standard_resume_of_both_state_dicts_is_bitwise_in_either_order(dtype, order):
    # Before: an optimizer built for bf16 or fp32 parameters (no loss scaling of its own) refused
    # the checkpoint of a run its GradScaler drove ("growth_interval ... 2147483647").
    model, opt = build(dtype)
    scaler = hs_scaler()
    for k in range(4):
        halfstep_iteration(model, opt, scaler, k)
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()})
    rest = [halfstep_iteration(model, opt, scaler, k) for k in range(4, 8)]
    resumed_model, resumed = build(dtype, seed=9)
    resumed_model.load_state_dict(saved["model"])
    resumed_scaler = hs_scaler()
    if order == "optimizer first":
        resumed.load_state_dict(saved["opt"])
        resumed_scaler.load_state_dict(saved["scaler"])
    else:
        resumed_scaler.load_state_dict(saved["scaler"])
        resumed.load_state_dict(saved["opt"])
    again = [halfstep_iteration(resumed_model, resumed, resumed_scaler, k) for k in range(4, 8)]
    assert reports_equal(again, rest) and same(weights(resumed_model), weights(model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_optimizers_state_dict_alone_is_refused_until_the_grad_scaler_is_attached(dtype):
    # Before: a fresh GradScaler scaled the first resumed loss by its init_scale while the step
    # unscaled by the restored scale: that step's gradients were off by their ratio, silently.
    model, opt = build(dtype)
    scaler = hs_scaler(3)
    for k in range(4):
        halfstep_iteration(model, opt, scaler, k)
    assert scaler.get_scale() == 512.0  # the overflow at step 1 backed it off
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    rest = [halfstep_iteration(model, opt, scaler, k) for k in range(4, 8)]
    resumed_model, resumed = build(dtype, seed=9)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["opt"])
    before = (resumed.scaler_state(), weights(resumed_model))
    fresh = hs_scaler(3)
    fresh.scale(loss_of(resumed_model, 4)).backward()
    with pytest.raises(RuntimeError, match=r"multiplied the loss by 1024\.0 .*continues a run at loss scale 512\.0"
                                           r".*Load the GradScaler's state_dict too, or attach it"):
        fresh.step(resumed)
    assert resumed.scaler_state() == before[0] and same(weights(resumed_model), before[1])
    # Attached before its first scale(), the GradScaler scales by the optimizer's restored scale.
    resumed.zero_grad()
    attached = hs_scaler(3)
    attached.attach(resumed)
    again = [halfstep_iteration(resumed_model, resumed, attached, k) for k in range(4, 8)]
    assert reports_equal(again, rest) and same(weights(resumed_model), weights(model))


def test_a_grad_scaler_created_after_the_load_or_loaded_alone_continues_the_scale():
    model, opt = build(torch.float32)
    scaler = hs_scaler()
    for k in range(4):
        halfstep_iteration(model, opt, scaler, k)
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()})
    rest = [halfstep_iteration(model, opt, scaler, k) for k in range(4, 8)]
    # Created after the optimizer's load, then loaded: bitwise.
    m1, o1 = build(torch.float32, seed=9)
    m1.load_state_dict(saved["model"])
    o1.load_state_dict(saved["opt"])
    s1 = hs_scaler()
    s1.load_state_dict(saved["scaler"])
    assert reports_equal([halfstep_iteration(m1, o1, s1, k) for k in range(4, 8)], rest)
    assert same(weights(m1), weights(model))
    # The GradScaler's state_dict alone, with a fresh optimizer over the loaded weights: the scale
    # and growth tracker continue (the moments start again, as a fresh torch.optim.AdamW's would).
    m2, o2 = build(torch.float32, seed=9)
    m2.load_state_dict(saved["model"])
    s2 = hs_scaler()
    s2.load_state_dict(saved["scaler"])
    r2 = halfstep_iteration(m2, o2, s2, 4)
    assert (r2["scale_used"], r2["scale_next"]) == (rest[0]["scale_used"], rest[0]["scale_next"])
    assert o2.scaler_state()["attempts"] == 1 and s2.state_dict()["_growth_tracker"] == \
        (saved["scaler"]["_growth_tracker"] + 1) % 2
    # A GradScaler state of another step than the optimizer's is refused.
    m3, o3 = build(torch.float32, seed=9)
    o3.load_state_dict(saved["opt"])
    s3 = hs_scaler()
    s3.load_state_dict(dict(saved["scaler"], _growth_tracker=(saved["scaler"]["_growth_tracker"] + 1) % 2))
    s3.scale(loss_of(m3, 4)).backward()
    with pytest.raises(ValueError, match="were not saved at the same step"):
        s3.step(o3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unscale_then_a_skipped_batch_leaves_no_unscaled_mark(dtype):
    # Before: unscale_, then skipping the batch and update() left the library's "next step is
    # unscaled" mark set: the next step used gradients `scale` times too large.
    def run(skip):
        model, opt = build(dtype)
        scaler = hs_scaler()
        reports = []
        for k in range(6):
            if skip and k == 2:
                scaler.scale(loss_of(model, 99)).backward()
                scaler.unscale_(opt)  # to look at the norm, which says: drop this batch
                opt.zero_grad()
                scaler.update()
            scaler.scale(loss_of(model, k)).backward()
            if k % 2:  # every other iteration unscales to clip by itself
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            reports.append(opt.last_report())
        return reports, weights(model)
    (a, wa), (b, wb) = run(False), run(True)
    assert reports_equal(a, b) and same(wa, wb)


@needs_torch_scaler
def test_a_step_refused_under_torch_amp_grad_scaler_leaves_no_scale_behind():
    # Before: the refused step left torch's opt.grad_scale set, and the next step unscaled by
    # scale squared.
    def run(refuse):
        model, opt = build(torch.float32)
        scaler = torch_cpu_grad_scaler(init_scale=2.0 ** 10, growth_interval=2)
        reports = []
        for k in range(4):
            scaler.scale(loss_of(model, k)).backward()
            if refuse and k == 2:
                opt.param_groups[0]["lr"] = -1.0  # a rate the step refuses
                with pytest.raises(ValueError, match="Invalid learning rate"):
                    scaler.step(opt)
                assert "grad_scale" not in opt.__dict__ and "found_inf" not in opt.__dict__
                opt.param_groups[0]["lr"] = 1e-2  # and the step is tried again
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            reports.append(opt.last_report())
        return reports, weights(model)
    (a, wa), (b, wb) = run(False), run(True)
    assert [r["scale_used"] for r in a] == [r["scale_used"] for r in b]
    assert same(wa, wb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grad_scaler_step_without_a_scaled_loss_is_refused_for_every_dtype(dtype):
    # Before: fp32 and bf16 parameters driven by halfstep's GradScaler applied gradients divided
    # by 65536 when the loss was never scaled.
    model, opt = build(dtype)
    scaler = GradScaler("cpu")
    loss_of(model, 0).backward()  # no scaler.scale(loss)
    with pytest.raises(RuntimeError, match="need a scaled loss"):
        scaler.step(opt)
    assert int(opt.applied_steps) == 0


@needs_torch_scaler
def test_torch_found_inf_skips_the_step_even_when_the_gradients_were_edited_after_unscale():
    # Before: gradients edited between unscale_ and step were applied while GradScaler backed off
    # as for a skip.
    model, opt = build(torch.float32)
    scaler = torch_cpu_grad_scaler(init_scale=2.0 ** 10, growth_interval=2)
    before = weights(model)
    scaler.scale(loss_of(model, 0)).backward()
    model[0].weight.grad.view(-1)[0] = math.inf
    scaler.unscale_(opt)  # torch finds the inf
    for p in model.parameters():
        p.grad.nan_to_num_(posinf=0.0)  # and the user edits it away
    scaler.step(opt)
    scaler.update()
    r = opt.last_report()
    assert (r["outcome"], r["reason"]) == ("skipped_overflow", "external_found_inf")
    assert same(weights(model), before) and scaler.get_scale() == 512.0 and int(opt.applied_steps) == 0


# -- torch.optim's conventions ----------------------------------------------------------------------

def test_a_set_of_parameters_warns_as_torch_does_and_a_group_set_is_refused():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.ones(2))]
    with pytest.warns(FutureWarning, match="ordering of tensors in sets will change between runs"):
        FusedAdamW(set(params))
    with pytest.raises(TypeError, match="ordered collections"):
        FusedAdamW([dict(params=set(params))])
    opt = FusedAdamW(params[:1])
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group(dict(params={params[1]}))


@pytest.mark.parametrize("option", ["maximize", "amsgrad", "differentiable"])
def test_options_the_fused_step_does_not_have_are_refused_wherever_they_appear(option):
    model, _ = build(torch.float32)
    params = list(model.parameters())
    with pytest.raises(ValueError, match="%s=True is not supported" % option):
        FusedAdamW([dict(params=params, **{option: True})])
    opt = FusedAdamW([dict(params=params[:2], **{option: False})])  # false: what the step does
    with pytest.raises(ValueError, match="%s=True is not supported" % option):
        opt.add_param_group(dict(params=params[2:], **{option: True}))
    opt.param_groups[0][option] = True
    loss_of(model, 0).backward()
    with pytest.raises(ValueError, match="%s=True is not supported" % option):
        opt.step()
    opt.param_groups[0][option] = False
    sd = opt.state_dict()
    sd["param_groups"][0][option] = True
    with pytest.raises(ValueError, match="%s=True is not supported" % option):
        opt.load_state_dict(sd)
    opt.step()
    assert int(opt.applied_steps) == 1


def test_foreach_capturable_and_fused_are_taken_and_ignored():
    model, _ = build(torch.float32)
    opt = FusedAdamW([dict(params=list(model.parameters()), foreach=True, capturable=False, fused=None)])
    loss_of(model, 0).backward()
    opt.step()
    assert opt.last_report()["outcome"] == "applied"


def test_tensor_lr_and_betas_step_as_their_values():
    def run(tensors):
        model, _ = build(torch.float32)
        lr = torch.tensor(1e-2) if tensors else 1e-2
        betas = (torch.tensor(0.8), torch.tensor(0.99)) if tensors else (0.8, 0.99)
        opt = FusedAdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.1)
        for k in range(5):
            if k == 3:
                if tensors:
                    opt.param_groups[0]["lr"].fill_(5e-3)  # in place, as a device schedule writes it
                    opt.param_groups[0]["betas"][0].fill_(0.7)
                else:
                    opt.param_groups[0]["lr"] = 5e-3
                    opt.param_groups[0]["betas"] = (0.7, 0.99)
            loss_of(model, k).backward()
            opt.step()
            opt.zero_grad()
        return weights(model)
    assert same(run(True), run(False))


def test_a_rate_decayed_below_fp32s_smallest_subnormal_is_zero_as_in_torch():
    # Before: a schedule decaying lr to 1e-50 raised mid-run; torch.optim's fp32 step continues
    # with a rate of 0.
    model, opt = build(torch.float32)
    opt.param_groups[0]["weight_decay"] = 0.0
    loss_of(model, 0).backward()
    opt.step()
    before = weights(model)
    opt.param_groups[0]["lr"] = 1e-50
    opt.zero_grad()
    loss_of(model, 1).backward()
    opt.step()
    assert opt.last_report()["outcome"] == "applied" and same(weights(model), before)
    assert FusedAdamW(mlp().parameters(), lr=1e-50).param_groups[0]["lr"] == 1e-50


def test_state_entries_assigned_are_the_state_and_an_emptied_state_restarts_the_moments():
    # Before: opt.state[p]["exp_avg"] = t and opt.state = defaultdict(dict) were ignored.
    model, opt = build(torch.float32)
    for k in range(3):
        loss_of(model, k).backward()
        opt.step()
        opt.zero_grad()
    p = model[0].weight
    opt.state[p]["exp_avg"] = torch.full_like(p, 0.25)
    assert bool((opt.state_dict()["state"][0]["exp_avg"] == 0.25).all())
    with pytest.raises(ValueError, match="finite"):
        opt.state[p]["exp_avg_sq"] = torch.full_like(p, math.nan)
    with pytest.raises(TypeError, match="one applied-step counter"):
        opt.state[p]["step"] = torch.tensor(0.0)
    with pytest.raises(TypeError, match="cannot be deleted"):
        del opt.state[p]
    # Emptied: every moment is zero and the bias corrections count from the next step, so the run
    # goes on as a new optimizer built over these weights would (no loss scaling: the scaler too).
    opt.state = collections.defaultdict(dict)
    assert all(bool((s["exp_avg"] == 0).all()) and bool((s["exp_avg_sq"] == 0).all())
               for s in opt.state_dict()["state"].values())
    twin_model = mlp()
    twin_model.load_state_dict(model.state_dict())
    twin = FusedAdamW(twin_model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    for k in range(3, 6):
        for m, o in ((model, opt), (twin_model, twin)):
            loss_of(m, k).backward()
            o.step()
            o.zero_grad()
    assert same(weights(model), weights(twin_model))
    with pytest.raises(TypeError, match="cannot be replaced"):
        opt.state = {p: {}}


def test_state_entries_that_are_no_parameters_are_kept_by_state_dict():
    model, opt = build(torch.float32)
    loss_of(model, 0).backward()
    opt.step()
    opt.state["schedule"] = {"phase": 2}
    opt.state[model[0].bias]["ema"] = torch.arange(3.0)
    sd = roundtrip(opt.state_dict())
    assert sd["state"]["schedule"] == {"phase": 2} and torch.equal(sd["state"][1]["ema"], torch.arange(3.0))
    other_model, other = build(torch.float32, seed=3)
    other.load_state_dict(sd)
    assert other.state["schedule"] == {"phase": 2}
    assert torch.equal(other.state[other_model[0].bias]["ema"], torch.arange(3.0))


def test_lr_tensor_handles_survive_every_rebuild():
    # Before: a handle from lr_tensor() stopped reaching the step after the optimizer rebuilt
    # itself (a GradScaler's first binding, add_param_group, storage moved before the first step).
    model = mlp()
    params = list(model.parameters())
    opt = FusedAdamW([dict(params=params[:2], weight_decay=0.0)], lr=1e-2)
    handle = opt.lr_tensor(0)
    params[0].data = params[0].data.clone()  # storage moved before the first step
    scaler = GradScaler("cpu", init_scale=4.0)   # binds at its step: the library is rebuilt
    opt.add_param_group(dict(params=params[2:], weight_decay=0.0))
    handle.fill_(0.0)  # a device schedule sets the rate to 0
    scaler.scale(loss_of(model, 0)).backward()
    before = weights(model)
    scaler.step(opt)
    scaler.update()
    assert opt.last_report()["outcome"] == "applied"
    after = weights(model)
    assert same(after[:2], before[:2]), "group 0 took the rate written into the handle"
    assert not torch.equal(after[2], before[2]), "group 1 has its own rate"
    assert opt.lr_tensor(0) is handle
    opt.param_groups[0]["lr"] = 3e-3  # a param_groups change still wins when step() sees it
    opt.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    scaler.step(opt)
    scaler.update()
    assert float(handle) == pytest.approx(3e-3)


@pytest.mark.skipif(not TORCH2, reason="torch.distributed.checkpoint.state_dict is PyTorch 2's")
@pytest.mark.parametrize("flatten", [False, True])
def test_get_and_set_optimizer_state_dict_keep_the_optimizers_own_state(flatten):
    # Before: get_optimizer_state_dict (accelerate's FSDP2 save_state, torchtitan, Lightning)
    # dropped the top-level 'halfstep' entry, and set_optimizer_state_dict refused the result.
    state_dict_api = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    options = state_dict_api.StateDictOptions(flatten_optimizer_state_dict=flatten)
    model, opt = build(torch.float16)
    for k in range(3):
        (loss_of(model, k) * opt.loss_scale).backward()
        inject(model, k)
        opt.step()
        opt.zero_grad()
    osd = roundtrip(state_dict_api.get_optimizer_state_dict(model, opt, options=options))
    rest = []
    for k in range(3, 6):
        (loss_of(model, k) * opt.loss_scale).backward()
        opt.step()
        opt.zero_grad()
        rest.append(opt.last_report())
    resumed_model, resumed = build(torch.float16, seed=7)
    state_dict_api.set_optimizer_state_dict(resumed_model, resumed, osd, options=options)
    assert resumed.scaler_state()["attempts"] == 3
    again = []
    for k in range(3, 6):
        (loss_of(resumed_model, k) * resumed.loss_scale).backward()
        resumed.step()
        resumed.zero_grad()
        again.append(resumed.last_report())
    assert reports_equal(again, rest) and same(weights(resumed_model), weights(model))


# -- checkpoints that could not have been written ---------------------------------------------------

def test_a_library_state_with_a_group_that_joined_after_the_steps_taken_is_refused():
    model, opt = build(torch.float32)
    params = list(model.parameters())
    opt2 = FusedAdamW([dict(params=params[:2])], lr=1e-2)
    loss_of(model, 0).backward()
    opt2.step()
    opt2.add_param_group(dict(params=params[2:]))  # joins at step 1
    sd = opt2.state_dict()
    blob = bytearray(bytes(halfstep_entry(sd)["optimizer_state"].tolist()))
    # The last group's step_offset ends the payload, before the CRC-32 (zlib) of everything before.
    struct.pack_into("<q", blob, len(blob) - 12, 5)
    struct.pack_into("<I", blob, len(blob) - 4, zlib.crc32(bytes(blob[:-4])))
    bad = with_halfstep_entry(sd, optimizer_state=torch.frombuffer(blob, dtype=torch.uint8))
    with pytest.raises(halfstep.HalfstepError, match=r"groups\[1\]\.step_offset must be at most OptimizerState\.step"):
        opt2.load_state_dict(bad)
    opt2.load_state_dict(sd)


def test_a_rebuild_keeps_the_state_views_it_handed_out():
    # Moved storage before the first step, a GradScaler's first binding and add_param_group rebuild
    # the optimizer over the same parameters: the very tensors of opt.state[p] carry on.
    def run(disturb):
        model = mlp(torch.bfloat16)
        params = list(model.parameters())
        opt = FusedAdamW([dict(params=params[:2])], lr=1e-2, weight_decay=0.1)
        held = opt.state[params[0]]["exp_avg"]
        held.fill_(1e-3)  # a warm start written through a view
        if disturb:
            params[1].data = params[1].data.clone()
            opt.add_param_group(dict(params=params[2:]))
        else:
            opt.add_param_group(dict(params=params[2:]))
        scaler = GradScaler("cpu", init_scale=8.0)
        for k in range(3):
            scaler.scale(loss_of(model, k)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert held.data_ptr() == opt.state[params[0]]["exp_avg"].data_ptr(), "the view handed out is the state"
        return weights(model)
    assert same(run(True), run(False))


# -- found by an outside review of the above -------------------------------------------------------

def test_a_change_of_the_other_hyperparameters_keeps_the_rate_written_into_lr_tensor():
    p = torch.nn.Parameter(torch.ones(4))
    opt = FusedAdamW([p], lr=0.0, weight_decay=0.0)
    handle = opt.lr_tensor(0)
    moved = []
    for k in range(3):
        handle.copy_(torch.tensor(0.1))
        if k == 1:
            opt.param_groups[0]["weight_decay"] = 1e-4
            opt.param_groups[0]["betas"] = (0.8, 0.99)
        before = p.detach().clone()
        p.grad = torch.ones(4)
        opt.step()
        moved.append(float((before - p.detach()).abs().max()))
    assert all(m > 0.05 for m in moved), moved
    assert float(handle) == pytest.approx(0.1)


def test_a_load_between_scale_and_step_is_refused_not_unscaled_by_the_loaded_scale():
    model, opt = build(torch.float32)
    scaler = hs_scaler()
    for k in range(3):
        halfstep_iteration(model, opt, scaler, k)
    saved = roundtrip(opt.state_dict())  # at scale 512 (the overflow at step 1)
    other_model, other = build(torch.float32, seed=4)
    attached = GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
    attached.attach(other)
    attached.scale(loss_of(other_model, 0)).backward()  # scaled by 4096
    other.load_state_dict(saved)                         # the scale is now 512
    with pytest.raises(RuntimeError, match="load_state_dict replaced the loss scale after this iteration's loss was"):
        attached.step(other)
    other.zero_grad()
    attached.scale(loss_of(other_model, 0)).backward()  # scaled again, by the loaded scale
    attached.step(other)
    attached.update()
    assert other.last_report()["scale_used"] == 512.0


def test_dict_methods_of_opt_state_go_through_the_checked_assignment():
    model, opt = build(torch.float32)
    loss_of(model, 0).backward()
    opt.step()
    p = model[0].weight
    view = opt.state[p]["exp_avg"]
    opt.state[p].update({"exp_avg": torch.full_like(p, 0.5)})
    assert bool((view == 0.5).all()) and opt.state[p]["exp_avg"] is view
    opt.state[p] |= {"exp_avg_sq": torch.full_like(p, 0.25)}
    assert bool((opt.state_dict()["state"][0]["exp_avg_sq"] == 0.25).all())
    with pytest.raises(TypeError, match="one applied-step counter"):
        opt.state[p].update(step=torch.tensor(3.0))
    with pytest.raises(TypeError, match="popitem"):
        opt.state[p].popitem()
    with pytest.raises(TypeError, match="cannot be replaced"):
        opt.state.update({p: {"exp_avg": torch.zeros_like(p)}})
    assert opt.state[p].setdefault("ema", 3) == 3 and opt.state_dict()["state"][0]["ema"] == 3


def test_a_loaded_tensor_rate_is_the_optimizers_own_copy():
    p1, p2 = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    o1, o2 = FusedAdamW([p1], lr=torch.tensor(0.1)), FusedAdamW([p2], lr=torch.tensor(0.1))
    p1.grad = torch.ones(3)
    o1.step()
    o2.load_state_dict(o1.state_dict())
    torch.optim.lr_scheduler.LambdaLR(o1, lambda k: 0.5)
    assert float(o2.param_groups[0]["lr"]) == pytest.approx(0.1)
    assert o2.param_groups[0]["lr"] is not o1.param_groups[0]["lr"]


@pytest.mark.skipif(not TORCH2, reason="torch.distributed.checkpoint.state_dict is PyTorch 2's")
def test_set_optimizer_state_dict_keeps_a_frozen_parameters_own_state():
    state_dict_api = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 5)
    m.bias.requires_grad_(False)
    opt = FusedAdamW(m.parameters(), lr=1e-2)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    osd = roundtrip(state_dict_api.get_optimizer_state_dict(m, opt))
    torch.manual_seed(0)
    m2 = torch.nn.Linear(4, 5)
    m2.bias.requires_grad_(False)
    m2.load_state_dict(m.state_dict())
    opt2 = FusedAdamW(m2.parameters(), lr=1e-2)
    state_dict_api.set_optimizer_state_dict(m2, opt2, osd)
    for o, model in ((opt, m), (opt2, m2)):
        model(torch.ones(2, 4)).sum().backward()
        o.step()
    assert torch.equal(m.weight, m2.weight) and torch.equal(m.bias, m2.bias)


def test_update_without_a_step_or_unscale_raises_as_torchs():
    model, opt = build(torch.float32)
    scaler = hs_scaler()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()
    scaler.update(new_scale=256.0)  # setting the scale needs none
    assert scaler.get_scale() == 256.0


@needs_torch_scaler
def test_pytorch1s_grad_scaler_contract_steps_as_pytorch2s():
    # PyTorch 1.x's GradScaler calls step(grad_scaler=self) on an optimizer that declares
    # _step_supports_amp_scaling; PyTorch 2's sets grad_scale and found_inf instead.
    def run(old_contract):
        model, opt = build(torch.float32)
        scaler = torch_cpu_grad_scaler(init_scale=2.0 ** 10, growth_interval=2)
        reports = []
        for k in range(6):
            scaler.scale(loss_of(model, k)).backward()
            inject(model, k)
            if k == 3:
                scaler.unscale_(opt)
            if old_contract:
                scaler._per_optimizer_states[id(opt)]  # created by scale()/unscale_
                opt.step(grad_scaler=scaler)
                scaler._per_optimizer_states[id(opt)]["stage"] = torch.amp.grad_scaler.OptState.STEPPED
            else:
                scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            reports.append(opt.last_report())
        return reports, weights(model), scaler.get_scale()
    (a, wa, sa), (b, wb, sb) = run(True), run(False)
    assert reports_equal(a, b) and same(wa, wb) and sa == sb


def test_a_cpu_tensor_rate_is_read_at_every_step_and_is_the_groups_lr_tensor():
    p = torch.nn.Parameter(torch.ones(3))
    lr = torch.tensor(0.1)
    opt = FusedAdamW([p], lr=lr, weight_decay=0.0)
    assert opt.lr_tensor(0) is lr
    lr.data.fill_(0.0)  # moves no version counter
    p.grad = torch.ones(3)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(3))


def test_a_grad_scaler_takes_the_rules_of_a_loaded_state_dict_before_it_drives():
    scaler = GradScaler("cpu", growth_interval=7)
    scaler.load_state_dict({"scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3,
                            "_growth_tracker": 1})
    assert scaler.get_growth_interval() == 3 and scaler.get_scale() == 64.0
    model, opt = build(torch.float32)
    halfstep_iteration(model, opt, scaler, 0)
    with pytest.raises(ValueError, match="the rules of a GradScaler that drives an optimizer are the optimizer's"):
        scaler.load_state_dict({"scale": 64.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5})
