"""The C API of libhalfstep (include/halfstep/halfstep.h) through ctypes: the library, its
structs and its functions. Nothing here needs PyTorch."""

import ctypes as C
import os

# Status codes and enums of halfstep.h.
OK = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_CORRUPT_STATE = 2
ERROR_CUDA = 3
ERROR_USAGE = 4
ERROR_INTERNAL = 5

F16, BF16, F32 = 0, 1, 2
BACKEND_CUDA, BACKEND_REFERENCE, BACKEND_HOST = 0, 1, 2
APPLIED, SKIPPED_OVERFLOW, SKIPPED_SPIKE, SKIPPED_NONFINITE_UPDATE, SKIPPED_INCONSISTENT = 0, 1, 2, 3, 4
MASTER_F32, MASTER_BF16_REMAINDER, MASTER_NONE = 0, 1, 2
MOMENT_F32, MOMENT_BF16, MOMENT_BLOCK8 = 0, 1, 2
ROUND_NEAREST, ROUND_STOCHASTIC = 0, 1



def seed(x):
    """x as the seed of stochastic rounding's bits: an integer in [0, 2^64) (numpy's and torch's
    integer scalars too; not a bool). Raises ValueError naming the rule otherwise."""
    import operator
    try:
        index = None if isinstance(x, bool) else operator.index(x)
    except TypeError:
        index = None
    if index is None or not 0 <= index < 2 ** 64:
        raise ValueError("seed must be an integer in [0, 2^64), got %r" % (x,))
    return index


TOTALS_SUM_WORDS = 24
TOTALS_MAX_WORDS = 4

# The structs of halfstep.h, field for field; python/tests/test_abi.py checks them against the
# header and the C compiler's layout.


class Tensor(C.Structure):
    _fields_ = [("master", C.c_void_p), ("grad", C.c_void_p), ("exp_avg", C.c_void_p),
                ("exp_avg_sq", C.c_void_p), ("model", C.c_void_p), ("numel", C.c_int64),
                ("group", C.c_int32), ("duplicate", C.c_int32), ("tensor_id", C.c_uint32), ("pad_", C.c_int32),
                ("offset", C.c_int64), ("whole_numel", C.c_int64), ("row", C.c_int64),
                ("exp_avg_scale", C.c_void_p), ("exp_avg_sq_scale", C.c_void_p)]


class MomentBlocks(C.Structure):
    _fields_ = [("quantized", C.c_int32), ("pad_", C.c_int32), ("blocks", C.c_int64), ("first", C.c_int64)]


class Group(C.Structure):
    _fields_ = [("lr", C.c_float), ("beta1", C.c_float), ("beta2", C.c_float), ("eps", C.c_float),
                ("weight_decay", C.c_float), ("decoupled_weight_decay", C.c_int32),
                ("bias_correction", C.c_int32), ("step_offset", C.c_int64)]


class Config(C.Structure):
    _fields_ = [("grad_dtype", C.c_int32), ("model_dtype", C.c_int32), ("backend", C.c_int32),
                ("host_driven", C.c_int32), ("max_grad_norm", C.c_float),
                ("init_scale", C.c_float), ("growth_factor", C.c_float),
                ("backoff_factor", C.c_float), ("min_scale", C.c_float), ("max_scale", C.c_float),
                ("growth_interval", C.c_int32), ("hysteresis", C.c_int32),
                ("consecutive_hysteresis", C.c_int32), ("headroom_growth", C.c_int32),
                ("headroom_margin_log2", C.c_float), ("spike_enabled", C.c_int32),
                ("spike_skip", C.c_int32), ("spike_warmup_steps", C.c_int32),
                ("spike_max_consecutive", C.c_int32), ("spike_z_threshold", C.c_float),
                ("spike_ema_beta", C.c_float), ("spike_min_std", C.c_float),
                ("compute_dtype", C.c_int32), ("master_format", C.c_int32), ("exp_avg_format", C.c_int32),
                ("exp_avg_sq_format", C.c_int32), ("rounding", C.c_int32), ("seed", C.c_uint64)]


class StateBytes(C.Structure):
    _fields_ = [("state", C.c_uint64), ("gradient", C.c_uint64), ("model", C.c_uint64), ("moved", C.c_uint64)]


class Report(C.Structure):
    _fields_ = [("attempt", C.c_int64), ("step", C.c_int64), ("outcome", C.c_int32),
                ("spike", C.c_int32), ("scale_used", C.c_float), ("scale_next", C.c_float),
                ("grad_norm", C.c_double), ("clip_coef", C.c_float),
                ("nonfinite_count", C.c_int64), ("first_nonfinite_tensor", C.c_int32),
                ("max_abs_scaled", C.c_float), ("headroom_log2", C.c_float),
                ("subnormal_count", C.c_int64), ("zero_count", C.c_int64), ("numel", C.c_int64),
                ("reason", C.c_int32), ("held_elements", C.c_int64),
                ("first_nonfinite_rank", C.c_int32)]


