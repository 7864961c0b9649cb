"""Lean optimizer state in halfstep.torch: bfloat16 parameters with int16 remainders instead of fp32
masters (store_param_remainders=True) or with no master (master_weight_dtype=None), bfloat16 moments
(exp_avg_dtype, exp_avg_sq_dtype), their state_dicts and conversions, and the same on ranks
(lean_worker.py: ZeRO-1 and FSDP2 on gloo)."""

import pytest

torch = pytest.importorskip("torch")

import lean_worker as W  # noqa: E402
from helpers import fresh_params, halfstep_entry, run_workers, scaled_grads, without  # noqa: E402
from halfstep.torch import FusedAdamW  # noqa: E402

from halfstep import _formats  # noqa: E402

BF16 = torch.bfloat16
U8 = torch.uint8
LEAN = dict(store_param_remainders=True, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
MASTERLESS = dict(master_weight_dtype=None, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
BLOCK8 = dict(exp_avg_dtype=U8, exp_avg_sq_dtype=U8)
BLOCK8_MASTERLESS = dict(master_weight_dtype=None, exp_avg_dtype=U8, exp_avg_sq_dtype=U8)


def whole_blocks(shape):
    n = 1
    for d in shape:
        n *= d
    return _formats.blocks(shape, n, n, 0)


def moment_values(entry, key, shape):
    """A saved moment's values: as they are, or block8 codes decoded with their scales."""
    t = entry[key]
    if t.dtype != U8:
        return t
    return _formats.decode(t, entry[key + "_scale"], key, whole_blocks(shape)).view(shape)


def loaded_as_converted(got, saved, key, shape):
    """Whether a loaded moment (`got`: an entry of the loading optimizer) is the saved one (`saved`)
    converted: codes and scales into the same blocks as they are, values into block8 encoded to
    nearest, codes into fp32 or bf16 decoded and then rounded as values are."""
    mine = got[key]
    if mine.dtype == U8:
        if saved[key].dtype == U8:
            codes, scales = saved[key], saved[key + "_scale"]
        else:
            codes, scales = _formats.encode(saved[key].float(), key, whole_blocks(shape))
        return torch.equal(mine, codes.view(shape)) and torch.equal(got[key + "_scale"], scales)
    return torch.equal(mine, moment_values(saved, key, shape).to(mine.dtype))


def run(steps, params=None, opt=None, start=0, **kw):
    """Two groups of bfloat16 parameters, `steps` steps of scaled gradients (an inf in step 4),
    clipping on; the parameters, the optimizer and the reports."""
    params = params if params is not None else fresh_params(W.SHAPES, BF16, seed=1)
    opt = opt if opt is not None else W.make(params, None, None, **kw)
    reports = []
    for k in range(start, start + steps):
        gen = torch.Generator().manual_seed(50 + k)
        for p, g in zip(params, scaled_grads(W.SHAPES, BF16, 1.0, gen, 3e-2)[1]):
            p.grad = g.clone()
        if k == 4:
            params[3].grad.view(-1)[0] = float("nan")
        opt.step()
        reports.append(without(opt.last_report()))
    return params, opt, reports


def same(a, b):
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def state_of(opt, params, key):
    return [opt.state[p][key].detach().clone() for p in params]


@pytest.mark.parametrize("moments", [torch.float32, BF16], ids=["fp32 moments", "bf16 moments"])
def test_remainders_step_bitwise_like_fp32_masters(moments):
    kw = dict(exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    a, oa, ra = run(12, **kw)
    b, ob, rb = run(12, store_param_remainders=True, **kw)
    assert ra == rb
    assert [r["outcome"] for r in ra].count("applied") == 11
    assert same(a, b)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert same(state_of(oa, a, key), state_of(ob, b, key)), key


def test_the_state_shows_fp32_masters_and_moments_in_their_dtype():
    params, opt, _ = run(3, **LEAN)
    for p in params:
        entry = opt.state[p]
        assert entry["master"].dtype == torch.float32 and entry["master"].shape == p.shape
        assert torch.equal(entry["master"].to(BF16), p.detach())  # the parameter is the master rounded
        assert entry["exp_avg"].dtype == BF16 and entry["exp_avg_sq"].dtype == BF16
        assert dict(entry)["master"].dtype == torch.float32 and {**entry}["master"].dtype == torch.float32
        assert [v.dtype for k, v in entry.items() if k == "master"] == [torch.float32]
    sd = opt.state_dict()
    assert {k: v.dtype for k, v in sd["state"][0].items()} == {"master": torch.float32, "exp_avg": BF16,
                                                              "exp_avg_sq": BF16, "step": torch.int64}
    assert halfstep_entry(sd)["state_format"] == dict(master="bf16_remainder", exp_avg="bf16", exp_avg_sq="bf16",
                                                      rounding="stochastic", seed=0)


def test_a_master_written_in_place_is_refused_and_one_assigned_is_taken():
    params, opt, _ = run(3, store_param_remainders=True)
    before = [p.detach().clone() for p in params]
    view = opt.state[params[0]]["master"]
    view.add_(1.0)  # a copy: the write would be lost
    with pytest.raises(RuntimeError, match="written in place, but it is a copy"):
        run(1, params, opt, start=3)
    assert same([p.detach() for p in params], before), "nothing stepped"
    # Assignment writes the master: the parameter becomes it rounded, the remainder its low half.
    new = opt.state[params[0]]["master"] + 0.25
    opt.state[params[0]]["master"] = new
    assert torch.equal(opt.state[params[0]]["master"], new)
    assert torch.equal(params[0].detach(), new.to(BF16))
    run(1, params, opt, start=3)  # steps again


def test_what_lean_state_cannot_serve_is_refused_by_name():
    for dtype, why in ((torch.float16, "float16 parameter and 16 bits"), (torch.float32, "masters themselves")):
        params = fresh_params(W.SHAPES, dtype, seed=1)
        with pytest.raises(ValueError, match="store_param_remainders=True.*" + why):
            FusedAdamW(params, store_param_remainders=True)
    params = fresh_params(W.SHAPES, BF16, seed=1)
    for kw, match in ((dict(exp_avg_dtype=torch.float16),
                       r"exp_avg_dtype must be torch.float32, torch.bfloat16 or torch.uint8 .*got torch.float16"),
                      (dict(exp_avg_sq_dtype=torch.uint8), "torch.uint8 .* is for both moments or neither"),
                      (dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=BF16), "both moments or neither"),
                      (dict(rounding="up"), "rounding must be 'stochastic' or 'nearest'"),
                      (dict(seed=-1), r"seed must be an integer in \[0, 2\^64\)"),
                      (dict(store_param_remainders="yes"), "store_param_remainders must be True, False or None")):
        with pytest.raises(ValueError, match=match):
            FusedAdamW(params, **kw)


FORMATS = {"fp32": {}, "remainders": dict(store_param_remainders=True),
           "bf16 moments": dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16), "lean": LEAN, "masterless": MASTERLESS,
           "block8": BLOCK8, "block8 masterless": BLOCK8_MASTERLESS}


@pytest.mark.parametrize("saved", list(FORMATS))
@pytest.mark.parametrize("loaded", list(FORMATS))
def test_state_dicts_load_into_every_format(saved, loaded):
    # fp32 masters in every state_dict (exact, from remainders too; without a master, the weights'
    # values); moments converted: fp32 into bf16 rounds once to nearest even, bf16 into fp32 is
    # exact; an fp32 master loaded where there is none rounds to nearest even. Into its own format
    # a state_dict resumes bit for bit.
    params, opt, _ = run(6, **FORMATS[saved])
    sd = opt.state_dict()
    rest = run(4, params, opt, start=6)
    fresh = fresh_params(W.SHAPES, BF16, seed=9)
    other = W.make(fresh, None, None, **FORMATS[loaded])
    other.load_state_dict(sd)
    for i, p in enumerate(fresh):
        master = sd["state"][i]["master"]
        if "masterless" in loaded:
            master = master.to(BF16).float()
        assert torch.equal(other.state[p]["master"], master)
        assert torch.equal(p.detach(), sd["state"][i]["master"].to(BF16))
        for key in ("exp_avg", "exp_avg_sq"):
            assert loaded_as_converted(other.state[p], sd["state"][i], key, tuple(p.shape)), (i, key)
    again = run(4, fresh, other, start=6)
    if saved == loaded:
        assert again[2] == rest[2]
        assert same(again[0], rest[0])


def test_a_lean_state_dict_through_fp32_and_back_is_unchanged():
    params, opt, _ = run(5, **LEAN)
    sd = opt.state_dict()
    wide = W.make(fresh_params(W.SHAPES, BF16, seed=2), None, None)
    wide.load_state_dict(sd)
    lean = W.make(fresh_params(W.SHAPES, BF16, seed=3), None, None, **LEAN)
    lean.load_state_dict(wide.state_dict())
    for i, (a, b) in enumerate(zip(sd["state"].values(), lean.state_dict()["state"].values())):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (i, key)


def test_stochastic_rounding_resumes_bit_for_bit_with_the_saved_seed():
    params, opt, _ = run(5, seed=1234, **LEAN)
    sd = opt.state_dict()
    assert halfstep_entry(sd)["state_format"]["seed"] == 1234
    _, _, rest = run(5, params, opt, start=5)
    straight = [p.detach().clone() for p in params]
    fresh = fresh_params(W.SHAPES, BF16, seed=7)
    other = W.make(fresh, None, None, seed=99, **LEAN)  # another seed: the state_dict's wins
    other.load_state_dict(sd)
    _, _, again = run(5, fresh, other, start=5)
    assert again == rest and same(fresh, straight)
    # Another seed draws other bits: the moments differ.
    a, oa, _ = run(5, seed=1, **LEAN)
    b, ob, _ = run(5, seed=2, **LEAN)
    assert not same(state_of(oa, a, "exp_avg_sq"), state_of(ob, b, "exp_avg_sq"))


def test_weights_written_into_the_parameters_with_remainders():
    # The same values written back (a model state_dict loaded after the optimizer's) keep every
    # remainder: the run continues bitwise. Other values become the masters (their remainder kept
    # only where the pair still rounds to the written value: doubling a weight doubles its master).
    params, opt, _ = run(4, store_param_remainders=True)
    reference, ref_opt, _ = run(4)
    masters = state_of(opt, params, "master")
    with torch.no_grad():
        for p in params:
            p.copy_(p.detach().clone())
        for p in reference:
            p.copy_(p.detach().clone())
    a, b = run(2, params, opt, start=4)[2], run(2, reference, ref_opt, start=4)[2]
    assert a == b and same(params, reference)
    masters = state_of(opt, params, "master")
    with torch.no_grad():
        params[0].mul_(2)
        params[1].copy_(torch.full_like(params[1], 0.375))
    opt.resync_weights()
    now = state_of(opt, params, "master")
    assert torch.equal(now[0], masters[0] * 2)
    assert torch.equal(now[1].to(BF16), params[1].detach())
    assert float((now[1] - 0.375).abs().max()) <= 2.0 ** -10  # half a bf16 ulp of 0.375
    assert torch.equal(now[2], masters[2])


def launch(world, mode, tmp_path, *args):
    outs = [tmp_path / ("%s-%d-of-%d.pt" % (mode, r, world)) for r in range(world)]
    run_workers("lean_worker.py", [[r, world, mode, tmp_path / ("init-%s-%d" % (mode, world)), outs[r]] + list(args)
                                   for r in range(world)], timeout=300)
    return [torch.load(o, weights_only=False) if int(torch.__version__.split(".")[0]) >= 2 else torch.load(o)
            for o in outs]


@pytest.mark.parametrize("world", [2, 3])
def test_zero1_and_replicated_lean_state_steps_bitwise_like_one_process(world, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    results = launch(world, "zero", tmp_path)
    for name in W.SAVED:  # remainders, no master, and 8-bit moments (cut where blocks start)
        params = fresh_params(W.SHAPES, BF16, seed=5)
        opt = W.make(params, None, None, **W.FORMATS[name])
        reports = [without(r) for r in W.train(params, opt)]
        assert [r["outcome"] for r in reports].count("applied") == W.STEPS - 1
        for shard in (True, False):
            # (Replicated, every rank holding the inf counts it: nonfinite_count is the world's.)
            mine = ("held_elements", "first_nonfinite_rank") + (() if shard else ("nonfinite_count",))
            for r in results:
                got = r[name, shard]
                assert [without(x, *mine) for x in got["reports"]] == [without(x, *mine) for x in reports], (name, shard)
                assert same(got["params"], [p.detach() for p in params]), (name, shard)
    for r in results:  # ZeRO-1 with 8-bit moments: resumed from each rank's state_dict, and rebuilt
        assert r["block8 resume"] == dict(same_reports=True, same_params=True)
        assert r["block8 carried"] and r["block8 carried codes"] == 2  # the (20, 300) weight's two moments
    assert sum(r["block8 held codes"] for r in results) >= 2  # the (20, 300) weight's pieces hold codes


try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2: PyTorch >= 2.6)
    HAS_FSDP2 = True
except Exception:  # noqa: BLE001
    HAS_FSDP2 = False


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    if not HAS_FSDP2:
        pytest.skip("FSDP2 needs PyTorch >= 2.6")
    work = tmp_path_factory.mktemp("lean-fsdp")
    return {1: launch(1, "fsdp", work, work / "ck1"), 2: launch(2, "fsdp", work, work / "ck2", work / "ck1"),
            3: launch(3, "fsdp", work, work / "ck3", work / "ck2")}


def reports_of(run):
    return [without(x, "held_elements", "first_nonfinite_rank") for x in run["reports"]]


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_lean_state_steps_bitwise_like_one_process(fsdp_runs, world):
    one = fsdp_runs[1][0]
    for r in fsdp_runs[world]:
        for name in W.FORMATS:
            assert reports_of(r[name]) == reports_of(one[name]), name
            assert same(r[name]["params"], one[name]["params"]), name
            for i, entry in one[name]["saved"].items():
                assert sorted(r[name]["saved"][i]) == sorted(entry), (name, i)
                for key in entry:  # master, moments (block8: codes and scales) and step
                    assert torch.equal(r[name]["saved"][i][key], entry[key]), (name, i, key)
    codes = one["block8"]["saved"][0]  # the first weight (24 x 300) holds codes: two blocks a row
    assert codes["exp_avg"].dtype == U8 and codes["exp_avg_sq_scale"].shape == (24, 2)
    assert one["block8"]["saved"][1]["exp_avg"].dtype == torch.float32  # its bias keeps fp32 moments


def test_fsdp2_remainders_step_bitwise_like_fp32_masters(fsdp_runs):
    for r in fsdp_runs[2]:
        assert reports_of(r["lean"]) == reports_of(r["bf16 moments"])
        assert same(r["lean"]["params"], r["bf16 moments"]["params"])


@pytest.mark.parametrize("saved,loaded", [(1, 2), (2, 3)])
def test_fsdp2_lean_checkpoint_saved_on_n_ranks_loads_on_m_in_every_format(fsdp_runs, saved, loaded):
    source = fsdp_runs[saved][0]["lean"]
    for r in fsdp_runs[loaded]:
        for name in W.FORMATS:
            got = r["loaded"][name]
            for i, entry in source["saved"].items():
                master = entry["master"].to(BF16).float() if name in ("masterless", "block8") else entry["master"]
                assert torch.equal(got["state"][i]["master"], master), (name, i)
                for key in ("exp_avg", "exp_avg_sq"):
                    assert loaded_as_converted(got["state"][i], entry, key, tuple(entry["master"].shape)), (name, key)
            if name == "lean":  # its own format: resumed bit for bit, on another number of ranks
                assert [without(x, "held_elements", "first_nonfinite_rank") for x in got["next"]] == \
                    [without(x, "held_elements", "first_nonfinite_rank") for x in source["next"]]
                assert same(got["params"], source["next_params"])
        # The master-free and the 8-bit checkpoints into their own format: the same state (codes and
        # scales too), resumed bit for bit.
        for name in ("masterless", "block8"):
            own, got = fsdp_runs[saved][0][name], r["loaded"][name + " from " + name]
            for i, entry in own["saved"].items():
                for key in entry:
                    assert torch.equal(got["state"][i][key], entry[key]), (name, i, key)
            assert reports_of(dict(reports=got["next"])) == reports_of(dict(reports=own["next"])), name
            assert same(got["params"], own["next_params"]), name
        # Filled by torch.distributed.checkpoint into another block8-ness, codes were cast to values
        # or values to codes: refused, by name.
        for name in ("block8", "block8 masters", "f32 from block8"):
            assert "values were cast on the way" in r["loaded"][name]["refused"], name
        # The 8-bit checkpoint into fp32 moments (through an optimizer of its own format): decoded.
        own, got = fsdp_runs[saved][0]["block8"], r["loaded"]["f32 from block8"]
        for i, entry in own["saved"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert loaded_as_converted(got["state"][i], entry, key, tuple(entry["master"].shape)), (i, key)


def test_zeros_written_through_data_with_remainders_are_the_masters():
    # Found by an outside review: +0 or -0 written over a negative remainder (p.data.zero_(), a
    # pruning mask through .data) joined to a NaN master, and those elements were held for good.
    params, opt, _ = run(3, store_param_remainders=True)
    with torch.no_grad():
        params[0].data.zero_()
    masters = state_of(opt, params, "master")
    # Each written zero's master rounds to it: 0 where the remainder was negative, else the old low
    # half kept (a subnormal below 2^-133, within half a bf16 ulp of the zero written).
    assert bool(torch.isfinite(masters[0]).all()) and bool((masters[0].abs() < 2.0 ** -133).all())
    assert torch.equal(masters[0].to(BF16), params[0].detach())
    assert bool((masters[0] == 0).any())
    _, _, reports = run(2, params, opt, start=3)
    assert all(r["held_elements"] == 0 for r in reports)
    assert all(bool(torch.isfinite(m).all()) for m in state_of(opt, params, "master"))


def test_a_temporary_master_copy_written_in_place_is_refused():
    # Found by an outside review: the check held a weak reference only, so a copy that was a
    # temporary (opt.state[p]["master"].mul_(0)) was freed before the step could see the write.
    params, opt, _ = run(2, store_param_remainders=True)
    before = [p.detach().clone() for p in params]
    opt.state[params[0]]["master"].mul_(0)
    with pytest.raises(RuntimeError, match="written in place, but it is a copy"):
        run(1, params, opt, start=2)
    assert same([p.detach() for p in params], before)
    kept = opt.state[params[1]]["master"]  # a copy kept across a step, written after it
    run(1, params, opt, start=2)
    kept[0] = 5.0
    with pytest.raises(RuntimeError, match="written in place, but it is a copy"):
        run(1, params, opt, start=3)


def test_the_loaded_seed_survives_a_rebuild_and_is_saved_again():
    # Found by an outside review: add_param_group after a load rebuilt the library with the seed the
    # optimizer was built with, and state_dict() recorded that one.
    params, opt, _ = run(4, seed=1234, **LEAN)
    sd = opt.state_dict()
    extra = torch.nn.Parameter(torch.zeros(6, dtype=BF16))
    opt.add_param_group(dict(params=[extra], lr=1e-3))
    fresh = fresh_params(W.SHAPES, BF16, seed=8)
    other = W.make(fresh, None, None, seed=99, **LEAN)
    other.load_state_dict(sd)
    assert halfstep_entry(other.state_dict())["state_format"]["seed"] == 1234
    extra2 = torch.nn.Parameter(torch.zeros(6, dtype=BF16))
    other.add_param_group(dict(params=[extra2], lr=1e-3))
    for k in range(4, 8):
        gen = torch.Generator().manual_seed(50 + k)
        grads = scaled_grads(W.SHAPES + [(6,)], BF16, 1.0, gen, 3e-2)[1]
        for p, g in zip(params + [extra], grads):
            p.grad = g.clone()
        for p, g in zip(fresh + [extra2], grads):
            p.grad = g.clone()
        opt.step()
        other.step()
    assert same(fresh + [extra2], params + [extra])
    assert same(state_of(other, fresh, "exp_avg_sq"), state_of(opt, params, "exp_avg_sq"))


def test_small_refusals_say_what_is_wrong():
    import copy
    import pickle
    import halfstep
    params, opt, _ = run(1, **LEAN)
    with pytest.raises(ValueError, match="past bfloat16's range"):
        opt.state[params[0]]["exp_avg"] = torch.full(params[0].shape, 3.4e38)
    with pytest.raises(ValueError, match="must be finite"):
        opt.state[params[0]]["exp_avg"] = torch.full(params[0].shape, float("inf"))
    assert FusedAdamW(params, seed=torch.tensor(5).item()).state_dict()["param_groups"][0]["halfstep"][
        "state_format"]["seed"] == 5
    try:
        import numpy
        assert halfstep_entry(FusedAdamW(params, seed=numpy.uint64(2 ** 64 - 1)).state_dict())["state_format"][
            "seed"] == 2 ** 64 - 1
    except ImportError:
        pass
    cfg = halfstep.config(dtype="bfloat16", master="bf16_remainder", exp_avg="bf16", exp_avg_sq="bf16")
    assert halfstep.state_bytes(cfg) == dict(state=6, gradient=2, model=2, moved=20)
    with pytest.raises(halfstep.HalfstepError, match="model copy"):
        halfstep.state_bytes(cfg, model_copy=False)
    with pytest.raises(halfstep.HalfstepError, match="bf16_remainder needs a bf16 model copy"):
        halfstep.state_bytes(halfstep.config(dtype="float16", master="bf16_remainder"))
    # opt.state copies and pickles as plain dicts of what it shows (the masters rebuilt).
    for copied in (copy.deepcopy(opt.state), pickle.loads(pickle.dumps(opt.state))):
        entry = copied[next(k for k in copied if isinstance(k, torch.Tensor) and k.shape == params[0].shape)]
        assert entry["master"].dtype == torch.float32 and entry["exp_avg"].dtype == BF16


# -- no master (master_weight_dtype=None) ------------------------------------------------------------


def test_without_a_master_the_parameter_is_the_weight():
    # opt.state[p]['master'] shows the parameter's own values in fp32 (a copy); each step is the
    # fp32-master step from the same weights, its result rounded once into the parameter (to one
    # of the two bf16 values around it): it stays within a bf16 ulp of a step with fp32 masters
    # restarted from the same weights and moments.
    params, opt, reports = run(3, **MASTERLESS)
    assert [r["outcome"] for r in reports].count("applied") == 3
    for p in params:
        entry = opt.state[p]
        assert entry["master"].dtype == torch.float32 and torch.equal(entry["master"], p.detach().float())
    wide = W.make(fresh_params(W.SHAPES, BF16, seed=4), None, None, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
    wide.load_state_dict(opt.state_dict())
    before = [p.detach().float() for p in params]
    run(1, params, opt, start=3)
    fresh = [p for g in wide.param_groups for p in g["params"]]
    run(1, fresh, wide, start=3)
    for p, q, b in zip(params, fresh, before):
        exact = wide.state[q]["master"]
        ulp = torch.where(exact.abs() >= 2.0 ** -126, 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7), 2.0 ** -133)
        assert bool(((p.detach().float() - exact).abs() < ulp).all())
    assert any(not torch.equal(p.detach().float(), b) for p, b in zip(params, before))


def test_without_a_master_stochastic_rounding_keeps_small_updates_and_nearest_loses_them():
    # 4096 weights at 1.5 (bf16 ulp 2^-7), lr 2^-11 (Adam's update under a constant gradient: a
    # sixteenth of an ulp) for 64 steps: to nearest nothing moves; stochastically the mean moves
    # by 64 * 2^-11 = 2^-5 within 6 standard errors (2^-11 each, see test_state.cpp).
    def moved(rounding):
        w = torch.nn.Parameter(torch.full((4096,), 1.5, dtype=BF16))
        opt = FusedAdamW([w], lr=2.0 ** -11, weight_decay=0.0, master_weight_dtype=None, rounding=rounding, seed=3)
        for _ in range(64):
            w.grad = torch.full_like(w, 0.25)
            opt.step()
        return 1.5 - float(w.detach().double().mean())
    assert moved("nearest") == 0.0
    assert abs(moved("stochastic") - 2.0 ** -5) < 6 * 2.0 ** -11


def test_without_a_master_resumes_bit_for_bit_with_the_saved_seed():
    params, opt, _ = run(5, seed=77, **MASTERLESS)
    sd = opt.state_dict()
    assert halfstep_entry(sd)["state_format"]["master"] == "none"
    _, _, rest = run(5, params, opt, start=5)
    straight = [p.detach().clone() for p in params]
    fresh = fresh_params(W.SHAPES, BF16, seed=7)
    other = W.make(fresh, None, None, seed=99, **MASTERLESS)
    other.load_state_dict(sd)
    _, _, again = run(5, fresh, other, start=5)
    assert again == rest and same(fresh, straight)
    a, _, _ = run(5, seed=1, master_weight_dtype=None)
    b, _, _ = run(5, seed=2, master_weight_dtype=None)
    assert not same(a, b)  # another seed rounds the weights otherwise


def test_without_a_master_what_cannot_be_served_is_refused_by_name():
    with pytest.raises(ValueError, match="master_weight_dtype=None: .*float16"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))], master_weight_dtype=None)
    with pytest.raises(ValueError, match="master_weight_dtype=None: .*their own fp32 masters"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3))], master_weight_dtype=None)
    with pytest.raises(ValueError, match="store_param_remainders=True keeps a master .*choose one"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=BF16))], master_weight_dtype=None,
                   store_param_remainders=True)
    with pytest.raises(ValueError, match="master_weight_dtype must be torch.float32 .* or None"):
        FusedAdamW([torch.nn.Parameter(torch.zeros(3, dtype=BF16))], master_weight_dtype=torch.bfloat16)


