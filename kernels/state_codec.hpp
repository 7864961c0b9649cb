// Internal: the kernels' codecs of the state formats, host-and-device so that host tests run the
// very code pass 2 runs. A codec decodes a stored element to an fp32 register, and encodes an fp32
// result back with the format's rounding, saying whether what it would store is finite (pass 2
// keeps an element's old values otherwise: invariant 11). The AdamW arithmetic between decode and
// encode is adamw_update, in fp32, for every format alike.
//
// The random bits of stochastic rounding are a hash of (seed, applied step, tensor id, element
// index in the whole tensor), never of a thread, a rank or a shard, so that any number of ranks and
// a resumed run round every element alike. Keys in 64 bits with splitmix64's finalizer (mix64),
// once a step and once a tensor; each element's 32 bits with murmur3's 32-bit finalizer (fmix32,
// a bijection: distinct indices of a tensor get distinct bits), about ten instructions:
//   step key    k_s = mix64(seed ^ mix64(step))
//   tensor key  k_t = mix64(k_s + tensor_id · 0x9E3779B97F4A7C15)
//   element     r   = fmix32(lo32(index) ^ lo32(k_t) ^ (hi32(index) + hi32(k_t)) · 0x9E3779B9)
// exp_avg rounds with bits 0-15 of r, exp_avg_sq with bits 16-31. Without a master the weight
// rounds with bits 0-15 of w = (r · 0x9E3779B9) ^ (r >> 16): three instructions instead of a second
// hash. Its low half is a bijection of r's low half xor r's high half, so given either half of r
// alone it is uniform: each of the three roundings is unbiased, and any two are independent
// (docs/design.md states it, and the reference backend computes it on its own).
#pragma once

#include <cuda_fp16.h>  // __float2half_rn: binary16 rounding, on the host and the device alike
#include <math.h>
#include <string.h>

#include <cstdint>

#include "halfstep/config.hpp"
#include "halfstep/formats.hpp"
#include "halfstep/state.hpp"

