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
// Encoding works on magnitudes y, without a search. A guess table indexed by y's fp32 exponent and
// top 7 fraction bits (one entry per 1/128 of an octave, octaves 2^-23 .. 2^0) holds, for the
// entry's lowest value, the answer and the one boundary past it that the entry's range may hold
// (no entry holds two: the densest boundaries, the top decade's, are 0.9/128 of a decade apart, at
// least 1/142 of their value, and an entry spans 1/128 of its octave's start; the tests check it
// entry by entry), so one read and one comparison give the result:
//
// - to nearest, the boundaries are thresholds: T_j is the smallest fp32 y that the rule "up when
//   y - m[j-1] > m[j] - y, in fp32" sends to m[j] (a tie to the smaller magnitude), and the code's
//   magnitude index is the number of thresholds at or below y;
// - stochastically, they are the magnitudes: the floor index p is the number of magnitudes at or
//   below y (less one), and the step from m[p] (lo) to m[p+1] (its gap, hi - lo in fp32, read with lo)
//   is taken with probability (y - lo) / gap, from 16 random bits.
//
// The thresholds are computed from that fp32 rule itself (near the map's lowest values, where
// neighbours are more than a factor 2 apart, y - m[j-1] is not exact and the rule is not the exact
// midpoint), so a table lookup gives bit for bit the rule's answer. Magnitudes below 2^-23 (1.2e-7)
// lie under both maps' first threshold (1.6e-7 and 2.8e-7, halfway to their smallest positive
// values), so the first entry answers for them too; those from 2^1 up lie over 1. On
// sm_90 that is one 8-byte read a value to nearest, two stochastically (bench/RESULTS.md).

inline constexpr int kGuessBits8 = 7;                          ///< fraction bits that index the guess
inline constexpr int kGuessOctaves8 = 24;                      ///< 2^-23 .. 2^0
inline constexpr int kGuessLowest8 = 127 - 23;                 ///< the lowest octave's biased exponent
inline constexpr int kGuessEntries8 = kGuessOctaves8 << kGuessBits8;

/// One entry of a guess table: the answer for the entry's lowest value, and the boundary past it
/// (+inf where there is none): a value at or past `next` takes index + 1.
struct alignas(8) Guess8 {
  float next;
  std::int32_t index;
};

/// A magnitude and the gap to the next one (fp32 hi - lo; +inf past 1), read together.
struct alignas(8) Step8 {
  float lo;
  float gap;
};

/// A map with what encoding it needs.
struct Codec8 {
  Map8 map;                          ///< code -> value (decode)
  float magnitude[258];              ///< the values >= 0, ascending, then +inf (twice): 129 values
                                     ///< signed, 256 unsigned
  Guess8 nearest[kGuessEntries8];    ///< to nearest: magnitude index of the entry's lowest value,
                                     ///< and the next threshold
  Guess8 floor[kGuessEntries8];      ///< stochastic: floor index of the entry's lowest value, and
                                     ///< the next magnitude
  Step8 step[257];                   ///< floor index -> its magnitude and the gap above it
  int top;                           ///< the index of 1 in magnitude: 128 signed, 255 unsigned
  bool is_signed;
};

namespace map8_detail {
/// 2^floor(log2 x), for x > 0 normal (a loop: no bit casts in constant expressions).
constexpr double binade(double x) {
  double e = 1.0;
  while (e * 2.0 <= x) e *= 2.0;
  while (e > x) e /= 2.0;
  return e;
}
/// The fp32 neighbours of a positive normal fp32 value.
constexpr float next_up(float f) { return static_cast<float>(static_cast<double>(f) + binade(f) * 0x1p-23); }
constexpr float next_down(float f) {
  const double e = binade(f);
  return static_cast<float>(static_cast<double>(f) - (static_cast<double>(f) == e ? e * 0x1p-24 : e * 0x1p-23));
}
/// The rule to nearest between neighbours lo < hi, in fp32 (a difference of two fp32 values of
/// the map is exact in double; one cast rounds it as an fp32 subtraction does): does y go up?
constexpr bool nearest_goes_up(float y, float lo, float hi) {
  return static_cast<float>(static_cast<double>(y) - lo) > static_cast<float>(static_cast<double>(hi) - y);
}
/// The smallest fp32 y that the rule sends from lo up to hi (the rule only turns from no to yes
/// as y grows: fp32 rounding is monotone).
constexpr float threshold(float lo, float hi) {
  float y = static_cast<float>((static_cast<double>(lo) + hi) / 2.0);
  while (nearest_goes_up(y, lo, hi)) y = next_down(y);
  while (!nearest_goes_up(y, lo, hi)) y = next_up(y);
  return y;
}
}  // namespace map8_detail

