"""FusedAdamW where PyTorch users scale out: FSDP2 (fully_shard, DTensor parameters; 1, 2 and 3
processes, and HSDP on a 2-D mesh) and DistributedDataParallel (2 processes), on gloo (CPU).

With the same batch on every rank, the reduced gradient is one process's: (g + g) / 2 is exact, and
so, measured here, is FSDP2's mean of three equal gradients (the test checks the reduced gradients
themselves, so a reduction that were not exact would show as such). Wherever it is exact the
ranks' reports and weights are one process's, bit for bit; the exact global norm makes the reports
independent of how the parameters are cut."""

import math

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import fsdp_worker as W  # noqa: E402
from helpers import run_workers, without  # noqa: E402

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401 (PyTorch >= 2.6)
    HAS_FSDP2 = True
except Exception:  # noqa: BLE001 (ImportError; Debian's 1.13 on Python 3.11 fails inside the package)
    HAS_FSDP2 = False
needs_fsdp2 = pytest.mark.skipif(not HAS_FSDP2, reason="FSDP2 (torch.distributed.fsdp.fully_shard) needs PyTorch >= 2.6")


def launch(world, mode, work, *args):
    init = work / ("init-%s-%d" % (mode, world))
    outs = [work / ("%s-%d-of-%d.pt" % (mode, rank, world)) for rank in range(world)]
    run_workers("fsdp_worker.py", [[rank, world, init, outs[rank], mode] + list(args) for rank in range(world)],
                timeout=300)
    return [torch.load(o, weights_only=False) for o in outs]


def same_reports(a, b):
    # held_elements is each rank's own count; the first inf's rank is checked on its own.
    return [without(x, "held_elements", "first_nonfinite_rank") for x in a] == \
        [without(x, "held_elements", "first_nonfinite_rank") for x in b]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """FSDP2 on 1, 2 and 3 processes; each saves its final state with torch.distributed.checkpoint,
    and the 2- and 3-process runs load the 1- and 2-process checkpoints."""
    if not HAS_FSDP2:
        pytest.skip("FSDP2 needs PyTorch >= 2.6")
    work = tmp_path_factory.mktemp("fsdp")
    runs = {1: launch(1, "fsdp", work, work / "ck1")}
    runs[2] = launch(2, "fsdp", work, work / "ck2", work / "ck1")
    runs[3] = launch(3, "fsdp", work, work / "ck3", work / "ck2")
    return runs


@pytest.fixture(scope="module")
def offload_runs(tmp_path_factory):
    """FSDP2 with CPUOffloadPolicy on 1 and 2 processes."""
    if not HAS_FSDP2:
        pytest.skip("FSDP2 needs PyTorch >= 2.6")
    work = tmp_path_factory.mktemp("offload")
    return {world: launch(world, "offload", work) for world in (1, 2)}


@needs_fsdp2
def test_fsdp2_cpu_offload_steps_bitwise_like_one_process_on_any_threads(offload_runs):
    """The optimizer step of CPU-offloaded training runs on the host backend: 2 ranks on 1 or 2
    threads each give one process's reports and weights, bit for bit."""
    one = offload_runs[1][0]
    for threads in (1, 2):
        assert same_reports(one[("reports", threads)], one[("reports", 1)])
        assert all(torch.equal(a, b) for a, b in zip(one[("params", threads)], one[("params", 1)]))
        for rank, r in enumerate(offload_runs[2]):
            for step, (mine, single) in enumerate(zip(r[("grads", threads)], one[("grads", 1)])):
                assert all(torch.equal(a, b) for a, b in zip(mine, single)), (rank, step)
            assert same_reports(r[("reports", threads)], one[("reports", 1)]), (rank, threads)
            assert all(torch.equal(a, b) for a, b in zip(r[("params", threads)], one[("params", 1)])), (rank, threads)
    assert one[("reports", 1)][W.INF_STEP]["outcome"] == "skipped_overflow"
    assert one[("reports", 1)][0]["outcome"] == "applied"


@needs_fsdp2
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_steps_bitwise_like_one_process(fsdp_runs, world):
    one = fsdp_runs[1][0]
    for rank, r in enumerate(fsdp_runs[world]):
        # The reduced gradients are one process's (the reduction was exact) ...
        for step, (mine, single) in enumerate(zip(r["grads"], one["grads"])):
            assert all(torch.equal(a, b) for a, b in zip(mine, single)), (rank, step)
        # ... so the reports and the weights are too, bit for bit.
        assert same_reports(r["reports"], one["reports"]), rank
        assert all(torch.equal(a, b) for a, b in zip(r["params"], one["params"])), rank


@needs_fsdp2
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_an_inf_in_one_ranks_shard_skips_every_rank_naming_it(fsdp_runs, world):
    for r in fsdp_runs[world]:
        rep = r["reports"][W.INF_STEP]
        assert (rep["outcome"], rep["reason"]) == ("skipped_overflow", "nonfinite_gradient")
        assert rep["first_nonfinite_rank"] == world - 1 and rep["first_nonfinite_tensor"] == W.INF_PARAM
        assert rep["nonfinite_count"] == 1
        assert [x["outcome"] for x in r["reports"]].count("applied") == W.EXACT_STEPS - 1


