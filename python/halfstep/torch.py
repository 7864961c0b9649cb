"""halfstep.torch: a torch.optim optimizer for fp16 and bf16 models with fp32 master weights.

    opt = halfstep.torch.FusedAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    for x, y in data:
        loss = loss_fn(model(x), y)
        (loss * opt.loss_scale).backward()   # the scale lives on the device: no synchronisation
        opt.step()                           # check, unscale, clip, AdamW, new fp16 weights
        opt.zero_grad()

The optimizer owns the fp32 masters and Adam moments; after an applied step the parameters hold
the new weights rounded to their dtype. The gradients live in buffers the optimizer attached to
the parameters (`.grad`), which autograd accumulates into; step() refuses a `.grad` that was
replaced. On CUDA tensors the step runs halfstep's fused kernels on the current stream and never
synchronises (the whole training step can be captured in a CUDA graph); on CPU tensors it runs
halfstep's reference backend.
"""

import contextlib as _contextlib
import ctypes as _C
import math as _math
import numbers as _numbers
import operator as _operator
import threading as _threading

import torch
import torch.distributed as _dist

from . import (BACKEND_CUDA, BACKEND_REFERENCE, BF16, F16, TOTALS_MAX_WORDS, TOTALS_SUM_WORDS, HalfstepError,
               Optimizer, config, group, version)
from . import _fp32, _ranks, _sharding

__all__ = ["FusedAdamW"]