constexpr Codec8 make_codec8(bool is_signed) {
  Codec8 c{};
  c.map = is_signed ? make_signed_map8() : make_unsigned_map8();
  c.is_signed = is_signed;
  const int zero = is_signed ? kSignedZero8 : kUnsignedZero8;
  c.top = 255 - zero;
  for (int p = 0; p <= c.top; ++p) c.magnitude[p] = c.map.value[zero + p];
  for (int p = c.top + 1; p < 258; ++p) c.magnitude[p] = __builtin_huge_valf();
  float thresholds[257] = {};  // thresholds[j]: from magnitude j - 1 to j (j = 1 .. top); +inf past
  for (int j = 1; j <= c.top; ++j) thresholds[j] = map8_detail::threshold(c.magnitude[j - 1], c.magnitude[j]);
  thresholds[c.top + 1] = __builtin_huge_valf();
  for (int p = 0; p <= c.top; ++p) {
    c.step[p].lo = c.magnitude[p];
    c.step[p].gap = p < c.top ? static_cast<float>(static_cast<double>(c.magnitude[p + 1]) - c.magnitude[p])
                              : __builtin_huge_valf();
  }
  for (int p = c.top + 1; p < 257; ++p) c.step[p] = Step8{__builtin_huge_valf(), __builtin_huge_valf()};
  // Entry e covers [2^(o-23)·(1 + j/128), 2^(o-23)·(1 + (j+1)/128)) for o = e / 128, j = e % 128;
  // both answers only grow with e, so one pass over the boundaries fills each table.
  int p = 0, q = 0;
  double octave = 1.0;
  for (int o = 0; o < 23; ++o) octave /= 2.0;
  for (int e = 0; e < kGuessEntries8; ++e) {
    if (e > 0 && e % (1 << kGuessBits8) == 0) octave *= 2.0;
    const double lowest = octave * (1.0 + static_cast<double>(e % (1 << kGuessBits8)) / (1 << kGuessBits8));
    while (p < c.top && static_cast<double>(c.magnitude[p + 1]) <= lowest) ++p;
    while (q < c.top && static_cast<double>(thresholds[q + 1]) <= lowest) ++q;
    c.floor[e] = Guess8{c.magnitude[p + 1], p};
    c.nearest[e] = Guess8{thresholds[q + 1], q};
  }
  return c;
}

/// The two codecs for host code (device code reads copies in device memory).
inline constexpr Codec8 kSignedCodec8 = make_codec8(true);
inline constexpr Codec8 kUnsignedCodec8 = make_codec8(false);

// -- one value -----------------------------------------------------------------------------------

/// The guess table entry of |x|: its exponent and top fraction bits, |x| first clamped to the
/// table's range (below 2^-23 the first entry, from 2^1 the last; NaN, never encoded, the first).
HALFSTEP_HD inline int guess_entry8(float x) {
  // Compares and selects (a NaN fails the first and takes the lowest), which vectorise where
  // fmaxf's NaN rule would not.
  const float a = fabsf(x);
  const float low = a >= 0x1p-23f ? a : 0x1p-23f;
  const float y = low <= 0x1.fffffep0f ? low : 0x1.fffffep0f;
  return static_cast<int>(bits_of(y) >> (23 - kGuessBits8)) - (kGuessLowest8 << kGuessBits8);
}

