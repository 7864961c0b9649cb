// Internal: block-wise 8-bit moments, host-and-device so that the reference backend, the host
// tests and pass 2 run the very same code.
//
// A moment stored in 8 bits is a code per element and one fp32 scale per block: the block's
// largest magnitude (its absmax). A code indexes a map of 256 values in [-1, 1] (signed, for
// exp_avg) or [0, 1] (unsigned, for exp_avg_sq's square root); the element's value is
// map[code] · absmax. Both maps are dynamic: seven decades, 1e-7 to 1, each a linear grid over
// [0.1, 1] of its decade whose cell count halves per decade down (the map measured best in
// bench/RESULTS.md, "choosing the 8-bit moment map": the only 8-bit format for exp_avg_sq that was
// unbiased and never 0 on both runs, and the pair with the smallest update error).
//
// exp_avg_sq is stored as the codes of sqrt(v): the update divides by sqrt(v), so a relative step
// of the map is half as large in the update, and the range of seven decades covers fourteen of v.
// A positive sqrt(v) never encodes to 0 (the map's smallest positive value, 3.25e-7 of the absmax,
// instead): an exp_avg_sq decoded as 0 would turn the update into m / eps.
//
// Blocks lie in the whole tensor's index space, never a shard's (block8_geometry): 256 consecutive
// elements of a row, a row's last block holding what is left, a row shorter than 256 one block.
// A shard that starts at a row boundary (FSDP2's Shard(0)) or at a block start therefore holds
// whole blocks, and every rank count encodes every block alike. Tensors of fewer than 4096
// elements, or with rows shorter than 32, keep their moments wide (a row shorter than 32 would
// spend more than an eighth of its codes' bytes on its scale).
#pragma once

#if defined(__CUDACC__) || defined(HALFSTEP_EMULATED)
#include "device.cuh"
#endif

#include <cstdint>

#include "block8_geometry.hpp"
#include "halfstep/config.hpp"
#include "step_math.hpp"

