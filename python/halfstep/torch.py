"""halfstep.torch: a torch.optim optimizer for mixed-precision training, and the GradScaler protocol.

    model = model.float()                                      # fp32 parameters: the masters
    opt = halfstep.torch.FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    scaler = halfstep.torch.GradScaler()                      # only for fp16 autocast
    for x, y in data:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()                          # the scale lives on the device
        scaler.step(opt)                                       # check, unscale, clip, AdamW: fused
        scaler.update()
        opt.zero_grad()

FusedAdamW takes fp32 parameters (they are the masters, updated in place: the autocast recipe), or
fp16 or bf16 parameters (it keeps their fp32 masters itself and writes the rounded masters into
them). It reads the gradients wherever PyTorch put them (`.grad`, a new tensor every step or a
bucket view), needs no host synchronisation per step on CUDA tensors (the step runs halfstep's
fused kernels on the current stream and can be captured in a CUDA graph), and runs halfstep's
reference backend on CPU tensors.
"""

import contextlib as _contextlib
import ctypes as _C
import math as _math
import numbers as _numbers
import operator as _operator
import threading as _threading

import torch
import torch.distributed as _dist

from . import (BACKEND_CUDA, BACKEND_REFERENCE, BF16, F16, F32, TOTALS_MAX_WORDS, TOTALS_SUM_WORDS, HalfstepError,
               Optimizer, config, group, version)
from . import _dtensor, _fp32, _ranks, _sharding

__all__ = ["FusedAdamW", "GradScaler"]

_DTYPES = {torch.float16: F16, torch.bfloat16: BF16, torch.float32: F32}
_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_SIGN = -(2 ** 63)  # flips an int64's sign bit: unsigned order as signed order
# The scaler of a run that does not scale its loss: the scale stays 1, the inf/NaN check stays on.
_NO_LOSS_SCALING = dict(init_scale=1.0, min_scale=1.0, max_scale=1.0, growth_interval=2 ** 31 - 1)
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


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


def _check_hyperparameters(lr, betas, eps, weight_decay, where="FusedAdamW"):
    """torch.optim's rules, raising ValueError with torch.optim.AdamW's words; then halfstep's own
    (the step computes in fp32). Returns the values as floats."""
    if isinstance(lr, torch.Tensor):
        raise TypeError("%s: lr is a tensor: give a number (a rate computed on the device goes into "
                        "opt.lr_tensor(i))" % where)
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(value, bool) or not isinstance(value, _numbers.Real):
            raise ValueError("Invalid %s: %r (%s: a number)" % (name, value, where))
    try:
        betas = tuple(betas)
    except TypeError:
        raise ValueError("Invalid betas: %r (%s: a pair beta1, beta2)" % (betas, where)) from None
    if len(betas) != 2 or not all(isinstance(b, _numbers.Real) and not isinstance(b, bool) for b in betas):
        raise ValueError("Invalid betas: %r (%s: a pair of numbers)" % (betas, where))
    if not 0.0 <= lr or not _math.isfinite(lr):
        raise ValueError("Invalid learning rate: %r (%s: finite and >= 0)" % (lr, where))
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError("Invalid beta parameter at index %d: %r (%s: in [0, 1))" % (i, b, where))
    if not 0.0 <= weight_decay or not _math.isfinite(weight_decay):
        raise ValueError("Invalid weight_decay value: %r (%s: finite and >= 0)" % (weight_decay, where))
    if not eps >= 2.0 ** -126 or not _math.isfinite(eps):
        raise ValueError("Invalid epsilon value: %r (%s: halfstep needs a normal fp32 number >= 2^-126, 1.18e-38, "
                         "where torch.optim.AdamW also takes 0)" % (eps, where))
    # The step computes in fp32: a rate or decay that rounds to 0 there, or a beta that rounds to 1,
    # would silently be another value.
    for name, value in (("learning rate", lr), ("weight_decay value", weight_decay)):
        if value != 0 and _C.c_float(value).value == 0:
            raise ValueError("Invalid %s: %r (%s: it rounds to 0 in fp32, where the step computes)" % (name, value, where))
    for i, b in enumerate(betas):
        if _C.c_float(b).value >= 1.0:
            raise ValueError("Invalid beta parameter at index %d: %r (%s: it rounds to 1 in fp32)" % (i, b, where))
    if float(_C.c_float(lr).value) * float(_C.c_float(weight_decay).value) >= 1:
        raise ValueError("Invalid learning rate: %r with weight_decay %r (%s: lr * weight_decay must be < 1, the "
                         "factor 1 - lr·wd multiplies every weight each step)" % (lr, weight_decay, where))
    return float(lr), (float(betas[0]), float(betas[1])), float(eps), float(weight_decay)


