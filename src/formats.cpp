// Exact conversions between double and the two 16-bit formats. One routine serves both formats:
// they differ only in exponent width and significand width.
#include "halfstep/formats.hpp"

#include <cmath>

namespace halfstep {
namespace {

struct Layout16 {
  FormatBits bits;
  int exponent_bits;  // 5 for binary16, 8 for bfloat16
  int fraction_bits;  // stored significand bits: 10 and 7
  constexpr explicit Layout16(DType dtype)
      : bits(format_bits(dtype)), exponent_bits(bits.exponent_bits), fraction_bits(bits.fraction_bits) {}
  int bias() const { return bits.bias(); }
  int min_exponent() const { return 1 - bias(); }  // exponent of the smallest normal
  std::uint16_t exponent_mask() const { return static_cast<std::uint16_t>(bits.exponent); }
  std::uint16_t fraction_mask() const { return static_cast<std::uint16_t>(bits.fraction); }
  std::uint16_t sign_mask() const { return static_cast<std::uint16_t>(bits.sign); }
};

constexpr Layout16 kF16{DType::f16};
constexpr Layout16 kBF16{DType::bf16};

// Rounds a non-negative double below 2^53 to the nearest integer, ties to even, without relying
// on the floating-point environment's rounding mode.
double round_half_even(double q) {
  const double lower = std::floor(q);
  const double rest = q - lower;  // exact: q and lower share an exponent range below 2^53
  if (rest > 0.5) return lower + 1.0;
  if (rest < 0.5) return lower;
  return std::fmod(lower, 2.0) == 0.0 ? lower : lower + 1.0;
}

std::uint16_t encode(const Layout16& f, double x) {
  const std::uint16_t sign = std::signbit(x) ? f.sign_mask() : std::uint16_t{0};
  if (std::isnan(x)) {  // quiet NaN: all exponent bits and the top fraction bit
    return static_cast<std::uint16_t>(sign | f.exponent_mask() | (1u << (f.fraction_bits - 1)));
  }
  const std::uint16_t inf = static_cast<std::uint16_t>(sign | f.exponent_mask());
  const double a = std::fabs(x);
  if (std::isinf(a)) return inf;
  if (a == 0.0) return sign;

  // Quantise a to the spacing of its binade (or of the subnormals, which share the spacing of
  // the smallest normal binade). Dividing by a power of two is exact in double.
  int e = std::ilogb(a);  // a in [2^e, 2^(e+1))
  if (e < f.min_exponent()) e = f.min_exponent();
  const double q = round_half_even(std::ldexp(a, f.fraction_bits - e));
  // Subnormals: q < 2^fraction_bits is the fraction field itself. Normals: q in
  // [2^fb, 2^(fb+1)], and (biased exponent << fb) + (q - 2^fb) also absorbs q == 2^(fb+1),
  // which carries into the next binade.
  const long biased = e - f.min_exponent();  // 0 for the smallest binade
  const long pattern = (biased << f.fraction_bits) + static_cast<long>(q);
  if (pattern >= static_cast<long>(f.exponent_mask())) return inf;
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(pattern));
}

double decode(const Layout16& f, std::uint16_t bits) {
  const bool negative = (bits & f.sign_mask()) != 0;
  const int exponent_field = (bits & f.exponent_mask()) >> f.fraction_bits;
  const int fraction = bits & f.fraction_mask();
  double magnitude;
  if (exponent_field == (1 << f.exponent_bits) - 1) {
    magnitude = fraction == 0 ? HUGE_VAL : std::nan("");
  } else if (exponent_field == 0) {
    magnitude = std::ldexp(static_cast<double>(fraction), f.min_exponent() - f.fraction_bits);
  } else {
    magnitude = std::ldexp(static_cast<double>(fraction + (1 << f.fraction_bits)),
                           exponent_field - f.bias() - f.fraction_bits);
  }
  return negative ? -magnitude : magnitude;
}

BitClass classify(const Layout16& f, std::uint16_t bits) {
  const std::uint16_t exponent = bits & f.exponent_mask();
  const std::uint16_t fraction = bits & f.fraction_mask();
  if (exponent == f.exponent_mask()) return fraction == 0 ? BitClass::infinite : BitClass::nan;
  if (exponent == 0) return fraction == 0 ? BitClass::zero : BitClass::subnormal;
  return BitClass::normal;
}

const Layout16& layout(DType dtype) { return dtype == DType::bf16 ? kBF16 : kF16; }

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
  }
  return "unknown";
}

std::uint16_t to_f16_bits(double x) { return encode(kF16, x); }
double from_f16_bits(std::uint16_t bits) { return decode(kF16, bits); }
std::uint16_t to_bf16_bits(double x) { return encode(kBF16, x); }
double from_bf16_bits(std::uint16_t bits) { return decode(kBF16, bits); }

std::uint16_t to_bits16(DType dtype, double x) { return encode(layout(dtype), x); }
double from_bits16(DType dtype, std::uint16_t bits) { return decode(layout(dtype), bits); }
BitClass classify_bits16(DType dtype, std::uint16_t bits) { return classify(layout(dtype), bits); }

}  // namespace halfstep
