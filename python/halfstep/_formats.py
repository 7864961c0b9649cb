"""How FusedAdamW holds each parameter's state (the library's StateFormat), and the conversions
between a slot as it is stored and as a user or a checkpoint sees it. Only the layouts
(_layouts) and the checkpoint's conversion (_checkpoint) use this module.

- master: "f32" (an fp32 tensor; float32 parameters are their own), or for bfloat16 parameters
  "bf16_remainder": no fp32 copy, the parameter itself and an int16 remainder rebuild the fp32
  master exactly (master bits = parameter bits * 2^16 + remainder); or "none": no master at all,
  the parameter is the weight, the step's fp32 result written to it with the rounding.
- exp_avg, exp_avg_sq: "f32" or "bf16" (decoded to fp32 in registers by the step, stored back with
  the rounding: "stochastic", reproducible from the seed, or "nearest").
"""

import collections as _collections
import torch

from . import _lib

# The keywords of TransformerEngine's FusedAdam (exp_avg_dtype, exp_avg_sq_dtype) by dtype.
MOMENT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# A master-free layout keeps the parameter (bfloat16) where the master would be.
DTYPE_OF = {"f32": torch.float32, "bf16": torch.bfloat16, "bf16_remainder": torch.int16, "none": torch.bfloat16}


class Formats(_collections.namedtuple("Formats", "master exp_avg exp_avg_sq rounding seed")):
    """One optimizer's state formats, by the library's names."""

    def dtype(self, slot):
        """The dtype a slot's tensor holds."""
        return DTYPE_OF[getattr(self, slot)]

    @property
    def remainders(self):
        return self.master == "bf16_remainder"

    @property
    def masterless(self):
        """No master: the bfloat16 parameter is the weight."""
        return self.master == "none"

    def library(self):
        """The keywords of halfstep.config()."""
        return dict(master=self.master, exp_avg=self.exp_avg, exp_avg_sq=self.exp_avg_sq, rounding=self.rounding,
                    seed=self.seed)

    def describe(self):
        """What a state_dict records."""
        return dict(self._asdict())

    @property
    def random_bits(self):
        """Whether a step draws stochastic rounding's bits (a bf16 moment, or a weight without a
        master, rounded stochastically)."""
        return self.rounding == "stochastic" and ("bf16" in (self.exp_avg, self.exp_avg_sq) or self.masterless)


def choose(param_dtype, store_param_remainders, exp_avg_dtype, exp_avg_sq_dtype, rounding, seed,
           master_weight_dtype=torch.float32):
    """The formats FusedAdamW's keywords ask for, or ValueError naming the keyword and the rule."""
    if master_weight_dtype is not None and master_weight_dtype is not torch.float32:
        raise ValueError("master_weight_dtype must be torch.float32 (the default: an fp32 master) or None (no master: "
                         "bfloat16 parameters updated with stochastic rounding), got %r" % (master_weight_dtype,))
    if master_weight_dtype is None:
        if param_dtype != torch.bfloat16:
            raise ValueError("master_weight_dtype=None: without a master the parameter is the weight, written with "
                             "stochastic rounding to bfloat16; these parameters are %s (%s). Leave it out, or train "
                             "bfloat16 parameters" % (str(param_dtype)[6:], "their own fp32 masters"
                                                      if param_dtype == torch.float32 else "float16"))
        if store_param_remainders:
            raise ValueError("store_param_remainders=True keeps a master (the parameter and an int16 remainder); "
                             "master_weight_dtype=None keeps none: choose one")
    if store_param_remainders not in (None, True, False):
        raise ValueError("store_param_remainders must be True, False or None, got %r" % (store_param_remainders,))
    if store_param_remainders and param_dtype != torch.bfloat16:
        raise ValueError("store_param_remainders=True: remainders rebuild an fp32 master from a bfloat16 parameter; "
                         "these parameters are %s (%s). Leave it out, or train bfloat16 parameters"
                         % (str(param_dtype)[6:], "they are the masters themselves" if param_dtype == torch.float32
                            else "a float16 parameter and 16 bits cannot hold every fp32 master"))
    moments = {}
    for name, dtype in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
        if dtype not in MOMENT_DTYPES:
            raise ValueError("%s must be torch.float32 or torch.bfloat16, got %r%s" % (
                name, dtype, " (block8 codes: halfstep.Optimizer and the C++ API hold them, with a scale per block; "
                "FusedAdamW does not yet)" if dtype is torch.uint8 else ""))
        moments[name] = MOMENT_DTYPES[dtype]
    if rounding not in ("stochastic", "nearest"):
        raise ValueError("rounding must be 'stochastic' or 'nearest', got %r" % (rounding,))
    seed = _lib.seed(seed)
    master = "none" if master_weight_dtype is None else "bf16_remainder" if store_param_remainders else "f32"
    return Formats(master, moments["exp_avg_dtype"],
                   moments["exp_avg_sq_dtype"], rounding, seed)


# -- masters as a bfloat16 parameter and an int16 remainder ----------------------------------------------


def _bits(t):
    """An fp32 tensor's bit patterns as int64 in [0, 2^32)."""
    return t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b):
    """int64 patterns in [0, 2^32) as an fp32 tensor."""
    return torch.where(b >= 2 ** 31, b - 2 ** 32, b).to(torch.int32).view(torch.float32)


def canonical(master):
    """The master a step with a bfloat16 model stores for fp32 `master`: itself, except the upper tie
    above an even bf16 pattern (low half 0x8000 under an even pattern), which 16 bits of remainder
    cannot hold; it becomes its neighbour towards zero, which rounds to the same bf16 value (the
    library's canonical_master)."""
    b = _bits(master)
    return _from_bits(torch.where((b & 0x1FFFF) == 0x8000, b - 1, b)).view(master.shape)


def split(master):
    """fp32 `master` (finite, canonical or made so) as (bfloat16 parameter, int16 remainder)."""
    b = _bits(canonical(master))
    model = _from_bits(b).to(torch.bfloat16)  # to nearest, ties to even
    high = (model.view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    return model.view(master.shape), (b - high).to(torch.int16).view(master.shape)


def join(model, remainder):
    """The fp32 masters a bfloat16 parameter and its int16 remainders hold, as the step reads them:
    a pair no step stores whose join is not a number (±0 written over a negative remainder, the sum
    wrapping past the sign) is the parameter's own value."""
    high = (model.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    joined = _from_bits((high + remainder.to(torch.int64)) & 0xFFFFFFFF).view(model.shape)
    own = model.float()
    return torch.where(torch.isfinite(joined) | ~torch.isfinite(own), joined, own)


def kept_remainders(model, remainder):
    """The remainders that still belong to their parameter after the parameter was written: a pair
    whose master rounds back to the parameter keeps its remainder (a write of the same value keeps
    the master's precision); the others become 0 (the master is the written value)."""
    m = model.contiguous().view(torch.int16).reshape(-1)
    b = ((m.to(torch.int64) & 0xFFFF) << 16) + remainder.reshape(-1).to(torch.int64)
    rebuilt = _from_bits(b & 0xFFFFFFFF)
    ok = (b >= 0) & (b < 2 ** 32) & torch.isfinite(rebuilt) & ((b & 0x1FFFF) != 0x8000)
    ok &= rebuilt.to(torch.bfloat16).view(torch.int16) == m
    return torch.where(ok, remainder.reshape(-1), torch.zeros_like(remainder.reshape(-1))).view(remainder.shape)


def moment(t, fmt):
    """A moment tensor in format `fmt`: fp32 to bf16 rounds once, to nearest even; bf16 to fp32 is exact."""
    return t.to(DTYPE_OF[fmt])
