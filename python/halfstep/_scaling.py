"""The loss-scale protocol between a FusedAdamW and the scalers that drive it.

One place holds the loss-scale state of a run: the optimizer's library state (scale, growth
tracker, hysteresis, counters), which its own state_dict saves. Around it, LossScaling (one per
optimizer) holds what a step needs to know of the protocol: which halfstep GradScaler drives the
optimizer, whether the scale was read since the last step, whether unscale_ divided the gradients
(the mark reaches the library with the step that consumes it, so a skipped batch cannot leave it
behind), and the tensors torch.amp.GradScaler handed the step. halfstep.torch.GradScaler keeps
nothing of its own once it drives an optimizer: its scale, tracker and state_dict are the
optimizer's; before that, a state it loaded waits to be checked against the optimizer's.
torch.amp.GradScaler owns its scale itself: it hands each step its scale and found_inf
(`_step_supports_amp_scaling`), which the step divides by and honours, and the optimizer's own
scaler leaves both alone.
"""

import contextlib as _contextlib

import torch

from . import config

_ABSENT = object()
# The halfstep_config fields of the loss scaler, and the rules among them (init_scale only starts a run).
SCALER_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale", "growth_interval",
                 "hysteresis", "consecutive_hysteresis", "headroom_growth", "headroom_margin_log2")
RULES = SCALER_FIELDS[1:]


def rules_of(cfg):
    """A halfstep_config's scaler rules by name."""
    return {f: getattr(cfg, f) for f in RULES}


def options_of(cfg):
    """A halfstep_config's scaler options by name (what FusedAdamW(scaler=...) takes)."""
    return {f: getattr(cfg, f) for f in SCALER_FIELDS}


class LossScaling:
    """The protocol state of one FusedAdamW (see the module's docstring)."""

    def __init__(self, rules_given):
        self.rules_given = rules_given  # FusedAdamW(scaler=...) named the rules
        self.driver = None              # the halfstep GradScaler driving the optimizer
        self.taken = False              # the scale was read since the last step
        self.unscaled = False           # unscale_ divided the gradients since the last step
        self.stepped = False            # the driver's step() ran since its update()
        self.reloaded = False           # load_state_dict replaced the scale since the last step
        self._external = ()             # torch.amp.GradScaler's tensors, alive until the next step

    def new_iteration(self):
        """GradScaler.update(): whatever unscale_ did to gradients no step consumed is forgotten
        with them."""
        self.unscaled = False
        self.stepped = False

    def check(self, opt):
        """The step's checks of the protocol, before anything changes. Returns torch.amp.GradScaler's
        (grad_scale, found_inf) when it drives this step, else None."""
        torch_scale = opt.__dict__.get("grad_scale", _ABSENT)  # set by torch.amp.GradScaler.step
        if torch_scale is _ABSENT:
            if self.reloaded and not self.taken and not self.unscaled and opt._needs_scaled_loss():
                raise RuntimeError(
                    "FusedAdamW.step(): load_state_dict replaced the loss scale after this iteration's loss was scaled "
                    "(or its gradients unscaled): the gradients would be unscaled by the loaded scale. Compute the loss "
                    "again, scaled by the loaded scale (scaler.scale(loss), or loss * opt.loss_scale)")
            if not self.taken and not self.unscaled and opt._needs_scaled_loss():
                raise RuntimeError(
                    "FusedAdamW.step(): %s gradients need a scaled loss (the loss scale is %s), and nothing read the "
                    "loss scale since the last step: the gradients would be divided by a scale the loss was never "
                    "multiplied by. Multiply the loss by opt.loss_scale before backward(), or use "
                    "halfstep.torch.GradScaler (scaler.scale(loss).backward(); scaler.step(opt); scaler.update()). "
                    "Without loss scaling, build the optimizer with scaler=dict(init_scale=1, min_scale=1, max_scale=1)"
                    % (str(opt._dtype)[6:], "dynamic" if opt._cfg.min_scale != opt._cfg.max_scale
                       else "%g" % opt._cfg.init_scale))
            return None
        found = opt.__dict__.get("found_inf", None)
        for name, t in (("grad_scale", torch_scale), ("found_inf", found)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point()):
                raise RuntimeError("FusedAdamW.step(): %s (set by torch.amp.GradScaler) must be a 1-element floating "
                                   "point tensor, got %r" % (name, t))
        return torch_scale, found

    def push(self, opt, external, stream):
        """How this step's gradients were scaled, to the library, ordered before the step."""
        if external is None:
            self._external = ()
            if self.unscaled:
                opt._opt.mark_unscaled(stream)
            return
        dev = opt._layout.device
        kept = tuple(None if t is None else t.detach().reshape(()).to(dev, torch.float32) for t in external)
        self._external = kept  # the library reads them on the stream: alive until the next step
        scale, found = kept
        opt._opt.use_external_scale(0 if scale is None else scale.data_ptr(), 0 if found is None else found.data_ptr(),
                                    stream)

    def push_refused(self, opt, stream):
        """What a rank whose step refused its own inputs still tells the library of the scale, so
        that its report of the (skipped) step names the scale the other ranks' do: torch.amp's,
        when it handed a well-formed one."""
        try:
            external = self.check(opt)
        except Exception:  # noqa: BLE001 (the step is refused already; nothing else is pushed)
            return
        if external is not None:
            self.push(opt, external, stream)

    def after_step(self):
        self.taken = False
        self.unscaled = False
        self.reloaded = False

    def after_load(self):
        """A loaded state replaced the scale: what was scaled or unscaled by the old one is void."""
        self.reloaded = self.taken or self.unscaled
        self.taken = False
        self.unscaled = False


