"""The protocol between FusedAdamW's ranks, 2 processes on gloo (protocol_worker.py): each case
was a silent wrong result, a hang or a wrong refusal before its fix (the safety round's list)."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import protocol_worker as W  # noqa: E402
from helpers import fresh_params, run_workers, without  # noqa: E402
from halfstep.torch import FusedAdamW  # noqa: E402

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2: PyTorch >= 2.6)
    HAS_FSDP2 = True
except Exception:  # noqa: BLE001 (ImportError; PyTorch 1.13's fsdp package fails on Python 3.11 itself)
    HAS_FSDP2 = False

try:
    torch.amp.GradScaler("cpu")
    HAS_CPU_SCALER = True
except Exception:  # noqa: BLE001
    HAS_CPU_SCALER = False


def launch(mode, dtype, tmp_path, world=2):
    outs = [tmp_path / ("rank%d.pt" % r) for r in range(world)]
    run_workers("protocol_worker.py", [[r, world, mode, dtype, tmp_path / "init", outs[r]] for r in range(world)],
                timeout=180)
    return [torch.load(o, weights_only=False) if int(torch.__version__.split(".")[0]) >= 2 else torch.load(o)
            for o in outs]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def single_run(dtype, start, steps, scaler):
    """One process from weights `start`: the reports and weights of `steps`."""
    params = [torch.nn.Parameter(w.clone()) for w in start]
    opt = W.make(params, None, scaler=scaler)
    return [W.iterate(params, opt, dtype, k) for k in steps], [p.detach().clone() for p in params]


def test_a_set_of_parameters_is_refused_with_a_process_group(tmp_path):
    # Before: accepted (with torch's warning at most): each process orders a set differently, and
    # ZeRO-1 wrote parameters with other parameters' values.
    for r in launch("set", "float32", tmp_path):
        assert "a set's order differs between processes" in r["set"]
        assert "same order" in r["group set"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_zero1_weights_loaded_on_every_rank_survive_a_rank_refused_step(dtype, tmp_path):
    # Before: the refusing rank had not taken the loaded weights into its masters, and the gather
    # after the step wrote its chunk of the old weights into every rank's parameters.
    results = launch("zeroload", dtype, tmp_path)
    assert "parameter 1's .grad" in results[1]["refused"]
    for r in results:
        assert (r["report"]["outcome"], r["report"]["reason"]) == ("skipped_inconsistent", "rank_refused")
        assert same(r["after_refused"], r["pretrained"]), "the loaded weights, on every rank"
    assert same(results[0]["params"], results[1]["params"])
    d = getattr(torch, dtype)
    params = fresh_params(W.SHAPES, d, seed=1)
    opt = W.make(params, None, scaler=dict(init_scale=2.0 ** 10))
    for k in range(3):
        W.iterate(params, opt, d, k)
    with torch.no_grad():
        for p, w in zip(params, results[0]["pretrained"]):
            p.copy_(w)
    for k in (4, 5):
        W.iterate(params, opt, d, k)
    assert same(results[0]["params"], [p.detach() for p in params])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_storage_moved_on_one_rank_before_the_first_step_neither_hangs_nor_diverges(dtype, tmp_path):
    # Before: rank 0 alone rebuilt its optimizer and entered an agreement the other rank never
    # joined (gloo aborted; NCCL would hang).
    results = launch("moved", dtype, tmp_path)
    d = getattr(torch, dtype)
    reports, weights = single_run(d, fresh_params(W.SHAPES, d, seed=7), range(4), dict(init_scale=2.0 ** 10))
    for shard in (True, False):
        for r in results:
            assert [without(x, "held_elements") for x in r[shard]["reports"]] == \
                [without(x, "held_elements") for x in reports], shard
            assert same(r[shard]["params"], weights), shard


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_shard_false_loads_the_state_dict_rank_0_saved_on_every_rank(dtype, tmp_path):
    # Before: refused ("written by rank 0 of 2 ranks; this is rank 1") although every rank's
    # state is the same without shard.
    for r in launch("rank0saves", dtype, tmp_path):
        assert [without(x, "held_elements") for x in r["again"]] == [without(x, "held_elements") for x in r["rest"]]
        assert same(r["resumed"], r["params"])


@pytest.mark.skipif(not HAS_CPU_SCALER, reason="torch.amp.GradScaler runs on the CPU from PyTorch 2.3")
def test_a_rank_refused_step_under_torch_amp_grad_scaler_keeps_the_replicas_equal(tmp_path):
    # Before: the refusing rank kept torch's grad_scale and unscaled its next steps by the scale
    # squared; the record's fingerprint did not cover the scale, every rank applied, and the
    # replicas diverged for good.
    a, b = launch("torchscaler", "float32", tmp_path)
    assert "Invalid learning rate" in b["refused"]
    assert [x["reason"] for x in a["reports"]].count("rank_refused") == 1
    assert all(x["reason"] != "hyperparameters_differ" for x in a["reports"] + b["reports"])
    assert [without(x, "held_elements") for x in a["reports"]] == [without(x, "held_elements") for x in b["reports"]]
    assert same(a["params"], b["params"]) and a["scales"] == b["scales"]


@pytest.mark.skipif(not HAS_FSDP2, reason="FSDP2 (torch.distributed.fsdp.fully_shard) needs PyTorch >= 2.6")
def test_fsdp2_resumes_through_get_and_set_optimizer_state_dict(tmp_path):
    # Before: get_optimizer_state_dict dropped the optimizer's own state, and
    # set_optimizer_state_dict then refused the checkpoint.
    for r in launch("dcpapi", "float32", tmp_path):
        assert r["attempts"] == 3
        assert [without(x, "held_elements") for x in r["again"]] == [without(x, "held_elements") for x in r["rest"]]
        assert same(r["resumed"], r["params"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_zero1_state_dict_keeps_the_keys_added_to_opt_state(dtype, tmp_path):
    # Found by an outside review: ZeRO-1's state_dict dropped keys a user added to opt.state[p].
    for rank, r in enumerate(launch("zeroextras", dtype, tmp_path)):
        assert [float(e[0]) for e in r["ema"]] == [10.0 * rank + i for i in range(len(W.SHAPES))]
        assert [without(x, "held_elements") for x in r["again"]] == [without(x, "held_elements") for x in r["rest"]]
        assert same(r["resumed"], r["params"])


def test_a_grad_scaler_refusing_on_one_rank_takes_part_in_the_step(tmp_path):
    # Found by an outside review: a GradScaler's own refusal (here: a first scale() by its initial
    # scale while the resumed optimizer is at another) was raised before the step's collectives,
    # and the other rank waited in them.
    a, b = launch("scalerrefuse", "float32", tmp_path)
    assert "refused" not in a and "attach it before the first scale()" in b["refused"]
    for r in (a, b):
        assert (r["report"]["outcome"], r["report"]["reason"]) == ("skipped_inconsistent", "rank_refused")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_gradient_missing_on_one_rank_skips_the_step_on_every_rank(dtype, tmp_path):
    # Found by an outside review: a parameter whose .grad is None on one rank only was stepped by
    # the ranks that had it and left alone by the other: replicated weights diverged silently.
    results = launch("gradpresence", dtype, tmp_path)
    for shard in (True, False):
        a, b = (r[shard] for r in results)
        assert [(x["outcome"], x["reason"]) for x in a["reports"]][2] == ("skipped_inconsistent",
                                                                          "hyperparameters_differ"), shard
        assert [without(x, "held_elements") for x in a["reports"]] == \
            [without(x, "held_elements") for x in b["reports"]], shard
        assert same(a["params"], b["params"]), shard
        assert [x["outcome"] for x in a["reports"]].count("applied") == 3, shard