namespace halfstep::detail {

HALFSTEP_HD inline std::uint32_t bits_of(float x) {
  std::uint32_t b;
  ::memcpy(&b, &x, sizeof b);
  return b;
}
HALFSTEP_HD inline float float_of(std::uint32_t b) {
  float x;
  ::memcpy(&x, &b, sizeof x);
  return x;
}

/// True for a finite fp32 value (x - x is NaN for inf and NaN).
HALFSTEP_HD inline bool finite32(float x) { return x - x == 0.0f; }

// -- the random bits of stochastic rounding ---------------------------------------------------------

HALFSTEP_HD inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/// The key of an applied step (`step` counts it: 1 for the first).
HALFSTEP_HD inline std::uint64_t step_key(std::uint64_t seed, std::int64_t step) {
  return mix64(seed ^ mix64(static_cast<std::uint64_t>(step)));
}
/// The key of a tensor within a step.
HALFSTEP_HD inline std::uint64_t tensor_key(std::uint64_t step, std::uint32_t tensor_id) {
  return mix64(step + static_cast<std::uint64_t>(tensor_id) * 0x9E3779B97F4A7C15ull);
}
HALFSTEP_HD inline std::uint32_t fmix32(std::uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}
/// The weight's random bits (MasterFormat::none) from an element's bits `r` (its low 16 count).
HALFSTEP_HD inline std::uint32_t weight_bits(std::uint32_t r) { return (r * 0x9E3779B9u) ^ (r >> 16); }
/// The random bits of element `index` of a tensor (its index in the whole tensor).
HALFSTEP_HD inline std::uint32_t element_bits(std::uint64_t tensor, std::int64_t index) {
  const auto i = static_cast<std::uint64_t>(index);
  const auto lo = static_cast<std::uint32_t>(i), hi = static_cast<std::uint32_t>(i >> 32);
  return fmix32(lo ^ static_cast<std::uint32_t>(tensor) ^ ((hi + static_cast<std::uint32_t>(tensor >> 32)) * 0x9E3779B9u));
}
/// element_bits of the 8 elements index .. index + 7, for `index` a multiple of 8: they share the
/// upper half of the index (its low half is below 2^32 - 7), so the key's mixing is done once.
HALFSTEP_HD inline void element_bits8(std::uint64_t tensor, std::int64_t index, std::uint32_t (&out)[8]) {
  const auto i = static_cast<std::uint64_t>(index);
  const auto lo = static_cast<std::uint32_t>(i), hi = static_cast<std::uint32_t>(i >> 32);
  const std::uint32_t c = static_cast<std::uint32_t>(tensor) ^ ((hi + static_cast<std::uint32_t>(tensor >> 32)) * 0x9E3779B9u);
  for (int j = 0; j < 8; ++j) out[j] = fmix32((lo | static_cast<std::uint32_t>(j)) ^ c);
}

// -- bfloat16 ---------------------------------------------------------------------------------------

HALFSTEP_HD inline float bf16_value(std::uint16_t b) { return float_of(static_cast<std::uint32_t>(b) << 16); }
HALFSTEP_HD inline bool bf16_finite(std::uint16_t b) {
  return (b & format_bits(DType::bf16).exponent) != format_bits(DType::bf16).exponent;
}
/// A finite fp32 value to bf16, to nearest, ties to even (past bf16's range: infinity).
HALFSTEP_HD inline std::uint16_t bf16_nearest(float x) {
  const std::uint32_t b = bits_of(x);
  return static_cast<std::uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
/// A finite fp32 value to bf16, rounded up in magnitude with probability (discarded bits) / 2^16:
/// `random` holds 16 uniform bits.
HALFSTEP_HD inline std::uint16_t bf16_stochastic(float x, std::uint32_t random) {
  return static_cast<std::uint16_t>((bits_of(x) + (random & 0xFFFFu)) >> 16);
}

// -- binary16 ---------------------------------------------------------------------------------------

/// The fp32 value of an fp16 pattern, exactly, without a branch (the host's loops of it vectorise;
/// a host test runs every pattern against __half2float): a normal pattern's fields rebased, a
/// subnormal one as its integer times 2^-24.
HALFSTEP_HD inline float f16_value(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  const std::uint32_t normal = sign | ((e == 0x1Fu ? 0xFFu : e + 112u) << 23) | (m << 13);
  const std::uint32_t subnormal = bits_of(static_cast<float>(static_cast<int>(m)) * 0x1p-24f) | sign;
  return float_of(e == 0 ? subnormal : normal);
}

/// An fp32 value to fp16, to nearest, ties to even, without a branch: bit for bit __float2half_rn
/// for every value but NaN (a host test runs all 2^32 patterns), which gives 0x7FFF. In fp16's
/// normal range the exponent is rebased and the 13 dropped bits rounded to nearest even; below it,
/// |x| + 0.5 rounds |x| in fp32 to a multiple of 2^-24 (0.5's ulp), whose count is the pattern; from
/// 65520 on, infinity.
HALFSTEP_HD inline std::uint16_t f16_nearest(float x) {
  const std::uint32_t b = bits_of(x);
  const std::uint32_t sign = (b >> 16) & 0x8000u;
  const std::uint32_t a = b & 0x7FFFFFFFu;
  const std::uint32_t r = a - 0x38000000u;  // wraps below fp16's normal range: not selected there
  const std::uint32_t normal = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
  const std::uint32_t sub = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
  const std::uint32_t mag = a >= 0x477FF000u ? 0x7C00u : a >= 0x38800000u ? normal : sub;
  return static_cast<std::uint16_t>(a > 0x7F800000u ? 0x7FFFu : (sign | mag));
}

// -- moments ----------------------------------------------------------------------------------------

template <MomentFormat kFormat>
struct MomentCodec;

template <>
struct MomentCodec<MomentFormat::f32> {
  using Stored = float;
  HALFSTEP_HD static float decode(float s) { return s; }
  /// The stored value of `x`, and whether it is finite.
  HALFSTEP_HD static bool encode(float x, bool /*stochastic*/, std::uint32_t /*random*/, float& out) {
    out = x;
    return finite32(x);
  }
};

template <>
struct MomentCodec<MomentFormat::bf16> {
  using Stored = std::uint16_t;
  HALFSTEP_HD static float decode(std::uint16_t s) { return bf16_value(s); }
  HALFSTEP_HD static bool encode(float x, bool stochastic, std::uint32_t random, std::uint16_t& out) {
    out = stochastic ? bf16_stochastic(x, random) : bf16_nearest(x);
    return finite32(x) & finite32(bf16_value(out));  // a value near fp32's largest rounds past bf16's
  }
};

// -- masters ----------------------------------------------------------------------------------------
//
// Every encode computes what it would store whatever the input, then says whether it is finite
// (what it computes from an inf or NaN is never stored): no branch, so that the host's loops of it
// vectorise, and the GPU's take selects.

/// The master a step with a bf16 model copy stores for the fp32 result `p`: `p`, except the upper
/// tie above an even bf16 pattern (low half 0x8000, the pattern's lowest bit clear), which 16 bits
/// of remainder cannot hold; it becomes its neighbour towards zero, which rounds to the same bf16
/// value. halfstep::canonical_master states the same rule for the host.
HALFSTEP_HD inline float canonical_master(float p) {
  const std::uint32_t b = bits_of(p);
  return (b & 0x1FFFFu) == 0x8000u ? float_of(b - 1u) : p;
}

/// A model copy's pattern from an fp32 master, to nearest even, per format.
template <DType kModel>
HALFSTEP_HD inline std::uint16_t model_of(float p);
template <>
HALFSTEP_HD inline std::uint16_t model_of<DType::bf16>(float p) {
  return bf16_nearest(p);
}
template <>
HALFSTEP_HD inline std::uint16_t model_of<DType::f16>(float p) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(p));
#else
  return f16_nearest(p);  // the same bits, and a loop of it vectorises
#endif
}

