"""How FusedAdamW holds each parameter's state (the library's StateFormat), and the conversions
between a slot as it is stored and as a user or a checkpoint sees it. Only the layouts
(_layouts) and the checkpoint's conversion (_checkpoint) use this module.

- master: "f32" (an fp32 tensor; float32 parameters are their own), or for bfloat16 parameters
  "bf16_remainder": no fp32 copy, the parameter itself and an int16 remainder rebuild the fp32
  master exactly (master bits = parameter bits * 2^16 + remainder); or "none": no master at all,
  the parameter is the weight, the step's fp32 result written to it with the rounding.
- exp_avg, exp_avg_sq: "f32" or "bf16" (decoded to fp32 in registers by the step, stored back with
  the rounding: "stochastic", reproducible from the seed, or "nearest"); or both "block8": 8-bit
  codes (uint8, the parameter's shape) with an fp32 scale per block (exp_avg_scale,
  exp_avg_sq_scale: [rows, blocks per row]), where a tensor's shape has blocks (Blocks); other
  tensors keep fp32 moments. Blocks lie in rows of dimension 0 (row_of), decided by the whole
  tensor's shape, never a shard's.
"""

import collections as _collections
import torch

from . import _lib

# The keywords of TransformerEngine's FusedAdam (exp_avg_dtype, exp_avg_sq_dtype) by dtype.
# torch.uint8 (both moments): block8 codes, as bitsandbytes' and torchao's 8-bit optimizers hold them.
MOMENT_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.uint8: "block8"}
# A master-free layout keeps the parameter (bfloat16) where the master would be.
DTYPE_OF = {"f32": torch.float32, "bf16": torch.bfloat16, "bf16_remainder": torch.int16, "none": torch.bfloat16,
            "block8": torch.uint8}
MOMENTS = ("exp_avg", "exp_avg_sq")
SCALE_OF = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}  # a block8 moment's scales
ZERO_CODE = {"exp_avg": 127, "exp_avg_sq": 0}  # the code of 0 in each moment's map


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
    def block8(self):
        """8-bit moments (codes and scales) where a tensor's shape has blocks."""
        return self.exp_avg == "block8"

    @property
    def random_bits(self):
        """Whether a step draws stochastic rounding's bits (a bf16 or block8 moment, or a weight
        without a master, rounded stochastically)."""
        return self.rounding == "stochastic" and (self.exp_avg != "f32" or self.exp_avg_sq != "f32" or self.masterless)


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
            raise ValueError("%s must be torch.float32, torch.bfloat16 or torch.uint8 (8-bit block-wise codes), got %r"
                             % (name, dtype))
        moments[name] = MOMENT_DTYPES[dtype]
    if (moments["exp_avg_dtype"] == "block8") != (moments["exp_avg_sq_dtype"] == "block8"):
        raise ValueError("exp_avg_dtype=%s, exp_avg_sq_dtype=%s: torch.uint8 (8-bit codes with a scale per block) is for "
                         "both moments or neither" % (exp_avg_dtype, exp_avg_sq_dtype))
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
    """A moment tensor (values) in a wide format `fmt` ("f32", "bf16"; a block8 optimizer's tensors
    without blocks are "f32"): fp32 to bf16 rounds once, to nearest even; bf16 to fp32 is exact."""
    return t.to(torch.float32 if fmt == "block8" else DTYPE_OF[fmt])


# -- 8-bit moments: where a tensor's blocks lie, and conversions ------------------------------------


def row_of(shape):
    """The elements of a row of a tensor of `shape`, for block8's blocks: a slice of dimension 0
    (FSDP2's Shard(0) cuts there, so every rank holds whole blocks). A one-dimensional tensor's rows
    are single elements: it keeps fp32 moments, on any mesh."""
    n = 1
    for d in tuple(shape)[1:]:
        n *= int(d)
    return n if len(shape) > 0 else 0


_BLOCK8_CONFIG = []


def _moment_blocks(numel, whole_numel, row, offset):
    from . import config, moment_blocks  # (the raw API: halfstep's own rule, one for C++ and Python)
    if not _BLOCK8_CONFIG:
        _BLOCK8_CONFIG.append(config(backend="reference", exp_avg="block8", exp_avg_sq="block8"))
    return moment_blocks(_BLOCK8_CONFIG[0], numel, whole_numel, row, offset)


class Blocks(_collections.namedtuple("Blocks", "whole_numel row offset numel count first scale_shape")):
    """The blocks of a piece (this rank's local tensor, `numel` elements from element `offset`) of
    a tensor whose shape has them: the whole tensor's numel and row, the piece's blocks (`count`
    scales per moment, from block `first`) and the shape its scales are kept in ([rows, blocks per
    row] for whole rows; flat otherwise)."""

    def first_of(self, offset, numel):
        """The first block of the piece of `numel` elements at `offset` in the whole tensor (cut where blocks start)."""
        return _moment_blocks(numel, self.whole_numel, self.row, offset)["first"]

    def next_start(self, index):
        """The first element at or after `index` (in the whole tensor) where a block starts (or the tensor's end)."""
        q, m = divmod(index, self.row)
        m = -(-m // 256) * 256
        return min(q * self.row + min(m, self.row), self.whole_numel)


def blocks(shape, whole_numel, numel, offset):
    """The Blocks of a piece of `numel` elements at `offset` of a tensor of (global) `shape`, or
    None where the shape has none (fewer than 4096 elements, rows shorter than 32: fp32 moments)."""
    row = row_of(shape)
    b = _moment_blocks(numel, whole_numel, row, offset)
    if not b["quantized"]:
        return None
    rows_whole = numel % row == 0 and offset % row == 0
    per_row = -(-row // 256)
    scale_shape = (numel // row, per_row) if rows_whole else (b["blocks"],)
    return Blocks(whole_numel, row, offset, numel, b["blocks"], b["first"], scale_shape)


def encode(values, name, b):
    """Moment `name`'s values (a tensor of b.numel finite values; exp_avg_sq's >= 0) as (codes,
    scales) on their device: to nearest, as a checkpoint conversion stores them."""
    from . import encode_moment
    x = values.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    codes = torch.empty(b.numel, dtype=torch.uint8)
    scales = torch.empty(b.count, dtype=torch.float32)
    encode_moment(name, x.data_ptr(), codes.data_ptr(), scales.data_ptr(), b.numel, b.whole_numel, b.row, b.offset)
    return codes.to(values.device), scales.view(b.scale_shape).to(values.device)


def decode(codes, scales, name, b):
    """The fp32 values codes and scales (of the piece `b`) hold, on the codes' device."""
    from . import decode_moment
    c = codes.detach().to("cpu").contiguous().reshape(-1)
    s = scales.detach().to("cpu", torch.float32).contiguous().reshape(-1)
    out = torch.empty(b.numel, dtype=torch.float32)
    decode_moment(name, c.data_ptr(), s.data_ptr(), out.data_ptr(), b.numel, b.whole_numel, b.row, b.offset)
    return out.to(codes.device)
