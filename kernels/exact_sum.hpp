// Internal: the exact sum of squares behind the global norm, host-and-device.
//
// Every finite fp16, bf16 or fp32 value is an integer multiple of 2^-149 (fp32's smallest
// subnormal; bf16's, 2^-133, and fp16's, 2^-24, are multiples of it), so every square is an
// integer multiple of 2^-298, and below 2^256. Σg² over any set of elements is therefore an
// integer in units of 2^-298. halfstep holds it as kSumLimbs base-2^32 digits ("limbs"), each in a
// 64-bit word so that many digits can be added before carrying. Integer addition is associative:
// the sum is the same bits whatever the order the elements, threads, blocks, chunks and ranks are
// added in, and however the work was split. It is rounded to double once, at the end, to nearest
// even.
//
// Sizes: a rank holds at most 2^31 chunks of 2^15 elements (2^46 elements), so its sum is below
// 2^302 (in units: 2^600, limbs 0..18); 2^31 ranks add 31 bits more (2^631 < 2^(32·20)). A
// normalised rank record has every limb below 2^32, so the SUM over 2^31 ranks stays below 2^63
// in every 64-bit word.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#include "halfstep/config.hpp"
#include "halfstep/formats.hpp"

namespace halfstep::detail {

/// Base-2^32 digits of Σg², least significant first.
inline constexpr int kSumLimbs = 20;
/// log2 of the unit of the lowest digit.
inline constexpr int kSumUnitLog2 = -298;

/// The bits of a double, on either side.
HALFSTEP_HD inline std::uint64_t double_bits(double x) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint64_t>(__double_as_longlong(x));
#else
  std::uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
#endif
}

/// Where a non-negative double that is an integer multiple of 2^-298 lands in the limbs: three
/// digits below 2^32 starting at limb `index`. Zero gives index -1 (nothing to add).
struct LimbDeposit {
  int index;
  std::uint32_t digit[3];
};

/// Splits `x` (>= 0, finite, an integer multiple of 2^-298, below 2^(32·kSumLimbs - 298 - 64))
/// into base-2^32 digits. The 53-bit significand, shifted to its place, spans at most three.
HALFSTEP_HD inline LimbDeposit limb_deposit(double x) {
  LimbDeposit d{-1, {0u, 0u, 0u}};
  const std::uint64_t bits = double_bits(x);
  const int biased = static_cast<int>(bits >> 52);
  std::uint64_t significand = bits & ((std::uint64_t{1} << 52) - 1);
  if (biased == 0 && significand == 0) return d;
  int exponent;  // x = significand · 2^exponent
  if (biased == 0) {
    exponent = -1074;  // subnormal double; cannot be a multiple of 2^-298 unless zero
  } else {
    significand |= std::uint64_t{1} << 52;
    exponent = biased - 1075;
  }
  int offset = exponent - kSumUnitLog2;  // bit position of the significand's lowest bit
  if (offset < 0) {  // the low bits are zero: x is a multiple of 2^-298
    significand >>= -offset;
    offset = 0;
  }
  d.index = offset / 32;
  const int shift = offset % 32;
  const std::uint64_t low = significand << shift;                     // bits 0..63
  const std::uint64_t high = shift == 0 ? 0 : significand >> (64 - shift);  // bits 64..84
  d.digit[0] = static_cast<std::uint32_t>(low);
  d.digit[1] = static_cast<std::uint32_t>(low >> 32);
  d.digit[2] = static_cast<std::uint32_t>(high);
  return d;
}

/// Carries every limb's excess into the next, leaving each limb below 2^32 but the last.
HALFSTEP_HD inline void limbs_normalize(std::uint64_t (&limbs)[kSumLimbs]) {
  std::uint64_t carry = 0;
  for (int i = 0; i < kSumLimbs; ++i) {
    const std::uint64_t v = limbs[i] + carry;  // callers keep limbs < 2^64 - 2^32: no wrap
    limbs[i] = i + 1 < kSumLimbs ? (v & 0xFFFFFFFFu) : v;
    carry = v >> 32;
  }
}

