"""halfstep.torch.FusedAdamW: the optimizer's bookkeeping and its step.

What lives where: the parameters' state in a layout (_layouts: slot -> tensor, one class per
storage strategy), the loss-scale protocol in LossScaling (_scaling), the hyperparameter rules in
_hyper, the state_dict in _checkpoint, the ranks' agreement in _ranks. This module builds them,
follows the parameters, and runs the step.
"""

import collections as _collections
import contextlib as _contextlib
import copy as _copy
import ctypes as _C
import hashlib as _hashlib
import math as _math
import operator as _operator
import threading as _threading
import warnings as _warnings
import weakref as _weakref

import torch
import torch.distributed as _dist

from . import BF16, F16, F32, TOTALS_MAX_WORDS, TOTALS_SUM_WORDS, Optimizer, config, group
from . import _checkpoint, _dtensor, _formats, _fp32, _hyper, _layouts, _ranks, _scaling

_DTYPES = {torch.float16: F16, torch.bfloat16: BF16, torch.float32: F32}
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_SIGN = -(2 ** 63)  # flips an int64's sign bit: unsigned order as signed order
# The scaler of a run that does not scale its loss: the scale stays 1, the inf/NaN check stays on.
_NO_LOSS_SCALING = dict(init_scale=1.0, min_scale=1.0, max_scale=1.0, growth_interval=2 ** 31 - 1)
_SET_WARNING = ("optimizer parameters need to be organized in ordered collections, but the ordering of tensors in "
                "sets will change between runs. Please use a list instead. This will be an error in a future release.")


class _CudaArray:
    """A zero-copy view of device memory for torch.as_tensor (__cuda_array_interface__)."""

    def __init__(self, address, typestr, numel, owner):
        self.__cuda_array_interface__ = {"shape": (numel,), "typestr": typestr, "data": (address, False),
                                         "version": 2}
        self.owner = owner


def _view(owner, address, dtype, device, numel=1):
    """A tensor over `numel` elements at `address` (device memory on CUDA, host memory on CPU),
    sharing the memory, and keeping `owner` (the halfstep.Optimizer that holds the memory) alive
    for as long as the tensor lives."""
    if device.type == "cuda":
        typestr = {torch.float32: "<f4", torch.int64: "<i8"}[dtype]
        return torch.as_tensor(_CudaArray(address, typestr, numel, owner), device=device)
    ctype = {torch.float32: _C.c_float, torch.int64: _C.c_int64}[dtype]
    array = (ctype * numel).from_address(address)
    array.owner = owner
    return torch.frombuffer(array, dtype=dtype)


class _ParamState(dict):
    """opt.state[p]: views of the parameter's slots (writing into them, or assigning a tensor to
    them, writes the optimizer's state), its step count (a copy the step refreshes: one
    applied-step counter for every parameter), and whatever keys the user adds. A master kept as
    the bfloat16 parameter and a remainder (store_param_remainders=True) is shown as fp32 masters
    rebuilt on each read, and without a master (master_weight_dtype=None) the weights' fp32 values:
    a copy, which only assignment writes (step() refuses a copy written in place)."""

    def __init__(self, opt, index, views, rebuilt=()):
        super().__init__(views)
        self._opt, self._index = opt, index
        self._rebuilt = frozenset(rebuilt)  # keys whose value is rebuilt on each read
        for key in self._rebuilt:
            dict.__setitem__(self, key, None)

    def __getitem__(self, key):
        if key in self._rebuilt:
            return self._opt._rebuilt_slot(self._index, key)
        return super().__getitem__(key)

    def __iter__(self):  # (not dict's own: dict(entry) and {**entry} then read through __getitem__)
        return iter(list(dict.keys(self)))

    def get(self, key, default=None):
        return self[key] if key in self else default

    def items(self):
        return [(k, self[k]) for k in dict.keys(self)]

    def values(self):
        return [self[k] for k in dict.keys(self)]

    def copy(self):
        return dict(self.items())

    def __reduce__(self):  # copy.deepcopy, pickle: a plain dict of the values as shown
        return dict, (), None, None, iter(self.items())

    def __repr__(self):
        return repr(dict(self.items()))

    def __eq__(self, other):
        return dict(self.items()) == other

    __hash__ = None

    def __setitem__(self, key, value):
        if self._held(key):
            self._opt._set_slot(self._index, key, value)
            return
        if key in ("step", "offset"):
            raise TypeError("opt.state[p][%r] cannot be set: halfstep keeps one applied-step counter for every "
                            "parameter (opt.applied_steps); clear opt.state to restart every bias correction" % key)
        super().__setitem__(key, value)

    def __delitem__(self, key):
        if self._held(key) or key in ("step", "offset"):
            raise TypeError("opt.state[p][%r] cannot be deleted: it is the optimizer's state of the parameter; clear "
                            "opt.state to reset every parameter's moments" % key)
        super().__delitem__(key)

    def pop(self, key, *default):
        if key in self and (self._held(key) or key in ("step", "offset")):
            self.__delitem__(key)
        return super().pop(key, *default)

    def clear(self):
        raise TypeError("opt.state[p] cannot be cleared on its own: one applied-step counter serves every parameter; "
                        "clear opt.state (opt.state.clear(), or opt.state = {}) to reset every parameter's moments")

    def popitem(self):
        raise TypeError("opt.state[p].popitem(): the entry's keys are the optimizer's state of the parameter")

    def update(self, *args, **kwargs):  # each key through the checked assignment
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other):
        self.update(other)
        return self

    def extras(self):
        """The keys a user added."""
        return {k: v for k, v in dict.items(self) if not self._held(k) and k not in ("step", "offset")}

    def _held(self, key):
        """Whether `key` is a slot of the optimizer's state of this parameter: the master and the
        moments, and the scales of block8 moments where the parameter holds codes (elsewhere a key
        of that name is the user's own)."""
        return key in _layouts.SLOTS or (key in _layouts.SCALES and self._opt._layout.blocks[self._index] is not None)


class _StateMap(_collections.defaultdict):
    """opt.state: an entry per parameter (_ParamState), and whatever non-parameter keys a user
    adds (kept by state_dict, as torch.optim keeps them). Clearing it resets every parameter's
    moments and restarts the bias corrections, as an emptied torch.optim state does."""

    def __reduce__(self):  # copy.deepcopy, pickle: a detached defaultdict(dict) of the entries as shown
        return _collections.defaultdict, (dict,), None, None, iter(self.items())

    def __init__(self, opt=None):
        super().__init__(dict)
        self._opt = opt
        self._ids = {id(p) for p in opt._params} if opt is not None else set()

    def _owned(self, key):
        return isinstance(key, torch.Tensor) and id(key) in self._ids

    def __setitem__(self, key, value):
        if self._owned(key) and self.get(key) is not value:
            raise TypeError("opt.state[p] cannot be replaced: set its entries (opt.state[p]['exp_avg'] = t), or clear "
                            "opt.state to reset every parameter's moments")
        super().__setitem__(key, value)

    def __delitem__(self, key):
        if self._owned(key):
            raise TypeError("opt.state[p] cannot be deleted: one applied-step counter serves every parameter; clear "
                            "opt.state (opt.state.clear()) to reset every parameter's moments")
        super().__delitem__(key)

    def pop(self, key, *default):
        if self._owned(key):
            self.__delitem__(key)
        return super().pop(key, *default)

    def popitem(self):
        raise TypeError("opt.state.popitem(): clear opt.state to reset every parameter's moments")

    def update(self, *args, **kwargs):  # each key through the checked assignment
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self):
        if self._opt is None:
            return super().clear()
        self._opt._reset_moments()
        for k in [k for k in self if not self._owned(k)]:
            super().__delitem__(k)

    def extras(self, p):
        entry = self.get(p)
        return entry.extras() if isinstance(entry, _ParamState) else {}

    def foreign(self):
        """Entries that are no parameter's."""
        return {k: v for k, v in self.items() if not self._owned(k)}


