"""The package without PyTorch: import, version, options, the raw C API wrapper."""

import ctypes
import os
import pathlib
import re
import subprocess
import sys

import pytest

import halfstep

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_needs_no_torch():
    # A Python where `import torch` fails: the package imports, halfstep.torch says why it cannot.
    code = ("import sys\nsys.modules['torch'] = None\nimport halfstep\nprint(halfstep.__version__)\n"
            "try:\n    import halfstep.torch\nexcept ImportError as e:\n    print('no torch:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == halfstep.version()
    assert lines[1].startswith("no torch:")


def test_the_library_loads_nccl_exactly_when_it_was_built_with_it():
    # The package's own build (pip install) has no NCCL: PyTorch brings its own, and a second one
    # loaded first breaks it ("undefined symbol: ncclCommResume" on PyTorch 2.x).
    code = "import halfstep\nprint(halfstep.has_nccl(), 'libnccl' in open('/proc/self/maps').read())\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    built_with, loaded = out.stdout.split()
    assert built_with == loaded


def test_version_is_the_librarys_and_the_projects():
    header = (ROOT / "include/halfstep/config.hpp").read_text()
    parts = [re.search(r"#define HALFSTEP_VERSION_%s (\d+)" % k, header).group(1) for k in ("MAJOR", "MINOR", "PATCH")]
    assert halfstep.version() == ".".join(parts) == halfstep.__version__
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == halfstep.version()


def test_config_takes_the_librarys_option_names():
    c = halfstep.config(scaler={"init_scale": 256.0, "growth_interval": 10, "hysteresis": 3},
                        spike={"enabled": True, "action": "skip", "warmup_steps": 5})
    assert (c.init_scale, c.growth_interval, c.hysteresis) == (256.0, 10, 3)
    assert (c.spike_enabled, c.spike_skip, c.spike_warmup_steps) == (1, 1, 5)

    class Opts:
        growth_factor = 4.0
    assert halfstep.config(scaler=Opts()).growth_factor == 4.0
    with pytest.raises(ValueError, match="unknown scaler option growth_intervall"):
        halfstep.config(scaler={"growth_intervall": 10})
    with pytest.raises(ValueError, match="spike action must be 'log' or 'skip'"):
        halfstep.config(spike={"action": "drop"})
    assert halfstep.config("bfloat16").model_dtype == halfstep.config(halfstep.BF16).model_dtype == halfstep.BF16
    with pytest.raises(ValueError, match="dtype must be 'float16', 'bfloat16' or 'float32', got 'int8'"):
        halfstep.config("int8")
    with pytest.raises(ValueError, match="backend must be 'cuda', 'host' or 'reference'"):
        halfstep.config(backend="cpu")
    bad = [(dict(scaler={"growth_interval": 2.9}), "growth_interval must be an integer, got 2.9"),
           (dict(scaler={"growth_interval": "7"}), "growth_interval must be an integer"),
           (dict(scaler={"growth_interval": float("inf")}), "growth_interval must be an integer"),
           (dict(scaler={"hysteresis": 2 ** 31}), "hysteresis = 2147483648 does not fit"),
           (dict(scaler={"init_scale": "1024"}), "init_scale must be a number"),
           (dict(max_grad_norm=1e-50), "max_grad_norm = 1e-50 rounds to 0 in fp32"),
           (dict(spike={"enabled": "False"}), "enabled must be True or False")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            halfstep.config(**kwargs)
    assert halfstep.config(scaler={"growth_interval": 2000.0, "headroom_growth": True}).growth_interval == 2000
    with pytest.raises(ValueError, match="beta2 = 0.99999999 rounds to 1 in fp32"):
        halfstep.group(beta2=0.99999999)


def _f16_buffer(values):
    import struct
    return (ctypes.c_uint16 * len(values))(*[struct.unpack("<H", struct.pack("<e", v))[0] for v in values])


def test_raw_optimizer_steps_and_names_the_bad_tensor():
    n = 4
    bufs = []
    tensors = []
    for t in range(2):
        master = (ctypes.c_float * n)(*[0.5] * n)
        grad = _f16_buffer([0.25 * 1024] * n)  # g = 0.25 at S = 1024
        m, v = (ctypes.c_float * n)(), (ctypes.c_float * n)()
        bufs += [master, grad, m, v]
        tensors.append(dict(master=ctypes.addressof(master), grad=ctypes.addressof(grad), exp_avg=ctypes.addressof(m),
                            exp_avg_sq=ctypes.addressof(v), model=0, numel=n, group=0))
    cfg = halfstep.config("float16", "reference", scaler={"init_scale": 1024.0})
    assert (cfg.grad_dtype, cfg.backend) == (halfstep.F16, halfstep.BACKEND_REFERENCE)
    opt = halfstep.Optimizer(tensors, [halfstep.group(lr=0.1)], cfg)
    opt.step()
    r = opt.last_report()
    assert r["outcome"] == "applied" and r["scale_used"] == 1024.0 and r["step"] == 1
    assert r["grad_norm"] == 0.25 * (2 * n) ** 0.5
    # Adam's first step moves every weight by lr (sign of g): 0.5 - 0.1.
    assert abs(bufs[0][0] - 0.4) < 1e-6
    bufs[5][3] = 0x7C00  # +inf in tensor 1
    opt.step()
    r = opt.last_report()
    assert r["outcome"] == "skipped_overflow" and r["first_nonfinite_tensor"] == 1 and r["nonfinite_count"] == 1
    assert opt.nonfinite_counts() == [0, 1]
    assert opt.loss_scale() == 512.0 and opt.state()["step"] == 1 and opt.state()["attempts"] == 2
    saved = opt.save_state()
    opt.load_state(saved)
    with pytest.raises(halfstep.HalfstepError) as e:
        opt.load_state(saved[:-1])
    assert e.value.status == 2
    with pytest.raises(halfstep.HalfstepError, match="group"):
        halfstep.Optimizer([dict(tensors[0], group=3)], [halfstep.group()], cfg)
    opt.close()
    with pytest.raises(halfstep.HalfstepError, match="closed"):
        opt.step()


def test_raw_optimizer_holds_block8_moments_and_pieces_cut_at_blocks_step_as_the_whole():
    cfg = halfstep.config("float16", "reference", scaler={"init_scale": 1024.0}, exp_avg="block8", exp_avg_sq="block8")
    assert (cfg.exp_avg_format, cfg.exp_avg_sq_format) == (halfstep.MOMENT_BLOCK8, halfstep.MOMENT_BLOCK8)
    assert halfstep.moment_blocks(cfg, 5000) == dict(quantized=True, blocks=20, first=0)
    assert halfstep.moment_blocks(cfg, 256, whole_numel=42000, row=300, offset=15000) == dict(quantized=True, blocks=1,
                                                                                              first=100)
    assert halfstep.moment_blocks(cfg, 4095)["quantized"] is False  # small tensors keep fp32 moments
    assert halfstep.moment_blocks(halfstep.config("float16", "reference"), 5000)["quantized"] is False
    assert halfstep.state_bytes(cfg)["state"] == 4 + 2  # a code a moment; the scales are apart
    n, cut = 6000, 2560  # one row; a block starts at 2560 = 10 * 256
    grads = [((i * 7919) % 1000 - 500) * 1e-4 * 1024 for i in range(n)]

    def run(pieces):
        """Steps the tensor as `pieces` ((offset, numel) each) three times; its masters, codes and scales."""
        keep, tensors = [], []
        for offset, numel in pieces:
            blocks = halfstep.moment_blocks(cfg, numel, whole_numel=n, offset=offset)["blocks"]
            master = (ctypes.c_float * numel)(*[0.5 - 1e-4 * (offset + i) for i in range(numel)])
            grad = _f16_buffer(grads[offset:offset + numel])
            m, v = (ctypes.c_uint8 * numel)(), (ctypes.c_uint8 * numel)()
            ms, vs = (ctypes.c_float * blocks)(), (ctypes.c_float * blocks)()
            keep.append((master, grad, m, v, ms, vs))
            tensors.append(dict(master=ctypes.addressof(master), grad=ctypes.addressof(grad), exp_avg=ctypes.addressof(m),
                                exp_avg_sq=ctypes.addressof(v), model=0, numel=numel, group=0, tensor_id=1,
                                offset=offset, whole_numel=n, exp_avg_scale=ctypes.addressof(ms),
                                exp_avg_sq_scale=ctypes.addressof(vs)))
        opt = halfstep.Optimizer(tensors, [halfstep.group(lr=0.01)], cfg)
        for _ in range(3):
            opt.step()
            assert opt.last_report()["outcome"] == "applied"
        opt.close()
        return [b"".join(bytes(k[j]) for k in keep) for j in (0, 2, 3, 4, 5)]

    whole = run([(0, n)])
    assert run([(0, cut), (cut, n - cut)]) == whole
    assert whole[3] != bytes(len(whole[3]))  # the steps wrote the scales
    with pytest.raises(halfstep.HalfstepError, match="block"):
        run([(0, cut - 60), (cut - 60, n - cut + 60)])  # a cut inside a block
