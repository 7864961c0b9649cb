"""Helpers of the PyTorch tests of the halfstep package.

The tests run against the package in python/ with the library named by HALFSTEP_LIBRARY (CTest
sets both), or against an installed package (pip install .)."""

import math
import os
import subprocess
import sys
import tempfile
import time

import torch

U = 2.0 ** -24  # fp32's unit roundoff


def run_workers(script, argvs, timeout):
    """Runs one process of the worker script per argument list (one per rank) and waits for all;
    fails the test if one exits with an error (the others are stopped at once: they would wait for
    it at their next collective) or if they are not all done within `timeout` seconds, showing
    every rank's output."""
    here = os.path.dirname(os.path.abspath(__file__))
    logs = [tempfile.TemporaryFile(mode="w+") for _ in argvs]  # files, not pipes: nothing blocks on a full pipe
    procs = [subprocess.Popen([sys.executable, os.path.join(here, script)] + [str(a) for a in argv],
                              stdout=log, stderr=subprocess.STDOUT, text=True) for argv, log in zip(argvs, logs)]
    deadline = time.monotonic() + timeout

    def first_failed():
        return next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)

    while first_failed() is None and any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    running = any(p.poll() is None for p in procs)
    failed = first_failed()  # after `running` (a rank that ends between them is seen), before any is killed
    hung = failed is None and running
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    shown = "\n".join("--- rank %d (exit status %s):\n%s" % (r, p.returncode, t)
                       for r, (p, t) in enumerate(zip(procs, texts)))
    assert not hung, "a rank hung (not all were done within %d s):\n%s" % (timeout, shown)
    assert failed is None, "rank %d of %d failed:\n%s" % (failed, len(procs), shown)


def halfstep_entry(state_dict):
    """The optimizer's own state in a FusedAdamW state_dict: param_groups[0]['halfstep']."""
    return state_dict["param_groups"][0]["halfstep"]


def with_halfstep_entry(state_dict, **changes):
    """A copy of a FusedAdamW state_dict whose halfstep entry has `changes`."""
    groups = [dict(g) for g in state_dict["param_groups"]]
    groups[0]["halfstep"] = dict(groups[0]["halfstep"], **changes)
    return dict(state_dict, param_groups=groups)


def without(report, *keys):
    """A report without the named keys, NaN written as "nan" so that reports compare with ==."""
    return {k: ("nan" if v != v else v) for k, v in report.items() if k not in keys}


def leave_process_group():
    """Ends a worker process of the distributed tests, its results already written.

    PyTorch 2.15's gloo can abort a process at exit ("terminate called without an active
    exception", SIGABRT) after the script's last line: a gloo worker thread that drops the last
    reference to a finished collective's tensors needs the GIL to free their Python objects, and
    a thread that asks for the GIL while the interpreter finalizes is ended by pthread_exit, whose
    unwinding through the work's noexcept destructor calls std::terminate. Seen in about 2% of
    two-process exits on a loaded 2-core machine (core dumps: ~AsyncAllgatherWork in
    ProcessGroupGloo::runLoop during Py_FinalizeEx), with or without destroy_process_group. The
    workers leave without finalizing the interpreter, so the exit status is the tests' own.

    The barrier first: a rank whose work needs no collective (a constructor refused on every
    rank) could otherwise close its sockets while another rank's gloo was still connecting its
    full mesh, and that rank's init_process_group failed ("Connection closed by peer")."""
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fresh_params(shapes, dtype, seed, device="cpu", scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype).to(device))
            for s in shapes]


def scaled_grads(shapes, dtype, scale, gen, magnitude):
    """True (unscaled) gradients in float64 and the fp16/bf16 gradients a scaled backward pass
    would give: round(g * S)."""
    true = [torch.randn(s, generator=gen, dtype=torch.float64) * magnitude for s in shapes]
    return true, [(t * scale).to(dtype) for t in true]


def unscaled_clipped(grads16, scale, max_norm):
    """torch's unscale and clip_grad_norm_ in float64: g / S, times min(1, max_norm / (|g| + 1e-6))."""
    g = [x.double() / scale for x in grads16]
    norm = math.sqrt(sum(float((x * x).sum()) for x in g))
    coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0
    return [x * coef for x in g], norm


def first_nonfinite(tensors):
    for i, t in enumerate(tensors):
        if not bool(torch.isfinite(t).all()):
            return i
    return -1


def gradscaler_rule(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """torch.amp.GradScaler's update (torch._amp_update_scale_, its CUDA kernel restated; PyTorch
    1.13's CPU build lacks the op): back off on an overflow, grow after growth_interval clean
    steps in a row, keep the old scale if the grown one is not finite."""
    if found_inf:
        return scale * backoff_factor, 0
    tracker += 1
    if tracker == growth_interval:
        grown = scale * growth_factor
        return (grown if math.isfinite(grown) else scale), 0
    return scale, tracker