/// Whether the model copy `model` of the master `p` (model_of) is finite. Checked on the fp32
/// side, as fp32 comparisons (a host loop of them vectorises): a bf16 pattern is finite exactly
/// when the fp32 value it is the upper half of is; fp16's rounding to nearest even overflows from
/// 65520 on (the midpoint between its largest finite value, 65504, and 65536), and NaN is not below it.
template <DType kModel>
HALFSTEP_HD inline bool model_finite(float p, std::uint16_t model) {
  if constexpr (kModel == DType::bf16) {
    return finite32(bf16_value(model));
  } else {
    return fabsf(p) < 65520.0f;
  }
}

template <MasterFormat kFormat, DType kModel>
struct MasterCodec;

/// fp32 masters: the model copy (if the tensor has one) is the master rounded to its format.
template <DType kModel>
struct MasterCodec<MasterFormat::f32, kModel> {
  using Stored = float;
  static constexpr bool kStored = true;      // a master buffer
  static constexpr bool kReadsModel = false;
  static constexpr bool kRounds = false;     // never rounded stochastically
  HALFSTEP_HD static float decode(float stored, std::uint16_t /*model*/) { return stored; }
  /// The stored master and model copy of the new master `p`, and whether both are finite.
  HALFSTEP_HD static bool encode(float p, bool with_model, bool /*stochastic*/, std::uint32_t /*random*/, float& stored,
                                 std::uint16_t& model) {
    if (kModel == DType::bf16 && with_model) p = canonical_master(p);
    stored = p;
    model = model_of<kModel>(p);  // computed either way: no branch, so that loops of it vectorise
    return finite32(p) & (!with_model | model_finite<kModel>(p, model));
  }
};

/// bf16 model copy plus int16 remainder: master bits = model·2^16 + remainder.
template <>
struct MasterCodec<MasterFormat::bf16_remainder, DType::bf16> {
  using Stored = std::uint16_t;  // the remainder's two's-complement bits
  static constexpr bool kStored = true;
  static constexpr bool kReadsModel = true;
  static constexpr bool kRounds = false;
  /// The master; a pair a step never stores whose join is not a number (the model copy written
  /// as ±0 over a negative remainder, outside the step: the sum wraps past the sign) is the model
  /// copy's own value. A model copy that is inf or NaN stays so (the update is then held).
  HALFSTEP_HD static float decode(std::uint16_t remainder, std::uint16_t model) {
    const float joined = float_of((static_cast<std::uint32_t>(model) << 16) +
                                  static_cast<std::uint32_t>(static_cast<std::int32_t>(static_cast<std::int16_t>(remainder))));
    return finite32(joined) | !finite32(bf16_value(model)) ? joined : bf16_value(model);
  }
  HALFSTEP_HD static bool encode(float p, bool /*with_model: always*/, bool /*stochastic*/, std::uint32_t /*random*/,
                                 std::uint16_t& stored, std::uint16_t& model) {
    const std::uint32_t b = bits_of(canonical_master(p));
    model = bf16_nearest(float_of(b));
    stored = static_cast<std::uint16_t>(b - (static_cast<std::uint32_t>(model) << 16));
    return finite32(p) & finite32(bf16_value(model));
  }
};

/// No master: the bf16 model copy is the weight. The fp32 result is written to it with the
/// state's rounding (stochastic: `random` holds 16 uniform bits of the weight's own draw).
template <>
struct MasterCodec<MasterFormat::none, DType::bf16> {
  using Stored = std::uint16_t;  // the type of an absent buffer: pass 2 never loads or stores it (kStored)
  static constexpr bool kStored = false;
  static constexpr bool kReadsModel = true;
  static constexpr bool kRounds = true;
  HALFSTEP_HD static float decode(std::uint16_t /*stored*/, std::uint16_t model) { return bf16_value(model); }
  HALFSTEP_HD static bool encode(float p, bool /*with_model: always*/, bool stochastic, std::uint32_t random,
                                 std::uint16_t& /*stored*/, std::uint16_t& model) {
    model = stochastic ? bf16_stochastic(p, random) : bf16_nearest(p);
    return finite32(p) & finite32(bf16_value(model));
  }
};

}  // namespace halfstep::detail