@needs_fsdp2
@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_global_norm_of_different_batches_is_the_float64_norm(fsdp_runs, world):
    # Each rank its own batch: the reported norm (the exact Σg², rounded once) against float64
    # torch.linalg.vector_norm of the full reduced gradient, whose own error is below n·2^-53
    # relative (n = 1,133 elements): 2^-40 bounds both.
    for r in fsdp_runs[world]:
        assert r["norms"] == fsdp_runs[world][0]["norms"]
        for ours, float64 in r["norms"]:
            assert math.isfinite(ours) and abs(ours - float64) <= 2.0 ** -40 * float64, (ours, float64)


@needs_fsdp2
@pytest.mark.parametrize("saved,loaded", [(1, 2), (2, 3)])
def test_fsdp2_checkpoint_saved_on_n_ranks_loads_on_m(fsdp_runs, saved, loaded):
    # torch.distributed.checkpoint saves the optimizer's DTensor state sharded; loaded into a new
    # model and optimizer on another number of ranks, the full masters, moments, weights and the
    # scaler state are the saved ones, bit for bit, and training goes on.
    before = fsdp_runs[saved][0]
    for r in fsdp_runs[loaded]:
        assert r["loaded_scaler"] == before["saved_scaler"]
        for i, entry in before["saved"].items():
            assert all(torch.equal(r["loaded"][i][k], entry[k]) for k in entry), i
        assert all(torch.equal(a, b) for a, b in zip(r["loaded_params"], before["saved_params"]))
        assert r["loaded_next"]["outcome"] == "applied"
        assert r["loaded_next"]["step"] == before["saved_scaler"]["step"] + 1


@needs_fsdp2
def test_hsdp_counts_a_replicated_dimension_once(fsdp_runs):
    # A 2-D mesh, (Replicate(), Shard(0)): both ranks hold every element; each counts in the
    # norm on one rank only, so the reports are one process's.
    one = fsdp_runs[1][0]
    for r in fsdp_runs[2]:
        assert r["hsdp_placements"] == "(Replicate(), Shard(dim=0))"
        assert same_reports(r["hsdp_reports"], one["reports"])
        assert r["hsdp_reports"][W.INF_STEP]["first_nonfinite_rank"] == 1
        assert all(torch.equal(a, b) for a, b in zip(r["hsdp_params"], one["params"]))


@needs_fsdp2
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp2_parameters_swapped_after_construction_are_followed(fsdp_runs, world):
    # The optimizer was built over the plain model, whose parameters accelerate-style code then
    # replaced in param_groups by their fully_shard-ed DTensors before the first step.
    for r in fsdp_runs[world]:
        assert same_reports(r["swapped_reports"], r["reports"])


@needs_fsdp2
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scaler", ["halfstep", "sharded"])
def test_fsdp2_fp16_with_a_grad_scaler_steps_like_one_process(fsdp_runs, world, scaler):
    # fp16 compute, the loss scaled by halfstep's GradScaler or torch's ShardedGradScaler (which
    # all-reduces its own inf check and hands the fused step its scale): the same decisions,
    # norms and scale sequence as one process, and as each other.
    one = fsdp_runs[1][0]["fp16_" + scaler]
    for r in fsdp_runs[world]:
        mine = r["fp16_" + scaler]
        assert same_reports([x for x, _ in mine], [x for x, _ in one])
        assert [s for _, s in mine] == [s for _, s in one]
        assert [s for _, s in mine] == [s for _, s in r["fp16_halfstep"]]
        assert [x["outcome"] for x, _ in mine][W.INF_STEP] == "skipped_overflow"


@needs_fsdp2
def test_fsdp2_what_the_optimizer_refuses(fsdp_runs):
    refused = fsdp_runs[2][0]["refused"]
    assert "a plain tensor and parameter 0 a DTensor" in refused["mixed"]
    assert "shard=True: DTensor parameters are sharded already" in refused["shard"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return launch(2, "ddp", tmp_path_factory.mktemp("ddp"))


@pytest.mark.parametrize("bucket_view", [False, True], ids=["grads", "bucket_views"])
@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "zero1"])
def test_ddp_steps_bitwise_like_one_process(ddp_runs, bucket_view, shard):
    # One process, the same model, batches and autocast, no DDP: DDP's mean of two equal
    # gradients is exact, so every rank's reports and weights are this, bit for bit.
    model = W.model_of(3)
    opt = W.optimizer(model.parameters())
    single = []
    for step in range(W.EXACT_STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = W.loss_of(model, *W.batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        single.append(opt.last_report())
    for r in ddp_runs:
        reports, params = r["ddp"][(bucket_view, shard)]
        assert same_reports(reports, single)
        assert all(torch.equal(a, b.detach()) for a, b in zip(params, model.parameters()))