namespace halfstep::detail {


// -- the maps ------------------------------------------------------------------------------------

/// 256 values, ascending; a code is an index.
struct Map8 {
  float value[256];
};

namespace map8_detail {
constexpr double kDecade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
/// The value of cell i of `cells` in decade k: the cell's midpoint on the linear grid over
/// [0.1, 1]·10^(k-6), computed in double and rounded once to fp32.
constexpr float cell(int k, int i, int cells) { return static_cast<float>((0.1 + 0.9 * (i + 0.5) / cells) * kDecade[k]); }
}  // namespace map8_detail

/// The signed dynamic map: 0, +1, and ±127 magnitudes (2^k cells in decade k = 0..6), so +1 and
/// no -1: a block whose absmax is negative stores it as -0.99296875 (its nearest code). Code 127 is 0.
constexpr Map8 make_signed_map8() {
  Map8 m{};
  int at = 0;
  for (int k = 6; k >= 0; --k) {
    for (int i = (1 << k) - 1; i >= 0; --i) m.value[at++] = -map8_detail::cell(k, i, 1 << k);
  }
  m.value[at++] = 0.0f;
  for (int k = 0; k <= 6; ++k) {
    for (int i = 0; i < (1 << k); ++i) m.value[at++] = map8_detail::cell(k, i, 1 << k);
  }
  m.value[at] = 1.0f;
  return m;
}

/// The unsigned dynamic map: 0, 1, and 254 magnitudes (2^(k+1) cells in decade k = 0..6). Code 0 is 0.
constexpr Map8 make_unsigned_map8() {
  Map8 m{};
  int at = 0;
  m.value[at++] = 0.0f;
  for (int k = 0; k <= 6; ++k) {
    for (int i = 0; i < (2 << k); ++i) m.value[at++] = map8_detail::cell(k, i, 2 << k);
  }
  m.value[at] = 1.0f;
  return m;
}

inline constexpr std::uint8_t kSignedZero8 = 127;  ///< the signed map's code of 0
inline constexpr std::uint8_t kUnsignedZero8 = 0;  ///< the unsigned map's code of 0

// -- the codec of a map ----------------------------------------------------------------------------
//
// Encoding works on magnitudes. A magnitude y's floor (the largest map magnitude <= y) is found
// without a search: a guess table indexed by y's fp32 exponent and top 7 fraction bits (one entry
// per 1/128 of an octave, octaves 2^-22 .. 2^0) holds the floor of the entry's lowest value, and
// no entry's range holds more than one map magnitude past it (both maps: the densest, the top
// decade's, are 0.9/128 apart, at least 1/142 of their value; an entry spans 1/128 of its
// octave's start, less than that gap — the tests check it entry by entry), so one comparison
// finishes. Magnitudes below 2^-22 lie under both maps' smallest positive value (3.25e-7 and
// 5.5e-7), those from 2^1 up over 1. That is four shared-memory reads a value and, on sm_90, 29
// SASS instructions to nearest and 35 stochastically, against 63 and 71 for a binary search of
// the map (eight dependent reads, then the two neighbours): bench/RESULTS.md.

inline constexpr int kGuessBits8 = 7;                          ///< fraction bits that index the guess
inline constexpr int kGuessOctaves8 = 23;                      ///< 2^-22 .. 2^0
inline constexpr int kGuessLowest8 = 127 - 22;                 ///< the lowest octave's biased exponent
inline constexpr int kGuessEntries8 = kGuessOctaves8 << kGuessBits8;

/// A map with what encoding it needs: its magnitudes (the values >= 0, ascending, then +inf)
/// and the guess table.
struct Codec8 {
  Map8 map;                          ///< code -> value (decode)
  float magnitude[258];              ///< 0 .. 1, then +inf (twice: a value past 1 reads two
                                     ///< past its floor): 129 values signed, 256 unsigned
  std::uint8_t guess[kGuessEntries8];  ///< floor index into magnitude of each entry's lowest value
  int top;                           ///< the index of 1 in magnitude: 128 signed, 255 unsigned
  bool is_signed;
};

constexpr Codec8 make_codec8(bool is_signed) {
  Codec8 c{};
  c.map = is_signed ? make_signed_map8() : make_unsigned_map8();
  c.is_signed = is_signed;
  const int zero = is_signed ? kSignedZero8 : kUnsignedZero8;
  c.top = 255 - zero;
  for (int p = 0; p <= c.top; ++p) c.magnitude[p] = c.map.value[zero + p];
  for (int p = c.top + 1; p < 258; ++p) c.magnitude[p] = __builtin_huge_valf();
  // Entry e covers [2^(o-22)·(1 + j/128), 2^(o-22)·(1 + (j+1)/128)) for o = e / 128, j = e % 128;
  // its floor only grows with e, so one pass over the magnitudes fills the table.
  int p = 0;
  double octave = 1.0;
  for (int o = 0; o < 22; ++o) octave /= 2.0;
  for (int e = 0; e < kGuessEntries8; ++e) {
    if (e > 0 && e % (1 << kGuessBits8) == 0) octave *= 2.0;
    const double lowest = octave * (1.0 + static_cast<double>(e % (1 << kGuessBits8)) / (1 << kGuessBits8));
    while (p < c.top && static_cast<double>(c.magnitude[p + 1]) <= lowest) ++p;
    c.guess[e] = static_cast<std::uint8_t>(p);
  }
  return c;
}

/// The two codecs for host code (device code copies them into shared memory).
inline constexpr Codec8 kSignedCodec8 = make_codec8(true);
inline constexpr Codec8 kUnsignedCodec8 = make_codec8(false);

// -- one value -----------------------------------------------------------------------------------

/// The code of `x`, a value already divided by its block's absmax (|x| <= 1 up to the rounding of
/// that division; beyond the map's ends the end codes), encoded by its magnitude: to the nearest
/// value, a tie to the smaller magnitude; or stochastically, to the larger of the two magnitudes
/// around |x| with the probability (to 2^-16) that |x| lies past the smaller, from 16 random bits
/// (`random`'s low half). A negative x takes the code of -(its magnitude), the lowest code (its
/// magnitude 0.99296875) where that would be -1, which the signed map lacks. `positive` (the
/// unsigned map only): the value was positive before its division by the absmax, which may have
/// flushed it to 0, and must not encode to code 0, the map's 0; it takes code 1, the smallest
/// positive value. kSigned says which map `codec` is (codec.is_signed), so that pass 2 compiles
/// only its own sign handling; encode8 below reads it from the codec.
template <bool kSigned>
HALFSTEP_HD inline std::uint8_t encode8_as(const Codec8& codec, float x, bool stochastic, std::uint32_t random, bool positive) {
  const std::uint32_t bits = bits_of(x);
  const float y = x < 0.0f ? -x : x;
  int e = static_cast<int>((bits & 0x7FFFFFFFu) >> (23 - kGuessBits8)) - (kGuessLowest8 << kGuessBits8);
  e = e < 0 ? 0 : e >= kGuessEntries8 ? kGuessEntries8 - 1 : e;
  int p = codec.guess[e];
  const float m0 = codec.magnitude[p], m1 = codec.magnitude[p + 1], m2 = codec.magnitude[p + 2];
  const bool past = m1 <= y;  // the one magnitude the entry may hold past its guess
  p += past ? 1 : 0;
  const float lo = past ? m1 : m0, hi = past ? m2 : m1;  // hi is +inf above 1: never up
  const float below = y - lo;
  bool up;
  if (stochastic) {
    // u = (r + 1/2)·2^-16, r uniform in [0, 2^16): P(u·(hi - lo) < below) = below / (hi - lo).
    up = below > (hi - lo) * ((static_cast<float>(random & 0xFFFFu) + 0.5f) * 0x1p-16f);
  } else {
    up = below > hi - y;
  }
  p += up ? 1 : 0;
  if (positive && p == 0) p = 1;
  if (!kSigned) return static_cast<std::uint8_t>(p);
  if (x < 0.0f) return static_cast<std::uint8_t>(kSignedZero8 - (p < kSignedZero8 ? p : kSignedZero8));
  return static_cast<std::uint8_t>(kSignedZero8 + p);
}
HALFSTEP_HD inline std::uint8_t encode8(const Codec8& codec, float x, bool stochastic, std::uint32_t random, bool positive) {
  return codec.is_signed ? encode8_as<true>(codec, x, stochastic, random, positive)
                         : encode8_as<false>(codec, x, stochastic, random, positive);
}

/// The scale a block stores for its largest magnitude `absmax` (>= 0, finite): absmax itself, or
/// 0 below fp32's smallest normal (such a block stores zeros: its reciprocal would overflow).
HALFSTEP_HD inline float scale8(float absmax) { return absmax >= 0x1p-126f ? absmax : 0.0f; }
/// What the codes of a block with scale `scale` are computed from: x · inverse8(scale), 0 for a
/// block of zeros (every element then encodes to the map's 0). Scales above 2^126 have subnormal
/// reciprocals and lose precision in the codes; moments never come near.
HALFSTEP_HD inline float inverse8(float scale) { return scale != 0.0f ? 1.0f / scale : 0.0f; }
/// The value of `code` in a block with scale `scale`.
HALFSTEP_HD inline float decode8(const Codec8& codec, std::uint8_t code, float scale) { return codec.map.value[code] * scale; }

// -- one block -------------------------------------------------------------------------------------

/// Encodes the `n` values `x` (1 <= n <= 256) of one block: its scale (scale8 of the largest |x|)
/// and a code per value (encode8 of x · inverse8(scale), with bits `shift` and up of `random[i]`
/// when stochastic; with `never_zero`, a positive value never takes the unsigned map's 0). Returns
/// false, writing nothing, if a value is not finite: the block then
/// keeps what it holds. Pass 2 computes the same codes a warp per block.
HALFSTEP_HD inline bool encode_block8(const Codec8& codec, const float* x, int n, bool stochastic, const std::uint32_t* random,
                                      int shift, bool never_zero, std::uint8_t* codes, float& scale) {
  float absmax = 0.0f;
  for (int i = 0; i < n; ++i) {
    if (!finite32(x[i])) return false;
    const float a = x[i] < 0.0f ? -x[i] : x[i];
    absmax = a > absmax ? a : absmax;
  }
  scale = scale8(absmax);
  const float inverse = inverse8(scale);
  for (int i = 0; i < n; ++i) {
    codes[i] = encode8(codec, x[i] * inverse, stochastic, stochastic ? random[i] >> shift : 0u, never_zero && x[i] > 0.0f);
  }
  return true;
}

#if defined(__CUDACC__) || defined(HALFSTEP_EMULATED)
/// Elements of a block each lane of a warp holds: lane l holds elements 8l .. 8l + 7.
inline constexpr int kBlock8PerLane = kBlock8 / 32;

/// encode_block8 by a warp, all 32 lanes together (warp-uniform control flow; 1-D thread blocks of
/// a multiple of 32 threads): lane l holds the
/// block's elements 8l + j in x[j], and those below `n`, the block's size, are the block's. Every
/// lane gets the block's scale and its own codes (0 past n), or false on every lane, with nothing
/// written, if any of the block's values is not finite. Bit for bit encode_block8: the absmax is
/// a maximum, the same whatever the order, and every code the same encode8. kSigned is
/// codec.is_signed; kChecked false skips the finiteness vote for values known finite; kFull
/// compiles a whole block (n = 256) without its guards.
template <bool kSigned, bool kChecked = true, bool kFull = false>
__device__ inline bool warp_encode_block8_as(const Codec8& codec, const float (&x)[kBlock8PerLane], int n, bool stochastic,
                                             const std::uint32_t (&random)[kBlock8PerLane], int shift, bool never_zero,
                                             std::uint8_t (&codes)[kBlock8PerLane], float& scale) {
  const int first = static_cast<int>(threadIdx.x % 32u) * kBlock8PerLane;
  float absmax = 0.0f;
  bool finite = true;
#pragma unroll
  for (int j = 0; j < kBlock8PerLane; ++j) {
    if (kFull || first + j < n) {
      if (kChecked) finite = finite && finite32(x[j]);
      const float a = x[j] < 0.0f ? -x[j] : x[j];
      absmax = a > absmax ? a : absmax;
    }
  }
  if (kChecked && __all_sync(0xFFFFFFFFu, finite ? 1 : 0) == 0) return false;
#pragma unroll
  for (int lanes = 16; lanes >= 1; lanes >>= 1) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, absmax, lanes);
    absmax = other > absmax ? other : absmax;
  }
  scale = scale8(absmax);
  const float inverse = inverse8(scale);
