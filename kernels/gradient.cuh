// Internal device helpers: reading 16-bit gradients and writing 16-bit model copies, per format.
#pragma once

#include "device.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "halfstep/formats.hpp"

namespace halfstep::detail {

template <DType kFormat>
struct Format16;

template <>
struct Format16<DType::f16> {
  /// The exponent field in place, and its lowest bit.
  static constexpr unsigned kExpBits = format_bits(DType::f16).exponent, kExpLsb = format_bits(DType::f16).exponent_lsb;
  __device__ static float to_float(std::uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
  }
  __device__ static std::uint16_t from_float(float x) {  // round to nearest even
    return __half_as_ushort(__float2half_rn(x));
  }
  __device__ static bool finite(std::uint16_t bits) { return (bits & kExpBits) != kExpBits; }
};

template <>
struct Format16<DType::bf16> {
  /// The exponent field in place, and its lowest bit.
  static constexpr unsigned kExpBits = format_bits(DType::bf16).exponent, kExpLsb = format_bits(DType::bf16).exponent_lsb;
  __device__ static float to_float(std::uint16_t bits) {
    return __uint_as_float(static_cast<unsigned>(bits) << 16);
  }
  __device__ static std::uint16_t from_float(float x) {  // round to nearest even
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  __device__ static bool finite(std::uint16_t bits) { return (bits & kExpBits) != kExpBits; }
};

/// The eight 16-bit values packed in a 16-byte vector, in memory order.
__device__ inline void unpack8(const uint4& q, std::uint16_t (&out)[8]) {
  const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = static_cast<std::uint16_t>(words[i] & 0xFFFFu);
    out[2 * i + 1] = static_cast<std::uint16_t>(words[i] >> 16);
  }
}

/// Packs eight 16-bit values into a 16-byte vector, in memory order.
__device__ inline uint4 pack8(const std::uint16_t (&in)[8]) {
  uint4 q;
  q.x = static_cast<unsigned>(in[0]) | (static_cast<unsigned>(in[1]) << 16);
  q.y = static_cast<unsigned>(in[2]) | (static_cast<unsigned>(in[3]) << 16);
  q.z = static_cast<unsigned>(in[4]) | (static_cast<unsigned>(in[5]) << 16);
  q.w = static_cast<unsigned>(in[6]) | (static_cast<unsigned>(in[7]) << 16);
  return q;
}

}  // namespace halfstep::detail