/// The magnitude index a guess table entry `g` gives |x| = y: the entry's own, or the next where y
/// is at or past the one boundary the entry may hold.
HALFSTEP_HD inline int guessed8(const Guess8& g, float y) { return g.index + (y >= g.next ? 1 : 0); }

/// Stochastic rounding's last step: 1 where y, between s.lo (its floor) and the next magnitude,
/// goes up, with probability (y - lo) / gap from 16 random bits (`random`'s low half). s.gap is
/// +inf above 1: never up.
HALFSTEP_HD inline int rounds_up8(const Step8& s, float y, std::uint32_t random) {
  // u = (r + 1/2)·2^-16, r uniform in [0, 2^16), made exactly as 1 + u in fp32's fraction bits
  // less 1: P(u·gap < y - lo) = (y - lo) / gap.
  const float u = float_of(0x3F800040u | (random & 0xFFFFu) << 7) - 1.0f;
  return y - s.lo > s.gap * u ? 1 : 0;
}

/// The code of magnitude index p for x (see encode8_as for `positive`).
template <bool kSigned>
HALFSTEP_HD inline std::uint8_t code8_as(int p, float x, bool positive) {
  // Selects, no branch: the host's loops of it vectorise.
  p = positive & (p == 0) ? 1 : p;
  if constexpr (!kSigned) {
    return static_cast<std::uint8_t>(p);
  } else {
    const int negative = kSignedZero8 - (p < kSignedZero8 ? p : kSignedZero8);
    return static_cast<std::uint8_t>(x < 0.0f ? negative : kSignedZero8 + p);
  }
}