def take_torch1_scale(opt, scaler):
    """PyTorch 1.x's GradScaler hands an optimizer that declares _step_supports_amp_scaling itself
    (step(grad_scaler=...)) instead of its scale and found_inf: they are taken from it here, as
    PyTorch 2's GradScaler.step computes them, and set on the optimizer for this step."""
    from torch.cuda.amp.grad_scaler import OptState
    state = scaler._per_optimizer_states[id(opt)]
    if state["stage"] is OptState.READY:
        scaler._check_inf_per_device(opt)
    scale = scaler._get_scale_async()
    found = sum(t.to(scale.device, non_blocking=True) for t in state["found_inf_per_device"].values())
    opt.grad_scale = None if state["stage"] is OptState.UNSCALED else scale
    opt.found_inf = found


def drop_torch_scale(opt):
    """Removes what torch.amp.GradScaler.step set on the optimizer before a step that raised: it
    deletes them only after a step that returned, and the next step would multiply the scales."""
    opt.__dict__.pop("grad_scale", None)
    opt.__dict__.pop("found_inf", None)


class GradScaler:
    """The torch.amp.GradScaler protocol over a halfstep FusedAdamW, so that loops written for
    GradScaler run unchanged — scale(loss), unscale_(opt), step(opt), update(), get_scale(),
    is_enabled(), state_dict(), load_state_dict() — with the step fused and the scale on the
    device: no host synchronisation, and the decisions and scale sequence of GradScaler's rules
    (back off by backoff_factor on an inf/NaN, grow by growth_factor after growth_interval clean
    steps). The optimizer's own loss scaler does the work and holds the state: the GradScaler gives
    it these options (before its first step) and reads and writes its scale.

    A GradScaler learns its optimizer at its first unscale_() or step(), or at attach(opt). A
    scale() before that multiplies by its own initial (or loaded) scale; binding then checks that
    the optimizer's scale is that one, and refuses a resumed optimizer whose scale is another (load
    the GradScaler's state_dict too, or attach it first). Without unscale_ the step stays one fused
    pass over the gradients (clip with the optimizer's max_grad_norm). unscale_(opt) really divides
    the gradients by the scale (fp32 and bf16 ones), for code that clips them itself
    (clip_grad_norm_); the step then unscales by 1. One GradScaler drives one FusedAdamW. Extra
    keyword options are the library's scaler options (hysteresis, min_scale, max_scale, ...);
    max_scale defaults to 2^127 here (GradScaler has none)."""

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
        self._loaded = None     # a state loaded before this GradScaler drove an optimizer
        self._scaled_by = None  # the scale scale() multiplied by before it drove one

    # -- the optimizer it drives ----------------------------------------------------------------

    def attach(self, optimizer):
        """Makes this GradScaler drive `optimizer` now (its first unscale_() or step() does it
        otherwise): from here on scale() multiplies by the optimizer's scale. For a resume that
        loads only the optimizer's state_dict: attach the GradScaler before its first scale()."""
        if not self._enabled:
            return
        from ._optim import FusedAdamW
        if not isinstance(optimizer, FusedAdamW):
            raise TypeError("halfstep.torch.GradScaler drives a halfstep.torch.FusedAdamW, got %s (for other "
                            "optimizers, use torch.amp.GradScaler)" % type(optimizer).__name__)
        if self._optimizer is optimizer:
            return
        if self._optimizer is not None:
            raise ValueError("this halfstep GradScaler drives another FusedAdamW: one GradScaler per optimizer (the "
                             "loss scale lives in the optimizer)")
        optimizer._bind_scaler(self)
        self._optimizer = optimizer
        self._loaded = None
        self._scaled_by = None

    def _scale_now(self):
        """The scale a scale() before binding multiplies by: the loaded one, else the initial."""
        return float(self._loaded["scale"]) if self._loaded is not None else self._options["init_scale"]

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
            self._scaled_by = self._scale_now()

        def apply(x):
            nonlocal factor
            if isinstance(x, torch.Tensor):
                if factor is None:
                    factor = torch.full((), self._scaled_by, dtype=torch.float32, device=x.device)
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
        self.attach(optimizer)
        scaling = optimizer._scaling
        if scaling.unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if scaling.stepped:
            raise RuntimeError("unscale_() is being called after step().")
        if optimizer._dtype == torch.float16:
            raise ValueError("Attempting to unscale FP16 gradients: halfstep.torch.GradScaler.unscale_ refuses them, as "
                             "torch.amp.GradScaler does; clip inside the fused step with FusedAdamW(max_grad_norm=...)")
        ctx = torch.cuda.device(optimizer._device) if optimizer._device.type == "cuda" else _contextlib.nullcontext()
        with optimizer._lock, ctx:
            inverse = 1.0 / optimizer._live_scale.clone()  # fp32, as GradScaler's inv_scale
            for g in (p.grad for p in optimizer._params if p.grad is not None):
                g.mul_(inverse)
            scaling.taken = True
            scaling.unscaled = True  # the step that consumes these gradients divides by 1

    def step(self, optimizer, *args, **kwargs):
        """optimizer.step(): the fused step checks, unscales (by the scale, or by 1 after
        unscale_), clips and applies or skips, and moves the scale, all on the device. Returns
        what optimizer.step() returns (None: whether the step was applied is in
        optimizer.last_report(), which waits for it)."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        from ._optim import FusedAdamW
        try:
            self.attach(optimizer)
            if optimizer._scaling.stepped:
                raise RuntimeError("step() has already been called since the last update().")
        except Exception as e:  # noqa: BLE001 (raised by the optimizer: with a process group, after every rank's step)
            if not isinstance(optimizer, FusedAdamW):
                raise
            optimizer._refuse(e)
        retval = optimizer.step(*args, **kwargs)
        optimizer._scaling.stepped = True
        return retval

    def update(self, new_scale=None):
        """The fused step already moved the scale by GradScaler's rules; update() starts the next
        iteration (gradients unscale_ divided and no step consumed are forgotten). new_scale (a
        float or a 1-element tensor) sets the scale, as GradScaler's does (a tensor is read on the
        host: one synchronisation)."""
        if not self._enabled:
            return
        scaling = self._optimizer._scaling if self._optimizer is not None else None
        if new_scale is None and (scaling is None or not (scaling.stepped or scaling.unscaled)):
            raise AssertionError("No inf checks were recorded prior to update.")  # torch.amp.GradScaler's words
        if new_scale is not None:
            value = float(new_scale.item() if isinstance(new_scale, torch.Tensor) else new_scale)
            if self._optimizer is None:
                self._options["init_scale"] = value
                if self._loaded is not None:
                    self._loaded["scale"] = value
            else:
                opt = self._optimizer
                with opt._lock:
                    opt._opt.set_loss_scale(value, opt._stream())
        if self._optimizer is not None:
            self._optimizer._scaling.new_iteration()
        self._scaled_by = None

    def get_scale(self):
        """The loss scale for the next step, as a Python float (waits for the last step); 1.0 when
        disabled."""
        if not self._enabled:
            return 1.0
        if self._optimizer is None:
            return self._scale_now()
        return float(self._optimizer._opt.loss_scale())

    def get_growth_factor(self):
        return self._options["growth_factor"]

    def get_backoff_factor(self):
        return self._options["backoff_factor"]

    def get_growth_interval(self):
        return self._options["growth_interval"]

    def _get_growth_tracker(self):
        if self._optimizer is None:
            return int(self._loaded["_growth_tracker"]) if self._loaded is not None else 0
        return int(self._optimizer._opt.state()["good_steps"])

    def state_dict(self):
        """GradScaler's state_dict: scale, growth_factor, backoff_factor, growth_interval,
        _growth_tracker (waits for the last step), and with hysteresis > 1 halfstep's
        _hysteresis_left. It is the optimizer's loss-scale state, which the optimizer's own
        state_dict holds exactly too."""
        if not self._enabled:
            return {}
        out = {"scale": self.get_scale(), "growth_factor": self._options["growth_factor"],
               "backoff_factor": self._options["backoff_factor"], "growth_interval": self._options["growth_interval"],
               "_growth_tracker": self._get_growth_tracker()}
        if self._options.get("hysteresis", 1) > 1:
            if self._optimizer is not None:
                out["_hysteresis_left"] = int(self._optimizer._opt.state()["hysteresis_left"])
            elif self._loaded is not None and "_hysteresis_left" in self._loaded:
                out["_hysteresis_left"] = self._loaded["_hysteresis_left"]
        return out

    def load_state_dict(self, state_dict):
        """Takes GradScaler's state_dict: the scale and the growth tracker (and halfstep's hysteresis
        count); the other entries must be this GradScaler's options. Driving an optimizer, it writes
        the optimizer's state; before that, it waits for the optimizer it will drive, which must
        then hold the same state or none (a fresh optimizer takes it)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError("The source state dict is empty, possibly because it was saved from a disabled "
                               "instance of GradScaler.")
        rules = {key: state_dict[key] for key in ("growth_factor", "backoff_factor", "growth_interval") if key in state_dict}
        if self._optimizer is not None:
            for key, value in rules.items():
                if value != self._options[key]:
                    raise ValueError("load_state_dict: %s is %r in the state_dict and %r here: the rules of a GradScaler "
                                     "that drives an optimizer are the optimizer's; load it before its first scale(), "
                                     "step() or unscale_()" % (key, value, self._options[key]))
        else:  # as torch.amp.GradScaler, the loaded rules are taken
            config(scaler=dict(self._options, **rules))
            self._options.update(rules)
        loaded = {"scale": float(state_dict["scale"]), "_growth_tracker": int(state_dict.get("_growth_tracker", 0))}
        if "_hysteresis_left" in state_dict:
            loaded["_hysteresis_left"] = int(state_dict["_hysteresis_left"])
        if self._optimizer is None:
            config(scaler=dict(self._options, init_scale=loaded["scale"]))  # a scale the rules allow
            self._loaded = loaded
            return
        self._optimizer._write_scaler_state(loaded)
