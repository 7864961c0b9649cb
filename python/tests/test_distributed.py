"""FusedAdamW with a process_group: 2 and 3 processes on gloo (CPU), sharded and replicated."""

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import dist_worker as W  # noqa: E402
from helpers import run_workers, without  # noqa: E402

def launch(world, shard, dtype, tmp_path, mode="train"):
    init = tmp_path / "init"
    outs = [tmp_path / ("rank%d.pt" % rank) for rank in range(world)]
    run_workers("dist_worker.py", [[rank, world, "1" if shard else "0", dtype, init, outs[rank], mode]
                                   for rank in range(world)], timeout=120)
    return [torch.load(o) for o in outs]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shard", [True, False], ids=["zero1", "replicated"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_inf_on_one_rank_skips_every_rank_with_one_report(world, shard, dtype, tmp_path):
    results = launch(world, shard, dtype, tmp_path)
    # One process, the same gradients, the same inf/NaN at the same places.
    params, opt = W.make(getattr(torch, dtype))
    single = []
    gen = torch.Generator().manual_seed(2)
    for step in range(W.STEPS):
        _, grads = W.scaled_grads(W.SHAPES, getattr(torch, dtype), float(opt.loss_scale), gen, 1e-2)
        for at, _, flat, value in W.injections(world):
            if at == step:
                t, i = W.flat_position(flat)
                grads[t].view(-1)[i] = value
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        single.append(opt.last_report())

    skipped = {at for at, _, _, _ in W.injections(world)}
    for rank, r in enumerate(results):
        # Every rank: bitwise the same reports (held_elements counts the rank's own elements).
        assert [without(x, "held_elements") for x in r["reports"]] == \
            [without(x, "held_elements") for x in results[0]["reports"]], rank
        assert r["scaler"] == results[0]["scaler"]
        assert [x["outcome"] != "applied" for x in r["reports"]] == [k in skipped for k in range(W.STEPS)]
        for (at, holder, flat, _) in W.injections(world):
            rep = r["reports"][at]
            assert rep["first_nonfinite_rank"] == holder and rep["nonfinite_count"] == 1
            assert rep["first_nonfinite_tensor"] == W.flat_position(flat)[0]
        # The global norm is exact: the same bits as on one process, whatever the split; so are
        # the new weights.
        assert [x["grad_norm"] for x in r["reports"] if x["outcome"] == "applied"] == \
            [x["grad_norm"] for x in single if x["outcome"] == "applied"]
        assert all(torch.equal(a, b.detach()) for a, b in zip(r["params"], params)), rank
        assert r["applied"] == int(opt.applied_steps) == W.STEPS - len(skipped)
    assert [without(x, "first_nonfinite_rank", "held_elements") for x in results[0]["reports"]] == \
        [without(x, "first_nonfinite_rank", "held_elements") for x in single]


@pytest.mark.parametrize("shard", [True, False], ids=["zero1", "replicated"])
def test_ranks_that_build_different_optimizers_are_all_refused(shard, tmp_path):
    results = launch(3, shard, "float16", tmp_path, mode="mismatch")
    for rank, r in enumerate(results):
        assert "the ranks built different optimizers" in r.get("refused", ""), rank


@pytest.mark.parametrize("shard", [True, False], ids=["zero1", "replicated"])
def test_a_state_dict_refused_on_one_rank_is_loaded_by_none(shard, tmp_path):
    results = launch(2, shard, "bfloat16", tmp_path, mode="badload")
    assert "holds inf or NaN" in results[0]["refused"]
    assert "another rank of the process group refused" in results[1]["refused"]
    # Rank 1 kept its own state (the one it had, which its state_dict also holds) ...
    for i, entry in results[1]["state_after"].items():
        expected = results[1]["expected"][i]
        assert all(torch.equal(v, expected[k]) if isinstance(v, torch.Tensor) else v == expected[k]
                   for k, v in entry.items())
    # ... and both ranks train on together, in step.
    assert [without(x, "held_elements") for x in results[0]["reports"]] == \
        [without(x, "held_elements") for x in results[1]["reports"]]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