_DTYPES = {torch.float16: F16, torch.bfloat16: BF16}
_SIGN = -(2 ** 63)  # flips an int64's sign bit: unsigned order as signed order


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


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (PyTorch's formula) on fp32 masters for fp16 or bf16 parameters, with halfstep's
    dynamic loss scaler, inf/NaN check, global-norm clipping and telemetry.

    params: fp16 or bf16 parameters (or param-group dicts with their own lr, betas, eps and
        weight_decay), all of one dtype, all on the CPU or all on one CUDA device, contiguous,
        leaves, not sharing storage.
    max_grad_norm: clip the unscaled global norm to this (0: no clipping).
    scaler: loss-scaler options by their library names (dict or object): init_scale,
        growth_factor, backoff_factor, min_scale, max_scale, growth_interval, hysteresis,
        consecutive_hysteresis, headroom_growth, headroom_margin_log2.
    spike: spike-detector options: enabled, z_threshold, ema_beta, warmup_steps, action ('log'
        or 'skip'), max_consecutive, min_std.
    process_group: a torch.distributed group whose ranks take one step together: they all-reduce
        the step's totals record (the split step), so every rank takes the same decision with the
        same global norm (bitwise the one process would compute) and holds the same report. The
        gradients must already be reduced across the ranks (DistributedDataParallel with its
        default gradient_as_bucket_view=False, or your own all-reduce into .grad).
    shard: with a process_group, True (the default) shards the optimizer state (ZeRO-1): each rank
        keeps the masters and moments of a 1/world chunk of the flat parameter space (cut
        anywhere, also mid-parameter), updates that chunk, and the new parameters are
        all-gathered. False keeps all of the state on every rank (plain data parallelism): each
        rank checks all of its gradients, counts its chunk in the norm, and updates everything.

    Only the learning rate may change after construction (schedulers write
    param_groups[i]["lr"]; step() pushes a change to the device without synchronising); other
    hyperparameters are fixed, and changing them raises.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, *, max_grad_norm=0.0,
                 scaler=None, spike=None, process_group=None, shard=True):
        self._built = False
        self._pg = process_group
        self._shard = bool(shard) and process_group is not None
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
            key = self._construct(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                                  max_grad_norm, scaler, spike)
        except Exception as e:  # noqa: BLE001 (re-raised below, after the ranks agreed)
            if process_group is None:
                raise
            error = e
        if process_group is not None:
            self._agree_on_config(error, key)

    def _construct(self, params, defaults, max_grad_norm, scaler, spike):
        """Checks the arguments, builds the state and the library's optimizer; returns the
        fingerprint the ranks of a process group compare."""
        super().__init__(params, defaults)
        params = [p for g in self.param_groups for p in g["params"]]
        if not params:
            raise ValueError("halfstep.torch.FusedAdamW: no parameters to optimise")
        self._params = params
        self._check_params(params)
        self._dtype = params[0].dtype
        self._device = params[0].device
        cuda = self._device.type == "cuda"
        self._hparams = [self._fixed(g) for g in self.param_groups]
        self._lrs = [self._lr_of(g, i, self._hparams[i][2]) for i, g in enumerate(self.param_groups)]
        groups = [group(lr=self._lrs[i], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                        weight_decay=g["weight_decay"]) for i, g in enumerate(self.param_groups)]
        cfg = config(dtype=_DTYPES[self._dtype], backend=BACKEND_CUDA if cuda else BACKEND_REFERENCE,
                     max_grad_norm=max_grad_norm, scaler=scaler, spike=spike)
        self._group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        self._shapes = [tuple(p.shape) for p in params]

        # The flat parameter space and the range each rank owns (_sharding).
        numels = [p.numel() for p in params]
        self._offsets = [sum(numels[:i]) for i in range(len(params))]
        self._chunk = _sharding.chunk_size(sum(numels), self._world)
        self._tables = [_sharding.rank_table(numels, self._world, r, self._pg is not None, self._shard)
                        for r in range(self._world)]
        self._pieces_of = [[] for _ in params]  # this rank's pieces of each parameter
        for i, off, length, at, _ in self._tables[self._rank]:
            self._pieces_of[i].append((off, length, at))

        # Persistent gradient buffers, attached as .grad: autograd accumulates into them in place.
        self._grads = []
        with torch.no_grad():
            for p in params:
                buf = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if p.grad is not None:
                    buf.copy_(p.grad)
                p.grad = buf
                self._grads.append(buf)
            tensors = self._build_state(params)
        with (torch.cuda.device(self._device) if cuda else _contextlib.nullcontext()):
            if cuda:
                torch.cuda.current_stream(self._device).synchronize()  # the copies above have landed
            self._opt = Optimizer(tensors, groups, cfg, rank=self._rank)
        # The live scale and applied-step counter in the library's memory; users get copies
        # (loss_scale, applied_steps), so that only the step writes them.
        self._live_scale = _view(self._opt, self._opt.loss_scale_address(), torch.float32, self._device).view(())
        self._live_steps = _view(self._opt, self._opt.step_count_address(), torch.int64, self._device).view(())
        self._totals = _view(self._opt, self._opt.totals_address(), torch.int64, self._device,
                             TOTALS_SUM_WORDS + TOTALS_MAX_WORDS)
        # What the library holds the addresses of, and the parameters' version counters: step()
        # refuses moved storage and takes weights written into the parameters as new masters.
        self._layout = self._current_layout()
        self._versions = [p._version for p in params]
        self._unstepped = True  # the first step takes the parameters as they are then
        # The groups' parameters as built: the tensor table is fixed, so step() refuses a
        # param_groups whose structure changed.
        self._group_params = [list(g["params"]) for g in self.param_groups]
        # step(), state_dict(), load_state_dict() and resync_weights() from several threads run one
        # at a time (the library's calls release the GIL; interleaved, updates would be lost).
        self._lock = _threading.RLock()
        self._built = True
        return repr((str(self._dtype), self._shapes, self._group_of, self._hparams, self._lrs, float(max_grad_norm),
                     bytes(cfg), self._shard)).encode()

    @property
    def loss_scale(self):
        """The loss scale for the next backward pass: a new 0-dim fp32 tensor on the parameters'
        device, copied from the optimizer's own memory on the current stream (no synchronisation;
        inside a captured CUDA graph, the copy replays with it). Writing into it changes nothing:
        only the step moves the scale."""
        return self._live_scale.clone()

    @property
    def applied_steps(self):
        """Applied steps so far (the Adam t), as a new 0-dim int64 tensor on the parameters'
        device, copied like loss_scale; skipped steps do not advance it."""
        return self._live_steps.clone()

    def _current_layout(self):
        return ([(p.data_ptr(), p.numel(), p.dtype) for p in self._params],
                [(g.data_ptr(), g.numel(), g.dtype) for g in self._grads])

    def _collective_device(self):
        """Where the group's backend reduces: the current CUDA device for NCCL, else the CPU."""
        if _dist.get_backend(self._pg) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _agree_on_config(self, error, key):
        """Every rank of the group must build the same optimizer: the ranks compare whether each
        built one, and a fingerprint of the parameters' shapes and dtype, the groups, the options
        and the mode; if any rank refused its arguments or any fingerprint differs, every rank
        raises (rather than let collectives hang or mix up data)."""
        all_ok, same = _ranks.agree(self._pg, self._collective_device(), error is None, key)
        if error is not None:
            raise error
        if not all_ok:
            raise ValueError("process_group: another rank refused its arguments to FusedAdamW; no rank built one")
        if not same:
            raise ValueError("process_group: the ranks built different optimizers (parameter shapes, dtype, "
                             "param groups, hyperparameters, options or shard differ); every rank must build the "
                             "same FusedAdamW")

    def _build_state(self, params):
        """The masters and moments (fp32, from the parameters) and the tensor table over them."""
        dev, elem = self._device, params[0].element_size()
        tensors = []
        if not self._shard:
            # One master and two moments per parameter; the model copy is the parameter itself.
            self._masters = [p.detach().float().contiguous().clone() for p in params]
            self._exp_avg = [torch.zeros_like(m) for m in self._masters]
            self._exp_avg_sq = [torch.zeros_like(m) for m in self._masters]
            for i, off, length, _, in_norm in self._tables[self._rank]:
                tensors.append(dict(master=self._masters[i].data_ptr() + 4 * off,
                                    grad=self._grads[i].data_ptr() + elem * off,
                                    exp_avg=self._exp_avg[i].data_ptr() + 4 * off,
                                    exp_avg_sq=self._exp_avg_sq[i].data_ptr() + 4 * off,
                                    model=params[i].data_ptr() + elem * off, numel=length,
                                    group=self._group_of[i], in_norm=in_norm))
            return tensors
        # ZeRO-1: this rank's chunk of the flat space, flat; the gradients are read where they are and
        # the new model chunk is all-gathered into the parameters after each step.
        n = max(self._chunk, 1)
        self._masters = [torch.zeros(n, dtype=torch.float32, device=dev)]
        self._exp_avg = [torch.zeros(n, dtype=torch.float32, device=dev)]
        self._exp_avg_sq = [torch.zeros(n, dtype=torch.float32, device=dev)]
        self._model_chunk = torch.zeros(n, dtype=self._dtype, device=dev)
        self._gathered = torch.zeros(n * self._world, dtype=self._dtype, device=dev)
        for i, off, length, at, _ in self._tables[self._rank]:
            src = params[i].detach().reshape(-1)[off:off + length]
            self._masters[0][at:at + length].copy_(src.float())
            self._model_chunk[at:at + length].copy_(src)
            tensors.append(dict(master=self._masters[0].data_ptr() + 4 * at, grad=self._grads[i].data_ptr() + elem * off,
                                exp_avg=self._exp_avg[0].data_ptr() + 4 * at,
                                exp_avg_sq=self._exp_avg_sq[0].data_ptr() + 4 * at,
                                model=self._model_chunk.data_ptr() + elem * at, numel=length,
                                group=self._group_of[i]))
        return tensors

    def __getstate__(self):
        raise TypeError("halfstep.torch.FusedAdamW cannot be pickled or copied (it holds device memory and "
                        "addresses): save opt.state_dict() and load it into a new optimizer")

    def __deepcopy__(self, memo):
        self.__getstate__()

    # -- construction checks ---------------------------------------------------------------------

    def add_param_group(self, param_group):
        if getattr(self, "_built", False):
            raise ValueError("halfstep.torch.FusedAdamW: parameter groups are fixed at construction "
                             "(the fused step's tensor table is built once)")
        super().add_param_group(param_group)

    @staticmethod
    def _check_params(params):
        if not params:
            return
        dtype, device = params[0].dtype, params[0].device
        seen = []
        ids = {}
        for i, p in enumerate(params):
            if id(p) in ids:
                raise ValueError("parameters %d and %d are the same tensor: list each parameter once" % (ids[id(p)], i))
            ids[id(p)] = i
            where = "parameter %d (%s %s)" % (i, tuple(p.shape), p.dtype)
            if p.dtype not in _DTYPES:
                raise TypeError("%s: halfstep takes float16 or bfloat16 parameters (their fp32 masters "
                                "it keeps itself), got %s" % (where, p.dtype))
            if p.dtype != dtype:
                raise TypeError("%s: every parameter must have one dtype, parameter 0 is %s" % (where, dtype))
            if p.device != device:
                raise ValueError("%s is on %s, parameter 0 on %s: one device per optimizer" % (where, p.device, device))
            if device.type not in ("cpu", "cuda"):
                raise ValueError("%s is on %s: halfstep runs on CUDA devices and on the CPU" % (where, device))
            if not p.is_leaf or not p.requires_grad:
                raise ValueError("%s must be a leaf that requires grad" % where)
            if not p.is_contiguous():
                raise ValueError("%s is not contiguous: halfstep writes the model copy in place" % where)
            if p.numel() > 0:
                seen.append((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i))
        seen.sort()
        for (a0, a1, i), (b0, b1, j) in zip(seen, seen[1:]):
            if b0 < a1:
                raise ValueError("parameters %d and %d share storage: each needs its own" % (min(i, j), max(i, j)))

    @staticmethod
    def _fixed(g):
        betas = tuple(g["betas"])
        if len(betas) != 2:
            raise ValueError("betas must be a pair (beta1, beta2), got %r" % (g["betas"],))
        return (tuple(float(b) for b in betas), float(g["eps"]), float(g["weight_decay"]))

    @staticmethod
    def _lr_of(g, i, weight_decay):
        """Group i's learning rate, checked by the library's rules (so that a refused step has
        pushed nothing): a real number, finite, >= 0, not rounding to 0 in fp32 unless 0, and
        lr·weight_decay < 1 (the decay factor 1 - lr·wd must stay positive)."""
        lr = g["lr"]
        where = "param_groups[%d]['lr']" % i
        if isinstance(lr, torch.Tensor):
            raise TypeError("%s is a tensor: give a number, or write the rate on the device through "
                            "opt.lr_tensor(%d)" % (where, i))
        if isinstance(lr, bool) or not isinstance(lr, _numbers.Real):
            raise ValueError("%s must be a number, got %r" % (where, lr))
        lr = _fp32(float(lr), where)
        if not _math.isfinite(_C.c_float(lr).value) or lr < 0:
            raise ValueError("%s must be finite and >= 0, got %r" % (where, lr))
        if float(_C.c_float(lr).value) * float(_C.c_float(weight_decay).value) >= 1:
            raise ValueError("%s * weight_decay must be < 1 (the factor 1 - lr·wd multiplies every weight each "
                             "step), got %r * %r" % (where, lr, weight_decay))
        return lr

    # -- the step --------------------------------------------------------------------------------

    def _stream(self):
        return torch.cuda.current_stream(self._device).cuda_stream if self._device.type == "cuda" else 0

    def _refuse_replaced_grads(self):
        for i, (p, buf) in enumerate(zip(self._params, self._grads)):
            if p.grad is not buf:
                if p.grad is None:
                    raise RuntimeError("parameter %d has .grad None: halfstep reads gradients from the buffer it "
                                       "attached; clear them with this optimizer's zero_grad() (not the module's "
                                       "zero_grad(set_to_none=True))" % i)
                raise RuntimeError("parameter %d's .grad was replaced by another tensor: halfstep reads gradients "
                                   "from the buffer it attached (restore it with opt.zero_grad(), or copy into "
                                   "p.grad instead of assigning)" % i)

    def _refuse_changed_groups(self):
        if len(self.param_groups) != len(self._group_params):
            raise ValueError("param_groups has %d groups; this optimizer was built with %d: groups cannot be added "
                             "(add_param_group) or removed after construction, since the fused step's tensor table "
                             "is built once. Build a new FusedAdamW" % (len(self.param_groups), len(self._group_params)))
        for i, (g, built) in enumerate(zip(self.param_groups, self._group_params)):
            if len(g["params"]) != len(built) or not all(map(_operator.is_, g["params"], built)):
                raise ValueError("param_groups[%d]['params'] was changed after construction (%d parameters, built with "
                                 "%d): the fused step's tensor table is built once; build a new FusedAdamW"
                                 % (i, len(g["params"]), len(built)))

    def _refuse_moved_storage(self):
        params, grads = self._current_layout()
        for what, now, then in (("parameter", params, self._layout[0]), ("gradient buffer (.grad) of parameter", grads,
                                                                          self._layout[1])):
            for i, (a, b) in enumerate(zip(now, then)):
                if a != b:
                    raise RuntimeError("%s %d now has other storage (%d elements of %s at 0x%x, was %d of %s at 0x%x): "
                                       "halfstep holds the addresses it was built with; .data assignments, .to(), "
                                       "resize_() and share_memory_() move it. Build the optimizer after such changes"
                                       % (what, i, a[1], a[2], a[0], b[1], b[2], b[0]))

    def _take_written_weights(self, versions, everything):
        """Weights written into the parameters become the masters of those elements, as torch.optim
        would continue from them: before the first step those of every parameter (whatever wrote
        them: the model's load_state_dict, DistributedDataParallel's broadcast, which PyTorch's
        version counters do not see), after it those of parameters whose version counter moved
        (in-place edits). Only elements that differ from their master rounded to the parameter's
        format are taken, so an in-place write of the same values (a norm-limiting embedding, a
        model state_dict loaded after the optimizer's) keeps the masters' precision.
        Stream-ordered device work, no synchronisation."""
        with torch.no_grad():
            for i, (p, now, then) in enumerate(zip(self._params, versions, self._versions)):
                if now == then and not everything:
                    continue
                flat = p.detach().reshape(-1)
                if not self._shard:
                    self._take(self._masters[i].view(-1), None, flat)
                    continue
                for off, length, at in self._pieces_of[i]:
                    self._take(self._masters[0][at:at + length], self._model_chunk[at:at + length],
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
            self._take_written_weights([p._version for p in self._params], everything=True)

    def _prepare(self):
        """Everything step() checks and pushes before the library runs; raises before anything
        changed."""
        if not all(map(_operator.is_, [p.grad for p in self._params], self._grads)):
            self._refuse_replaced_grads()
        # The parameters' and the gradient buffers' addresses, sizes and dtypes (a buffer the
        # optimizer owns keeps its memory alive whatever view of it .grad became; resize_ changes
        # its size in place).
        if self._current_layout() != self._layout:
            self._refuse_moved_storage()
        if len(self.param_groups) != len(self._group_params) or not all(
                len(g["params"]) == len(built) and all(map(_operator.is_, g["params"], built))
                for g, built in zip(self.param_groups, self._group_params)):
            self._refuse_changed_groups()
        lrs = []
        for i, g in enumerate(self.param_groups):
            if self._fixed(g) != self._hparams[i]:
                raise ValueError("param_groups[%d]: betas, eps and weight_decay are fixed at construction; only lr "
                                 "may change" % i)
            lrs.append(self._lr_of(g, i, self._hparams[i][2]))
        # Checked; from here on, changes.
        stream = self._stream()
        self._take_pending_weights()
        for i, lr in enumerate(lrs):
            if lr != self._lrs[i]:
                self._opt.set_lr(i, lr, stream)  # ordered before this step on the stream
                self._lrs[i] = lr
        return stream

    @torch.no_grad()
    def step(self, closure=None):
        """One step on the current stream: check, unscale, clip, AdamW, model copy. Never waits
        for the device (CPU tensors: runs at once)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ctx = torch.cuda.device(self._device) if self._device.type == "cuda" else _contextlib.nullcontext()
        with self._lock, ctx:
            stream = self._prepare()
            if self._pg is None:
                self._opt.step(stream)
            else:
                self._opt.step_local(stream)
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
        return loss

    def _gather(self):
        """Every rank's chunk of the model copy into every parameter."""
        parts = list(self._gathered.view(torch.uint8).chunk(self._world))
        _dist.all_gather(parts, self._model_chunk.view(torch.uint8), group=self._pg)
        flat = self._gathered
        for p, at in zip(self._params, self._offsets):
            p.detach().view(-1).copy_(flat[at:at + p.numel()])
        self._versions = [p._version for p in self._params]  # our own writes

    @torch.no_grad()
    def zero_grad(self, set_to_none=True):
        """Zeros the gradient buffers in place (with either set_to_none: halfstep's kernels hold
        the buffers, so they stay attached) and re-attaches any that were replaced."""
        for p, buf in zip(self._params, self._grads):
            buf.zero_()
            if p.grad is not buf:
                p.grad = buf

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
        return self._opt.state()

    # -- checkpoints -----------------------------------------------------------------------------

    @torch.no_grad()
    def state_dict(self):
        """Masters, moments, learning rates and the halfstep state (the scaler, the spike
        detector, the counters): torch.save writes it, load_state_dict resumes bitwise. With a
        process_group it holds this rank's shard and is loaded by the same rank of the same world.
        Weights written into the parameters since the last step (a model's load_state_dict, a
        broadcast before the first step, an in-place edit) are taken into the masters first, as
        the next step would take them, so the state_dict resumes the weights the model holds."""
        with self._lock:
            self._take_pending_weights()
            return self._state_dict()

    def _take_pending_weights(self):
        """What the next step takes from the parameters before it runs: before the first step
        every parameter, after it those whose version counter moved."""
        versions = [p._version for p in self._params]
        if self._unstepped or versions != self._versions:
            self._take_written_weights(versions, everything=self._unstepped)
            self._unstepped = False

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
        return {"state": state, "param_groups": groups,
                # The library's state as a uint8 tensor: torch.load(weights_only=True) reads it.
                "halfstep": {"version": version(),
                             "optimizer_state": torch.frombuffer(bytearray(self._opt.save_state()), dtype=torch.uint8),
                             "world": self._world, "rank": self._rank, "shapes": list(self._shapes),
                             "shard": self._shard, "pushed_lr": list(self._lrs)}}

    def load_state_dict(self, state_dict):
        """Restores state_dict(): everything is checked first; a mismatch raises (ValueError, or
        halfstep.HalfstepError from the library) naming it, and nothing changes. With a
        process_group every rank must call it; if any rank refuses its state_dict, every rank
        raises and none changes."""
        with self._lock:
            self._load_state_dict(state_dict)

    def _load_state_dict(self, state_dict):
        error = None
        try:
            state, groups, blob, pushed = self._checked(state_dict)
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
                m.copy_(state[i]["master"])
                a.copy_(state[i]["exp_avg"])
                s.copy_(state[i]["exp_avg_sq"])
            # The parameters are the masters rounded to their dtype (round to nearest even, as the
            # step writes them), so the model resumes exactly without its own state_dict.
            if self._shard:
                self._model_chunk.copy_(self._masters[0])
                self._gather()
            else:
                for p, m in zip(self._params, self._masters):
                    p.detach().copy_(m.view_as(p))
        self._versions = [p._version for p in self._params]  # our own writes
        self._unstepped = False  # the masters are the checkpoint's, not the rounded parameters
        # The device holds the learning rates of the saved optimizer (also any written through
        # lr_tensor), param_groups the saved values, and the rates the saved optimizer last pushed
        # decide, as they would have there, whether the next step pushes param_groups' again.
        self._lrs = pushed
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
        if hs.get("world") != self._world or hs.get("rank") != self._rank:
            raise ValueError("load_state_dict: written by rank %s of %s ranks; this is rank %d of %d" %
                             (hs.get("rank"), hs.get("world"), self._rank, self._world))
        shapes = [tuple(x) for x in hs.get("shapes", ())] if isinstance(hs.get("shapes"), (list, tuple)) else None
        if shapes != self._shapes or hs.get("shard") != self._shard:
            raise ValueError("load_state_dict: written for parameters of shapes %s (shard=%s); this optimizer's are "
                             "%s (shard=%s)" % (shapes, hs.get("shard"), self._shapes, self._shard))
        groups = state_dict.get("param_groups", [])
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self.param_groups):
            raise ValueError("load_state_dict: %s parameter groups, this optimizer has %d" %
                             (len(groups) if isinstance(groups, (list, tuple)) else "no list of",
                              len(self.param_groups)))
        for i, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, dict) or not all(k in saved for k in ("params", "lr", "betas", "eps",
                                                                            "weight_decay")):
                raise ValueError("load_state_dict: param_groups[%d] must be a dict with params, lr, betas, eps and "
                                 "weight_decay" % i)
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError("load_state_dict: param_groups[%d] has %d parameters, this optimizer's %d" %
                                 (i, len(saved["params"]), len(mine["params"])))
            if self._fixed(saved) != self._hparams[i]:
                raise ValueError("load_state_dict: param_groups[%d] has betas, eps or weight_decay %s; this "
                                 "optimizer's are %s" % (i, self._fixed(saved), self._hparams[i]))
            lr = saved["lr"]
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not _math.isfinite(lr) or lr < 0:
                raise ValueError("load_state_dict: param_groups[%d]['lr'] must be a finite number >= 0, got %r" %
                                 (i, lr))
        pushed = hs.get("pushed_lr")
        if not isinstance(pushed, (list, tuple)) or len(pushed) != len(self.param_groups) or not all(
                isinstance(x, float) and _math.isfinite(x) and x >= 0 for x in pushed):
            raise ValueError("load_state_dict: ['halfstep']['pushed_lr'] must hold one finite rate >= 0 per group")
        state = state_dict.get("state", {})
        for i, m in enumerate(self._masters):
            entry = state.get(i) if isinstance(state, dict) else None
            if not isinstance(entry, dict):
                raise ValueError("load_state_dict: no state for tensor %d" % i)
            for key in ("master", "exp_avg", "exp_avg_sq"):
                t = entry.get(key)
                if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != m.shape:
                    raise ValueError("load_state_dict: state[%d]['%s'] must be a float32 tensor of shape %s" %
                                     (i, key, tuple(m.shape)))
                if not bool(torch.isfinite(t).all()):
                    raise ValueError("load_state_dict: state[%d]['%s'] holds inf or NaN: an applied step never "
                                     "writes one, so this state was not written by a step" % (i, key))
            if bool((entry["exp_avg_sq"] < 0).any()):
                raise ValueError("load_state_dict: state[%d]['exp_avg_sq'] holds negative values" % i)
            if not bool(torch.isfinite(entry["master"].to(self._dtype)).all()):
                raise ValueError("load_state_dict: state[%d]['master'] holds values past %s's range: the parameters "
                                 "could not hold them" % (i, str(self._dtype)[6:]))
        blob = hs["optimizer_state"]
        blob = bytes(blob.tolist()) if isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8 else blob
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError("load_state_dict: ['halfstep']['optimizer_state'] must be a uint8 tensor")
        return state, groups, bytes(blob), [float(x) for x in pushed]

