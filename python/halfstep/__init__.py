"""halfstep: the optimizer end of mixed-precision training — an inf/NaN check that skips the whole
step, the global norm, unscale, clip, AdamW on fp32 masters and the fp16/bf16 model copy, in two
fused passes, with a dynamic loss scaler on the device.

This package wraps libhalfstep's C API (ctypes, no PyTorch ABI): `Optimizer` takes raw buffer
addresses. `halfstep.torch.FusedAdamW` is the torch.optim optimizer built on it (needs PyTorch).
"""

import ctypes as _C
import math as _math

from . import _lib
from ._lib import (APPLIED, BACKEND_CUDA, BACKEND_HOST, BACKEND_REFERENCE, BF16, ERROR_INVALID_ARGUMENT, ERROR_USAGE, F16, F32,
                   MASTER_BF16_REMAINDER, MASTER_F32, MASTER_NONE, MOMENT_BF16, MOMENT_BLOCK8, MOMENT_F32,
                   ROUND_NEAREST,
                   ROUND_STOCHASTIC, SKIPPED_INCONSISTENT, SKIPPED_NONFINITE_UPDATE, SKIPPED_OVERFLOW, SKIPPED_SPIKE,
                   TOTALS_MAX_WORDS, TOTALS_SUM_WORDS, Config, Group, HalfstepError, MomentBlocks, Report, State,
                   StateBytes, Tensor,
                   check, lib, library_path)

__all__ = ["Optimizer", "HalfstepError", "version", "has_nccl", "config", "group", "report_dict", "state_bytes",
           "moment_blocks", "encode_moment", "decode_moment",
           "SCALER_OPTIONS", "SPIKE_OPTIONS", "F16", "BF16", "F32", "BACKEND_CUDA", "BACKEND_REFERENCE", "BACKEND_HOST",
           "TOTALS_SUM_WORDS", "TOTALS_MAX_WORDS"]


def version():
    """The library's version, "MAJOR.MINOR.PATCH"."""
    return lib.halfstep_version().decode()


__version__ = version()


def has_nccl():
    """Whether the library was built with NCCL. The package's own build (pip install) is not: it
    leaves NCCL to PyTorch and reduces the step's record through torch.distributed."""
    return bool(lib.halfstep_has_nccl())

# ScalerConfig and SpikeConfig fields by their library names (docs/design.md).
SCALER_OPTIONS = ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale",
                  "growth_interval", "hysteresis", "consecutive_hysteresis", "headroom_growth",
                  "headroom_margin_log2")
SPIKE_OPTIONS = ("enabled", "z_threshold", "ema_beta", "warmup_steps", "action", "max_consecutive",
                 "min_std")


_DTYPE_NAMES = {"float16": F16, "fp16": F16, "bfloat16": BF16, "bf16": BF16, "float32": F32, "fp32": F32, F16: F16,
                BF16: BF16, F32: F32}
_BACKEND_NAMES = {"cuda": BACKEND_CUDA, "reference": BACKEND_REFERENCE, "host": BACKEND_HOST, BACKEND_CUDA: BACKEND_CUDA,
                  BACKEND_REFERENCE: BACKEND_REFERENCE, BACKEND_HOST: BACKEND_HOST}
# The state formats (halfstep::StateFormat) by their library names.
MASTER_FORMATS = {"f32": MASTER_F32, "bf16_remainder": MASTER_BF16_REMAINDER, "none": MASTER_NONE}
MOMENT_FORMATS = {"f32": MOMENT_F32, "bf16": MOMENT_BF16, "block8": MOMENT_BLOCK8}
ROUNDINGS = {"nearest": ROUND_NEAREST, "stochastic": ROUND_STOCHASTIC}


def _named(value, names, what):
    if value not in names:
        raise ValueError("%s must be one of %s, got %r" % (what, ", ".join(repr(n) for n in names), value))
    return names[value]