/// The value of normalised limbs, rounded once to the nearest double (ties to even).
HALFSTEP_HD inline double limbs_to_double(const std::uint64_t (&limbs)[kSumLimbs]) {
  int top = kSumLimbs - 1;
  while (top >= 0 && limbs[top] == 0) --top;
  if (top < 0) return 0.0;
  // The top limb may exceed 32 bits (the last carries into it); take the leading 64 bits from
  // the top limb and the two below, then fold every lower bit into a sticky bit.
  std::uint64_t hi = limbs[top];
  std::uint64_t mid = top >= 1 ? limbs[top - 1] : 0;
  std::uint64_t lo = top >= 2 ? limbs[top - 2] : 0;
  bool sticky = false;
  for (int i = top - 3; i >= 0; --i) sticky = sticky || limbs[i] != 0;
  // value = (hi·2^64 + mid·2^32 + lo) · 2^(32·(top-2) - 266), hi < 2^63
  int lead = 63;
  while (((hi >> lead) & 1u) == 0) --lead;  // hi > 0
  // hi·2^64 + mid:lo has 64 + lead + 1 significant bits: keep the leading 64 in `word` (hi
  // shifted up, then the top bits of mid:lo) and fold the `drop` lowest bits of mid:lo into the
  // sticky bit.
  const int drop = lead + 1;
  const std::uint64_t midlo = (mid << 32) | lo;
  std::uint64_t word;
  if (drop == 64) {
    word = hi;
    sticky = sticky || midlo != 0;
  } else {
    word = (hi << (64 - drop)) | (midlo >> drop);
    sticky = sticky || (midlo & ((std::uint64_t{1} << drop) - 1)) != 0;
  }
  // word holds the leading 64 bits; rounding to 53 happens at bit 11, so any lower bit that is
  // set only needs to reach bit 0 for the conversion below to round correctly.
  word |= sticky ? 1u : 0u;
  const int scale = 32 * (top - 2) + drop + kSumUnitLog2;  // word · 2^scale is the value
  return ::ldexp(static_cast<double>(word), scale);
}

/// How pass 1 sums squares in registers (docs/design.md, "The exact norm"). The square x² of a
/// gradient is exact in fp64 (at most 48 significant bits). It is split at fixed bit positions,
/// error-free, into parts: t = fma(x, x, M) with the "magic" M = 1.5 · 2^(P + 52) rounds x² to a
/// multiple of 2^P (for x² < 2^(P + 51)), t - M is that multiple exactly, and x² minus it is the
/// exact remainder, below 2^(P - 1) in magnitude. Each part is added into its own fp64 sum. A
/// thread adds at most kMaxPerThread squares, and the split points are chosen so that every part's
/// sum is an integer below 2^53 in its unit (unit[k], the split point or, for the last part, the
/// grid every square of the window is a multiple of): fp64 adds it exactly, in any order.
///
/// f16: two parts, P = 2^-8, grid 2^-48 (every fp16 square): Σ hi < 128 · 2^32, in units of 2^-8
///   below 2^47; |lo| <= 2^-9, Σ |lo| / 2^-48 < 2^46. Every finite fp16 value is in the window.
/// bf16: two parts over a window of 39 binades [2^e0, 2^(e0+39)): P = 2^(2·e0 + 32), grid
///   2^(2·e0 - 14) (the square of bf16's 8-bit significand at 2^e0): Σ hi / 2^P <= 128 · 2^46 =
///   2^53; |lo| <= 2^(P - 1), Σ |lo| / grid <= 128 · 2^45 = 2^52.
/// f32: three parts over a window of 46 binades: P1 = 2^(2·e0 + 46), P2 = 2^(2·e0), grid
///   2^(2·e0 - 46) (24-bit significands): Σ hi / P1 <= 128 · 2^46; the remainder r (|r| <= P1/2) is
///   split again at P2, |mid| / P2 <= 2^45 + 1/2, |lo| <= P2/2, Σ |lo| / grid <= 128 · 2^45.
/// The bf16 and f32 windows follow the previous step's largest gradient (8 or 9 binades above it,
/// the rest below). A thread that read a nonzero value outside the window adds its squares again,
/// those outside straight into the block's limbs: slower, as exact.
inline constexpr int kMaxPerThread = 128;