class State(C.Structure):
    _fields_ = [("scale", C.c_float), ("good_steps", C.c_int32), ("hysteresis_left", C.c_int32),
                ("overflows", C.c_int64), ("growths", C.c_int64), ("backoffs", C.c_int64),
                ("spike_mean", C.c_double), ("spike_var", C.c_double), ("spike_seen", C.c_int64),
                ("spikes", C.c_int64), ("spike_consecutive", C.c_int64), ("step", C.c_int64),
                ("attempts", C.c_int64)]


def library_path():
    """Where libhalfstep is: $HALFSTEP_LIBRARY, else next to this package (pip install .)."""
    env = os.environ.get("HALFSTEP_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("libhalfstep.so", "libhalfstep.dylib", "halfstep.dll"):
        path = os.path.join(here, name)
        if os.path.exists(path):
            return path
    raise ImportError("libhalfstep is not next to the halfstep package (" + here + "): install the "
                      "package with 'pip install .' at the repository root, or point "
                      "HALFSTEP_LIBRARY at a built libhalfstep.so")


def _load(path):
    lib = C.CDLL(path)
    P = C.c_void_p
    sig = {
        "halfstep_version": (C.c_char_p, []),
        "halfstep_version_number": (C.c_int32, []),
        "halfstep_has_nccl": (C.c_int32, []),
        "halfstep_outcome_name": (C.c_char_p, [C.c_int32]),
        "halfstep_reason_name": (C.c_char_p, [C.c_int32]),
        "halfstep_config_init": (None, [C.POINTER(Config)]),
        "halfstep_group_init": (None, [C.POINTER(Group)]),
        "halfstep_create_distributed": (C.c_int, [C.POINTER(Tensor), C.c_int64, C.POINTER(Group), C.c_int32,
                                                  C.POINTER(Config), C.c_int32, C.POINTER(C.c_void_p), C.c_int32,
                                                  C.POINTER(P)]),
        "halfstep_destroy": (None, [P]),
        "halfstep_step": (C.c_int, [P, P]),
        "halfstep_step_local": (C.c_int, [P, P]),
        "halfstep_step_finish": (C.c_int, [P, P]),
        "halfstep_step_local_refused": (C.c_int, [P, P]),
        "halfstep_device_totals": (C.POINTER(C.c_uint64), [P]),
        "halfstep_last_report": (C.c_int, [P, C.POINTER(Report)]),
        "halfstep_nonfinite_counts": (C.c_int, [P, C.POINTER(C.c_int64), C.c_int64]),
        "halfstep_set_lr": (C.c_int, [P, C.c_int32, C.c_float, P]),
        "halfstep_set_threads": (C.c_int, [P, C.c_int32]),
        "halfstep_threads": (C.c_int, [P, C.POINTER(C.c_int32)]),
        "halfstep_set_group": (C.c_int, [P, C.c_int32, C.POINTER(Group), P]),
        "halfstep_set_gradients": (C.c_int, [P, C.POINTER(C.c_void_p), C.c_int64, P, C.c_uint64]),
        "halfstep_mark_unscaled": (C.c_int, [P, P]),
        "halfstep_use_external_scale": (C.c_int, [P, P, P, P]),
        "halfstep_get_group": (C.c_int, [P, C.c_int32, C.POINTER(Group)]),
        "halfstep_set_loss_scale": (C.c_int, [P, C.c_float, P]),
        "halfstep_device_lr": (C.POINTER(C.c_float), [P, C.c_int32]),
        "halfstep_state_bytes_of": (C.c_int, [C.POINTER(Config), C.c_int32, C.POINTER(StateBytes)]),
        "halfstep_tensor_init": (None, [C.POINTER(Tensor)]),
        "halfstep_moment_blocks_of": (C.c_int, [C.POINTER(Config), C.POINTER(Tensor), C.POINTER(MomentBlocks)]),
        "halfstep_encode_moment": (C.c_int, [C.POINTER(Tensor), C.c_int32, P, P, P]),
        "halfstep_decode_moment": (C.c_int, [C.POINTER(Tensor), C.c_int32, P, P, P]),
        "halfstep_learning_rates": (C.c_int, [P, C.POINTER(C.c_float), C.c_int32]),
        "halfstep_loss_scale": (C.c_int, [P, C.POINTER(C.c_float)]),
        "halfstep_device_loss_scale": (C.POINTER(C.c_float), [P]),
        "halfstep_device_step_count": (C.POINTER(C.c_int64), [P]),
        "halfstep_step_count": (C.c_int, [P, C.POINTER(C.c_int64), C.POINTER(C.c_int64)]),
        "halfstep_get_state": (C.c_int, [P, C.POINTER(State)]),
        "halfstep_set_state": (C.c_int, [P, C.POINTER(State)]),
        "halfstep_save_state": (C.c_int, [P, P, C.c_size_t, C.POINTER(C.c_size_t)]),
        "halfstep_load_state": (C.c_int, [P, P, C.c_size_t]),
        "halfstep_last_error": (C.c_char_p, []),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


lib = _load(library_path())


class HalfstepError(RuntimeError):
    """A failed libhalfstep call: `status` is the C API's code, the message names the argument
    and the rule (halfstep_last_error)."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def check(status):
    if status != OK:
        raise HalfstepError(status, lib.halfstep_last_error().decode())
