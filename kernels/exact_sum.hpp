// Internal: the exact sum of squares behind the global norm, host-and-device.
//
// Every fp16 or bf16 value is an integer multiple of 2^-133 (bf16's smallest subnormal; fp16's,
// 2^-24, is a multiple of it), so every square is an integer multiple of 2^-266, and below 2^256.
// Σg² over any set of elements is therefore an integer in units of 2^-266. halfstep holds it as
// kSumLimbs base-2^32 digits ("limbs"), each in a 64-bit word so that many digits can be added
// before carrying. Integer addition is associative: the sum is the same bits whatever the order
// the elements, threads, blocks, chunks and ranks are added in, and however the work was split.
// It is rounded to double once, at the end, to nearest even.
//
// Sizes: a rank holds at most 2^31 chunks of 2^15 elements (2^46 elements), so its sum is below
// 2^302 (in units: 2^568, limbs 0..17); 2^31 ranks add 31 bits more (2^599 < 2^(32·19)). A
// normalised rank record has every limb below 2^32, so the SUM over 2^31 ranks stays below 2^63
// in every 64-bit word.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#include "halfstep/config.hpp"

namespace halfstep::detail {

/// Base-2^32 digits of Σg², least significant first.
inline constexpr int kSumLimbs = 19;
/// log2 of the unit of the lowest digit.
inline constexpr int kSumUnitLog2 = -266;

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

/// Where a non-negative double that is an integer multiple of 2^-266 lands in the limbs: three
/// digits below 2^32 starting at limb `index`. Zero gives index -1 (nothing to add).
struct LimbDeposit {
  int index;
  std::uint32_t digit[3];
};

/// Splits `x` (>= 0, finite, an integer multiple of 2^-266, below 2^(32·kSumLimbs - 266 - 64))
/// into base-2^32 digits. The 53-bit significand, shifted to its place, spans at most three.
HALFSTEP_HD inline LimbDeposit limb_deposit(double x) {
  LimbDeposit d{-1, {0u, 0u, 0u}};
  const std::uint64_t bits = double_bits(x);
  const int biased = static_cast<int>(bits >> 52);
  std::uint64_t significand = bits & ((std::uint64_t{1} << 52) - 1);
  if (biased == 0 && significand == 0) return d;
  int exponent;  // x = significand · 2^exponent
  if (biased == 0) {
    exponent = -1074;  // subnormal double; cannot be a multiple of 2^-266 unless zero
  } else {
    significand |= std::uint64_t{1} << 52;
    exponent = biased - 1075;
  }
  int offset = exponent - kSumUnitLog2;  // bit position of the significand's lowest bit
  if (offset < 0) {  // the low bits are zero: x is a multiple of 2^-266
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

/// How pass 1 sums squares in registers (docs/design.md, "The exact norm"). A thread reads at most
/// kMaxPerThread gradients of a chunk and sorts each square into one of three classes by the
/// value's magnitude; a class spans few enough binades that its sum over kMaxPerThread squares is
/// an integer below 2^53 in the class's unit, so fp64 adds it exactly. The classes' units are
/// u0, u0·2^kShift1 and u0·2^kShift2, and u0 sits kSumUnitLog2 + offset in the limbs.
///
/// fp16: fixed classes |x| < 2^-1 (unit 2^-48: sum < 128·2^-2 = 2^5), 2^-1 <= |x| < 2^12 (unit
/// 2^-22: sum < 128·2^24 = 2^31) and |x| >= 2^12 (unit 2^4: sum < 128·2^32 = 2^39). They cover
/// every fp16 value.
/// bf16 (8 significant bits, exponents 2^-133..2^127): three classes of 16 exponents each, from a
/// bottom exponent field E0 >= 1 (unit of the lowest: 2^(2·E0 - 268); sum < 128·2^(2·(E0+16) -
/// 254) = 2^53 units). They cover 48 binades; E0 follows the previous step's largest gradient
/// (39 binades below it, 8 above). A square outside them (a value further from the largest, a
/// subnormal) is added to the block's limbs directly: slower, as exact.
inline constexpr int kMaxPerThread = 128;

/// The bf16 window's bottom exponent field, from the 16-bit magnitude pattern of a recent largest
/// gradient (any value works: the window only decides which squares take the slower path).
HALFSTEP_HD inline int bf16_window_bottom(std::uint32_t hint) {
  int e = static_cast<int>((hint >> 7) & 0xFFu) - 39;
  if (e < 1) e = 1;
  if (e > 207) e = 207;  // the window's top class ends at exponent field 254
  return e;
}

/// The bit offset, from 2^kSumUnitLog2, of the lowest class's unit.
HALFSTEP_HD inline int class_unit_offset(bool bf16, int window_bottom) {
  return bf16 ? 2 * window_bottom - 2 : 218;
}

/// A 128-bit unsigned integer, enough for one block's class sums in the lowest class's unit.
struct U128 {
  std::uint64_t lo = 0, hi = 0;
  HALFSTEP_HD void add(std::uint64_t lo2, std::uint64_t hi2) {
    const std::uint64_t l = lo + lo2;
    hi += hi2 + (l < lo ? 1u : 0u);
    lo = l;
  }
  /// Adds v · 2^shift, 0 <= shift < 128.
  HALFSTEP_HD void add_shifted(std::uint64_t v, int shift) {
    if (shift == 0) add(v, 0);
    else if (shift < 64) add(v << shift, v >> (64 - shift));
    else add(0, v << (shift - 64));
  }
};

/// Digits of n · 2^shift (0 <= shift < 32) in base 2^32: five of them hold any n < 2^128.
HALFSTEP_HD inline void place_digits(const U128& n, int shift, std::uint32_t (&digit)[5]) {
  const std::uint32_t w[4] = {static_cast<std::uint32_t>(n.lo), static_cast<std::uint32_t>(n.lo >> 32),
                              static_cast<std::uint32_t>(n.hi), static_cast<std::uint32_t>(n.hi >> 32)};
  std::uint32_t carry = 0;
  for (int i = 0; i < 4; ++i) {
    digit[i] = shift == 0 ? w[i] : (w[i] << shift) | carry;
    carry = shift == 0 ? 0u : w[i] >> (32 - shift);
  }
  digit[4] = carry;
}

}  // namespace halfstep::detail