def test_an_argument_one_rank_refuses_is_refused_on_every_rank(tmp_path):
    results = launch(3, True, "float16", tmp_path, mode="badarg")
    assert "max_grad_norm" in results[1]["refused"]
    for rank in (0, 2):
        assert "another rank refused its arguments" in results[rank]["refused"], rank


def test_state_dicts_of_different_steps_are_refused_on_every_rank(tmp_path):
    results = launch(2, False, "float16", tmp_path, mode="mixedsteps")
    for rank, r in enumerate(results):
        assert "not saved at the same step" in r["refused"], rank
        assert r["unchanged"], rank


@pytest.mark.parametrize("shard", [True, False], ids=["zero1", "replicated"])
def test_a_learning_rate_changed_on_one_rank_skips_that_step_on_every_rank(shard, tmp_path):
    results = launch(2, shard, "float16", tmp_path, mode="lronerank")
    for r in results:
        # From step 5 on the ranks' rates differ: every rank skips, naming why, every step.
        assert [(x["outcome"], x["reason"]) for x in r["reports"][5:]] == \
            [("skipped_inconsistent", "hyperparameters_differ")] * (W.STEPS - 5)
        assert [without(x, "held_elements") for x in r["reports"]] == \
            [without(x, "held_elements") for x in results[0]["reports"]]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"])), \
        "the replicas stay the same"


@pytest.mark.parametrize("shard", [True, False], ids=["zero1", "replicated"])
def test_a_rank_that_refuses_its_step_does_not_leave_the_others_waiting(shard, tmp_path):
    # Rank 1's step() refuses a gradient of the wrong shape at step 4. It takes part in the step
    # without its gradients, then raises; every rank skips that step (rank_refused), and the run
    # goes on as one process's run without that step (launch() fails on a hung rank).
    results = launch(3, shard, "float16", tmp_path, mode="refuse")
    assert len(results[1]["refusals"]) == 1 and results[1]["refusals"][0][0] == 4
    assert "halfstep reads gradients of the parameter's dtype, shape and device" in results[1]["refusals"][0][1]
    assert results[0]["refusals"] == results[2]["refusals"] == []
    for r in results:
        assert (r["reports"][4]["outcome"], r["reports"][4]["reason"]) == ("skipped_inconsistent", "rank_refused")
        assert [without(x, "held_elements") for x in r["reports"]] == \
            [without(x, "held_elements") for x in results[0]["reports"]]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))
    params, opt = W.make(torch.float16)
    gen = torch.Generator().manual_seed(2)
    single = []
    for step in range(W.STEPS):
        _, grads = W.scaled_grads(W.SHAPES, torch.float16, float(opt.loss_scale), gen, 1e-2)
        for at, _, flat, value in W.injections(3):
            if at == step:
                t, i = W.flat_position(flat)
                grads[t].view(-1)[i] = value
        if step == 4:
            continue  # the refused step: nothing of it is applied anywhere
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        single.append(opt.last_report())
    mine = [x for k, x in enumerate(results[0]["reports"]) if k != 4]
    assert [without(x, "attempt", "held_elements", "first_nonfinite_rank") for x in mine] == \
        [without(x, "attempt", "held_elements", "first_nonfinite_rank") for x in single]
    assert all(torch.equal(a, b.detach()) for a, b in zip(results[0]["params"], params))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shard", [True, False], ids=["zero1", "replicated"])
def test_a_state_dict_after_the_broadcast_resumes_the_broadcast_weights(world, shard, tmp_path):
    results = launch(world, shard, "bfloat16", tmp_path, mode="resume")
    for rank, r in enumerate(results):
        assert all(torch.equal(a, b) for a, b in zip(r["loaded"], results[0]["broadcast"])), rank
        assert all(torch.equal(a, b) for a, b in zip(r["resumed_params"], r["params"])), rank
        assert [without(x) for x in r["resumed_reports"]] == [without(x) for x in r["reports"]], rank
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"])), rank
