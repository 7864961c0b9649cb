"""The resume matrix (resume_worker.py): {optimizer only, scaler only, both in either order, scaler
created after the load} x {halfstep's GradScaler, torch.amp.GradScaler, none} x {one process, two
with ZeRO-1, two with FSDP2}. Each resumed run is bitwise the run it must equal — the uninterrupted
one, or for a partial restore the uninterrupted one in which the object not restored was replaced
at the checkpoint by a new one — or refused with a message that says what to do."""

import pytest

torch = pytest.importorskip("torch")

import resume_worker as W  # noqa: E402
from helpers import run_workers, without  # noqa: E402

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2: PyTorch >= 2.6)
    HAS_FSDP2 = True
except Exception:  # noqa: BLE001 (ImportError; PyTorch 1.13's fsdp package fails on Python 3.11 itself)
    HAS_FSDP2 = False


def same_run(got, want):
    reports, weights = want
    return [without(r, "held_elements") for r in got["reports"]] == [without(r, "held_elements") for r in reports] \
        and all(torch.equal(a, b) for a, b in zip(got["weights"], weights))


def check(results):
    assert len(results) == len(W.SCALERS) * len(W.ORDERS) - (len(W.ORDERS) - 1)
    for (kind, order), cell in results.items():
        where = "%s GradScaler, %s" % (kind, order)
        if cell["expected"].startswith("refused"):
            assert "refused" in cell["got"], where
            assert "Load the GradScaler's state_dict too, or attach it" in cell["got"]["refused"], where
            assert same_run(cell["attached"], cell["want"]), where
        else:
            assert "refused" not in cell["got"], (where, cell["got"].get("refused"))
            assert same_run(cell["got"], cell["want"]), where


def test_resume_matrix_on_one_process():
    check(W.matrix("single"))


@pytest.mark.parametrize("topology", ["zero", pytest.param("fsdp", marks=pytest.mark.skipif(
    not HAS_FSDP2, reason="FSDP2 (torch.distributed.fsdp.fully_shard) needs PyTorch >= 2.6"))])
def test_resume_matrix_on_two_processes(topology, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    outs = [tmp_path / ("rank%d.pt" % r) for r in range(2)]
    run_workers("resume_worker.py", [[r, 2, topology, tmp_path / "init", outs[r]] for r in range(2)], timeout=300)
    results = [torch.load(o, weights_only=False) if int(torch.__version__.split(".")[0]) >= 2 else torch.load(o)
               for o in outs]
    for r in results:
        check(r)
    for key, cell in results[0].items():  # the ranks hold one run
        other = results[1][key]
        if "reports" in cell["got"]:
            assert same_run(other["got"], (cell["got"]["reports"], cell["got"]["weights"])), key