/// Base-2^32 digits of one chunk's Σg² in its ChunkPartial (the block's parts, each below 2^61,
/// shifted to their units and placed: below 2^(61 + 92 + 31) for f32's three parts).
inline constexpr int kPartialDigits = 6;

/// Pass 1's split of the squares for one launch: the same for every chunk and every rank.
struct SquareSplit {
  int parts;                  ///< 2 (f16, bf16) or 3 (f32)
  int unit_log2[3];           ///< log2 of each part's unit, decreasing; the last is the grid
  double magic[2];            ///< 1.5 · 2^(unit + 52) of the split points
  std::uint32_t low, high;    ///< magnitude patterns of the window [2^e0, 2^(e0 + B)); high is
                              ///< the format's infinity when the window reaches past its range
};

/// The largest gradient's binade, from the magnitude pattern `hint` of the format (a subnormal or
/// zero hint gives the format's lowest binade).
HALFSTEP_HD inline int hint_binade(DType format, std::uint32_t hint) {
  if (format == DType::f32) {
    const int field = static_cast<int>((hint >> 23) & 0xFFu);
    return (field == 0 ? 1 : field) - 127;
  }
  const int field = static_cast<int>((hint >> 7) & 0xFFu);  // bf16
  return (field == 0 ? 1 : field) - 127;
}

/// The magnitude pattern of 2^e in `format` (bf16 or f32; e within its range, subnormals included).
HALFSTEP_HD inline std::uint32_t power_pattern(DType format, int e) {
  if (format == DType::f32) {
    return e >= -126 ? static_cast<std::uint32_t>(e + 127) << 23 : std::uint32_t{1} << (e + 149);
  }
  return e >= -126 ? static_cast<std::uint32_t>(e + 127) << 7 : std::uint32_t{1} << (e + 133);
}

/// The split for gradients in `format`, the bf16 and f32 windows placed by `hint` (the magnitude
/// pattern of a recent largest gradient; any value gives a correct sum, it only decides which
/// squares take the slower path).
HALFSTEP_HD inline SquareSplit square_split(DType format, std::uint32_t hint) {
  SquareSplit s{};
  if (format == DType::f16) {
    s.parts = 2;
    s.unit_log2[0] = -8;
    s.unit_log2[1] = -48;
    s.low = 1;          // every nonzero finite value
    s.high = format_bits(DType::f16).infinity();
  } else if (format == DType::bf16) {
    int e0 = hint_binade(format, hint) - 30;
    e0 = e0 < -133 ? -133 : e0 > 89 ? 89 : e0;  // the grid stays a multiple of 2^-298
    s.parts = 2;
    s.unit_log2[0] = 2 * e0 + 32;
    s.unit_log2[1] = 2 * e0 - 14;
    s.low = power_pattern(format, e0);
    s.high = e0 + 39 >= 128 ? format_bits(DType::bf16).infinity() : power_pattern(format, e0 + 39);
  } else {
    int e0 = hint_binade(format, hint) - 37;
    e0 = e0 < -126 ? -126 : e0 > 82 ? 82 : e0;  // the grid stays a multiple of 2^-298
    s.parts = 3;
    s.unit_log2[0] = 2 * e0 + 46;
    s.unit_log2[1] = 2 * e0;
    s.unit_log2[2] = 2 * e0 - 46;
    s.low = power_pattern(format, e0);
    s.high = e0 + 46 >= 128 ? format_bits(DType::f32).infinity() : power_pattern(format, e0 + 46);
  }
  for (int k = 0; k + 1 < s.parts; ++k) s.magic[k] = ::ldexp(1.5, s.unit_log2[k] + 52);
  return s;
}

