// halfstep: the number formats of gradients, model copies and master weights, and exact
// round-to-nearest-even conversions into and out of the 16-bit ones.
#pragma once

#include "halfstep/config.hpp"
#include <cstddef>
#include <cstdint>

namespace halfstep {

/// Element format of a buffer.
enum class DType : std::uint8_t { f16, bf16, f32 };

/// The range and precision of a format (IEEE 754 binary16, bfloat16, binary32).
struct FormatInfo {
  float max;             ///< largest finite value
  float min_normal;      ///< smallest positive normal value
  float min_subnormal;   ///< smallest positive subnormal value
  float unit_roundoff;   ///< half the distance from 1 to the next value: 2^-significand_bits
  int significand_bits;  ///< precision, counting the implicit leading bit
};

/// Range and precision of `dtype`.
constexpr FormatInfo format_info(DType dtype) {
  switch (dtype) {
    case DType::f16:
      return {65504.0f, 0x1p-14f, 0x1p-24f, 0x1p-11f, 11};
    case DType::bf16:
      return {0x1.fep127f, 0x1p-126f, 0x1p-133f, 0x1p-8f, 8};
    case DType::f32:
    default:
      return {0x1.fffffep127f, 0x1p-126f, 0x1p-149f, 0x1p-24f, 24};
  }
}

/// The bit fields of a format's patterns, in place: what every encoder and decoder of it (the
/// kernels', the reference's, the conversions below) agrees on. Patterns are sign-magnitude:
/// for finite values the magnitude bits order as the magnitudes do.
struct FormatBits {
  std::uint32_t sign;          ///< the sign bit
  std::uint32_t exponent;      ///< the exponent field; all ones (this value) is infinity, above it NaN
  std::uint32_t exponent_lsb;  ///< the exponent field's lowest bit: the smallest normal's pattern
  std::uint32_t fraction;      ///< the stored fraction field
  int fraction_bits;           ///< stored significand bits
  int exponent_bits;
  /// Every bit but the sign.
  HALFSTEP_HD constexpr std::uint32_t magnitude() const { return exponent | fraction; }
  /// Infinity's magnitude pattern; NaNs' lie above it.
  HALFSTEP_HD constexpr std::uint32_t infinity() const { return exponent; }
  HALFSTEP_HD constexpr int bias() const { return (1 << (exponent_bits - 1)) - 1; }
};

/// The bit fields of `dtype`.
HALFSTEP_HD constexpr FormatBits format_bits(DType dtype) {
  return dtype == DType::f16    ? FormatBits{0x8000u, 0x7C00u, 0x0400u, 0x03FFu, 10, 5}
         : dtype == DType::bf16 ? FormatBits{0x8000u, 0x7F80u, 0x0080u, 0x007Fu, 7, 8}
                                : FormatBits{0x80000000u, 0x7F800000u, 0x00800000u, 0x007FFFFFu, 23, 8};
}

/// Bytes per element of `dtype`.
constexpr std::size_t element_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

/// "f16", "bf16" or "f32".
HALFSTEP_API const char* dtype_name(DType dtype);

/// The binary16 value nearest to `x`, ties to even; NaN stays NaN (sign kept), ±inf and -0 are
/// kept, and magnitudes from 65520 up round to infinity.
HALFSTEP_API std::uint16_t to_f16_bits(double x);
/// The exact value of a binary16 bit pattern.
HALFSTEP_API double from_f16_bits(std::uint16_t bits);
/// The bfloat16 value nearest to `x`, ties to even, with the same special-value rules.
HALFSTEP_API std::uint16_t to_bf16_bits(double x);
/// The exact value of a bfloat16 bit pattern.
HALFSTEP_API double from_bf16_bits(std::uint16_t bits);

/// Bits of the 16-bit format `dtype` (f16 or bf16) nearest to `x`.
HALFSTEP_API std::uint16_t to_bits16(DType dtype, double x);
/// Exact value of the 16-bit pattern `bits` in format `dtype` (f16 or bf16).
HALFSTEP_API double from_bits16(DType dtype, std::uint16_t bits);

/// How a 16-bit pattern classifies, read from its exponent field.
enum class BitClass : std::uint8_t { zero, subnormal, normal, infinite, nan };
/// Class of the 16-bit pattern `bits` in format `dtype` (f16 or bf16).
HALFSTEP_API BitClass classify_bits16(DType dtype, std::uint16_t bits);

}  // namespace halfstep