#pragma unroll
  for (int j = 0; j < kBlock8PerLane; ++j) {
    codes[j] = kFull || first + j < n
                   ? encode8_as<kSigned>(codec, x[j] * inverse, stochastic, stochastic ? random[j] >> shift : 0u,
                                         never_zero && x[j] > 0.0f)
                   : std::uint8_t{0};
  }
  return true;
}
__device__ inline bool warp_encode_block8(const Codec8& codec, const float (&x)[kBlock8PerLane], int n, bool stochastic,
                                          const std::uint32_t (&random)[kBlock8PerLane], int shift, bool never_zero,
                                          std::uint8_t (&codes)[kBlock8PerLane], float& scale) {
  return codec.is_signed ? warp_encode_block8_as<true>(codec, x, n, stochastic, random, shift, never_zero, codes, scale)
                         : warp_encode_block8_as<false>(codec, x, n, stochastic, random, shift, never_zero, codes, scale);
}
#endif

// -- one block's AdamW step ----------------------------------------------------------------------------
//
// A block of a quantized tensor is updated as a whole: each element decodes its master (the
// master codec, as for every format) and its moments (exp_avg = map·scale, exp_avg_sq = (map ·
// scale)²), runs adamw_update in fp32, and encodes its master; then the block's new exp_avg and
// sqrt(exp_avg_sq) get new scales and codes. exp_avg rounds to nearest (it decays fast, beta1 =
// 0.9, and rounding it stochastically only added noise in the measurement); sqrt(exp_avg_sq) with
// the state's rounding, bits 16-31 of the element's draw, never to 0 while positive. If any
// element's new master, model copy, exp_avg or exp_avg_sq would not be finite, the whole block
// keeps everything it held: its elements' masters too, since their moments could not move.