def config(dtype="float16", backend="cuda", max_grad_norm=0.0, scaler=None, spike=None, host_driven=False,
           compute_dtype="float16", master="f32", exp_avg="f32", exp_avg_sq="f32", rounding="stochastic", seed=0):
    """A halfstep_config: the library's defaults, then `scaler` and `spike` options by name (a dict,
    or an object with those attributes). `dtype` is the gradients' format, "float16", "bfloat16" or
    "float32" (or F16, BF16, F32), and for 16-bit gradients the model copy's too (float32
    gradients come with float32 parameters, which are the masters: no model copy); `compute_dtype`
    is the format float32 gradients were computed in, which the headroom and subnormal count are
    measured against; `backend` is "cuda" (device pointers), "host" (host memory: the kernels' own
    arithmetic, vectorised, on Optimizer.set_threads threads, bit for bit the CUDA backend's) or
    "reference" (host memory, the CPU reference step in double) (or BACKEND_CUDA, BACKEND_HOST,
    BACKEND_REFERENCE). The state formats: `master` "f32",
    "bf16_remainder" (bfloat16 models: the model copy and an int16 remainder are the master) or
    "none" (bfloat16 models: the model copy is the weight, updated with `rounding`), `exp_avg` and
    `exp_avg_sq` "f32", "bf16" or (both) "block8" (8-bit codes and a scale per block of 256
    elements of a row: moment_blocks), `rounding` of bf16 moments (and weights without a master)
    "stochastic" or "nearest", and `seed`, the key of stochastic rounding's bits (an integer in [0, 2^64)).
    Unknown names raise ValueError."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError("dtype must be 'float16', 'bfloat16' or 'float32', got %r" % (dtype,))
    if compute_dtype not in _DTYPE_NAMES:
        raise ValueError("compute_dtype must be 'float16', 'bfloat16' or 'float32', got %r" % (compute_dtype,))
    if backend not in _BACKEND_NAMES:
        raise ValueError("backend must be 'cuda', 'host' or 'reference', got %r" % (backend,))
    c = Config()
    lib.halfstep_config_init(_C.byref(c))
    c.grad_dtype = _DTYPE_NAMES[dtype]
    c.model_dtype = c.grad_dtype if c.grad_dtype != F32 else F16  # (f32: no tensor has a model copy)
    c.compute_dtype = _DTYPE_NAMES[compute_dtype]
    c.backend = _BACKEND_NAMES[backend]
    c.max_grad_norm = _fp32(max_grad_norm, "max_grad_norm")
    c.host_driven = 1 if host_driven else 0
    c.master_format = _named(master, MASTER_FORMATS, "master")
    c.exp_avg_format = _named(exp_avg, MOMENT_FORMATS, "exp_avg")
    c.exp_avg_sq_format = _named(exp_avg_sq, MOMENT_FORMATS, "exp_avg_sq")
    c.rounding = _named(rounding, ROUNDINGS, "rounding")
    c.seed = _lib.seed(seed)
    for name, value in _options(scaler, SCALER_OPTIONS, "scaler").items():
        _set(c, name, value, "scaler")
    for name, value in _options(spike, SPIKE_OPTIONS, "spike").items():
        if name == "enabled":
            if value not in (True, False):  # (also 0 and 1)
                raise ValueError("spike option enabled must be True or False, got %r" % (value,))
            c.spike_enabled = 1 if value else 0
        elif name == "action":
            if value not in ("log", "skip"):
                raise ValueError("spike action must be 'log' or 'skip', got %r" % (value,))
            c.spike_skip = 1 if value == "skip" else 0
        else:
            _set(c, "spike_" + name, value, "spike", name)
    return c


def _set(c, field, value, what, name=None):
    """Sets a config field: an integer field takes an integral number the C API's int32 holds, a
    float field a real number that does not round to 0 in fp32 unless it is 0."""
    name = "%s option %s" % (what, name or field)
    setattr(c, field, _int32(value, name) if isinstance(getattr(c, field), int) else _fp32(value, name))


def _int32(value, name):
    if isinstance(value, float) and _math.isfinite(value) and value == int(value):
        value = int(value)
    if not isinstance(value, int):
        raise ValueError("%s must be an integer, got %r" % (name, value))
    if not -2 ** 31 <= value < 2 ** 31:
        raise ValueError("%s = %d does not fit the C API's int32" % (name, value))
    return int(value)


def _int64(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or not -2 ** 63 <= value < 2 ** 63:
        raise ValueError("%s must be an integer the C API's int64 holds, got %r" % (name, value))
    return int(value)


def _fp32(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("%s must be a number, got %r" % (name, value))
    value = float(value)
    if value != 0 and _C.c_float(value).value == 0:
        raise ValueError("%s = %r rounds to 0 in fp32, where the step computes" % (name, value))
    return value


def _options(given, names, what):
    if given is None:
        return {}
    if isinstance(given, dict):
        items = dict(given)
    else:
        items = {n: getattr(given, n) for n in names if hasattr(given, n)}
    unknown = sorted(set(items) - set(names))
    if unknown:
        raise ValueError("unknown %s option%s %s (known: %s)" % (what, "s" if len(unknown) > 1 else "",
                                                                 ", ".join(unknown), ", ".join(names)))
    return items


def group(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
          bias_correction=True, step_offset=0):
    """A halfstep_group (AdamWConfig); step_offset: applied steps taken before the group joined."""
    g = Group()
    lib.halfstep_group_init(_C.byref(g))
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if isinstance(value, (int, float)) and value < 1 and _C.c_float(float(value)).value >= 1:
            raise ValueError("%s = %r rounds to 1 in fp32, where the step computes" % (name, value))
    g.lr, g.beta1, g.beta2 = _fp32(lr, "lr"), _fp32(beta1, "beta1"), _fp32(beta2, "beta2")
    g.eps, g.weight_decay = _fp32(eps, "eps"), _fp32(weight_decay, "weight_decay")
    g.decoupled_weight_decay = 1 if decoupled_weight_decay else 0
    g.bias_correction = 1 if bias_correction else 0
    g.step_offset = _int64(step_offset, "step_offset")
    return g


def state_bytes(cfg, model_copy=True):
    """Bytes per parameter element of a step with `cfg` (a `config(...)`), for tensors with a model
    copy or without (float32 parameters that are the masters): a dict with state (masters and
    moments, held between steps), gradient, model and moved (read and written by one applied step)."""
    out = StateBytes()
    check(lib.halfstep_state_bytes_of(_C.byref(cfg), 1 if model_copy else 0, _C.byref(out)))
    return {name: getattr(out, name) for name, _ in StateBytes._fields_}


def moment_blocks(cfg, numel, whole_numel=0, row=0, offset=0):
    """How a tensor of `numel` elements (a piece at `offset` of a whole tensor of `whole_numel`, 0:
    numel, in rows of `row` elements, 0: one row) holds its moments under `cfg`: a dict with
    quantized (block8 codes and scales; False: fp32 moments, and every other format), blocks (the
    scales each moment's buffer holds) and first (the piece's first block in the whole tensor)."""
    t = _piece(numel, whole_numel, row, offset)
    out = MomentBlocks()
    check(lib.halfstep_moment_blocks_of(_C.byref(cfg), _C.byref(t), _C.byref(out)))
    return dict(quantized=bool(out.quantized), blocks=out.blocks, first=out.first)


def _piece(numel, whole_numel, row, offset):
    t = Tensor()
    lib.halfstep_tensor_init(_C.byref(t))
    t.numel = _int64(numel, "numel")
    t.whole_numel = _int64(whole_numel, "whole_numel")
    t.row = _int64(row, "row")
    t.offset = _int64(offset, "offset")
    return t


_MOMENTS = {"exp_avg": 0, "exp_avg_sq": 1}


def encode_moment(moment, values, codes, scales, numel, whole_numel=0, row=0, offset=0):
    """Host-memory moment values (the address of `numel` finite fp32 values; exp_avg_sq's >= 0) as
    the block8 codes (`codes`: numel bytes) and scales (`scales`: moment_blocks' blocks floats) of
    a tensor (a piece at `offset` of a whole tensor of `whole_numel` elements in rows of `row`,
    cut where blocks start), to nearest, as a checkpoint conversion stores them. `moment` is
    "exp_avg" or "exp_avg_sq". Nothing is written on error."""
    t = _piece(numel, whole_numel, row, offset)
    check(lib.halfstep_encode_moment(_C.byref(t), _named(moment, _MOMENTS, "moment"), values, codes, scales))


def decode_moment(moment, codes, scales, values, numel, whole_numel=0, row=0, offset=0):
    """The values host-memory block8 codes and scales hold (exp_avg_sq's squared), into `values`
    (numel floats); the piece may be cut anywhere, its scales those of the blocks its elements lie
    in, from its first element's."""
    t = _piece(numel, whole_numel, row, offset)
    check(lib.halfstep_decode_moment(_C.byref(t), _named(moment, _MOMENTS, "moment"), codes, scales, values))


def report_dict(r):
    """A Report as a dict, outcome and reason by name."""
    d = {name: getattr(r, name) for name, _ in Report._fields_}
    d["outcome"] = lib.halfstep_outcome_name(r.outcome).decode()
    d["reason"] = lib.halfstep_reason_name(r.reason).decode()
    d["spike"] = bool(r.spike)
    return d


class Optimizer:
    """halfstep's FusedAdamW over raw buffers. `tensors` is a list of dicts (or tuples) with the
    addresses master, grad, exp_avg, exp_avg_sq, model (may be 0), numel, group and optionally
    duplicate (another rank counts the tensor in the norm), tensor_id (stochastic rounding's id of
    the whole tensor, the same on every rank: 1 + its index in the model) and offset (the index of
    the buffer's first element in the whole tensor), and under block8 moments whole_numel, row and
    the scales' addresses exp_avg_scale and exp_avg_sq_scale (moment_blocks); `groups` a list of
    `group(...)`; `cfg` a
    `config(...)`. With `rank` (and NCCL communicators `comms`, ncclComm_t addresses) it is one rank
    of a multi-rank step."""

    def __init__(self, tensors, groups, cfg, rank=0, comms=()):
        arr = (Tensor * max(len(tensors), 1))()
        for i, t in enumerate(tensors):
            if not isinstance(t, dict):
                t = dict(zip(("master", "grad", "exp_avg", "exp_avg_sq", "model", "numel", "group"), t))
            arr[i] = Tensor(t["master"], t["grad"], t["exp_avg"], t["exp_avg_sq"], t.get("model") or 0,
                            int(t["numel"]), int(t.get("group", 0)), 1 if t.get("duplicate", False) else 0,
                            int(t.get("tensor_id", 0)), 0, int(t.get("offset", 0)), int(t.get("whole_numel", 0)),
                            int(t.get("row", 0)), t.get("exp_avg_scale") or 0, t.get("exp_avg_sq_scale") or 0)
        garr = (Group * max(len(groups), 1))(*groups)
        carr = (_C.c_void_p * max(len(comms), 1))(*comms)
        handle = _C.c_void_p()
        check(lib.halfstep_create_distributed(arr, len(tensors), garr, len(groups), _C.byref(cfg), int(rank),
                                              carr, len(comms), _C.byref(handle)))
        self._handle = handle
        self.n_tensors = len(tensors)
        self.n_groups = len(groups)

    def close(self):
        if getattr(self, "_handle", None):
            lib.halfstep_destroy(self._handle)
            self._handle = None

    def __del__(self):
        self.close()

    @property
    def handle(self):
        if not self._handle:
            raise HalfstepError(ERROR_USAGE, "this optimizer was closed")
        return self._handle

    def step(self, stream=0):
        check(lib.halfstep_step(self.handle, stream or None))

    def step_local(self, stream=0):
        check(lib.halfstep_step_local(self.handle, stream or None))

    def step_finish(self, stream=0):
        check(lib.halfstep_step_finish(self.handle, stream or None))

    def step_local_refused(self, stream=0):
        """step_local for a rank whose own inputs failed its checks: a record without elements that
        makes every rank's step (after the reduction and step_finish) skip as rank_refused."""
        check(lib.halfstep_step_local_refused(self.handle, stream or None))

    def totals_address(self):
        """Address of the totals record: TOTALS_SUM_WORDS words reduced with SUM, then
        TOTALS_MAX_WORDS with MAX (uint64)."""
        p = lib.halfstep_device_totals(self.handle)
        if not p:
            check(ERROR_USAGE)
        return _C.cast(p, _C.c_void_p).value

    def last_report(self):
        r = Report()
        check(lib.halfstep_last_report(self.handle, _C.byref(r)))
        return report_dict(r)

    def nonfinite_counts(self):
        out = (_C.c_int64 * max(self.n_tensors, 1))()
        check(lib.halfstep_nonfinite_counts(self.handle, out, self.n_tensors))
        return list(out)[:self.n_tensors]

    def set_threads(self, threads):
        """The host backend: the step runs on `threads` host threads (1 to 1024), with the same
        results on any number."""
        check(lib.halfstep_set_threads(self.handle, int(threads)))

    def threads(self):
        """The threads the step runs on (1 but for the host backend)."""
        out = _C.c_int32()
        check(lib.halfstep_threads(self.handle, _C.byref(out)))
        return out.value

    def set_lr(self, group, lr, stream=0):
        check(lib.halfstep_set_lr(self.handle, int(group), float(lr), stream or None))

    def set_group(self, group, g, stream=0):
        """Every hyperparameter of `group` (a `group(...)`) for the following steps, on `stream`."""
        check(lib.halfstep_set_group(self.handle, int(group), _C.byref(g), stream or None))

    def set_gradients(self, addresses, stream=0, key=0):
        """New gradient addresses, one per tensor (0: no gradient this step), on `stream`. `key`
        (an integer in [0, 2^64)) names which of the model's tensors have a gradient, the same on
        every rank that steps them alike: the ranks' records compare it (0: none given)."""
        arr = (_C.c_void_p * max(len(addresses), 1))(*[a or None for a in addresses])
        check(lib.halfstep_set_gradients(self.handle, arr, len(addresses), stream or None, int(key)))

    def mark_unscaled(self, stream=0):
        """The next step's gradients are already divided by the loss scale."""
        check(lib.halfstep_mark_unscaled(self.handle, stream or None))

    def use_external_scale(self, scale_address, found_inf_address, stream=0):
        """The next step's gradients were scaled by the fp32 at `scale_address` (0: already
        unscaled), a scale another scaler owns, whose own check found an inf/NaN where the fp32 at
        `found_inf_address` is nonzero (0: no check); read on `stream` (device memory; host memory
        for the reference backend)."""
        check(lib.halfstep_use_external_scale(self.handle, scale_address or None, found_inf_address or None,
                                              stream or None))

    def group(self, index):
        """Group `index`'s hyperparameters as the next step uses them, as a dict (waits)."""
        g = Group()
        check(lib.halfstep_get_group(self.handle, int(index), _C.byref(g)))
        return {name: getattr(g, name) for name, _ in Group._fields_}

    def set_loss_scale(self, scale, stream=0):
        check(lib.halfstep_set_loss_scale(self.handle, float(scale), stream or None))

    def set_state(self, state):
        """Replaces the optimizer's own state (a dict as `state()` returns it)."""
        s = State(**{name: state[name] for name, _ in State._fields_})
        check(lib.halfstep_set_state(self.handle, _C.byref(s)))

    def learning_rates(self):
        out = (_C.c_float * max(self.n_groups, 1))()
        check(lib.halfstep_learning_rates(self.handle, out, self.n_groups))
        return list(out)[:self.n_groups]

    def _address(self, fn, *args):
        p = fn(self.handle, *args)
        if not p:
            raise HalfstepError(ERROR_INVALID_ARGUMENT, lib.halfstep_last_error().decode())
        return _C.cast(p, _C.c_void_p).value

    def device_lr_address(self, group):
        """Address of the fp32 learning rate of `group` the next step reads."""
        return self._address(lib.halfstep_device_lr, int(group))

    def loss_scale_address(self):
        """Address of the fp32 loss scale the next backward pass uses."""
        return self._address(lib.halfstep_device_loss_scale)

    def step_count_address(self):
        """Address of the int64 applied-step counter."""
        return self._address(lib.halfstep_device_step_count)

    def loss_scale(self):
        out = _C.c_float()
        check(lib.halfstep_loss_scale(self.handle, _C.byref(out)))
        return out.value

    def state(self):
        s = State()
        check(lib.halfstep_get_state(self.handle, _C.byref(s)))
        return {name: getattr(s, name) for name, _ in State._fields_}

    def save_state(self):
        size = _C.c_size_t()
        check(lib.halfstep_save_state(self.handle, None, 0, _C.byref(size)))
        buf = _C.create_string_buffer(size.value)
        check(lib.halfstep_save_state(self.handle, buf, size.value, _C.byref(size)))
        return buf.raw[:size.value]

    def load_state(self, data):
        data = bytes(data)
        check(lib.halfstep_load_state(self.handle, data, len(data)))
