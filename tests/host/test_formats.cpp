// Number formats: exact round-to-nearest-even conversions and format constants.
#include <catch2/catch.hpp>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "halfstep/formats.hpp"

using namespace halfstep;

namespace {

std::uint16_t cuda_f16_bits(float x) {
  const __half_raw r = __float2half_rn(x);
  return r.x;
}
std::uint16_t cuda_bf16_bits(float x) {
  const __nv_bfloat16_raw r = __float2bfloat16_rn(x);
  return r.x;
}
float float_from_bits(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace

TEST_CASE("every f16 bit pattern round-trips through double", "[formats]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const double x = from_f16_bits(bits);
    CAPTURE(b, x);
    if (classify_bits16(DType::f16, bits) == BitClass::nan) {
      REQUIRE(std::isnan(x));
      REQUIRE(classify_bits16(DType::f16, to_f16_bits(x)) == BitClass::nan);
      REQUIRE((to_f16_bits(x) & 0x8000u) == (bits & 0x8000u));
    } else {
      REQUIRE(to_f16_bits(x) == bits);
    }
  }
}

TEST_CASE("every bf16 bit pattern round-trips through double", "[formats]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const double x = from_bf16_bits(bits);
    CAPTURE(b, x);
    if (classify_bits16(DType::bf16, bits) == BitClass::nan) {
      REQUIRE(std::isnan(x));
      REQUIRE(classify_bits16(DType::bf16, to_bf16_bits(x)) == BitClass::nan);
    } else {
      REQUIRE(to_bf16_bits(x) == bits);
    }
  }
}

TEST_CASE("f16 rounding at the boundaries follows IEEE binary16", "[formats]") {
  CHECK(to_f16_bits(65504.0) == 0x7BFF);
  CHECK(to_f16_bits(65519.999) == 0x7BFF);
  CHECK(to_f16_bits(65520.0) == 0x7C00);  // the tie with 65536 rounds to even: infinity
  CHECK(to_f16_bits(-65520.0) == 0xFC00);
  CHECK(to_f16_bits(1e300) == 0x7C00);
  CHECK(to_f16_bits(std::numeric_limits<double>::infinity()) == 0x7C00);
  CHECK(to_f16_bits(-std::numeric_limits<double>::infinity()) == 0xFC00);
  CHECK(to_f16_bits(-0.0) == 0x8000);
  CHECK(to_f16_bits(0.0) == 0x0000);
  CHECK(to_f16_bits(0x1p-24) == 0x0001);               // smallest subnormal
  CHECK(to_f16_bits(0x1p-25) == 0x0000);               // tie with 0: even
  CHECK(to_f16_bits(0x1.000001p-25) == 0x0001);        // just past the tie
  CHECK(to_f16_bits(3 * 0x1p-25) == 0x0002);           // 1.5 ulp: tie to even 2
  CHECK(to_f16_bits(-0x1p-26) == 0x8000);              // underflow keeps the sign
  CHECK(to_f16_bits(0x1p-14) == 0x0400);               // smallest normal
  CHECK(to_f16_bits(0x1p-14 - 0x1p-25) == 0x0400);     // tie between 0x3FF and 0x400: even
  CHECK(to_f16_bits(1.0) == 0x3C00);
  CHECK(to_f16_bits(1.0 + 0x1p-11) == 0x3C00);         // tie: even
  CHECK(to_f16_bits(1.0 + 3 * 0x1p-11) == 0x3C02);     // tie: even
  CHECK(to_f16_bits(1.0 - 0x1p-12) == 0x3C00);         // tie below 1: even
  CHECK(to_f16_bits(-2.5) == 0xC100);
  CHECK(classify_bits16(DType::f16, to_f16_bits(std::nan(""))) == BitClass::nan);
}

TEST_CASE("double inputs are rounded once and not through float", "[formats]") {
  // 1 + 2^-11 + 2^-40 lies just above the f16 tie; via float it would land on the tie and
  // round down to 1.0.
  CHECK(to_f16_bits(1.0 + 0x1p-11 + 0x1p-40) == 0x3C01);
  CHECK(to_bf16_bits(1.0 + 0x1p-8 + 0x1p-40) == 0x3F81);
}

TEST_CASE("bf16 rounding at the boundaries follows bfloat16", "[formats]") {
  CHECK(to_bf16_bits(0x1.fep127) == 0x7F7F);
  CHECK(to_bf16_bits(0x1.fefffffp127) == 0x7F7F);
  CHECK(to_bf16_bits(0x1.ffp127) == 0x7F80);  // the tie with 2^128 rounds to infinity
  CHECK(to_bf16_bits(static_cast<double>(std::numeric_limits<float>::max())) == 0x7F80);
  CHECK(to_bf16_bits(-1e300) == 0xFF80);
  CHECK(to_bf16_bits(0x1p-133) == 0x0001);
  CHECK(to_bf16_bits(0x1p-134) == 0x0000);
  CHECK(to_bf16_bits(0x1p-126) == 0x0080);
  CHECK(to_bf16_bits(1.0) == 0x3F80);
  CHECK(to_bf16_bits(1.0 + 0x1p-8) == 0x3F80);
  CHECK(to_bf16_bits(1.0 + 3 * 0x1p-8) == 0x3F82);
  CHECK(to_bf16_bits(-0.0) == 0x8000);
  CHECK(classify_bits16(DType::bf16, to_bf16_bits(-std::nan(""))) == BitClass::nan);
}