/// One element of a block: its new master (ps_new, model_new), exp_avg (m) and sqrt(exp_avg_sq)
/// (root), and whether all are finite. Nothing is written in place.
template <class Master, bool kDraw>
HALFSTEP_HD inline bool update_element8(const Codec8& exp_avg_codec, const Codec8& exp_avg_sq_codec,
                                        const typename Master::Stored& ps, std::uint16_t model, std::uint8_t m_code,
                                        std::uint8_t v_code, float m_scale, float v_scale, float g, bool with_model,
                                        std::uint32_t random, const GroupConsts& k, typename Master::Stored& ps_new,
                                        std::uint16_t& model_new, float& m, float& root) {
  float p = Master::decode(ps, model);
  m = decode8(exp_avg_codec, m_code, m_scale);
  const float r = decode8(exp_avg_sq_codec, v_code, v_scale);
  float v = r * r;
  adamw_update(p, m, v, g, k);
  root = sqrtf(v);
  const std::uint32_t random_w = kDraw && Master::kRounds ? weight_bits(random) : 0u;
  const bool ok = Master::encode(p, with_model, kDraw, random_w, ps_new, model_new);
  return ok & finite32(m) & finite32(v);
}

/// The host's block step (the tests' mirror of warp_update_block8): the n elements of one block,
/// updated in place; returns true, changing nothing, if the block is held. `with_model` must be
/// true where the master format reads the model copy (remainders, no master): it is half of the
/// master, or the weight.
template <class Master, bool kDraw>
HALFSTEP_HD inline bool update_block8(const Codec8& exp_avg_codec, const Codec8& exp_avg_sq_codec,
                                      typename Master::Stored* ps, std::uint16_t* model, std::uint8_t* m_codes,
                                      std::uint8_t* v_codes, float& m_scale, float& v_scale, const float* g, int n,
                                      bool with_model, const std::uint32_t* random, const GroupConsts& k) {
  typename Master::Stored ps_new[kBlock8];
  std::uint16_t model_new[kBlock8];
  float m[kBlock8] = {}, root[kBlock8] = {};
  bool ok = true;
  for (int i = 0; i < n; ++i) {
    ps_new[i] = typename Master::Stored{};
    model_new[i] = 0;
    // Only the buffers the format has are read: no master without one, no model copy unless it
    // is written or read, no random bits to nearest.
    const typename Master::Stored stored = Master::kStored ? ps[i] : typename Master::Stored{};
    const std::uint16_t weight = with_model ? model[i] : std::uint16_t{0};
    ok = update_element8<Master, kDraw>(exp_avg_codec, exp_avg_sq_codec, stored, weight, m_codes[i], v_codes[i], m_scale,
                                        v_scale, g[i], with_model, kDraw ? random[i] : 0u, k, ps_new[i], model_new[i],
                                        m[i], root[i]) &&
         ok;
  }
  if (!ok) return true;
  std::uint8_t mc[kBlock8], vc[kBlock8];
  float ms = 0.0f, vs = 0.0f;
  encode_block8(exp_avg_codec, m, n, false, random, 0, false, mc, ms);
  encode_block8(exp_avg_sq_codec, root, n, kDraw, random, 16, true, vc, vs);
  for (int i = 0; i < n; ++i) {
    if (Master::kStored) ps[i] = ps_new[i];
    if (with_model) model[i] = model_new[i];
    m_codes[i] = mc[i];
    v_codes[i] = vc[i];
  }
  m_scale = ms;
  v_scale = vs;
  return false;
}

