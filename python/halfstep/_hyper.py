"""The hyperparameters of FusedAdamW's param groups: torch.optim.AdamW's rules, in its words, then
halfstep's own (the step computes in fp32).

A group's learning rate is a number, or a 1-element tensor as torch.optim takes it: a tensor on the
parameters' device is copied into the library's memory on the stream before every step (no host
read), where the step checks it as it checks a rate written through lr_tensor(); a tensor elsewhere
is read on the host at every step. Betas may be 1-element tensors too; they are read on the host
when their version counter moved (a CUDA tensor: one synchronisation per change).
"""

import ctypes as _C
import math as _math
import numbers as _numbers

import torch

HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
# torch.optim.AdamW options that change what a step computes, which the fused step does not do:
# refused wherever they are true (the constructor has no keyword for them; a param group's dict,
# add_param_group, a loaded state_dict, param_groups edited later).
REFUSED_OPTIONS = {
    "maximize": "the fused step minimises; negate the loss to maximise it",
    "amsgrad": "the fused step is AdamW without the AMSGrad maximum",
    "differentiable": "the fused step is not differentiable",
}
# torch.optim.AdamW options that choose how it runs, not what it computes: accepted and ignored (the
# fused step is always fused, capturable and free of host synchronisation).
IGNORED_OPTIONS = ("foreach", "capturable", "fused")
# A param-group key the optimizer writes itself: group 0's entry for its own state in a state_dict
# (torch.distributed.checkpoint keeps a param group's keys, and only those, besides the state).
STATE_KEY = "halfstep"


def fp32(value):
    """`value` rounded to fp32, as the step computes with it."""
    return _C.c_float(value).value


def _scalar_tensor(t, name, where):
    if t.numel() != 1 or not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise ValueError("Tensor %s must be 1-element (%s: a real 1-element tensor, got shape %s %s)"
                         % (name, where, tuple(t.shape), t.dtype))


def _real(value, name, where):
    if isinstance(value, bool) or not isinstance(value, _numbers.Real):
        raise ValueError("Invalid %s: %r (%s: a number)" % (name, value, where))
    return float(value)


class Hyper(tuple):
    """A group's hyperparameters as the step takes them: (lr, (beta1, beta2), eps, weight_decay),
    floats, where a rate or decay that rounds to 0 in fp32 is 0 (as torch.optim's fp32 step
    continues with it); `lr` is None when the group's rate is a tensor on the device (its values
    reach the step by a copy from `lr_source`)."""

    def __new__(cls, lr, betas, eps, weight_decay, lr_source=None):
        self = super().__new__(cls, (lr, betas, eps, weight_decay))
        self.lr_source = lr_source
        return self

    def __eq__(self, other):
        return tuple.__eq__(self, other) and getattr(self, "lr_source", None) is getattr(other, "lr_source", None)

    def __ne__(self, other):
        return not self == other

    __hash__ = tuple.__hash__

    def fingerprint(self):
        """What ranks compare: the values, a tensor rate by its shape (its value is on the device)."""
        return (("tensor",) if self.lr_source is not None else self[0], self[1], self[2], self[3])


def _beta(value, i, where, tensors):
    if isinstance(value, torch.Tensor):
        _scalar_tensor(value, "betas[%d]" % i, where)
        return float(tensors.value(value))
    return _real(value, "beta parameter at index %d" % i, where)


class TensorReads:
    """Values of 1-element tensors read on the host, each again only when its version counter moved."""

    def __init__(self):
        self._seen = {}

    def value(self, t):
        key = id(t)
        hit = self._seen.get(key)
        if hit is not None and hit[0] is t and hit[1] == t._version:
            return hit[2]
        v = float(t.detach().reshape(()).item())
        self._seen[key] = (t, t._version, v)
        return v


def check_options(group, where):
    """Raises ValueError for a torch.optim.AdamW option the fused step does not have, set true."""
    for key, why in REFUSED_OPTIONS.items():
        value = group.get(key, False)
        if value is not None and value is not False and not (isinstance(value, (int, float)) and value == 0):
            raise ValueError("%s: %s=%r is not supported: %s" % (where, key, value, why))


def check(lr, betas, eps, weight_decay, where="FusedAdamW", tensors=None, device=None):
    """torch.optim's rules, raising ValueError with torch.optim.AdamW's words; then halfstep's own
    (the step computes in fp32). Returns a Hyper. A tensor `lr` on `device` (the parameters') is a
    rate copied on the device; on another device (the CPU) it is read on the host."""
    tensors = tensors if tensors is not None else TensorReads()
    source = None
    if isinstance(lr, torch.Tensor):
        _scalar_tensor(lr, "lr", where)
        if device is not None and lr.device == device:
            source = lr
        else:
            lr = float(lr.detach().reshape(()).item())  # every time: writes through .data move no version
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if isinstance(value, torch.Tensor):
            raise ValueError("Invalid %s: a tensor (%s: give %s as a number; torch.optim.AdamW takes tensors for lr "
                             "and betas only)" % (name, where, name))
    if source is None:
        lr = _real(lr, "lr", where)
    eps = _real(eps, "eps", where)
    weight_decay = _real(weight_decay, "weight_decay", where)
    if isinstance(betas, torch.Tensor) or isinstance(betas, (str, bytes)):
        raise ValueError("Invalid betas: %r (%s: a pair beta1, beta2)" % (betas, where))
    try:
        betas = tuple(betas)
    except TypeError:
        raise ValueError("Invalid betas: %r (%s: a pair beta1, beta2)" % (betas, where)) from None
    if len(betas) != 2:
        raise ValueError("Invalid betas: %r (%s: a pair of numbers)" % (betas, where))
    betas = tuple(_beta(b, i, where, tensors) for i, b in enumerate(betas))
    if source is None and (not 0.0 <= lr or not _math.isfinite(lr)):
        raise ValueError("Invalid learning rate: %r (%s: finite and >= 0)" % (lr, where))
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ValueError("Invalid beta parameter at index %d: %r (%s: in [0, 1))" % (i, b, where))
    if not 0.0 <= weight_decay or not _math.isfinite(weight_decay):
        raise ValueError("Invalid weight_decay value: %r (%s: finite and >= 0)" % (weight_decay, where))
    if not eps >= 2.0 ** -126 or not _math.isfinite(eps):
        raise ValueError("Invalid epsilon value: %r (%s: halfstep needs a normal fp32 number >= 2^-126, 1.18e-38, "
                         "where torch.optim.AdamW also takes 0)" % (eps, where))
    # The step computes in fp32: a beta that rounds to 1 would silently be another value; a rate or
    # decay below fp32's smallest subnormal is 0 there, as torch.optim's fp32 step takes it.
    for i, b in enumerate(betas):
        if fp32(b) >= 1.0:
            raise ValueError("Invalid beta parameter at index %d: %r (%s: it rounds to 1 in fp32)" % (i, b, where))
    if source is None and fp32(lr) * fp32(weight_decay) >= 1:
        raise ValueError("Invalid learning rate: %r with weight_decay %r (%s: lr * weight_decay must be < 1, the "
                         "factor 1 - lr·wd multiplies every weight each step)" % (lr, weight_decay, where))
    if source is None and fp32(lr) == 0.0:
        lr = 0.0
    if fp32(weight_decay) == 0.0:
        weight_decay = 0.0
    return Hyper(None if source is not None else lr, betas, eps, weight_decay, source)


def of_group(g, where="param_groups", tensors=None, device=None):
    """A param group's Hyper, its options checked first."""
    check_options(g, where)
    return check(g["lr"], g["betas"], g["eps"], g["weight_decay"], where, tensors, device)
