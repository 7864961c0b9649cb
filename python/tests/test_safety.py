"""halfstep.torch.FusedAdamW: the doors through which a wrong result could come in silently —
weights written into the parameters and then saved, state only the step may write, threads, a
param_groups changed under the optimizer, and a refused step() that must change nothing."""

import ctypes
import math
import threading

import pytest

torch = pytest.importorskip("torch")

import halfstep  # noqa: E402
from halfstep.torch import FusedAdamW  # noqa: E402

from helpers import fresh_params, halfstep_entry, scaled_grads  # noqa: E402

SHAPES = [(7, 5), (33,), (4, 4, 3), (1,)]


def build(params, **kw):
    return FusedAdamW([dict(params=params[:2], lr=1e-2, weight_decay=0.1), dict(params=params[2:], lr=3e-3)],
                      max_grad_norm=0.5, scaler=dict(init_scale=2.0 ** 10, growth_interval=4), **kw)


def run(params, opt, steps, seed=2, magnitude=1e-2):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _, grads = scaled_grads(SHAPES, params[0].dtype, float(opt.loss_scale), gen, magnitude)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()


def state_of(opt):
    """Everything the optimizer holds, for bitwise comparisons."""
    sd = opt.state_dict()
    return ([t.clone() for entry in sd["state"].values() for t in entry.values()],
            bytes(halfstep_entry(sd)["optimizer_state"].tolist()), opt._opt.learning_rates())


def same_state(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1:] == b[1:]


# -- 1. resuming restores the weights the user had --------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_weights_loaded_after_construction_are_what_a_state_dict_resumes(dtype):
    pretrained = fresh_params(SHAPES, dtype, seed=7)
    params = fresh_params(SHAPES, dtype, seed=1)  # the random initialisation
    opt = build(params)
    with torch.no_grad():  # model.load_state_dict(pretrained), after the optimizer was built
        for p, w in zip(params, pretrained):
            p.copy_(w)
    saved = opt.state_dict()
    for s, w in zip(saved["state"].values(), pretrained):
        assert torch.equal(s["master"].view_as(w), w.float()), "the masters are the pretrained weights"
    resumed_params = fresh_params(SHAPES, dtype, seed=3)
    resumed = build(resumed_params)
    resumed.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, pretrained))
    # ... and training on from there is the uninterrupted run, bit for bit.
    run(params, opt, 6)
    run(resumed_params, resumed, 6)
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, params))
    assert same_state(state_of(resumed), state_of(opt))


def test_an_in_place_write_mid_run_is_saved_and_resumed_bitwise():
    params = fresh_params(SHAPES, torch.bfloat16, seed=1)
    opt = build(params)
    run(params, opt, 5)
    with torch.no_grad():
        params[0].mul_(0.5)  # p.mul_(0.5) between steps
    saved = opt.state_dict()
    assert torch.equal(saved["state"][0]["master"].view_as(params[0]).to(torch.bfloat16), params[0])
    resumed_params = fresh_params(SHAPES, torch.bfloat16, seed=9)
    resumed = build(resumed_params)
    resumed.load_state_dict(saved)
    run(params, opt, 7, seed=5)
    run(resumed_params, resumed, 7, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(resumed_params, params))
    assert same_state(state_of(resumed), state_of(opt))


# -- 3. state only the step may write ---------------------------------------------------------

def test_loss_scale_and_applied_steps_are_copies_the_user_cannot_corrupt():
    a_params, b_params = fresh_params(SHAPES, torch.float16, seed=1), fresh_params(SHAPES, torch.float16, seed=1)
    a, b = build(a_params), build(b_params)
    run(a_params, a, 3)
    run(b_params, b, 3)
    a.loss_scale.fill_(-1.0)       # each read is a new tensor: writing it changes nothing
    a.applied_steps.fill_(1000)
    a.loss_scale.fill_(2.0 ** 30)
    assert float(a.loss_scale) == float(b.loss_scale) > 0 and int(a.applied_steps) == int(b.applied_steps) == 3
    run(a_params, a, 4, seed=8)
    run(b_params, b, 4, seed=8)
    assert a.last_report() == b.last_report() and a.last_report()["grad_norm"] > 0
    assert all(torch.equal(x, y) for x, y in zip(a_params, b_params))