#if defined(__CUDACC__) || defined(HALFSTEP_EMULATED)
/// The body of warp_update_block8; kFull: a whole block, compiled without the short block's guards.
template <class Master, bool kDraw, bool kFull>
__device__ inline bool warp_update_block8_body(const Codec8& exp_avg_codec, const Codec8& exp_avg_sq_codec,
                                               typename Master::Stored (&ps)[kBlock8PerLane],
                                               std::uint16_t (&model)[kBlock8PerLane],
                                               std::uint8_t (&m_codes)[kBlock8PerLane],
                                               std::uint8_t (&v_codes)[kBlock8PerLane], float& m_scale, float& v_scale,
                                               const float (&g)[kBlock8PerLane], int n, bool with_model,
                                               const std::uint32_t (&random)[kBlock8PerLane], const GroupConsts& k) {
  const int first = static_cast<int>(threadIdx.x % 32u) * kBlock8PerLane;
  typename Master::Stored ps_new[kBlock8PerLane];
  std::uint16_t model_new[kBlock8PerLane];
  float m[kBlock8PerLane], root[kBlock8PerLane];
  bool ok = true;
#pragma unroll
  for (int j = 0; j < kBlock8PerLane; ++j) {
    ps_new[j] = typename Master::Stored{};
    model_new[j] = 0;
    m[j] = 0.0f;
    root[j] = 0.0f;
    if (kFull || first + j < n) {
      ok = update_element8<Master, kDraw>(exp_avg_codec, exp_avg_sq_codec, ps[j], model[j], m_codes[j], v_codes[j],
                                          m_scale, v_scale, g[j], with_model, random[j], k, ps_new[j], model_new[j], m[j],
                                          root[j]) &&
           ok;
    }
  }
  if (__all_sync(0xFFFFFFFFu, ok ? 1 : 0) == 0) return true;
  std::uint8_t mc[kBlock8PerLane], vc[kBlock8PerLane];
  float ms = 0.0f, vs = 0.0f;
  // Every value is finite now: neither encode votes again.
  warp_encode_block8_as<true, false, kFull>(exp_avg_codec, m, n, false, random, 0, false, mc, ms);
  warp_encode_block8_as<false, false, kFull>(exp_avg_sq_codec, root, n, kDraw, random, 16, true, vc, vs);
#pragma unroll
  for (int j = 0; j < kBlock8PerLane; ++j) {
    if (kFull || first + j < n) {
      if (Master::kStored) ps[j] = ps_new[j];
      if (with_model) model[j] = model_new[j];
      m_codes[j] = mc[j];
      v_codes[j] = vc[j];
    }
  }
  m_scale = ms;
  v_scale = vs;
  return false;
}