TEST_CASE("format constants match the decoded extreme patterns", "[formats]") {
  static_assert(format_info(DType::f16).max == 65504.0f);
  static_assert(format_info(DType::f16).significand_bits == 11);
  static_assert(format_info(DType::bf16).significand_bits == 8);
  static_assert(format_info(DType::f32).significand_bits == 24);
  CHECK(format_info(DType::f16).max == from_f16_bits(0x7BFF));
  CHECK(format_info(DType::f16).min_normal == from_f16_bits(0x0400));
  CHECK(format_info(DType::f16).min_subnormal == from_f16_bits(0x0001));
  CHECK(format_info(DType::f16).unit_roundoff == (from_f16_bits(0x3C01) - 1.0) / 2);
  CHECK(format_info(DType::bf16).max == from_bf16_bits(0x7F7F));
  CHECK(format_info(DType::bf16).min_normal == from_bf16_bits(0x0080));
  CHECK(format_info(DType::bf16).min_subnormal == from_bf16_bits(0x0001));
  CHECK(format_info(DType::bf16).unit_roundoff == (from_bf16_bits(0x3F81) - 1.0) / 2);
  CHECK(format_info(DType::f32).max == std::numeric_limits<float>::max());
  CHECK(format_info(DType::f32).min_normal == std::numeric_limits<float>::min());
  CHECK(format_info(DType::f32).min_subnormal == std::numeric_limits<float>::denorm_min());
  CHECK(format_info(DType::f32).unit_roundoff == std::numeric_limits<float>::epsilon() / 2);
  CHECK(element_size(DType::f16) == 2);
  CHECK(element_size(DType::f32) == 4);
}

TEST_CASE("bit classes come from the exponent field", "[formats]") {
  CHECK(classify_bits16(DType::f16, 0x0000) == BitClass::zero);
  CHECK(classify_bits16(DType::f16, 0x8000) == BitClass::zero);
  CHECK(classify_bits16(DType::f16, 0x03FF) == BitClass::subnormal);
  CHECK(classify_bits16(DType::f16, 0x0400) == BitClass::normal);
  CHECK(classify_bits16(DType::f16, 0x7C00) == BitClass::infinite);
  CHECK(classify_bits16(DType::f16, 0xFC00) == BitClass::infinite);
  CHECK(classify_bits16(DType::f16, 0x7C01) == BitClass::nan);  // signalling
  CHECK(classify_bits16(DType::f16, 0x7E00) == BitClass::nan);  // quiet
  CHECK(classify_bits16(DType::bf16, 0x007F) == BitClass::subnormal);
  CHECK(classify_bits16(DType::bf16, 0x7F80) == BitClass::infinite);
  CHECK(classify_bits16(DType::bf16, 0x7F81) == BitClass::nan);
}

TEST_CASE("f16 conversions agree with cuda_fp16.h on a seeded sample", "[formats]") {
  std::mt19937_64 rng(20261129);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  std::uniform_real_distribution<float> near_range(-70000.0f, 70000.0f);
  std::uniform_real_distribution<double> log_mag(-30.0, 17.0);
  for (int i = 0; i < 300000; ++i) {
    float x;
    switch (i % 3) {
      case 0: x = float_from_bits(any_bits(rng)); break;
      case 1: x = near_range(rng); break;
      default: x = static_cast<float>(std::exp2(log_mag(rng))) * (i % 2 ? 1.0f : -1.0f); break;
    }
    CAPTURE(i, x);
    const std::uint16_t ours = to_f16_bits(static_cast<double>(x));
    const std::uint16_t theirs = cuda_f16_bits(x);
    if (std::isnan(x)) {
      REQUIRE(classify_bits16(DType::f16, ours) == BitClass::nan);
      REQUIRE(classify_bits16(DType::f16, theirs) == BitClass::nan);
    } else {
      REQUIRE(ours == theirs);
    }
  }
  for (std::uint32_t b = 0; b < 65536; ++b) {
    __half_raw r;
    r.x = static_cast<unsigned short>(b);
    const float theirs = __half2float(__half(r));
    const double ours = from_f16_bits(static_cast<std::uint16_t>(b));
    CAPTURE(b);
    if (std::isnan(ours)) {
      REQUIRE(std::isnan(theirs));
    } else {
      REQUIRE(static_cast<double>(theirs) == ours);
    }
  }
}

TEST_CASE("bf16 conversions agree with cuda_bf16.h on a seeded sample", "[formats]") {
  std::mt19937_64 rng(11292026);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 300000; ++i) {
    const float x = float_from_bits(any_bits(rng));
    CAPTURE(i, x);
    const std::uint16_t ours = to_bf16_bits(static_cast<double>(x));
    const std::uint16_t theirs = cuda_bf16_bits(x);
    if (std::isnan(x)) {
      REQUIRE(classify_bits16(DType::bf16, ours) == BitClass::nan);
      REQUIRE(classify_bits16(DType::bf16, theirs) == BitClass::nan);
    } else {
      REQUIRE(ours == theirs);
    }
  }
  for (std::uint32_t b = 0; b < 65536; ++b) {
    __nv_bfloat16_raw r;
    r.x = static_cast<unsigned short>(b);
    const float theirs = __bfloat162float(__nv_bfloat16(r));
    const double ours = from_bf16_bits(static_cast<std::uint16_t>(b));
    CAPTURE(b);
    if (std::isnan(ours)) {
      REQUIRE(std::isnan(theirs));
    } else {
      REQUIRE(static_cast<double>(theirs) == ours);
    }
  }
}