def test_steps_from_several_threads_are_serialised():
    # (bf16 without loss scaling: the steps need no scale read in between, which several threads
    # could not give each)
    params, twin_params = fresh_params(SHAPES, torch.bfloat16, seed=1), fresh_params(SHAPES, torch.bfloat16, seed=1)
    opt, twin = [FusedAdamW([dict(params=ps[:2], lr=1e-2, weight_decay=0.1), dict(params=ps[2:], lr=3e-3)],
                            max_grad_norm=0.5) for ps in (params, twin_params)]
    gen = torch.Generator().manual_seed(4)
    _, grads = scaled_grads(SHAPES, torch.bfloat16, float(opt.loss_scale), gen, 1e-3)
    for p, q, g in zip(params, twin_params, grads):
        p.grad = g.clone()
        q.grad = g.clone()
    threads = [threading.Thread(target=lambda: [opt.step() for _ in range(25)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(100):
        twin.step()
    assert opt.scaler_state() == twin.scaler_state() and opt.scaler_state()["attempts"] == 100
    assert all(torch.equal(x, y) for x, y in zip(params, twin_params))


def test_param_groups_changed_after_construction_are_refused_and_nothing_changes():
    params = fresh_params(SHAPES, torch.float16, seed=1)
    opt = build(params)
    run(params, opt, 2)
    before = state_of(opt)
    extra = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    opt.param_groups[1]["params"].append(extra)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\] was changed in place.*add_param_group"):
        opt.step()
    opt.param_groups[1]["params"].pop()
    removed = opt.param_groups.pop(0)
    with pytest.raises(ValueError, match="param_groups has 1 groups; this optimizer has 2"):
        opt.step()
    opt.param_groups.insert(0, removed)
    opt.param_groups[0]["params"][0] = extra
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\] was changed"):
        opt.step()
    opt.param_groups[0]["params"][0] = params[0]
    assert same_state(state_of(opt), before)
    float(opt.loss_scale)
    opt.step()  # restored: it steps again
    assert opt.scaler_state()["attempts"] == 3


@pytest.mark.parametrize("bad, error", [("0.5", "Invalid lr"), (1e300, "Invalid learning rate"), (math.nan, "Invalid learning rate"),
                                        (-1e-3, ">= 0"), (20.0, r"weight_decay must be < 1")])
def test_a_refused_step_pushes_no_learning_rate_and_takes_no_weights(bad, error):
    params = fresh_params(SHAPES, torch.float16, seed=1)
    opt = FusedAdamW([dict(params=params[:2], lr=1e-2), dict(params=params[2:], lr=3e-3, weight_decay=0.1)])
    run(params, opt, 2)
    before = state_of(opt)
    opt.param_groups[0]["lr"] = 5e-3   # valid, and checked first
    opt.param_groups[1]["lr"] = bad    # refused
    with torch.no_grad():
        params[0].add_(1.0)  # a write the next step would take
    with pytest.raises(ValueError, match=error):
        opt.step()
    assert opt._opt.learning_rates() == before[2], "group 0's new rate was not pushed"
    assert opt._versions != [p._version for p in params], "the written weights were not taken"
    opt.param_groups[1]["lr"] = 3e-3
    float(opt.loss_scale)
    opt.step()
    assert opt._opt.learning_rates()[0] == ctypes.c_float(5e-3).value


def test_a_gradient_resized_in_place_is_refused():
    params = fresh_params(SHAPES, torch.bfloat16, seed=1)
    opt = build(params)
    run(params, opt, 1)
    before = state_of(opt)
    params[1].grad.resize_(2)  # shrinks in place: the same storage, fewer elements
    with pytest.raises(RuntimeError, match=r"parameter 1's \.grad is torch.bfloat16 \(2,\)"):
        opt.step()
    assert same_state(state_of(opt), before)


# -- the record a step acts on ----------------------------------------------------------------

@pytest.mark.parametrize("fault, reason", [
    ("negative_count", "inconsistent_totals"), ("key_without_count", "inconsistent_totals"),
    ("zeros_without_elements", "inconsistent_totals"), ("fingerprints", "hyperparameters_differ")])
def test_a_record_no_reduction_gives_is_never_applied(fault, reason):
    """What a faulty all-reduce between step_local and step_finish could leave: the step is
    skipped with the reason named, and nothing but the attempt counter moves."""
    params = fresh_params(SHAPES, torch.float16, seed=1)
    opt = build(params)
    run(params, opt, 2)
    gen = torch.Generator().manual_seed(6)
    _, grads = scaled_grads(SHAPES, torch.float16, float(opt.loss_scale), gen, 1e-2)
    grads[1].view(-1)[3] = math.inf
    for p, g in zip(params, grads):
        p.grad = g.clone()
    before = state_of(opt)
    opt._prepare()  # what step() pushes first: the gradients' addresses
    opt._opt.step_local()
    words = opt._totals  # int64 view of the record: sum words, then max words
    n = halfstep.TOTALS_SUM_WORDS
    if fault == "negative_count":
        words[n - 4] = -1           # the inf/NaN count, negative
    elif fault == "key_without_count":
        words[n - 4] = 0            # the inf is there, the count says none
    elif fault == "zeros_without_elements":
        words[n - 4] = 0
        words[n] = 0                # no first-bad key
        words[n - 1] = 0            # no elements in the norm ...
        words[n - 2] = 5            # ... but five zeros
    else:
        words[n + 2] ^= 1           # as if another rank's fingerprint were larger
    opt._opt.step_finish()
    r = opt.last_report()
    assert (r["outcome"], r["reason"]) == ("skipped_inconsistent", reason)
    after = state_of(opt)
    assert all(torch.equal(x, y) for x, y in zip(after[0], before[0])) and after[2] == before[2]
    assert opt.scaler_state()["attempts"] == 3 and opt.scaler_state()["step"] == 2
    assert float(opt.loss_scale) == 2.0 ** 10