/// update_block8 by a warp, all 32 lanes together (1-D thread blocks of a multiple of 32 threads;
/// n, the scales and the codecs the same on every lane): lane l holds elements 8l + j of the block
/// (the first n are the block's) and gets its own new values in place; every lane returns true,
/// changing nothing, if the block is held. Bit for bit update_block8 where both compile alike (the
/// emulated device and the host, without contraction); on hardware nvcc contracts AdamW's
/// arithmetic into FMAs, as it does for every format. `exp_avg_codec` is the signed map's,
/// `exp_avg_sq_codec` the unsigned map's.
template <class Master, bool kDraw>
__device__ inline bool warp_update_block8(const Codec8& exp_avg_codec, const Codec8& exp_avg_sq_codec,
                                          typename Master::Stored (&ps)[kBlock8PerLane],
                                          std::uint16_t (&model)[kBlock8PerLane], std::uint8_t (&m_codes)[kBlock8PerLane],
                                          std::uint8_t (&v_codes)[kBlock8PerLane], float& m_scale, float& v_scale,
                                          const float (&g)[kBlock8PerLane], int n, bool with_model,
                                          const std::uint32_t (&random)[kBlock8PerLane], const GroupConsts& k) {
  if (n == kBlock8) {
    return warp_update_block8_body<Master, kDraw, true>(exp_avg_codec, exp_avg_sq_codec, ps, model, m_codes, v_codes,
                                                        m_scale, v_scale, g, n, with_model, random, k);
  }
  return warp_update_block8_body<Master, kDraw, false>(exp_avg_codec, exp_avg_sq_codec, ps, model, m_codes, v_codes,
                                                       m_scale, v_scale, g, n, with_model, random, k);
}
#endif

// The geometry of a tensor's blocks (Block8Geometry, block8_geometry): block8_geometry.hpp.

}  // namespace halfstep::detail