def _listed(params):
    """The params argument as torch.optim takes it (an iterable of tensors or of param-group dicts),
    as a list, each group's params a list: iterators are read once, here."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                        + torch.typename(params))
    out = []
    for g in params:
        if isinstance(g, dict) and "params" in g:
            g = {**g, "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])}
        out.append(g)
    return out


class _ParamState(dict):
    """opt.state[p]: views of the parameter's fp32 master, exp_avg and exp_avg_sq (writing into
    them writes the optimizer's state), and its step count, a copy the step refreshes (the
    applied-step counter is shared by every parameter and only the step writes it)."""


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (PyTorch's formula) on fp32 masters, with halfstep's dynamic loss scaler, inf/NaN
    check, global-norm clipping and telemetry, in two fused passes.

    params: parameters (or param-group dicts with their own lr, betas, eps and weight_decay), all
        of one dtype, all on the CPU or all on one CUDA device, contiguous leaves: float32 (they
        are the masters, updated in place; their gradients fp32 — the torch.autocast recipe), or
        float16 or bfloat16 (the optimizer keeps their fp32 masters and writes the masters rounded
        to their dtype into them after each applied step).
    lr, betas, eps, weight_decay: as torch.optim.AdamW (weight_decay 1e-2, decoupled). They may
        change between steps (schedulers write param_groups); step() pushes changes to the device
        without synchronising.
    max_grad_norm: clip the unscaled global norm to this (0: no clipping), inside the fused step.
    scaler: loss-scaler options by their library names (dict or object): init_scale,
        growth_factor, backoff_factor, min_scale, max_scale, growth_interval, hysteresis,
        consecutive_hysteresis, headroom_growth, headroom_margin_log2. Default: dynamic loss
        scaling (from 2^16) for float16 parameters; none for bfloat16 and float32 ones (the scale
        stays 1, the inf/NaN check stays on) unless a GradScaler drives the optimizer.
    spike: spike-detector options: enabled, z_threshold, ema_beta, warmup_steps, action ('log'
        or 'skip'), max_consecutive, min_std.
    compute_dtype: for float32 parameters, the dtype the backward pass computed the gradients in
        (torch.float16 under fp16 autocast, the default; torch.bfloat16): the headroom and the
        subnormal count in reports are measured against its range.
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
    one (accelerate's FSDP2 preparation) or moved to other storage, it is rebuilt over them.
    """

    # torch.amp.GradScaler.step calls step() directly, with the optimizer's `grad_scale` (its
    # scale, or None when unscale_ ran) and `found_inf` set, instead of unscaling itself and
    # synchronising on found_inf: the fused step unscales and checks.
    _step_supports_amp_scaling = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, max_grad_norm=0.0,
                 scaler=None, spike=None, compute_dtype=torch.float16, process_group=None, shard=None):
        self._built = False
        params = _listed(params)
        # DTensor parameters (FSDP2, tensor parallelism): the record is all-reduced over their mesh.
        self._mesh = _dtensor.check(list(enumerate(
            t for g in params for t in (g["params"] if isinstance(g, dict) else [g]) if isinstance(t, torch.Tensor))))
        if self._mesh is not None:
            if shard:
                raise ValueError("shard=True: DTensor parameters are sharded already (FSDP2); FusedAdamW steps each "
                                 "rank's local shards (leave shard out)")
            process_group = _dtensor.mesh_group(self._mesh, process_group)
        self._pg = process_group
        self._shard = (shard is None or bool(shard)) and process_group is not None and self._mesh is None
        if process_group is None:
            self._world, self._rank = 1, 0
        else:
            if not _dist.is_available() or not _dist.is_initialized():
                raise ValueError("process_group: torch.distributed is not initialised (call "
                                 "torch.distributed.init_process_group first)")
            self._world, self._rank = _dist.get_world_size(process_group), _dist.get_rank(process_group)
            if self._rank < 0:
                raise ValueError("process_group: this process is not a member of the group")
        # With a process group, every rank must build the same optimizer or none may: a rank that
        # refused its arguments would leave the others waiting in the first collective.
        error, key = None, b""
        try:
            lr, betas, eps, weight_decay = _check_hyperparameters(lr, betas, eps, weight_decay)
            self._options = dict(max_grad_norm=_fp32(max_grad_norm, "max_grad_norm"), scaler=scaler, spike=spike,
                                 compute_dtype=compute_dtype)
            if not _math.isfinite(self._options["max_grad_norm"]) or self._options["max_grad_norm"] < 0:
                raise ValueError("Invalid max_grad_norm: %r (FusedAdamW: finite and >= 0; 0: no clipping)" % max_grad_norm)
            if compute_dtype not in _DTYPES:
                raise ValueError("FusedAdamW: compute_dtype must be torch.float16, torch.bfloat16 or torch.float32, "
                                 "got %r" % (compute_dtype,))
            key = self._construct(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        except Exception as e:  # noqa: BLE001 (re-raised below, after the ranks agreed)
            if process_group is None:
                raise
            error = e
        if process_group is not None:
            self._agree_on(error, key, "another rank refused its arguments to FusedAdamW; no rank built one",
                           "the ranks built different optimizers (parameter shapes, dtype, param groups, "
                           "hyperparameters, options or shard differ); every rank must build the same FusedAdamW")

    def _construct(self, params, defaults):
        """Checks the arguments and builds everything; returns the fingerprint the ranks of a
        process group compare."""
        super().__init__(params, defaults)
        params = [p for g in self.param_groups for p in g["params"]]
        if not params:
            raise ValueError("halfstep.torch.FusedAdamW: no parameters to optimise")
        self._check_params(params)
        self._dtype = params[0].dtype
        self._device = params[0].device
        self._scaler_options = self._options["scaler"]
        if self._scaler_options is None and self._dtype != torch.float16:
            self._scaler_options = _NO_LOSS_SCALING
        self._grad_scaler = None  # the halfstep GradScaler driving this optimizer, once one did
        self._scale_taken = False  # the loss scale was read since the last step
        # step(), state_dict(), load_state_dict(), add_param_group() and resync_weights() from several
        # threads run one at a time (the library's calls release the GIL; interleaved, updates
        # would be lost).
        self._lock = _threading.RLock()
        self._step_offsets = [0] * len(self.param_groups)  # applied steps before each group joined
        self._stepped = False  # a step was attempted (from then on the parameters are fixed)
        self._build({})
        self._built = True
        return self._fingerprint()

    def _fingerprint(self):
        layout = [_dtensor.describe(p) for p in self._params] if self._mesh is not None else None
        return repr((str(self._dtype), self._shapes, layout, self._group_of, [self._pushable(g) for g in self.param_groups],
                     float(self._options["max_grad_norm"]), bytes(self._cfg), self._shard)).encode()

    # -- building the step -------------------------------------------------------------------------

    def _library_config(self):
        cuda = self._device.type == "cuda"
        return config(dtype=_NAMES[self._dtype], backend="cuda" if cuda else "reference",
                      max_grad_norm=self._options["max_grad_norm"], scaler=self._scaler_options,
                      spike=self._options["spike"], compute_dtype=_NAMES[self._options["compute_dtype"]])

    def _build(self, carried, library_state=None):
        """Builds the state and the library's optimizer for self.param_groups. `carried` maps
        parameters to (master, exp_avg, exp_avg_sq) full-shape fp32 tensors to continue from (an
        added param group keeps the others' state); `library_state` is the state() of the optimizer
        it replaces."""
        params = [p for g in self.param_groups for p in g["params"]]
        self._params = params
        self._locals = [_dtensor.local(p) for p in params]  # what this rank holds (DTensors: the shards)
        self._group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        self._shapes = [tuple(p.shape) for p in params]
        self._pushed = [self._pushable(g) for g in self.param_groups]  # what the device holds
        cuda = self._device.type == "cuda"
        self._cfg = self._library_config()
        groups = [group(lr=h[0], beta1=h[1][0], beta2=h[1][1], eps=h[2], weight_decay=h[3], step_offset=k)
                  for h, k in zip(self._pushed, self._step_offsets)]

        # The flat parameter space and the range each rank owns (_sharding).
        numels = [t.numel() for t in self._locals]
        self._offsets = [sum(numels[:i]) for i in range(len(params))]
        self._chunk = _sharding.chunk_size(sum(numels), self._world)
        if self._mesh is not None:
            # Each rank steps its local shards, whole; every rank's table has one entry per
            # parameter (a report's tensor index is the parameter's on every rank).
            mine = [(i, 0, n, 0, _dtensor.counts_in_norm(p)) for i, (p, n) in enumerate(zip(params, numels))]
            self._tables = [mine] * self._world
        else:
            self._tables = [_sharding.rank_table(numels, self._world, r, self._pg is not None, self._shard)
                            for r in range(self._world)]
        self._pieces_of = [[] for _ in params]  # this rank's pieces of each parameter
        for i, off, length, at, _ in self._tables[self._rank]:
            self._pieces_of[i].append((off, length, at))

        with torch.no_grad():
            tensors = self._build_state(params, carried)
        self._grad_addresses = [0] * len(tensors)  # no gradient until step() sees one
        with (torch.cuda.device(self._device) if cuda else _contextlib.nullcontext()):
            if cuda:
                torch.cuda.current_stream(self._device).synchronize()  # the copies above have landed
            self._opt = Optimizer(tensors, groups, self._cfg, rank=self._rank)
            if library_state is not None:
                self._opt.set_state(library_state)
        # The live scale and applied-step counter in the library's memory; users get copies
        # (loss_scale, applied_steps, state[p]["step"]), so that only the step writes them.
        self._live_scale = _view(self._opt, self._opt.loss_scale_address(), torch.float32, self._device).view(())
        self._live_steps = _view(self._opt, self._opt.step_count_address(), torch.int64, self._device).view(())
        self._totals = _view(self._opt, self._opt.totals_address(), torch.int64, self._device,
                             TOTALS_SUM_WORDS + TOTALS_MAX_WORDS)
        self._step_copy = self._live_steps.clone()
        # What the library holds the addresses of, and the parameters' version counters: step()
        # refuses moved storage and takes weights written into the parameters as new masters.
        self._layout = self._current_layout()
        self._versions = self._current_versions()
        self._unstepped = not carried  # the first step takes the parameters as they are then
        # The groups' parameters as built: step() refuses a param_groups changed other than by
        # add_param_group.
        self._group_params = [list(g["params"]) for g in self.param_groups]
        self._fill_state()

    def _build_state(self, params, carried):
        """The masters and moments, and the tensor table over them: one entry per parameter, or per
        piece of this rank's range (shard)."""
        dev, elem = self._device, params[0].element_size()
        fp32 = self._dtype == torch.float32
        weights = [t.detach() for t in self._locals]

        def initial(i):
            if params[i] in carried:
                return carried[params[i]]
            w = weights[i]
            return (w.float().contiguous().clone(), torch.zeros(w.shape, dtype=torch.float32, device=dev),
                    torch.zeros(w.shape, dtype=torch.float32, device=dev))

        tensors = []
        if not self._shard:
            # Per parameter; the model copy is the parameter itself (fp32: the parameter is the master).
            self._masters, self._exp_avg, self._exp_avg_sq = [], [], []
            for i, w in enumerate(weights):
                m, a, s = initial(i)
                if fp32:
                    w.copy_(m.view_as(w))  # the carried master (the same values)
                    m = w
                self._masters.append(m)
                self._exp_avg.append(a.contiguous())
                self._exp_avg_sq.append(s.contiguous())
            for i, off, length, _, in_norm in self._tables[self._rank]:
                tensors.append(dict(master=self._masters[i].data_ptr() + 4 * off, grad=0,
                                    exp_avg=self._exp_avg[i].data_ptr() + 4 * off,
                                    exp_avg_sq=self._exp_avg_sq[i].data_ptr() + 4 * off,
                                    model=0 if fp32 else weights[i].data_ptr() + elem * off, numel=length,
                                    group=self._group_of[i], in_norm=in_norm))
            return tensors
        # ZeRO-1: this rank's chunk of the flat space, flat; the gradients are read where they are and
        # the new model chunk (fp32: the masters themselves) is all-gathered into the parameters.
        n = max(self._chunk, 1)
        self._masters = [torch.zeros(n, dtype=torch.float32, device=dev)]
        self._exp_avg = [torch.zeros(n, dtype=torch.float32, device=dev)]
        self._exp_avg_sq = [torch.zeros(n, dtype=torch.float32, device=dev)]
        self._model_chunk = self._masters[0] if fp32 else torch.zeros(n, dtype=self._dtype, device=dev)
        self._gathered = torch.zeros(n * self._world, dtype=self._dtype, device=dev)
        for i, off, length, at, _ in self._tables[self._rank]:
            m, a, s = initial(i)
            self._masters[0][at:at + length].copy_(m.reshape(-1)[off:off + length])
            self._exp_avg[0][at:at + length].copy_(a.reshape(-1)[off:off + length])
            self._exp_avg_sq[0][at:at + length].copy_(s.reshape(-1)[off:off + length])
            if not fp32:
                self._model_chunk[at:at + length].copy_(weights[i].reshape(-1)[off:off + length])
            tensors.append(dict(master=self._masters[0].data_ptr() + 4 * at, grad=0,
                                exp_avg=self._exp_avg[0].data_ptr() + 4 * at,
                                exp_avg_sq=self._exp_avg_sq[0].data_ptr() + 4 * at,
                                model=0 if fp32 else self._model_chunk.data_ptr() + elem * at, numel=length,
                                group=self._group_of[i]))
        return tensors

    def _fill_state(self):
        """opt.state[p] for every parameter: views of this rank's state of it."""
        self.state.clear()
        for i, p in enumerate(self._params):
            entry = _ParamState(step=self._step_copy)
            if not self._shard:
                entry.update(master=self._masters[i], exp_avg=self._exp_avg[i], exp_avg_sq=self._exp_avg_sq[i])
            else:
                # This rank's piece of the flattened parameter (ZeRO-1), where it starts in p.view(-1).
                for off, length, at in self._pieces_of[i]:
                    entry.update(master=self._masters[0][at:at + length], exp_avg=self._exp_avg[0][at:at + length],
                                 exp_avg_sq=self._exp_avg_sq[0][at:at + length], offset=off)
            self.state[p] = entry

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
        self._scale_taken = True
        return self._live_scale.clone()

    @property
    def applied_steps(self):
        """Applied steps so far (the Adam t), as a new 0-dim int64 tensor on the parameters'
        device, copied like loss_scale; skipped steps do not advance it."""
        return self._live_steps.clone()

    def _current_layout(self):
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

    # -- construction checks ---------------------------------------------------------------------

    def add_param_group(self, param_group):
        """Adds a group of parameters (Lightning's fine-tuning unfreeze does): the optimizer is
        rebuilt over every group, the existing parameters keep their masters and moments, the
        scaler, spike detector and step counters carry on. Waits for the device once. With a
        process_group, every rank must add the same group."""
        if not getattr(self, "_built", False):
            super().add_param_group(param_group)
            return
        with self._lock:
            self._follow_replaced_params()
            before = list(self.param_groups)
            error = None
            try:
                if not isinstance(param_group, dict):
                    raise TypeError("add_param_group: param_group must be a dict, got %s" % type(param_group).__name__)
                given = {k: v for k, v in param_group.items() if k in _HYPERPARAMETERS}
                merged = {**self.defaults, **given}
                _check_hyperparameters(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"],
                                       "add_param_group")
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
                    self._pushable(self.param_groups[-1]))).encode()
                try:
                    self._agree_on(error, key, "another rank refused its add_param_group; no rank added one",
                                   "the ranks added different parameter groups")
                except Exception:
                    self.param_groups[:] = before
                    raise
            self._rebuild()

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
        values as the weights). Once a step was attempted, the step refuses such changes."""
        if self._stepped:
            return
        groups = self.param_groups
        same = self._groups_as_built()
        if same and self._current_layout() == self._layout:
            return
        if len(groups) != len(self._group_params) or any(len(g["params"]) != len(b)
                                                         for g, b in zip(groups, self._group_params)):
            return  # not a swap: the step's own check names the change
        new = [p for g in groups for p in g["params"]]
        if not all(isinstance(p, torch.Tensor) and tuple(p.shape) == old_shape and p.dtype == self._dtype
                   for p, old_shape in zip(new, self._shapes)):
            return
        if self._opt.state()["attempts"] > 0:  # a loaded state: it belongs to the storage it was loaded into
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
        library_state = self._opt.state()
        if mesh is not None:
            pg = _dtensor.mesh_group(mesh, self._pg if self._mesh is not None else None)
            self._mesh, self._pg, self._shard = mesh, pg, False
            self._world, self._rank = _dist.get_world_size(pg), _dist.get_rank(pg)
        self._device = new[0].device
        self._build({}, library_state)
        self._unstepped = True
        if self._pg is not None:
            self._agree_on(None, self._fingerprint(), "another rank refused its parameters",
                           "the ranks replaced their parameters by different ones")

    def _rebuild(self):
        """A new library optimizer over the current param_groups, continuing this one's state. A
        new group counts its bias corrections from its own first step, as torch.optim does."""
        self._take_pending_weights()
        carried = self._full_state()
        library_state = self._opt.state()  # waits for the last step
        self._step_offsets += [library_state["step"]] * (len(self.param_groups) - len(self._step_offsets))
        self._build(carried, library_state)
        self._unstepped = False

    def _full_state(self):
        """Every parameter's (master, exp_avg, exp_avg_sq) as full-shape fp32 tensors (sharded: the
        ranks all-gather their chunks)."""
        old = self._params
        if not self._shard:
            return {p: (m.detach().clone().view(t.shape), a.view(t.shape), s.view(t.shape))
                    for p, t, m, a, s in zip(old, self._locals, self._masters, self._exp_avg, self._exp_avg_sq)}
        flats = []
        for chunk in (self._masters[0], self._exp_avg[0], self._exp_avg_sq[0]):
            parts = [torch.empty_like(chunk) for _ in range(self._world)]
            _dist.all_gather(parts, chunk, group=self._pg)
            flats.append(torch.cat(parts))
        return {p: tuple(f[at:at + p.numel()].clone().view(p.shape) for f in flats)
                for p, at in zip(old, self._offsets)}

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

    @staticmethod
    def _pushable(g):
        """A group's hyperparameters as the step takes them, checked (ValueError)."""
        return _check_hyperparameters(g["lr"], g["betas"], g["eps"], g["weight_decay"], "param_groups")

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
        for i, (now, then) in enumerate(zip(self._current_layout(), self._layout)):
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
        for i, (p, g) in enumerate(zip(self._locals, grads)):
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
        elem = self._params[0].element_size()
        addresses = []
        for i, off, _, _, _ in self._tables[self._rank]:
            g = grads[i]
            addresses.append(0 if g is None or g.numel() == 0 else g.data_ptr() + elem * off)
        return addresses

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
        if self._dtype == torch.float32 and not self._shard:
            self._versions = versions
            return
        with torch.no_grad():
            for i, (t, now, then) in enumerate(zip(self._locals, versions, self._versions)):
                if now == then and not everything:
                    continue
                flat = t.detach().reshape(-1)
                if not self._shard:
                    self._take(self._masters[i].view(-1), None, flat)
                    continue
                fp32 = self._dtype == torch.float32
                for off, length, at in self._pieces_of[i]:
                    self._take(self._masters[0][at:at + length], None if fp32 else self._model_chunk[at:at + length],
                               flat[off:off + length])
        self._versions = versions

    @staticmethod
    def _take(master, model, weights):
        changed = weights != master.to(weights.dtype)
        master.copy_(torch.where(changed, weights.float(), master))
        if model is not None:
            model.copy_(weights)

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

    def _prepare(self):
        """Everything step() checks and pushes before the library runs; raises before anything
        changed. Returns the stream."""
        if not self._groups_as_built():
            self._refuse_changed_groups()
        if self._current_layout() != self._layout:
            self._refuse_moved_storage()
        hyper = [self._pushable(g) for g in self.param_groups]
        addresses = self._gradients()
        torch_scale = self.__dict__.get("grad_scale", _ABSENT)  # set by torch.amp.GradScaler.step
        if torch_scale is _ABSENT and not self._scale_taken and self._needs_scaled_loss():
            raise RuntimeError(
                "FusedAdamW.step(): float16 gradients need a scaled loss, and nothing read the loss scale since the "
                "last step: multiply the loss by opt.loss_scale before backward(), or use "
                "halfstep.torch.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()). "
                "Without loss scaling, build the optimizer with scaler=dict(init_scale=1, min_scale=1, max_scale=1)")
        if torch_scale is not _ABSENT and torch_scale is not None:
            if not isinstance(torch_scale, torch.Tensor) or torch_scale.numel() != 1:
                raise RuntimeError("FusedAdamW.step(): grad_scale (set by torch.amp.GradScaler) must be a 1-element "
                                   "tensor, got %r" % (torch_scale,))
        # Checked; from here on, changes.
        stream = self._stream()
        self._take_pending_weights()
        for i, h in enumerate(hyper):
            if h != self._pushed[i]:
                if h[1:] == self._pushed[i][1:]:
                    self._opt.set_lr(i, h[0], stream)  # ordered before this step on the stream
                else:
                    self._opt.set_group(i, group(lr=h[0], beta1=h[1][0], beta2=h[1][1], eps=h[2], weight_decay=h[3],
                                                 step_offset=self._step_offsets[i]), stream)
                self._pushed[i] = h
        if addresses != self._grad_addresses:
            self._opt.set_gradients(addresses, stream)
            self._grad_addresses = addresses
        if torch_scale is not _ABSENT:
            # torch.amp.GradScaler scaled the loss with its own scale (or unscale_ divided the
            # gradients by it: None): the step unscales by that, and the GradScaler moves its scale.
            if torch_scale is None:
                self._opt.mark_unscaled(stream)
            else:
                self._live_scale.copy_(torch_scale.reshape(()).to(self._live_scale.device, torch.float32))
        return stream

    def _needs_scaled_loss(self):
        """fp16 gradients with a loss scale other than a constant 1: a loss the backward pass did
        not multiply by the scale would be unscaled by it, silently wrong."""
        c = self._cfg
        return self._dtype == torch.float16 and not (c.init_scale == c.min_scale == c.max_scale == 1.0)

    @torch.no_grad()
    def step(self, closure=None):
        """One step on the current stream: check, unscale, clip, AdamW, the parameters' new values.
        Never waits for the device (CPU tensors: runs at once)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ctx = torch.cuda.device(self._device) if self._device.type == "cuda" else _contextlib.nullcontext()
        with self._lock, ctx:
            self._follow_replaced_params()
            if self._pg is None:
                self._opt.step(self._prepare())
            else:
                # A rank whose own checks refuse this step still takes part, without its
                # gradients, so that the others do not wait for it in the all-reduce: every rank
                # skips the step (reason rank_refused), then this rank raises.
                refused = None
                try:
                    stream = self._prepare()
                except Exception as e:  # noqa: BLE001 (re-raised below, after the collectives)
                    refused, stream = e, self._stream()
                if refused is None:
                    self._opt.step_local(stream)
                else:
                    self._opt.step_local_refused(stream)
                # The record: SUM over the first words, MAX over the last (as int64: the keys'
                # sign bit flipped so that signed order is their unsigned order).
                total, top = self._totals[:TOTALS_SUM_WORDS], self._totals[TOTALS_SUM_WORDS:]
                top.bitwise_xor_(_SIGN)
                _dist.all_reduce(total, op=_dist.ReduceOp.SUM, group=self._pg)
                _dist.all_reduce(top, op=_dist.ReduceOp.MAX, group=self._pg)
                top.bitwise_xor_(_SIGN)
                self._opt.step_finish(stream)
                if self._shard:
                    self._gather()
                if refused is not None:
                    self._step_copy.copy_(self._live_steps)
                    raise refused
            self._step_copy.copy_(self._live_steps)
            self._scale_taken = False
            self._stepped = True
        return loss

    def _gather(self):
        """Every rank's chunk of the model copy into every parameter."""
        parts = list(self._gathered.view(torch.uint8).chunk(self._world))
        _dist.all_gather(parts, self._model_chunk.view(torch.uint8), group=self._pg)
        flat = self._gathered
        for p, at in zip(self._params, self._offsets):
            p.detach().view(-1).copy_(flat[at:at + p.numel()])
        self._versions = self._current_versions()  # our own writes

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
            r["first_nonfinite_tensor"] = self._tables[r["first_nonfinite_rank"]][r["first_nonfinite_tensor"]][0]
        return r

    def lr_tensor(self, group_index):
        """A 0-dim fp32 tensor over the device memory the next step reads group `group_index`'s
        learning rate from: a schedule computed on the device writes it (copy_) without a
        synchronisation. param_groups[i]['lr'] changes still win when step() sees them."""
        if not isinstance(group_index, int) or not 0 <= group_index < len(self.param_groups):
            raise IndexError("lr_tensor: group_index must be in [0, %d), got %r" % (len(self.param_groups), group_index))
        return _view(self._opt, self._opt.device_lr_address(group_index), torch.float32, self._device).view(())

    def scaler_state(self):
        """The loss scaler, spike detector and step counters; waits for the last step."""
        self._scale_taken = True
        return self._opt.state()

    # -- checkpoints -----------------------------------------------------------------------------

    @torch.no_grad()
    def state_dict(self):
        """Masters, moments, the groups' hyperparameters and the halfstep state (the scaler, the
        spike detector, the counters): torch.save writes it, load_state_dict resumes bitwise. With
        a process_group it holds this rank's shard and is loaded by the same rank of the same world.
        Weights written into the parameters since the last step (a model's load_state_dict, a
        broadcast before the first step, an in-place edit) are taken into the masters first, as
        the next step would take them, so the state_dict resumes the weights the model holds.
        Runs the optimizer's state_dict pre and post hooks (PyTorch >= 2.1)."""
        with self._lock:
            for hook in getattr(self, "_optimizer_state_dict_pre_hooks", {}).values():
                hook(self)
            self._follow_replaced_params()
            self._take_pending_weights()
            sd = self._state_dict()
            for hook in getattr(self, "_optimizer_state_dict_post_hooks", {}).values():
                result = hook(self, sd)
                if result is not None:
                    sd = result
            return sd

    def _state_dict(self):
        groups = []
        index = 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(d)
        state = {}
        for i, (m, a, s) in enumerate(zip(self._masters, self._exp_avg, self._exp_avg_sq)):
            state[i] = {"master": m.detach().clone(), "exp_avg": a.detach().clone(), "exp_avg_sq": s.detach().clone()}
            if self._mesh is not None:
                # DTensors laid out as the parameter: torch.distributed.checkpoint saves them
                # sharded and loads them into any other number of ranks.
                state[i] = {k: _dtensor.like(v.view(self._locals[i].shape), self._params[i]) for k, v in state[i].items()}
        return {"state": state, "param_groups": groups,
                # The library's state as a uint8 tensor: torch.load(weights_only=True) reads it.
                "halfstep": {"version": version(),
                             "optimizer_state": torch.frombuffer(bytearray(self._opt.save_state()), dtype=torch.uint8),
                             "world": self._world, "rank": self._rank, "shapes": list(self._shapes),
                             "dtype": _NAMES[self._dtype], "shard": self._shard,
                             "pushed": [[h[0], list(h[1]), h[2], h[3]] for h in self._pushed],
                             "step_offsets": list(self._step_offsets)}}

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
            self._load_state_dict(state_dict)
            for hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
                hook(self)

    def _load_state_dict(self, state_dict):
        self._follow_replaced_params()
        error = None
        try:
            state, groups, blob, pushed, offsets = self._checked(state_dict)
            before = self._opt.save_state()
            self._opt.load_state(blob)  # checks the state against the config, then takes it
        except Exception as e:  # noqa: BLE001 (re-raised below, after the ranks agreed)
            if self._pg is None:
                raise
            error = e
        if self._pg is not None:
            # Every rank holds the same library state (scaler, counters, rates): the ranks compare
            # it, so that checkpoints of different steps are not mixed.
            all_ok, same = _ranks.agree(self._pg, self._collective_device(), error is None,
                                        blob if error is None else b"")
            if error is None and not (all_ok and same):
                self._opt.load_state(before)  # keep what this rank had
                error = ValueError("load_state_dict: " + (
                    "another rank of the process group refused its state_dict" if not all_ok else
                    "the ranks' state_dicts hold different optimizer states (scaler, counters or rates): they "
                    "were not saved at the same step") + "; no rank loaded anything")
        if error is not None:
            raise error
        with torch.no_grad():
            for i, (m, a, s) in enumerate(zip(self._masters, self._exp_avg, self._exp_avg_sq)):
                m.copy_(state[i]["master"].view(m.shape))
                a.copy_(state[i]["exp_avg"])
                s.copy_(state[i]["exp_avg_sq"])
            # The parameters are the masters rounded to their dtype (round to nearest even, as the
            # step writes them), so the model resumes exactly without its own state_dict.
            if self._shard:
                if self._dtype != torch.float32:
                    self._model_chunk.copy_(self._masters[0])
                self._gather()
            elif self._dtype != torch.float32:
                for t, m in zip(self._locals, self._masters):
                    t.detach().copy_(m.view_as(t))
        self._versions = self._current_versions()  # our own writes
        self._unstepped = False  # the masters are the checkpoint's, not the rounded parameters
        self._step_copy.copy_(self._live_steps)
        # The device holds the hyperparameters of the saved optimizer (also a rate written through
        # lr_tensor), param_groups the saved values, and the values the saved optimizer last pushed
        # decide, as they would have there, whether the next step pushes param_groups' again.
        self._pushed = pushed
        self._step_offsets = offsets
        for mine, saved in zip(self.param_groups, groups):
            for key, value in saved.items():
                if key != "params":
                    mine[key] = value

    def _checked(self, state_dict):
        """The parts of a state_dict, each checked against this optimizer; raises naming what
        does not match."""
        hs = state_dict.get("halfstep") if isinstance(state_dict, dict) else None
        if not isinstance(hs, dict) or "optimizer_state" not in hs:
            raise ValueError("load_state_dict: not a halfstep.torch.FusedAdamW state_dict (no 'halfstep' entry)")
        if self._mesh is None and (hs.get("world") != self._world or hs.get("rank") != self._rank):
            raise ValueError("load_state_dict: written by rank %s of %s ranks; this is rank %d of %d" %
                             (hs.get("rank"), hs.get("world"), self._rank, self._world))
        shapes = [tuple(x) for x in hs.get("shapes", ())] if isinstance(hs.get("shapes"), (list, tuple)) else None
        if shapes != self._shapes or hs.get("shard") != self._shard:
            raise ValueError("load_state_dict: written for parameters of shapes %s (shard=%s); this optimizer's are "
                             "%s (shard=%s)" % (shapes, hs.get("shard"), self._shapes, self._shard))
        if hs.get("dtype", _NAMES[self._dtype]) != _NAMES[self._dtype]:
            raise ValueError("load_state_dict: written for %s parameters; this optimizer's are %s"
                             % (hs.get("dtype"), _NAMES[self._dtype]))
        groups = state_dict.get("param_groups", [])
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self.param_groups):
            raise ValueError("load_state_dict: %s parameter groups, this optimizer has %d" %
                             (len(groups) if isinstance(groups, (list, tuple)) else "no list of",
                              len(self.param_groups)))
        for i, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, dict) or not all(k in saved for k in ("params",) + _HYPERPARAMETERS):
                raise ValueError("load_state_dict: param_groups[%d] must be a dict with params, lr, betas, eps and "
                                 "weight_decay" % i)
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError("load_state_dict: param_groups[%d] has %d parameters, this optimizer's %d" %
                                 (i, len(saved["params"]), len(mine["params"])))
            _check_hyperparameters(saved["lr"], saved["betas"], saved["eps"], saved["weight_decay"],
                                   "load_state_dict: param_groups[%d]" % i)
        pushed = hs.get("pushed")
        if pushed is None and isinstance(hs.get("pushed_lr"), (list, tuple)):  # halfstep 0.2's state_dict
            pushed = [[lr, g.get("betas"), g.get("eps"), g.get("weight_decay")]
                      for lr, g in zip(hs["pushed_lr"], groups)] if len(hs["pushed_lr"]) == len(groups) else None
        if not isinstance(pushed, (list, tuple)) or len(pushed) != len(self.param_groups):
            raise ValueError("load_state_dict: ['halfstep']['pushed'] must hold one entry per group")
        try:
            pushed = [_check_hyperparameters(h[0], h[1], h[2], h[3], "load_state_dict: ['halfstep']['pushed']")
                      for h in pushed]
        except (TypeError, IndexError, KeyError):
            raise ValueError("load_state_dict: ['halfstep']['pushed'] must hold (lr, betas, eps, weight_decay) "
                             "per group") from None
        state = state_dict.get("state", {})
        if self._mesh is not None:
            state = self._local_state(state)
        for i, m in enumerate(self._masters):
            entry = state.get(i) if isinstance(state, dict) else None
            if not isinstance(entry, dict):
                raise ValueError("load_state_dict: no state for tensor %d" % i)
            for key in ("master", "exp_avg", "exp_avg_sq"):
                t = entry.get(key)
                if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != self._exp_avg[i].shape:
                    raise ValueError("load_state_dict: state[%d]['%s'] must be a float32 tensor of shape %s" %
                                     (i, key, tuple(self._exp_avg[i].shape)))
                if not bool(torch.isfinite(t).all()):
                    raise ValueError("load_state_dict: state[%d]['%s'] holds inf or NaN: an applied step never "
                                     "writes one, so this state was not written by a step" % (i, key))
            if bool((entry["exp_avg_sq"] < 0).any()):
                raise ValueError("load_state_dict: state[%d]['exp_avg_sq'] holds negative values" % i)
            if not bool(torch.isfinite(entry["master"].to(self._dtype)).all()):
                raise ValueError("load_state_dict: state[%d]['master'] holds values past %s's range: the parameters "
                                 "could not hold them" % (i, str(self._dtype)[6:]))
        offsets = hs.get("step_offsets", [0] * len(self.param_groups))
        if not isinstance(offsets, (list, tuple)) or len(offsets) != len(self.param_groups) or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in offsets):
            raise ValueError("load_state_dict: ['halfstep']['step_offsets'] must hold one step count >= 0 per group")
        blob = hs["optimizer_state"]
        blob = bytes(blob.tolist()) if isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8 else blob
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError("load_state_dict: ['halfstep']['optimizer_state'] must be a uint8 tensor")
        return state, groups, bytes(blob), pushed, list(offsets)

    def _local_state(self, state):
        """A DTensor optimizer's state entries as this rank's local tensors: DTensors laid out as
        their parameter (what state_dict() gives, also after torch.distributed.checkpoint loaded
        it on another number of ranks), or whole tensors of the parameter's global shape (a
        gathered state_dict), of which each rank takes its own piece."""
        if not isinstance(state, dict):
            return state
        out = {}
        for i, entry in state.items():
            if not isinstance(i, int) or not 0 <= i < len(self._params) or not isinstance(entry, dict):
                out[i] = entry
                continue
            p, local = self._params[i], {}
            for key, t in entry.items():
                if _dtensor.is_dtensor(t):
                    if t.device_mesh != p.device_mesh or t.placements != p.placements or t.shape != p.shape:
                        raise ValueError("load_state_dict: state[%d]['%s'] is a DTensor of shape %s with placements %s "
                                         "on %s; parameter %d's are %s, %s on %s: load it with "
                                         "torch.distributed.checkpoint into this optimizer's state_dict()"
                                         % (i, key, tuple(t.shape), t.placements, t.device_mesh, i, tuple(p.shape),
                                            p.placements, p.device_mesh))
                    t = _dtensor.local(t)
                elif isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(p.shape) and t.shape != self._locals[i].shape:
                    t = _dtensor.piece(t, p)
                local[key] = t
            out[i] = local
        return out

    # -- the GradScaler protocol -------------------------------------------------------------------

    def _attach(self, scaler, options):
        """Makes `scaler` (a halfstep GradScaler) the one that drives this optimizer: before the
        first step the loss scaler takes its options (a rebuild); after it, they must be the ones
        it has."""
        with self._lock:
            if self._grad_scaler is scaler:
                return
            if self._grad_scaler is not None:
                raise ValueError("this FusedAdamW is driven by another halfstep GradScaler: one GradScaler per "
                                 "optimizer (the loss scale lives in the optimizer)")
            wanted = config(scaler=options)
            if any(getattr(wanted, f) != getattr(self._cfg, f) for f in _SCALER_FIELDS):
                if self._opt.state()["attempts"] > 0:
                    raise ValueError("halfstep GradScaler: this FusedAdamW has stepped with other loss-scaler options "
                                     "(%r); build it with scaler=%r, or let the GradScaler drive it from the first "
                                     "step" % (self._scaler_options, options))
                self._scaler_options = options
                self._take_pending_weights()
                self._build(self._full_state() if not self._shard else {})
            self._grad_scaler = scaler