/// The code of `x`, a value already divided by its block's absmax (|x| <= 1 up to the rounding of
/// that division; beyond the map's ends the end codes), encoded by its magnitude: to the nearest
/// value, a tie to the smaller magnitude; or stochastically, to the larger of the two magnitudes
/// around |x| with the probability (to 2^-16) that |x| lies past the smaller, from 16 random bits
/// (`random`'s low half). A negative x takes the code of -(its magnitude), the lowest code (its
/// magnitude 0.99296875) where that would be -1, which the signed map lacks. `positive` (the
/// unsigned map only): the value was positive before its division by the absmax, which may have
/// flushed it to 0, and must not encode to code 0, the map's 0; it takes code 1, the smallest
/// positive value. kSigned says which map `codec` is (codec.is_signed), so that pass 2 compiles
/// only its own sign handling; encode8 below reads it from the codec. The host's block step runs
/// the same pieces (guess_entry8, guessed8, rounds_up8, code8_as) with the table reads gathered.
template <bool kSigned>
HALFSTEP_HD inline std::uint8_t encode8_as(const Codec8& codec, float x, bool stochastic, std::uint32_t random, bool positive) {
  const float y = x < 0.0f ? -x : x;
  const int e = guess_entry8(x);
  int p;
  if (stochastic) {
    p = guessed8(codec.floor[e], y);  // the floor: the entry holds at most one magnitude past its guess
    p += rounds_up8(codec.step[p], y, random);
  } else {
    p = guessed8(codec.nearest[e], y);  // the entry holds at most one threshold past its guess
  }
  return code8_as<kSigned>(p, x, positive);
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
/// The same from a copy of the map's 256 values (pass 2 reads them from shared memory).
HALFSTEP_HD inline float decode8(const float* map, std::uint8_t code, float scale) { return map[code] * scale; }

// -- one block -------------------------------------------------------------------------------------

/// Encodes the `n` values `x` (1 <= n <= 256) of one block: its scale (scale8 of the largest |x|)
/// and a code per value (encode8 of x · inverse8(scale), with bits `shift` and up of `random[i]`
/// when stochastic; with `never_zero`, a positive value never takes the unsigned map's 0). Returns
/// false, writing nothing, if a value is not finite: the block then
/// keeps what it holds. Pass 2 computes the same codes a warp per block.
HALFSTEP_HD inline bool encode_block8(const Codec8& codec, const float* x, int n, bool stochastic, const std::uint32_t* random,
                                      int shift, bool never_zero, std::uint8_t* codes, float& scale) {
  // The largest magnitude as the largest pattern of |x|: non-negative fp32 values order as their
  // patterns do, so it is the value a comparison of magnitudes finds, and an inf or NaN, whose
  // patterns lie above every finite one, shows as a largest pattern from 0x7F800000 up (one
  // integer maximum: a loop of it vectorises).
  std::uint32_t largest = 0;
  for (int i = 0; i < n; ++i) {
    const std::uint32_t a = bits_of(x[i]) & 0x7FFFFFFFu;
    largest = a > largest ? a : largest;
  }
  if (largest >= 0x7F800000u) return false;
  scale = scale8(float_of(largest));
  const float inverse = inverse8(scale);
  for (int i = 0; i < n; ++i) {
    codes[i] = encode8(codec, x[i] * inverse, stochastic, stochastic ? random[i] >> shift : 0u, never_zero & (x[i] > 0.0f));
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
      // The largest magnitude; a maximum of finite values (a non-finite one returns below), so
      // the same whatever the order and the same as encode_block8's.
      absmax = fmaxf(absmax, fabsf(x[j]));
    }
  }
  if (kChecked && __all_sync(0xFFFFFFFFu, finite ? 1 : 0) == 0) return false;
#pragma unroll
  for (int lanes = 16; lanes >= 1; lanes >>= 1) absmax = fmaxf(absmax, __shfl_xor_sync(0xFFFFFFFFu, absmax, lanes));
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
HALFSTEP_HD inline bool update_element8(const float* exp_avg_map, const float* exp_avg_sq_map,
                                        const typename Master::Stored& ps, std::uint16_t model, std::uint8_t m_code,
                                        std::uint8_t v_code, float m_scale, float v_scale, float g, bool with_model,
                                        std::uint32_t random, const GroupConsts& k, typename Master::Stored& ps_new,
                                        std::uint16_t& model_new, float& m, float& root) {
  float p = Master::decode(ps, model);
  m = decode8(exp_avg_map, m_code, m_scale);
  const float r = decode8(exp_avg_sq_map, v_code, v_scale);
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
  int ok = 1;  // an int, not a bool: the host's compiler vectorises an int reduction
  for (int i = 0; i < n; ++i) {
    ps_new[i] = typename Master::Stored{};
    model_new[i] = 0;
    // Only the buffers the format has are read: no master without one, no model copy unless it
    // is written or read, no random bits to nearest.
    const typename Master::Stored stored = Master::kStored ? ps[i] : typename Master::Stored{};
    const std::uint16_t weight = Master::kReadsModel || with_model ? model[i] : std::uint16_t{0};
    ok = update_element8<Master, kDraw>(exp_avg_codec.map.value, exp_avg_sq_codec.map.value, stored, weight, m_codes[i],
                                        v_codes[i], m_scale,
                                        v_scale, g[i], with_model, kDraw ? random[i] : 0u, k, ps_new[i], model_new[i],
                                        m[i], root[i]) &
         ok;
  }
  if (ok == 0) return true;
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
/// One block's AdamW step by a warp, all 32 lanes together (1-D thread blocks of a multiple of 32
/// threads; n, the scales and the codecs the same on every lane; the maps decoded from are the
/// codecs' own or copies of them): lane l holds elements 8l + j of
/// the block in the inputs and gets their new values in the outputs; returns, the same on every
/// lane, whether the block applies (every new value finite): if not, the caller keeps all it
/// holds. Nothing is written in place, and the encodes run either way (their codes of a held block
/// are never stored), so the common path has no branch. kGuarded: only elements below n are the
/// block's (the others get zeros); without it every lane's 8 elements are computed, and a lane
/// past n must hold neutral inputs (zeros: master 0, the maps' 0 codes, gradient 0), whose results
/// are finite zeros that change neither scale nor vote and are never stored. Bit for bit
/// update_block8 where both compile alike (the emulated device and the host, without
/// contraction). `exp_avg_codec` is the signed map's, `exp_avg_sq_codec` the unsigned map's.
template <class Master, bool kDraw, bool kGuarded>
__device__ inline bool warp_step_block8(const Codec8& exp_avg_codec, const Codec8& exp_avg_sq_codec,
                                        const float* exp_avg_map, const float* exp_avg_sq_map,
                                        const typename Master::Stored (&ps)[kBlock8PerLane],
                                        const std::uint16_t (&model)[kBlock8PerLane],
                                        const std::uint8_t (&m_codes)[kBlock8PerLane],
                                        const std::uint8_t (&v_codes)[kBlock8PerLane], float m_scale, float v_scale,
                                        const float (&g)[kBlock8PerLane], int n, bool with_model,
                                        const std::uint32_t (&random)[kBlock8PerLane], const GroupConsts& k,
                                        typename Master::Stored (&ps_new)[kBlock8PerLane],
                                        std::uint16_t (&model_new)[kBlock8PerLane],
                                        std::uint8_t (&m_new)[kBlock8PerLane], std::uint8_t (&v_new)[kBlock8PerLane],
                                        float& m_scale_new, float& v_scale_new) {
  const int first = static_cast<int>(threadIdx.x % 32u) * kBlock8PerLane;
  float m[kBlock8PerLane], root[kBlock8PerLane];
  bool ok = true;
#pragma unroll
  for (int j = 0; j < kBlock8PerLane; ++j) {
    ps_new[j] = typename Master::Stored{};
    model_new[j] = 0;
    m[j] = 0.0f;
    root[j] = 0.0f;
    if (!kGuarded || first + j < n) {
      ok = update_element8<Master, kDraw>(exp_avg_map, exp_avg_sq_map, ps[j], model[j], m_codes[j], v_codes[j],
                                          m_scale, v_scale, g[j], with_model, random[j], k, ps_new[j], model_new[j], m[j],
                                          root[j]) &&
           ok;
    }
  }
  const bool apply = __all_sync(0xFFFFFFFFu, ok ? 1 : 0) != 0;
  // The values are finite when the block applies: neither encode votes again.
  warp_encode_block8_as<true, false, !kGuarded>(exp_avg_codec, m, n, false, random, 0, false, m_new, m_scale_new);
  warp_encode_block8_as<false, false, !kGuarded>(exp_avg_sq_codec, root, n, kDraw, random, 16, true, v_new, v_scale_new);
  return apply;
}

/// update_block8 by a warp (warp_step_block8, then the new values in place unless the block is
/// held): every lane returns true, changing nothing, if the block is held. Elements past n are
/// left alone.
template <class Master, bool kDraw>
__device__ inline bool warp_update_block8(const Codec8& exp_avg_codec, const Codec8& exp_avg_sq_codec,
                                          typename Master::Stored (&ps)[kBlock8PerLane],
                                          std::uint16_t (&model)[kBlock8PerLane], std::uint8_t (&m_codes)[kBlock8PerLane],
                                          std::uint8_t (&v_codes)[kBlock8PerLane], float& m_scale, float& v_scale,
                                          const float (&g)[kBlock8PerLane], int n, bool with_model,
                                          const std::uint32_t (&random)[kBlock8PerLane], const GroupConsts& k) {
  typename Master::Stored ps_new[kBlock8PerLane];
  std::uint16_t model_new[kBlock8PerLane];
  std::uint8_t mc[kBlock8PerLane], vc[kBlock8PerLane];
  float ms = 0.0f, vs = 0.0f;
  if (!warp_step_block8<Master, kDraw, true>(exp_avg_codec, exp_avg_sq_codec, exp_avg_codec.map.value,
                                             exp_avg_sq_codec.map.value, ps, model, m_codes, v_codes, m_scale,
                                             v_scale, g, n, with_model, random, k, ps_new, model_new, mc, vc, ms, vs)) {
    return true;
  }
  const int first = static_cast<int>(threadIdx.x % 32u) * kBlock8PerLane;
#pragma unroll
  for (int j = 0; j < kBlock8PerLane; ++j) {
    if (first + j < n) {
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
#endif

// The geometry of a tensor's blocks (Block8Geometry, block8_geometry): block8_geometry.hpp.

}  // namespace halfstep::detail