def test_without_a_master_a_copy_written_in_place_is_refused_and_weights_written_are_taken():
    params, opt, _ = run(2, **MASTERLESS)
    shown = opt.state[params[0]]["master"]
    shown.add_(1.0)
    with pytest.raises(RuntimeError, match="master_weight_dtype=None there is no master"):
        run(1, params, opt, start=2)
    params, opt, _ = run(2, **MASTERLESS)
    with torch.no_grad():
        params[1].copy_(torch.full_like(params[1], 0.375))
    assert torch.equal(opt.state[params[1]]["master"], torch.full(params[1].shape, 0.375))
    opt.state[params[0]]["master"] = torch.full(params[0].shape, 0.1)  # assigned: rounded into the weight
    assert torch.equal(params[0].detach(), torch.full(params[0].shape, 0.1).to(BF16))


def test_block8_moments_hold_what_fp32_moments_hold_within_a_code():
    # After one step from zero, fp32 moments hold m = (1 - b1) g and v = (1 - b2) g^2 exactly. The
    # 8-bit ones hold them as codes of a block's largest magnitude: exp_avg to nearest, within half
    # the signed map's widest cell (its top decade's 64 cells over [0.1, 1]: 0.9/64/2 of the
    # block's absmax); sqrt(exp_avg_sq) stochastically, within one cell of the unsigned map's
    # (0.9/128). A block's largest magnitude itself is exact (code 1), or 0.99296875 of it when
    # exp_avg's is negative (the signed map has no -1).
    a, oa, _ = run(1, **BLOCK8_MASTERLESS)
    b, ob, _ = run(1, master_weight_dtype=None)
    quantized = 0
    for pa, pb in zip(a, b):
        got, want = oa.state[pa], ob.state[pb]
        shape = tuple(pa.shape)
        blocks = whole_blocks(shape)
        if blocks is None:  # small or short-row tensors keep fp32 moments: bitwise the fp32 run's
            assert got["exp_avg"].dtype == torch.float32 and "exp_avg_scale" not in got
            assert torch.equal(got["exp_avg"], want["exp_avg"]) and torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])
            continue
        quantized += 1
        assert got["exp_avg"].dtype == U8 and got["exp_avg_scale"].shape == blocks.scale_shape
        m = moment_values(got, "exp_avg", shape).reshape(blocks.scale_shape[0], -1)
        r = moment_values(got, "exp_avg_sq", shape).sqrt().reshape(blocks.scale_shape[0], -1)
        wm = want["exp_avg"].reshape(m.shape)
        wr = want["exp_avg_sq"].sqrt().reshape(m.shape)
        for k in range(blocks.scale_shape[1]):
            cols = slice(256 * k, 256 * (k + 1))
            am = wm[:, cols].abs().amax(dim=1, keepdim=True)
            ar = wr[:, cols].amax(dim=1, keepdim=True)
            assert torch.equal(got["exp_avg_scale"][:, k:k + 1], am)
            # (the step roots its own v; the fp32 run's stored v rooted here may differ by an ulp)
            assert bool(((got["exp_avg_sq_scale"][:, k:k + 1] - ar).abs() <= ar * 2.0 ** -22).all())
            assert bool(((m[:, cols] - wm[:, cols]).abs() <= am * (0.9 / 128 + 1e-6)).all())
            assert bool(((r[:, cols] - wr[:, cols]).abs() <= ar * (0.9 / 128 + 1e-6)).all())
    assert quantized == 1
    # 2 bytes of codes per element, and two fp32 scales per 256 elements of a row, for (20, 300):
    p = a[-1]
    held = sum(oa.state[p][k].numel() * oa.state[p][k].element_size()
               for k in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"))
    assert held == 2 * 6000 + 2 * 4 * 40


def test_block8_state_assigned_cleared_and_refused():
    params, opt, _ = run(3, **BLOCK8)
    p = params[-1]
    entry = opt.state[p]
    # Values assigned to a codes slot are encoded with their scales, to nearest; codes as they are.
    values = torch.linspace(-1e-3, 1e-3, 6000).view(20, 300)
    entry["exp_avg"] = values
    codes, scales = _formats.encode(values, "exp_avg", whole_blocks((20, 300)))
    assert torch.equal(entry["exp_avg"], codes.view(20, 300)) and torch.equal(entry["exp_avg_scale"], scales)
    entry["exp_avg"] = values.half()  # any floating-point dtype: encoded from its fp32 values
    codes, scales = _formats.encode(values.half().float(), "exp_avg", whole_blocks((20, 300)))
    assert torch.equal(entry["exp_avg"], codes.view(20, 300)) and torch.equal(entry["exp_avg_scale"], scales)
    # Where a parameter holds no codes, a key named like a scale is the user's own, as any other.
    small = opt.state[params[0]]
    small["exp_avg_scale"] = "mine"
    assert opt.state_dict()["state"][0]["exp_avg_scale"] == "mine"
    entry["exp_avg"] = torch.full((20, 300), 200, dtype=U8)
    assert int(entry["exp_avg"].min()) == 200 and torch.equal(entry["exp_avg_scale"], scales)
    for key, value, match in (("exp_avg", torch.zeros(6000, dtype=torch.int32), "takes block8 codes"),
                              ("exp_avg_sq_scale", -torch.ones(20, 2), "must be >= 0"),
                              ("exp_avg_sq", torch.full((20, 300), -1.0), "must be >= 0"),
                              ("exp_avg_scale", torch.full((20, 2), float("nan")), "must be finite")):
        with pytest.raises(ValueError, match=match):
            entry[key] = value
    # An emptied state: codes of 0 and scales of 0, as a fresh optimizer holds them.
    opt.state.clear()
    fresh = W.make(fresh_params(W.SHAPES, BF16, seed=1), None, None, **BLOCK8)
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(opt.state[p][key], fresh.state[fresh.param_groups[-1]["params"][-1]][key]), key
    assert int(opt.state[p]["exp_avg"][0, 0]) == 127
    # state_dicts: codes without their scales, scales of the wrong shape, codes for a tensor that
    # has no blocks: refused by name, nothing loaded.
    last = len(params) - 1
    for edit, match in ((lambda e: e.pop("exp_avg_scale"), r"\['exp_avg_scale'\] must be a float32 tensor of shape "
                                                            r"\(20, 2\)"),
                        (lambda e: e.update(exp_avg_sq_scale=torch.ones(40)), "exp_avg_sq_scale"),
                        (lambda e: e.update(exp_avg_sq_scale=-torch.ones(20, 2)), "negative scales")):
        bad = opt.state_dict()
        edit(bad["state"][last])
        other = W.make(fresh_params(W.SHAPES, BF16, seed=4), None, None, **BLOCK8)
        before = [other.state[q]["exp_avg"].clone() for q in other.param_groups[-1]["params"]]
        with pytest.raises(ValueError, match=match):
            other.load_state_dict(bad)
        assert all(torch.equal(x, other.state[q]["exp_avg"]) for x, q in zip(before, other.param_groups[-1]["params"]))
    bad = opt.state_dict()
    bad["state"][0]["exp_avg"] = torch.zeros(7, 5, dtype=U8)
    bad["state"][0]["exp_avg_scale"] = torch.zeros(7, 1)
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] holds block8 codes, but parameter 0's shape"):
        W.make(fresh_params(W.SHAPES, BF16, seed=4), None, None).load_state_dict(bad)
    # Codes where the state_dict says values were saved (a cast): refused, by name.
    bad = opt.state_dict()
    bad["param_groups"][0]["halfstep"]["state_format"]["exp_avg"] = "f32"
    with pytest.raises(ValueError, match=r"state\[5\]\['exp_avg'\] is uint8, but the state_dict was saved with fp32"):
        W.make(fresh_params(W.SHAPES, BF16, seed=4), None, None, **BLOCK8).load_state_dict(bad)