_ABSENT = object()
# The halfstep_config fields of the loss scaler.
_SCALER_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale", "growth_interval",
                  "hysteresis", "consecutive_hysteresis", "headroom_growth", "headroom_margin_log2")


class GradScaler:
    """The torch.amp.GradScaler protocol over a halfstep FusedAdamW, so that loops written for
    GradScaler run unchanged — scale(loss), unscale_(opt), step(opt), update(), get_scale(),
    is_enabled(), state_dict(), load_state_dict() — with the step fused and the scale on the
    device: no host synchronisation, and the decisions and scale sequence of GradScaler's rules
    (back off by backoff_factor on an inf/NaN, grow by growth_factor after growth_interval clean
    steps). The optimizer's own loss scaler does the work: the GradScaler gives it these options
    (before its first step) and reads and writes its scale.

    Without unscale_ the step stays one fused pass over the gradients (clip with the optimizer's
    max_grad_norm). unscale_(opt) really divides the gradients by the scale (fp32 and bf16 ones),
    for code that clips them itself (clip_grad_norm_); the step then unscales by 1. One GradScaler
    drives one FusedAdamW. Extra keyword options are the library's scaler options (hysteresis,
    min_scale, max_scale, ...); max_scale defaults to 2^127 here (GradScaler has none)."""

    def __init__(self, device="cuda", init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, enabled=True, **options):
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError("GradScaler: device must be a device name or torch.device, got %r (give init_scale by "
                            "keyword); the scale lives on the device of the optimizer's parameters" % (device,))
        self._enabled = bool(enabled)
        self._options = dict(init_scale=float(init_scale), growth_factor=float(growth_factor),
                             backoff_factor=float(backoff_factor), growth_interval=growth_interval,
                             max_scale=2.0 ** 127)
        self._options.update(options)
        config(scaler=self._options)  # the library's rules, checked now (ValueError / HalfstepError)
        self._optimizer = None
        self._unscaled = False   # unscale_ ran since the last update
        self._stepped = False    # step ran since the last update
        self._scaled = False     # scale() ran before an optimizer was known
        self._pending_tracker = None  # a loaded _growth_tracker, for the optimizer it will drive

    def _bind(self, optimizer):
        if not isinstance(optimizer, FusedAdamW):
            raise TypeError("halfstep.torch.GradScaler drives a halfstep.torch.FusedAdamW, got %s (for other "
                            "optimizers, use torch.amp.GradScaler)" % type(optimizer).__name__)
        if self._optimizer is not None and self._optimizer is not optimizer:
            raise ValueError("this halfstep GradScaler drives another FusedAdamW: one GradScaler per optimizer (the "
                             "loss scale lives in the optimizer)")
        if self._optimizer is None:
            optimizer._attach(self, dict(self._options))
            self._optimizer = optimizer
            if self._scaled:
                optimizer._scale_taken = True
            if self._pending_tracker is not None:
                self._set_tracker(self._pending_tracker)
                self._pending_tracker = None

    def is_enabled(self):
        return self._enabled

    def scale(self, outputs):
        """outputs (a tensor, or tensors in lists, tuples and dicts) times the loss scale, on the
        device: no synchronisation."""
        if not self._enabled:
            return outputs
        if self._optimizer is not None:
            factor = self._optimizer.loss_scale  # marks the scale as taken
        else:
            factor = None
            self._scaled = True

        def apply(x):
            nonlocal factor
            if isinstance(x, torch.Tensor):
                if factor is None:
                    factor = torch.full((), self._options["init_scale"], dtype=torch.float32, device=x.device)
                return x * factor.to(x.device)
            if isinstance(x, (list, tuple)):
                return type(x)(apply(v) for v in x)
            if isinstance(x, dict):
                return {k: apply(v) for k, v in x.items()}
            raise ValueError("outputs must be a tensor or an iterable of tensors")
        return apply(outputs)

    @torch.no_grad()
    def unscale_(self, optimizer):
        """Divides the optimizer's gradients by the loss scale in place, on the device, so that the
        caller can clip them (clip_grad_norm_); the next step unscales by 1 instead. fp16 gradients
        are refused, as GradScaler refuses them: unscaled, the values loss scaling keeps from
        underflowing would underflow — clip with FusedAdamW(max_grad_norm=...) instead."""
        if not self._enabled:
            return
        self._bind(optimizer)
        if self._unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if self._stepped:
            raise RuntimeError("unscale_() is being called after step().")
        if optimizer._dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients: halfstep.torch.GradScaler.unscale_ refuses them, as "
                             "torch.amp.GradScaler does; clip inside the fused step with FusedAdamW(max_grad_norm=...)")
        ctx = torch.cuda.device(optimizer._device) if optimizer._device.type == "cuda" else _contextlib.nullcontext()
        with optimizer._lock, ctx:
            inverse = 1.0 / optimizer._live_scale.clone()  # fp32, as GradScaler's inv_scale
            grads = [p.grad for p in optimizer._params if p.grad is not None]
            for g in grads:
                g.mul_(inverse)
            optimizer._opt.mark_unscaled(optimizer._stream())
            optimizer._scale_taken = True
        self._unscaled = True

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(): the fused step checks, unscales (by the scale, or by 1 after
        unscale_), clips and applies or skips, and moves the scale, all on the device. Returns
        what optimizer.step() returns (None: whether the step was applied is in
        optimizer.last_report(), which waits for it)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._bind(optimizer)
        if self._stepped:
            raise RuntimeError("step() has already been called since the last update().")
        retval = optimizer.step(*args, **kwargs)
        self._stepped = True
        return retval

    def update(self, new_scale=None):
        """The fused step already moved the scale by GradScaler's rules; update() starts the next
        iteration. new_scale (a float or a 1-element tensor) sets the scale, as GradScaler's does
        (a tensor is read on the host: one synchronisation)."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            if self._optimizer is None:
                self._options["init_scale"] = value
            else:
                opt = self._optimizer
                with opt._lock:
                    opt._opt.set_loss_scale(value, opt._stream())
        self._unscaled = False
        self._stepped = False

    def get_scale(self):
        """The loss scale for the next step, as a Python float (waits for the last step); 1.0 when
        disabled."""
        if not self._enabled:
            return 1.0
        if self._optimizer is None:
            return float(self._options["init_scale"])
        return float(self._optimizer._opt.loss_scale())

    def get_growth_factor(self):
        return self._options["growth_factor"]

    def get_backoff_factor(self):
        return self._options["backoff_factor"]

    def get_growth_interval(self):
        return self._options["growth_interval"]

    def _get_growth_tracker(self):
        return 0 if self._optimizer is None else int(self._optimizer._opt.state()["good_steps"])

    def state_dict(self):
        """GradScaler's state_dict: scale, growth_factor, backoff_factor, growth_interval,
        _growth_tracker (waits for the last step). The optimizer's own state_dict holds the same
        scaler state, exactly."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._options["growth_factor"],
                "backoff_factor": self._options["backoff_factor"], "growth_interval": self._options["growth_interval"],
                "_growth_tracker": self._get_growth_tracker()}

    def load_state_dict(self, state_dict):
        """Takes GradScaler's state_dict: the scale and the growth tracker (the other entries must
        be this GradScaler's options). Loaded after the optimizer's own state_dict, it restores the
        same values."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        for key in ("growth_factor", "backoff_factor", "growth_interval"):
            if key in state_dict and state_dict[key] != self._options[key]:
                raise ValueError("load_state_dict: %s is %r in the state_dict and %r here: the scaler's rules are fixed "
                                 "when it drives an optimizer" % (key, state_dict[key], self._options[key]))
        scale = float(state_dict["scale"])
        tracker = int(state_dict.get("_growth_tracker", 0))
        if self._optimizer is None:
            self._options["init_scale"] = scale
            self._pending_tracker = tracker
            return
        opt = self._optimizer
        with opt._lock:
            s = opt._opt.state()
            s["scale"] = scale
            s["good_steps"] = tracker
            opt._opt.set_state(s)

    def _set_tracker(self, tracker):
        opt = self._optimizer
        with opt._lock:
            s = opt._opt.state()
            s["good_steps"] = tracker
            opt._opt.set_state(s)