def _tensors_in(params):
    """The tensors of a params argument as torch.optim reads it (tensors, (name, tensor) pairs,
    param-group dicts), before torch.optim has read it."""
    for g in params:
        items = g.get("params", ()) if isinstance(g, dict) else [g]
        if isinstance(items, torch.Tensor):
            items = [items]
        for t in items:
            t = t[1] if isinstance(t, tuple) and len(t) == 2 else t
            if isinstance(t, torch.Tensor):
                yield t


def _listed(params, distributed):
    """The params argument as torch.optim reads it, with torch's warning for a set; a set is refused
    with a process group (each rank would order it differently)."""
    if isinstance(params, set):
        if distributed:
            raise TypeError("params is a set: with a process group every rank must list the parameters in the same "
                            "order, and a set's order differs between processes; give a list "
                            "(list(model.parameters()))")
        _warnings.warn(_SET_WARNING, FutureWarning, stacklevel=3)
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        + torch.typename(params))
    out = list(params)
    for g in out:
        if isinstance(g, dict):
            _hyper.check_options(g, "FusedAdamW: a param group")
            if isinstance(g.get("params"), set) and distributed:
                raise TypeError("a param group's params is a set: with a process group every rank must list the "
                                "parameters in the same order; give a list")
    return out


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (PyTorch's formula) on fp32 masters, with halfstep's dynamic loss scaler, inf/NaN
    check, global-norm clipping and telemetry, in two fused passes.

    params: parameters (or param-group dicts with their own lr, betas, eps and weight_decay), all
        of one dtype, all on the CPU or all on one CUDA device, contiguous leaves: float32 (they
        are the masters, updated in place; their gradients fp32 — the torch.autocast recipe), or
        float16 or bfloat16 (the optimizer keeps their fp32 masters and writes the masters rounded
        to their dtype into them after each applied step). A set is taken with torch.optim's
        warning (refused with a process group: its order differs between processes).
    lr, betas, eps, weight_decay: as torch.optim.AdamW (weight_decay 1e-2, decoupled); lr and betas
        may be 1-element tensors. They may change between steps (schedulers write param_groups);
        step() pushes changes to the device without synchronising. A rate below fp32's smallest
        subnormal is 0, as torch.optim's fp32 step takes it. maximize, amsgrad and differentiable
        are refused where they are true; foreach, capturable and fused are ignored.
    max_grad_norm: clip the unscaled global norm to this (0: no clipping), inside the fused step.
    scaler: loss-scaler options by their library names (dict or object): init_scale,
        growth_factor, backoff_factor, min_scale, max_scale, growth_interval, hysteresis,
        consecutive_hysteresis, headroom_growth, headroom_margin_log2. Default: dynamic loss
        scaling (from 2^16) for float16 parameters; none for bfloat16 and float32 ones (the scale
        stays 1, the inf/NaN check stays on) unless a GradScaler drives the optimizer or a loaded
        state_dict brings its scaler's rules.
    spike: spike-detector options: enabled, z_threshold, ema_beta, warmup_steps, action ('log'
        or 'skip'), max_consecutive, min_std.
    compute_dtype: for float32 parameters, the dtype the backward pass computed the gradients in
        (torch.float16 under fp16 autocast, the default; torch.bfloat16): the headroom and the
        subnormal count in reports are measured against its range.
    store_param_remainders: bfloat16 parameters only: True keeps no fp32 master, the parameter
        itself (stepped in place) and an int16 remainder rebuild it exactly, 2 bytes per parameter
        instead of 4, with bitwise the results of fp32 masters. opt.state[p]['master'] and
        state_dict() show the rebuilt fp32 masters. False or None (the default): fp32 masters.
    master_weight_dtype: torch.float32 (the default) keeps a master (fp32, or a remainder); None,
        for bfloat16 parameters, keeps none: the step's fp32 result is written to the parameter
        with the rounding below (stochastic by default, keyed as the moments' bits), 4 bytes per
        parameter less than fp32 masters. opt.state[p]['master'] and state_dict() show the
        parameter's values in fp32; a state_dict with fp32 masters loads (rounded to nearest).
    exp_avg_dtype, exp_avg_sq_dtype: torch.float32 (the default) or torch.bfloat16: the moments
        held in bfloat16, decoded and encoded inside the fused step (2 bytes each instead of 4); or
        both torch.uint8: 8-bit block-wise codes (1 byte each, and an fp32 scale per block of 256
        elements of a row of dimension 0: opt.state[p]['exp_avg_scale'], ['exp_avg_sq_scale']) for
        parameters of at least 4096 elements with rows of at least 32 (the others keep fp32
        moments: the rule reads the whole parameter's shape, so any mesh gives the same state).
        exp_avg is stored to nearest, the square root of exp_avg_sq with the rounding below.
        On a process group, cuts move to where blocks start (ZeRO-1's ranges too).
    rounding: how bfloat16 moments (and weights without a master) are stored: 'stochastic' (the
        default: unbiased, so that exp_avg_sq and the weights keep moving when a step's change is
        below half a bf16 ulp; its bits a hash of seed, step, parameter and element, the same on
        any number of ranks and after a resume) or 'nearest'.
    seed: the key of stochastic rounding's bits (an integer in [0, 2^64); the state_dict carries it).
    threads: CPU parameters: the host threads the step runs on (1 to 1024; None, the default:
        torch.get_num_threads()). The host backend runs the CUDA kernels' own arithmetic,
        vectorised, so the results are the same bits on any number of threads and on a GPU.
    process_group: a torch.distributed group whose ranks take one step together: they all-reduce
        the step's totals record, so every rank takes the same decision with the same global norm
        (bitwise the one process would compute) and holds the same report. The gradients must
        already be reduced across the ranks (DistributedDataParallel, or your own all-reduce). A
        rank whose own checks refuse its step() takes part without its gradients (every rank
        skips that step: reason rank_refused), then raises.
    shard: with a process_group over plain tensors, True (the default) shards the optimizer state
        (ZeRO-1): each rank keeps the masters and moments of a 1/world chunk of the flat parameter
        space (cut anywhere), updates that chunk, and the new parameters are all-gathered. False
        keeps all of the state on every rank (plain data parallelism).

    DTensor parameters (FSDP2's fully_shard; all of one device mesh): each rank steps its local
    shards in place, the record is all-reduced over the mesh's ranks (process_group, if given,
    must be exactly those), an element on a Replicate() dimension counts in the norm once, and
    state_dict() holds DTensors for torch.distributed.checkpoint. shard=True is refused there.
    Before its first step the optimizer follows its parameters: replaced in param_groups one for
    one (accelerate's FSDP2 preparation) or moved to other storage, it is rebuilt over them, each
    rank on its own (every rank compares what it built at the first step).
    """

    # torch.amp.GradScaler.step calls step() directly, with the optimizer's `grad_scale` (its
    # scale, or None when unscale_ ran) and `found_inf` set, instead of unscaling itself and
    # synchronising on found_inf: the fused step unscales by that scale and skips on found_inf.
    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, max_grad_norm=0.0,
                 scaler=None, spike=None, compute_dtype=torch.float16, process_group=None, shard=None,
                 store_param_remainders=None, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 rounding="stochastic", seed=0, master_weight_dtype=torch.float32, threads=None):
        self._built = False
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 1024):
            raise ValueError("FusedAdamW: threads must be an integer in [1, 1024] or None, got %r" % (threads,))
        self._threads = threads
        params = _listed(params, process_group is not None)
        self._pg, self._shard_wanted = process_group, shard
        # DTensor parameters (FSDP2, tensor parallelism): the record is all-reduced over their mesh.
        self._mesh = _dtensor.check(list(enumerate(_tensors_in(params))))
        if self._mesh is not None:
            if shard:
                raise ValueError("shard=True: DTensor parameters are sharded already (FSDP2); FusedAdamW steps each "
                                 "rank's local shards (leave shard out)")
            self._pg = _dtensor.mesh_group(self._mesh, process_group)
        self._join_group()
        # With a process group, every rank must build the same optimizer or none may: a rank that
        # refused its arguments would leave the others waiting in the first collective.
        error, key = None, b""
        try:
            _hyper.check(lr, betas, eps, weight_decay, device=None)
            self._options = dict(max_grad_norm=_fp32(max_grad_norm, "max_grad_norm"), spike=spike,
                                 compute_dtype=compute_dtype)
            if not _math.isfinite(self._options["max_grad_norm"]) or self._options["max_grad_norm"] < 0:
                raise ValueError("Invalid max_grad_norm: %r (FusedAdamW: finite and >= 0; 0: no clipping)" % max_grad_norm)
            if compute_dtype not in _DTYPES:
                raise ValueError("FusedAdamW: compute_dtype must be torch.float16, torch.bfloat16 or torch.float32, "
                                 "got %r" % (compute_dtype,))
            self._state_options = dict(store_param_remainders=store_param_remainders, exp_avg_dtype=exp_avg_dtype,
                                       exp_avg_sq_dtype=exp_avg_sq_dtype, rounding=rounding, seed=seed,
                                       master_weight_dtype=master_weight_dtype)
            self._scaling = _scaling.LossScaling(rules_given=scaler is not None)
            self._scaler_options = scaler
            key = self._construct(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        except Exception as e:  # noqa: BLE001 (re-raised below, after the ranks agreed)
            if self._pg is None:
                raise
            error = e
        if self._pg is not None:
            self._agree_on(error, key, "another rank refused its arguments to FusedAdamW; no rank built one",
                           "the ranks built different optimizers (parameter shapes or names, dtype, param groups, "
                           "hyperparameters, options or shard differ); every rank must build the same FusedAdamW")

    # -- construction ------------------------------------------------------------------------------

    @property
    def threads(self):
        """CPU parameters: the host threads the step runs on — the `threads` given, or
        torch.get_num_threads() (read at each build; 1 where torch's own is 1). The results are the
        same bits on any number. 1 for CUDA parameters."""
        if self._device.type == "cuda":
            return 1
        return self._threads if self._threads is not None else max(1, min(1024, torch.get_num_threads()))

    @threads.setter
    def threads(self, value):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
            raise ValueError("FusedAdamW.threads must be an integer in [1, 1024], got %r" % (value,))
        if self._device.type == "cuda":
            raise ValueError("FusedAdamW.threads: CUDA parameters are stepped on their device")
        with self._lock:
            self._threads = value
            self._opt.set_threads(value)

    @property
    def state(self):
        """Per parameter: views of its slots (master, exp_avg, exp_avg_sq, each in its dtype; a
        master kept as a remainder shown rebuilt in fp32) and its step count; see _ParamState. Assigning an empty mapping (opt.state = defaultdict(dict)) resets every
        parameter's moments, as torch.optim's emptied state does."""
        return self.__dict__["_state_map"]

    @state.setter
    def state(self, value):
        if not self.__dict__.get("_built", False):  # torch.optim.Optimizer.__init__
            self.__dict__["_state_map"] = _StateMap()
            self.__dict__["_state_map"].update(value)
            return
        if isinstance(value, _StateMap) and value is self.__dict__["_state_map"]:
            return
        try:
            empty = len(value) == 0
        except TypeError:
            empty = False
        if not empty:
            raise TypeError("opt.state cannot be replaced by another state: load_state_dict restores a saved one; "
                            "assign an empty mapping (or call opt.state.clear()) to reset every parameter's moments")
        self.__dict__["_state_map"].clear()

    def _construct(self, params, defaults):
        """Checks the arguments and builds everything; returns the fingerprint the ranks of a
        process group compare."""
        super().__init__(params, defaults)
        self._params = [p for g in self.param_groups for p in g["params"]]
        if not self._params:
            raise ValueError("halfstep.torch.FusedAdamW: no parameters to optimise")
        self._check_params(self._params)
        self._dtype = self._params[0].dtype
        self._device = self._params[0].device
        self._formats = _formats.choose(self._dtype, **self._state_options)
        if self._scaler_options is None and self._dtype != torch.float16:
            self._scaler_options = _NO_LOSS_SCALING
        # step(), state_dict(), load_state_dict(), add_param_group() and resync_weights() from several
        # threads run one at a time (the library's calls release the GIL; interleaved, updates
        # would be lost).
        self._lock = _threading.RLock()
        self._stepped = False  # a step was attempted (from then on the parameters are fixed)
        self._captured = False  # a CUDA graph captured a step (from then on no rebuild)
        self._tensor_reads = _hyper.TensorReads()
        self._lr_handles = {}  # group -> tensor: lr_tensor() handles, which outlive rebuilds
        self._lr_views = []
        self._pushed = [_hyper.of_group(g, "param_groups", self._tensor_reads, self._device) for g in self.param_groups]
        self.param_groups[0].setdefault(_hyper.STATE_KEY, "the optimizer's own state: see state_dict()")
        self._build({}, [0] * len(self.param_groups))
        self._built = True
        return self._fingerprint()

    def _join_group(self):
        self._shard = (self._shard_wanted is None or bool(self._shard_wanted)) and self._pg is not None and \
            self._mesh is None
        if self._pg is None:
            self._world, self._rank = 1, 0
            return
        if not _dist.is_available() or not _dist.is_initialized():
            raise ValueError("process_group: torch.distributed is not initialised (call "
                             "torch.distributed.init_process_group first)")
        self._world, self._rank = _dist.get_world_size(self._pg), _dist.get_rank(self._pg)
        if self._rank < 0:
            raise ValueError("process_group: this process is not a member of the group")

    def _fingerprint(self):
        layout = [_dtensor.describe(p) for p in self._params] if self._mesh is not None else None
        names = [g.get("param_names") for g in self.param_groups]
        return repr((str(self._dtype), self._shapes, layout, names, self._group_of(),
                     [h.fingerprint() for h in self._pushed], [p.requires_grad for p in self._params],
                     float(self._options["max_grad_norm"]), bytes(self._cfg), self._shard)).encode()

    def _group_of(self):
        return [i for i, g in enumerate(self.param_groups) for _ in g["params"]]

    @staticmethod
    def _check_params(params):
        if not params:
            return
        dtype, device = params[0].dtype, params[0].device
        seen = []
        ids = {}
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError("parameter %d is a %s, not a tensor" % (i, type(p).__name__))
            if id(p) in ids:
                raise ValueError("parameters %d and %d are the same tensor: list each parameter once" % (ids[id(p)], i))
            ids[id(p)] = i
            where = "parameter %d (%s %s)" % (i, tuple(p.shape), p.dtype)
            if p.dtype not in _DTYPES:
                raise TypeError("%s: halfstep takes float32 parameters (they are the masters: train them under "
                                "torch.autocast), or float16 or bfloat16 ones (it keeps their fp32 masters itself); "
                                "got %s: convert the model with .float(), .half() or .bfloat16()" % (where, p.dtype))
            if p.dtype != dtype:
                raise TypeError("%s: every parameter must have one dtype (all float32, all float16 or all "
                                "bfloat16), parameter 0 is %s: keep the whole model in one dtype (model.float() "
                                "with torch.autocast for mixed precision)" % (where, dtype))
            if p.device != device:
                raise ValueError("%s is on %s, parameter 0 on %s: one device per optimizer" % (where, p.device, device))
            if device.type not in ("cpu", "cuda"):
                raise ValueError("%s is on %s: halfstep runs on CUDA devices and on the CPU" % (where, device))
            if not p.is_leaf:
                raise ValueError("%s must be a leaf tensor" % where)
            t = _dtensor.local(p)
            if not t.is_contiguous():
                raise ValueError("%s is not contiguous: halfstep writes the parameter in place" % where)
            if t.numel() > 0:
                seen.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i))
        seen.sort()
        for (a0, a1, i), (b0, b1, j) in zip(seen, seen[1:]):
            if b0 < a1:
                raise ValueError("parameters %d and %d share storage: each needs its own" % (min(i, j), max(i, j)))

    # -- building ------------------------------------------------------------------------------------

    def _library_config(self, scaler_options=None):
        cuda = self._device.type == "cuda"
        return config(dtype=_NAMES[self._dtype], backend="cuda" if cuda else "host",
                      max_grad_norm=self._options["max_grad_norm"],
                      scaler=self._scaler_options if scaler_options is None else scaler_options,
                      spike=self._options["spike"], compute_dtype=_NAMES[self._options["compute_dtype"]],
                      **self._formats.library())

    def _build(self, carried, offsets, library_state=None):
        """Builds the layout of this rank's state over param_groups' parameters (continuing from
        `carried`: parameter -> slots) and the library's optimizer over it (continuing from
        `library_state`, the state() of the one it replaces; group i joined after `offsets[i]`
        applied steps)."""
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._shapes = [tuple(p.shape) for p in self._params]
        with torch.no_grad():
            self._layout = _layouts.build(self._params, self._group_of(), self._world, self._rank, self._pg, self._mesh,
                                          self._shard, self._formats, carried)
        self._cfg = self._library_config()
        self._new_library(self._cfg, self._groups_for(offsets), library_state)
        # What the library holds the addresses of, and the parameters' version counters: step()
        # refuses moved storage and takes weights written into the parameters as new masters.
        self._storage = self._current_storage()
        self._versions = self._current_versions()
        self._unstepped = not carried  # the first step takes the parameters as they are then
        # The groups' parameters as built: step() refuses a param_groups changed other than by
        # add_param_group.
        self._group_params = [list(g["params"]) for g in self.param_groups]
        self._fill_state()

    def _groups_for(self, offsets):
        """The library's groups: the hyperparameters pushed last, the rates as the device holds them
        (a tensor rate arrives by its copy), joined after `offsets` applied steps."""
        self._offsets = list(offsets)
        self._device_lr = [0.0 if h[0] is None else h[0] for h in self._pushed]
        return [group(lr=lr, beta1=h[1][0], beta2=h[1][1], eps=h[2], weight_decay=h[3], step_offset=k)
                for h, lr, k in zip(self._pushed, self._device_lr, offsets)]

    def _new_library(self, cfg, groups, library_state=None):
        """A library optimizer over the layout's table; the live views over its memory."""
        cuda = self._device.type == "cuda"
        with (torch.cuda.device(self._device) if cuda else _contextlib.nullcontext()):
            if cuda:
                torch.cuda.current_stream(self._device).synchronize()  # the layout's copies have landed
            opt = Optimizer(self._layout.entries(), groups, cfg, rank=self._rank)
            if not cuda:
                opt.set_threads(self.threads)
            if library_state is not None:
                opt.set_state(library_state)
        self._install(opt, cfg)

    def _install(self, opt, cfg):
        self._opt, self._cfg = opt, cfg
        # The live scale and applied-step counter in the library's memory; users get copies
        # (loss_scale, applied_steps, state[p]["step"]), so that only the step writes them.
        dev = self._device
        self._live_scale = _view(opt, opt.loss_scale_address(), torch.float32, dev).view(())
        self._live_steps = _view(opt, opt.step_count_address(), torch.int64, dev).view(())
        self._totals = _view(opt, opt.totals_address(), torch.int64, dev, TOTALS_SUM_WORDS + TOTALS_MAX_WORDS)
        self._lr_views = [_view(opt, opt.device_lr_address(i), torch.float32, dev).view(())
                          for i in range(len(self.param_groups))]
        if not hasattr(self, "_step_copy"):
            self._step_copy = self._live_steps.clone()
        else:
            self._step_copy.copy_(self._live_steps)
        self._grad_addresses = [0] * len(self._layout.table)  # no gradient until step() sees one
        self._grads_key = 0
        if not hasattr(self, "_copies"):
            # Rebuilt slots handed out: [parameter index, slot, tensor or weak reference, version].
            # Held strongly until the next step checks them (a temporary written in place, as in
            # opt.state[p]["master"].mul_(0), is caught too), weakly after.
            self._copies = []

    def _library_snapshot(self):
        """What load_state_dict restores if it cannot finish: the library optimizer and its state."""
        return self._opt, self._cfg, self._scaler_options, self._opt.save_state()

    def _library_restore(self, snapshot):
        opt, cfg, options, blob = snapshot
        if opt is not self._opt:
            self._install(opt, cfg)
            self._scaler_options = options
        opt.load_state(blob)

    def _rebuild_library(self, scaler_options):
        """The library's optimizer again, over the same layout, with other loss-scaler rules (a
        GradScaler's before the first step, or a loaded state_dict's): the layout's state and views,
        lr_tensor() handles, the learning rates and the counters carry on; the scaler starts at the
        new rules' init_scale."""
        self._refuse_rebuild_after_capture("other loss-scaler rules (a GradScaler's, or a loaded state_dict's)")
        old = self._opt
        cfg = self._library_config(scaler_options)
        groups = [old.group(i) for i in range(len(self.param_groups))]
        state = dict(old.state(), scale=cfg.init_scale, good_steps=0, hysteresis_left=cfg.hysteresis)
        self._new_library(cfg, [group(**{k: g[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay",
                                                            "step_offset")}) for g in groups], state)
        self._scaler_options = scaler_options

    def _fill_state(self):
        """opt.state[p] for every parameter: views of this rank's state of it; the keys a user added
        to an entry, and entries that are no parameter's, carry over."""
        state = self.__dict__["_state_map"]
        extras = {id(k): v.extras() for k, v in state.items() if isinstance(v, _ParamState)}
        fresh = _StateMap(self)
        for i, p in enumerate(self._params):
            views = self._layout.views(i)
            entry = _ParamState(self, i, views, [k for k in self._layout.rebuilt_slots() if k in views])
            dict.__setitem__(entry, "step", self._step_copy)
            for k, v in extras.get(id(p), {}).items():
                dict.__setitem__(entry, k, v)
            dict.__setitem__(fresh, p, entry)
        for k, v in state.items():
            if not isinstance(v, _ParamState) and not fresh._owned(k):
                dict.__setitem__(fresh, k, v)
        self.__dict__["_state_map"] = fresh

    def __getstate__(self):
        raise TypeError("halfstep.torch.FusedAdamW cannot be pickled or copied (it holds device memory and "
                        "addresses): save opt.state_dict() and load it into a new optimizer")

    def __deepcopy__(self, memo):
        self.__getstate__()

    # -- the live values ------------------------------------------------------------------------

    @property
    def loss_scale(self):
        """The loss scale for the next backward pass: a new 0-dim fp32 tensor on the parameters'
        device, copied from the optimizer's own memory on the current stream (no synchronisation;
        inside a captured CUDA graph, the copy replays with it). Writing into it changes nothing:
        only the step moves the scale. Reading it tells step() the loss was scaled."""
        self._scaling.taken = True
        return self._live_scale.clone()

    @property
    def applied_steps(self):
        """Applied steps so far (the Adam t), as a new 0-dim int64 tensor on the parameters'
        device, copied like loss_scale; skipped steps do not advance it."""
        return self._live_steps.clone()

    def _current_storage(self):
        return [(t.data_ptr(), t.numel(), t.dtype) for t in map(_dtensor.local, self._params)]

    def _current_versions(self):
        return [_dtensor.version(p) for p in self._params]

    def _collective_device(self):
        """Where the group's backend reduces: the current CUDA device for NCCL, else the CPU."""
        if _dist.get_backend(self._pg) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _agree_on(self, error, key, refused, different):
        """Every rank of the group must do the same: the ranks compare whether each passed its
        checks and a fingerprint of what it is about to do; if any rank refused or any fingerprint
        differs, every rank raises (rather than let collectives hang or mix up data)."""
        all_ok, same = _ranks.agree(self._pg, self._collective_device(), error is None, key)
        if error is not None:
            raise error
        if not all_ok:
            raise ValueError("process_group: " + refused)
        if not same:
            raise ValueError("process_group: " + different)

    # -- param groups ------------------------------------------------------------------------------

    def add_param_group(self, param_group):
        """Adds a group of parameters (Lightning's fine-tuning unfreeze does): the optimizer is
        rebuilt over every group, the existing parameters keep their masters and moments (the very
        tensors, without shard), the scaler, spike detector, step counters and lr_tensor() handles
        carry on. Waits for the device once. With a process_group, every rank must add the same
        group."""
        if not getattr(self, "_built", False):
            super().add_param_group(param_group)
            return
        with self._lock:
            before = list(self.param_groups)
            error = None
            try:
                self._follow_replaced_params()
                if not isinstance(param_group, dict):
                    raise TypeError("add_param_group: param_group must be a dict, got %s" % type(param_group).__name__)
                if isinstance(param_group.get("params"), set) and self._pg is not None:
                    raise TypeError("add_param_group: params is a set: with a process group every rank must list the "
                                    "parameters in the same order; give a list")
                _hyper.check_options(param_group, "add_param_group")
                given = {k: v for k, v in param_group.items() if k in _hyper.HYPERPARAMETERS}
                merged = {**self.defaults, **given}
                _hyper.check(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"], "add_param_group",
                             self._tensor_reads, self._device)
                super().add_param_group(param_group)  # torch's checks: a parameter in two groups, ...
                everything = [p for g in self.param_groups for p in g["params"]]
                self._check_params(everything)
                if _dtensor.check(list(enumerate(everything))) != self._mesh:
                    raise ValueError("add_param_group: the new parameters are not on this optimizer's device mesh "
                                     "(%s)" % (self._mesh,))
            except Exception as e:  # noqa: BLE001 (re-raised below, after the ranks agreed)
                self.param_groups[:] = before
                if self._pg is None:
                    raise
                error = e
            if self._pg is not None:
                key = b"" if error is not None else repr((
                    [tuple(p.shape) for p in self.param_groups[-1]["params"]],
                    _hyper.of_group(self.param_groups[-1], "add_param_group", self._tensor_reads,
                                    self._device).fingerprint())).encode()
                try:
                    self._agree_on(error, key, "another rank refused its add_param_group; no rank added one",
                                   "the ranks added different parameter groups")
                except Exception:
                    self.param_groups[:] = before
                    raise
            self._rebuild()

    def _refuse_rebuild_after_capture(self, why):
        """A CUDA graph that captured a step replays the library optimizer it captured: after a
        rebuild it would step the old one, silently. Such a rebuild is refused."""
        if self._captured:
            raise RuntimeError("FusedAdamW: a CUDA graph captured this optimizer's step, and %s would rebuild it: the "
                               "graph would go on stepping the optimizer it captured. Make the change before capturing, "
                               "or build a new optimizer and capture again" % why)

    def _rebuild(self):
        """A new layout and library optimizer over the current param_groups, continuing this one's
        state. A new group counts its bias corrections from its own first step, as torch.optim
        does."""
        self._refuse_rebuild_after_capture("add_param_group")
        self._take_pending_weights()
        self._push_lr_sources(self._stream())
        carried = self._layout.carried()
        library_state = self._opt.state()  # waits for the last step
        offsets = self._offsets + [library_state["step"]] * (len(self.param_groups) - len(self._offsets))
        self._pushed += [_hyper.of_group(g, "param_groups", self._tensor_reads, self._device)
                         for g in self.param_groups[len(self._pushed):]]
        self._build(carried, offsets, library_state)
        self._unstepped = False

    def _groups_as_built(self):
        """Whether param_groups holds the very parameters this optimizer was built over, group by group."""
        return len(self.param_groups) == len(self._group_params) and all(
            len(g["params"]) == len(built) and all(map(_operator.is_, g["params"], built))
            for g, built in zip(self.param_groups, self._group_params))

    def _follow_replaced_params(self):
        """Before the first step the optimizer follows its parameters: parameters that
        param_groups holds in place of those it was built with, one for one with the same global
        shape and dtype (accelerate's FSDP2 preparation, Trainer's too, swaps a built optimizer's
        parameters for their fully_shard-ed DTensors), and parameters whose storage moved
        (.to(), a framework's wrapping). It is rebuilt over them (a DTensor mesh's group, their
        values as the weights), by this rank alone: the ranks compare what they built at the first
        step. Once a step was attempted, the step refuses such changes."""
        if self._stepped:
            return
        groups = self.param_groups
        same = self._groups_as_built()
        if same and self._current_storage() == self._storage:
            return
        if len(groups) != len(self._group_params) or any(len(g["params"]) != len(b)
                                                         for g, b in zip(groups, self._group_params)):
            return  # not a swap: the step's own check names the change
        new = [p for g in groups for p in g["params"]]
        if not all(isinstance(p, torch.Tensor) and tuple(p.shape) == old_shape and p.dtype == self._dtype
                   for p, old_shape in zip(new, self._shapes)):
            return
        library_state = self._opt.state()
        if library_state["attempts"] > 0:  # a loaded state: it belongs to the storage it was loaded into
            self._stepped = True
            if same:
                return  # the step names the moved storage
            raise ValueError("param_groups holds other parameters than this optimizer was built with, and it has "
                             "stepped: parameters may be replaced (as accelerate's FSDP2 preparation does) only "
                             "before the first step; build the optimizer over the new parameters")
        mesh = _dtensor.check(list(enumerate(new)))
        if mesh is None and self._mesh is not None:
            raise ValueError("param_groups' DTensor parameters were replaced by plain tensors: build the optimizer "
                             "over the new parameters")
        self._check_params(new)
        self._refuse_rebuild_after_capture("parameters replaced or moved")
        moved = same and new[0].device == self._device  # the same parameters, their storage moved
        if moved and not self._layout.follows_storage():
            self._storage = self._current_storage()  # nothing holds it; the first step takes the values
            self._unstepped = True
            return
        if mesh is not None:
            self._pg = _dtensor.mesh_group(mesh, self._pg if self._mesh is not None else None)
            self._mesh, self._shard_wanted = mesh, None
            self._join_group()
        self._device = new[0].device
        offsets = self._offsets
        # The same parameters keep their moments (and views of them); the masters are the new storage's.
        self._build(self._layout.carried(masters=False) if moved else {}, offsets, library_state)
        self._unstepped = True

    # -- weights written into the parameters ---------------------------------------------------------

    def _take_written_weights(self, versions, everything):
        """Weights written into the parameters become the masters of those elements, as torch.optim
        would continue from them: before the first step those of every parameter (whatever wrote
        them: the model's load_state_dict, DistributedDataParallel's broadcast, which PyTorch's
        version counters do not see), after it those of parameters whose version counter moved
        (in-place edits). Only elements that differ from their master rounded to the parameter's
        format are taken, so an in-place write of the same values (a norm-limiting embedding, a
        model state_dict loaded after the optimizer's) keeps the masters' precision. fp32
        parameters that are the masters themselves have nothing to take. Stream-ordered device
        work, no synchronisation."""
        with torch.no_grad():
            for i, (now, then) in enumerate(zip(versions, self._versions)):
                if now != then or everything:
                    self._layout.take(i)
        self._versions = versions

    @torch.no_grad()
    def resync_weights(self):
        """Takes the parameters' current values as the masters of every element that differs from
        its master rounded to the parameter's format. step() does this by itself before the first
        step and for parameters changed in place since the last one (PyTorch's version counters
        show those); call this after writes it cannot see: through `.data`, raw pointers, or a
        collective such as a broadcast after training began. With a process_group, on every rank."""
        with self._lock:
            self._take_written_weights(self._current_versions(), everything=True)

    def _take_pending_weights(self):
        """What the next step takes from the parameters before it runs: before the first step
        every parameter, after it those whose version counter moved."""
        versions = self._current_versions()
        if self._unstepped or versions != self._versions:
            self._take_written_weights(versions, everything=self._unstepped)
            self._unstepped = False

    def _set_slot(self, i, name, value):
        """opt.state[p][name] = value: copied into the optimizer's state of parameter i (the master
        also into the parameter, rounded to its dtype, as a step would write it)."""
        view = self._layout.shown(i, name)
        if view is None:
            raise ValueError("opt.state[p][%r]: this rank holds no piece of parameter %d (shard=True: each rank "
                             "holds its chunk of the flat parameter space)" % (name, i))
        if not isinstance(value, torch.Tensor) or value.numel() != view.numel():
            raise ValueError("opt.state[p][%r] takes a tensor of %d elements (%s), got %r" % (
                name, view.numel(), tuple(view.shape), value if not isinstance(value, torch.Tensor) else
                "a tensor of shape %s" % (tuple(value.shape),)))
        value = _dtensor.local(value) if _dtensor.is_dtensor(value) else value
        codes = view.dtype == torch.uint8  # block8 codes: as stored (uint8), or values to encode
        if codes != (value.dtype == torch.uint8) and (not codes or not value.is_floating_point()):
            raise ValueError("opt.state[p][%r] takes %s, got a %s tensor" % (
                name, "block8 codes (uint8) or values (a floating-point tensor, encoded with its scales)" if codes
                else "values (a floating-point tensor)", str(value.dtype)[6:]))
        if not codes or value.dtype != torch.uint8:
            if not bool(torch.isfinite(value.detach()).all()):
                raise ValueError("opt.state[p][%r]: the values must be finite" % name)
            if name in ("exp_avg_sq",) + _layouts.SCALES and bool((value < 0).any()):
                raise ValueError("opt.state[p][%r]: the values must be >= 0" % name)
        if codes and value.dtype != torch.uint8:  # values: encoded to nearest, with their scales
            values = value.detach().to(self._device, torch.float32).reshape(view.shape)
            with self._lock, torch.no_grad():
                self._take_pending_weights()
                stored = self._layout.saved_moment(i, name, {name: values})
                for key, t in stored.items():
                    self._layout.set_slot(i, key, t)
                self._versions = self._current_versions()
            return
        value = value.detach().to(view.device, view.dtype).reshape(view.shape)
        if not bool(torch.isfinite(value).all()):
            raise ValueError("opt.state[p][%r]: values past %s's range, the dtype this optimizer keeps it in"
                             % (name, str(view.dtype)[6:]))
        if name == "master" and not bool(torch.isfinite(value.to(self._dtype)).all()):
            raise ValueError("opt.state[p]['master']: values past %s's range" % str(self._dtype)[6:])
        with self._lock, torch.no_grad():
            self._take_pending_weights()
            self._layout.set_slot(i, name, value)
            self._versions = self._current_versions()  # our own writes

    def _rebuilt_slot(self, i, name):
        """opt.state[p][name] of a slot that is not stored as shown (a master kept as a remainder):
        its values rebuilt, a copy. step() refuses it written in place (the write would be lost)."""
        with self._lock, torch.no_grad():
            self._take_pending_weights()
            t = self._layout.shown(i, name)
            self._copies.append([i, name, t, t._version])
            return t

    @staticmethod
    def _copy_of(entry):
        held = entry[2]
        return held if isinstance(held, torch.Tensor) else held()

    def _refuse_written_copies(self):
        """Raises, before anything changes, if a rebuilt slot handed out was written in place (the
        write would be lost); the copies are held weakly from here on."""
        kept, written = [], []
        for entry in self._copies:
            t = self._copy_of(entry)
            if t is not None:
                (written if t._version != entry[3] else kept).append((entry, t))
        self._copies = [[entry[0], entry[1], _weakref.ref(t), entry[3]] for entry, t in kept]
        if written:
            i, name = written[0][0][0], written[0][0][1]
            held = ("with master_weight_dtype=None there is no master: the bfloat16 parameter is the weight, "
                    "shown in fp32 when read" if self._formats.masterless else
                    "with store_param_remainders=True the master is the bfloat16 parameter and an int16 remainder, "
                    "rebuilt in fp32 when read")
            raise RuntimeError("opt.state[p][%r] of parameter %d was written in place, but it is a copy: %s. Assign it "
                               "instead (opt.state[p][%r] = t); nothing was stepped" % (name, i, held, name))

    def _reset_moments(self):
        """opt.state emptied: every parameter's moments are zero and every group's bias
        corrections count again from its next step, as torch.optim restarts an emptied state."""
        with self._lock, torch.no_grad():
            self._take_pending_weights()
            for i in range(len(self._params)):
                self._layout.zero_moments(i)
            step = self._opt.state()["step"]
            stream = self._stream()
            for i in range(len(self._pushed)):
                g = self._opt.group(i)
                self._opt.set_group(i, group(lr=g["lr"], beta1=g["beta1"], beta2=g["beta2"], eps=g["eps"],
                                             weight_decay=g["weight_decay"], step_offset=step), stream)
                self._offsets[i] = step

    # -- the step --------------------------------------------------------------------------------

    def _stream(self):
        return torch.cuda.current_stream(self._device).cuda_stream if self._device.type == "cuda" else 0

    def _refuse_changed_groups(self):
        if len(self.param_groups) != len(self._group_params):
            raise ValueError("param_groups has %d groups; this optimizer has %d: add groups with add_param_group(); "
                             "groups cannot be removed" % (len(self.param_groups), len(self._group_params)))
        for i, (g, built) in enumerate(zip(self.param_groups, self._group_params)):
            if len(g["params"]) != len(built) or not all(map(_operator.is_, g["params"], built)):
                raise ValueError("param_groups[%d]['params'] was changed in place (%d parameters, built with %d): add "
                                 "parameters with add_param_group(); they cannot be removed or replaced"
                                 % (i, len(g["params"]), len(built)))

    def _refuse_moved_storage(self):
        for i, (now, then) in enumerate(zip(self._current_storage(), self._storage)):
            if now != then:
                raise RuntimeError("parameter %d now has other storage (%d elements of %s at 0x%x, was %d of %s at "
                                   "0x%x): halfstep holds the addresses it was built with; .data assignments, .to(), "
                                   "resize_() and share_memory_() move it. Build the optimizer after such changes"
                                   % (i, now[1], now[2], now[0], then[1], then[2], then[0]))

    def _gradients(self):
        """The parameters' gradients, checked, as the library's table wants them: the address of
        each entry's gradient (0: the parameter has none this step)."""
        grads = [p.grad for p in self._params]
        if self._mesh is not None:
            for i, (p, g) in enumerate(zip(self._params, grads)):
                if g is None:
                    continue
                if not _dtensor.is_dtensor(g) or g.device_mesh != p.device_mesh or g.placements != p.placements:
                    raise RuntimeError("parameter %d's .grad is %s; the parameter is a DTensor with placements %s: "
                                       "halfstep reads gradients laid out as their parameters (reduced: no Partial)"
                                       % (i, ("a DTensor with placements %s" % (g.placements,)) if _dtensor.is_dtensor(g)
                                          else "a plain tensor", p.placements))
            grads = [None if g is None else _dtensor.local(g) for g in grads]
        for i, (p, g) in enumerate(zip(self._layout.local, grads)):
            if g is None:
                continue
            if g.dtype != p.dtype or g.device != p.device or g.shape != p.shape:
                raise RuntimeError("parameter %d's .grad is %s %s on %s; the parameter is %s %s on %s: halfstep "
                                   "reads gradients of the parameter's dtype, shape and device"
                                   % (i, g.dtype, tuple(g.shape), g.device, p.dtype, tuple(p.shape), p.device))
            if not g.is_contiguous():
                raise RuntimeError("parameter %d's .grad is not contiguous: halfstep reads it as one buffer" % i)
            if g.is_sparse:
                raise RuntimeError("parameter %d's .grad is sparse: halfstep reads dense gradients" % i)
        return self._layout.grad_addresses(grads)

    def _grads_present_key(self):
        """Which of the parameters have a gradient this step, as a 64-bit key the ranks of a process
        group compare in the step's record (a rank's table may not hold the parameter whose
        gradient another rank lacks): the ranks must step the same parameters. 0 without a group."""
        if self._pg is None:
            return 0
        present = bytes(int(p.grad is not None) for p in self._params)
        return int.from_bytes(_hashlib.blake2b(present, digest_size=8).digest(), "little") or 1

    def _needs_scaled_loss(self):
        """A loss scale other than a constant 1: a loss the backward pass did not multiply by it
        would be unscaled by it, silently wrong."""
        c = self._cfg
        return not (c.init_scale == c.min_scale == c.max_scale == 1.0)

    def _prepare(self):
        """Everything step() checks and pushes before the library runs; raises before anything
        changed. Returns the stream."""
        if not self._groups_as_built():
            self._refuse_changed_groups()
        if self._current_storage() != self._storage:
            self._refuse_moved_storage()
        hyper = [_hyper.of_group(g, "param_groups[%d]" % i, self._tensor_reads, self._device)
                 for i, g in enumerate(self.param_groups)]
        addresses = self._gradients()
        grads_key = self._grads_present_key()
        if self._copies:
            self._refuse_written_copies()
        external = self._scaling.check(self)
        # Checked; from here on, changes.
        stream = self._stream()
        self._take_pending_weights()
        for i, h in enumerate(hyper):
            if h != self._pushed[i]:
                # A rate changed in param_groups wins over one written into the device (lr_tensor);
                # a change of the other hyperparameters keeps the rate the device holds.
                lr_changed = h[0] is not None and h[0] != self._pushed[i][0]
                if lr_changed:
                    self._device_lr[i] = h[0]
                    if i in self._lr_handles:
                        self._lr_handles[i].fill_(h[0])
                if h[1:] != self._pushed[i][1:]:
                    self._opt.set_group(i, group(lr=self._device_lr[i], beta1=h[1][0], beta2=h[1][1], eps=h[2],
                                                 weight_decay=h[3], step_offset=self._offsets[i]), stream)
                elif lr_changed:
                    self._opt.set_lr(i, h[0], stream)  # ordered before this step on the stream
                self._pushed[i] = h
        self._push_lr_sources(stream)
        if addresses != self._grad_addresses or grads_key != self._grads_key:
            self._opt.set_gradients(addresses, stream, grads_key)
            self._grad_addresses, self._grads_key = addresses, grads_key
        self._scaling.push(self, external, stream)
        return stream

    def _lr_sources(self):
        """Per group, the tensor its rate is copied from before a step: the group's own tensor lr
        on the device, or its lr_tensor() handle."""
        return {i: h.lr_source if h.lr_source is not None else self._lr_handles.get(i)
                for i, h in enumerate(self._pushed) if h.lr_source is not None or i in self._lr_handles}

    def _push_lr_sources(self, stream):
        sources = self._lr_sources()
        if sources:
            dst = [self._lr_views[i] for i in sources]
            src = [t.detach().reshape(()) for t in sources.values()]
            if hasattr(torch, "_foreach_copy_") and all(s.device == d.device for s, d in zip(src, dst)):
                torch._foreach_copy_(dst, src)
            else:
                for d, s in zip(dst, src):
                    d.copy_(s)

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One step on the current stream: check, unscale, clip, AdamW, the parameters' new values.
        Never waits for the device (CPU tensors: runs at once). `grad_scaler` is what PyTorch 1.x's
        GradScaler passes an optimizer that declares _step_supports_amp_scaling (PyTorch 2 sets
        the optimizer's grad_scale and found_inf instead)."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError("step() got an unexpected keyword argument %r" % next(iter(kwargs)))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            with self._lock, (torch.cuda.device(self._device) if self._device.type == "cuda"
                              else _contextlib.nullcontext()):
                if grad_scaler is not None:
                    _scaling.take_torch1_scale(self, grad_scaler)
                self._step()
        except BaseException:
            _scaling.drop_torch_scale(self)
            raise
        if grad_scaler is not None:
            _scaling.drop_torch_scale(self)
        return loss

    def _refuse(self, error):
        """Raises `error`, a refusal of this rank's step found outside step() (a GradScaler's):
        with a process group this rank first takes part in the step without its gradients, as a
        refusal inside step() does, so that no rank waits for it."""
        if self._pg is None:
            raise error
        with self._lock, (torch.cuda.device(self._device) if self._device.type == "cuda" else _contextlib.nullcontext()):
            self._step(refusal=error)

    def _step(self, refusal=None):
        # Before the first step each rank follows its parameters on its own (which may bring it a
        # device mesh's group); the ranks of a group then compare what they built, every one of
        # them, so that a rank that rebuilt differently raises with the others instead of entering
        # other collectives than theirs.
        if not self._stepped:
            error = None
            try:
                self._follow_replaced_params()
            except Exception as e:  # noqa: BLE001 (re-raised below, after the ranks agreed)
                if self._pg is None:
                    raise
                error = e
            if self._pg is not None:
                self._agree_on(error, b"" if error is not None else self._fingerprint(),
                               "another rank refused its parameters", "the ranks' optimizers differ at their first "
                               "step (parameters replaced or moved on some ranks only, or other shapes, groups or "
                               "hyperparameters): every rank must step the same parameters")
        if self._device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._captured = True
        if self._pg is None:
            self._opt.step(self._prepare())
            self._stepped = True
            self._after_step()
            return
        # A rank whose own checks refuse this step still takes part, without its gradients, so that
        # the others do not wait for it in the all-reduce: every rank skips the step (reason
        # rank_refused), then this rank raises.
        refused = refusal
        try:
            if refused is not None:
                raise refused
            stream = self._prepare()
        except Exception as e:  # noqa: BLE001 (re-raised below, after the collectives)
            refused, stream = e, self._stream()
        if refused is None:
            self._opt.step_local(stream)
        else:
            self._layout.refused()
            self._scaling.push_refused(self, stream)
            self._opt.step_local_refused(stream)
        # The record: SUM over the first words, MAX over the last (as int64: the keys' sign bit
        # flipped so that signed order is their unsigned order).
        total, top = self._totals[:TOTALS_SUM_WORDS], self._totals[TOTALS_SUM_WORDS:]
        top.bitwise_xor_(_SIGN)
        _dist.all_reduce(total, op=_dist.ReduceOp.SUM, group=self._pg)
        _dist.all_reduce(top, op=_dist.ReduceOp.MAX, group=self._pg)
        top.bitwise_xor_(_SIGN)
        self._opt.step_finish(stream)
        self._stepped = True  # on every rank: the step was collective, refused or not
        self._layout.after_step()
        if self._layout.sharded:
            self._versions = self._current_versions()  # the gather's own writes
        self._after_step()
        if refused is not None:
            raise refused

    def _after_step(self):
        self._step_copy.copy_(self._live_steps)
        self._scaling.after_step()

    @torch.no_grad()
    def zero_grad(self, set_to_none=True):
        """As torch.optim: sets every parameter's .grad to None (or zeroes it in place with
        set_to_none=False). The next backward pass's new gradients are what the next step reads."""
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    # -- what the step reports, and device memory for schedules ---------------------------------

    def last_report(self):
        """The last step's StepReport as a dict (outcome and reason as strings); waits for that
        step only. first_nonfinite_tensor is the index of the parameter (in param-group order)."""
        r = self._opt.last_report()
        if r["first_nonfinite_tensor"] >= 0 and r["outcome"] != "skipped_inconsistent":
            r["first_nonfinite_tensor"] = self._layout.param_of(r["first_nonfinite_rank"], r["first_nonfinite_tensor"])
        return r

    def lr_tensor(self, group_index):
        """A 0-dim fp32 tensor on the parameters' device holding group `group_index`'s learning rate,
        which each step copies (on the stream, no synchronisation) into the memory the step reads: a
        schedule computed on the device writes it (copy_). A group whose lr is a tensor on the device
        gives that tensor. The handle outlives the optimizer's rebuilds (add_param_group, a
        GradScaler's first binding). param_groups[i]['lr'] changes still win when step() sees them."""
        if not isinstance(group_index, int) or not 0 <= group_index < len(self.param_groups):
            raise IndexError("lr_tensor: group_index must be in [0, %d), got %r" % (len(self.param_groups), group_index))
        with self._lock:
            source = self._pushed[group_index].lr_source
            if source is not None:
                return source
            if group_index not in self._lr_handles:
                self._lr_handles[group_index] = self._lr_views[group_index].clone()  # the rate as the step reads it
            return self._lr_handles[group_index]

    def scaler_state(self):
        """The loss scaler, spike detector and step counters; waits for the last step."""
        self._scaling.taken = True
        return self._opt.state()

    # -- the loss scaler's rules and state (the GradScaler protocol) -------------------------------

    def _scaler_options_now(self):
        return _scaling.options_of(self._cfg)

    def _bind_scaler(self, scaler):
        """Makes `scaler` (a halfstep GradScaler) the one that drives this optimizer. A fresh
        optimizer (no step attempted) takes its options and, if the GradScaler loaded a state, that
        state; one that continues a run keeps its own, and the GradScaler must agree with it: the
        same rules, a loaded state equal to the optimizer's, and a loss the GradScaler already
        scaled scaled by the optimizer's scale."""
        with self._lock:
            if self._scaling.driver is not None and self._scaling.driver is not scaler:
                raise ValueError("this FusedAdamW is driven by another halfstep GradScaler: one GradScaler per "
                                 "optimizer (the loss scale lives in the optimizer)")
            state = self._opt.state()
            wanted = config(scaler=dict(scaler._options, init_scale=scaler._scale_now()))
            if state["attempts"] == 0:
                if _scaling.options_of(wanted) != self._scaler_options_now():
                    self._take_pending_weights()
                    self._rebuild_library(_scaling.options_of(wanted))
                if scaler._loaded is not None:
                    self._write_scaler_state(scaler._loaded)
            else:
                rules, mine = _scaling.rules_of(wanted), _scaling.rules_of(self._cfg)
                differ = [k for k in _scaling.RULES if rules[k] != mine[k]]
                if differ:
                    raise ValueError("halfstep GradScaler: this FusedAdamW continues a run whose loss scaler has %s; "
                                     "this GradScaler has %s: build the GradScaler with the run's options"
                                     % (", ".join("%s=%r" % (k, mine[k]) for k in differ),
                                        ", ".join("%s=%r" % (k, rules[k]) for k in differ)))
                loaded = scaler._loaded
                if loaded is not None and (loaded["scale"] != state["scale"] or
                                           loaded["_growth_tracker"] != state["good_steps"] or
                                           loaded.get("_hysteresis_left", state["hysteresis_left"])
                                           != state["hysteresis_left"]):
                    raise ValueError("halfstep GradScaler: its loaded state_dict (scale %r, growth tracker %d) and this "
                                     "FusedAdamW's state (scale %r, growth tracker %d) were not saved at the same step; "
                                     "load both from one checkpoint" % (loaded["scale"], loaded["_growth_tracker"],
                                                                        state["scale"], state["good_steps"]))
                if scaler._scaled_by is not None and scaler._scaled_by != state["scale"]:
                    raise RuntimeError(
                        "halfstep GradScaler: scale() multiplied the loss by %r (this GradScaler's own %s scale) before "
                        "it drove this FusedAdamW, which continues a run at loss scale %r: the gradients would be "
                        "unscaled by the wrong factor. Load the GradScaler's state_dict too, or attach it before the "
                        "first scale() (scaler.attach(opt)) so that it scales by the optimizer's scale"
                        % (scaler._scaled_by, "loaded" if scaler._loaded is not None else "initial", state["scale"]))
            if scaler._scaled_by is not None:
                self._scaling.taken = True  # the loss of this iteration was scaled
            self._scaling.driver = scaler

    def _write_scaler_state(self, loaded):
        """A GradScaler's state_dict values into the library state (checked there). A growth
        tracker past this optimizer's applied steps (a GradScaler's state given to a new optimizer)
        counts from the optimizer's first step: the optimizer's counters hold one run's history."""
        with self._lock:
            s = self._opt.state()
            s["scale"] = loaded["scale"]
            s["good_steps"] = min(loaded["_growth_tracker"], s["step"])
            if "_hysteresis_left" in loaded:
                s["hysteresis_left"] = loaded["_hysteresis_left"]
            self._opt.set_state(s)

    def _adopt_scaler_rules(self, saved):
        """A state_dict's loss-scaler rules, taken by an optimizer whose rules nobody named (not
        FusedAdamW(scaler=...), no GradScaler driving it): the run it resumes was scaled by them.
        Otherwise the library's load refuses rules that differ, naming them."""
        if saved is None or self._scaling.rules_given or self._scaling.driver is not None:
            return
        wanted = self._library_config(saved)  # a scaler option the library refuses raises, named
        if _scaling.rules_of(wanted) != _scaling.rules_of(self._cfg):
            self._rebuild_library(_scaling.options_of(wanted))

    # -- checkpoints -----------------------------------------------------------------------------

    @torch.no_grad()
    def state_dict(self):
        """Masters, moments and step per parameter, the groups' hyperparameters, and the halfstep
        state (the scaler, the spike detector, the counters, the rates the device holds) in
        param_groups[0]['halfstep']: torch.save writes it, load_state_dict resumes bitwise, and
        torch.distributed.checkpoint's get_optimizer_state_dict keeps all of it. With shard=True
        it holds this rank's chunk and is loaded by the same rank of the same world; otherwise any
        rank's loads on any rank. Weights written into the parameters since the last step are taken
        into the masters first, as the next step would take them. Runs the optimizer's state_dict
        pre and post hooks (PyTorch >= 2.1)."""
        with self._lock:
            for hook in getattr(self, "_optimizer_state_dict_pre_hooks", {}).values():
                hook(self)
            self._follow_replaced_params()
            self._take_pending_weights()
            self._push_lr_sources(self._stream())
            sd = _checkpoint.save(self)
            for hook in getattr(self, "_optimizer_state_dict_post_hooks", {}).values():
                result = hook(self, sd)
                if result is not None:
                    sd = result
            return sd

    def load_state_dict(self, state_dict):
        """Restores state_dict(): everything is checked first; a mismatch raises (ValueError, or
        halfstep.HalfstepError from the library) naming it, and nothing changes. With a
        process_group every rank must call it; if any rank refuses its state_dict, every rank
        raises and none changes. Runs the optimizer's load_state_dict pre and post hooks (PyTorch
        >= 2.1)."""
        with self._lock:
            for hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
                result = hook(self, state_dict)
                if result is not None:
                    state_dict = result
            _checkpoint.load(self, state_dict)
            for hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
                hook(self)

    def _after_load(self, checked):
        """The bookkeeping of a load that succeeded."""
        if checked.seed is not None:  # the run's seed (the library restored it): rebuilds keep it
            self._formats = self._formats._replace(seed=checked.seed)
            self._cfg.seed = checked.seed
        self._versions = self._current_versions()  # our own writes
        self._unstepped = False  # the masters are the checkpoint's, not the rounded parameters
        self._step_copy.copy_(self._live_steps)
        self._scaling.after_load()
        # The device holds the hyperparameters of the saved optimizer (also a rate written through
        # lr_tensor), param_groups the saved values, and the values the saved optimizer last pushed
        # decide, as they would have there, whether the next step pushes param_groups' again.
        self._pushed = checked.pushed
        self._offsets = [self._opt.group(i)["step_offset"] for i in range(len(self.param_groups))]
        self._device_lr = self._opt.learning_rates()
        for mine, saved in zip(self.param_groups, checked.groups):
            for key, value in saved.items():
                if key not in ("params", _hyper.STATE_KEY):  # copies, as torch.optim's load takes them
                    mine[key] = value.detach().clone() if isinstance(value, torch.Tensor) else _copy.deepcopy(value)
        for i, handle in self._lr_handles.items():
            handle.copy_(self._lr_views[i])
        state = self.__dict__["_state_map"]
        for k in [k for k in state if not (isinstance(k, torch.Tensor) and any(k is p for p in self._params))]:
            dict.__delitem__(state, k)
        for k, v in checked.foreign.items():
            dict.__setitem__(state, k, v)
        for i, extras in checked.extras.items():
            entry = state[self._params[i]]
            for k in entry.extras():
                dict.__delitem__(entry, k)
            for k, v in extras.items():
                dict.__setitem__(entry, k, v)