/// Adds the parts of x² (x finite, |x| in the split's window) to the part sums; kParts is
/// s.parts.
template <int kParts>
HALFSTEP_HD inline void add_square(const SquareSplit& s, double x, double (&sum)[kParts]) {
  const double hi = ::fma(x, x, s.magic[0]) - s.magic[0];  // x² rounded to a multiple of 2^P1
  const double rest = ::fma(x, x, -hi);                      // x² - hi, exactly
  sum[0] += hi;
  if constexpr (kParts == 2) {
    sum[1] += rest;
  } else {
    const double mid = (rest + s.magic[1]) - s.magic[1];  // rest rounded to a multiple of 2^P2
    sum[1] += mid;
    sum[2] += rest - mid;  // exactly
  }
}

/// Adds v · 2^shift (v signed, |v| < 2^63, 0 <= shift < 32·(kPartialDigits + 2) - 64) into the
/// two's-complement integer of kPartialDigits + 2 base-2^32 digits `d` (modulo 2^(32·(kPartialDigits
/// + 2)): the sign extended above the top digit is dropped, so a total that is non-negative and below
/// 2^(32·kPartialDigits) comes out exact whatever the order and signs of its terms).
HALFSTEP_HD inline void add_shifted(std::uint32_t (&d)[kPartialDigits + 2], std::int64_t v, int shift) {
  // v · 2^shift as digits: the 64 bits of v placed at shift, then v's sign extended above.
  const std::uint64_t bits = static_cast<std::uint64_t>(v);
  const std::uint32_t fill = v < 0 ? 0xFFFFFFFFu : 0u;
  const int at = shift / 32, r = shift % 32;
  std::uint32_t part[kPartialDigits + 2];
  for (int i = 0; i < kPartialDigits + 2; ++i) part[i] = i < at ? 0u : fill;
  const std::uint32_t w0 = static_cast<std::uint32_t>(bits), w1 = static_cast<std::uint32_t>(bits >> 32);
  part[at] = w0 << r;
  part[at + 1] = r == 0 ? w1 : (w1 << r) | (w0 >> (32 - r));
  if (at + 2 < kPartialDigits + 2) part[at + 2] = r == 0 ? fill : (fill << r) | (w1 >> (32 - r));
  std::uint64_t carry = 0;
  for (int i = 0; i < kPartialDigits + 2; ++i) {
    const std::uint64_t t = std::uint64_t{d[i]} + part[i] + carry;
    d[i] = static_cast<std::uint32_t>(t);
    carry = t >> 32;
  }
}

/// The limb the chunk digits of this split start at, and their shift within it.
HALFSTEP_HD inline int split_grid_offset(const SquareSplit& s) {
  return s.unit_log2[s.parts - 1] - kSumUnitLog2;  // >= 0: the grid is a multiple of 2^-298
}

/// Part sums (integers in units of 2^unit_log2[k], signed; their total is >= 0 and below
/// 2^(32·kPartialDigits) units of digit 0) as kPartialDigits digits from limb
/// split_grid_offset(s) / 32. Every unit is at or above the split's grid and less than
/// 32·(kPartialDigits + 2) - 64 bits above digit 0's (add_shifted).
HALFSTEP_HD inline void place_units(const SquareSplit& s, int parts, const std::int64_t* part, const int* unit_log2,
                                    std::uint32_t (&digit)[kPartialDigits]) {
  std::uint32_t d[kPartialDigits + 2] = {};
  const int digit0 = s.unit_log2[s.parts - 1] - split_grid_offset(s) % 32;  // log2 of digit 0's unit
  for (int k = 0; k < parts; ++k) add_shifted(d, part[k], unit_log2[k] - digit0);
  for (int i = 0; i < kPartialDigits; ++i) digit[i] = d[i];
}

/// The block's part sums (integers in each part's unit, signed; their total is >= 0) as
/// kPartialDigits digits from limb split_grid_offset(s) / 32.
HALFSTEP_HD inline void place_parts(const SquareSplit& s, const std::int64_t (&part)[3],
                                    std::uint32_t (&digit)[kPartialDigits]) {
  place_units(s, s.parts, part, s.unit_log2, digit);
}

}  // namespace halfstep::detail
