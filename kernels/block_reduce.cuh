// Internal device helpers: block-wide reductions of integers. Each is a fixed tree of warp
// shuffles and one pass over the warp results; no atomics.
#pragma once

#include "device.cuh"

#include <cstdint>

namespace halfstep::detail {

struct Sum {
  template <class T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct Max {
  template <class T>
  __device__ T operator()(T a, T b) const { return a < b ? b : a; }
};
struct Min {
  template <class T>
  __device__ T operator()(T a, T b) const { return b < a ? b : a; }
};

template <class T, class Op>
__device__ T warp_reduce(T value, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    value = op(value, __shfl_down_sync(0xffffffffu, value, offset));
  }
  return value;
}

/// Reduces `value` over a block of kThreads threads (a multiple of 32); the result is valid in
/// thread 0. `scratch` holds at least kThreads / 32 elements; the call ends with a barrier, so
/// the scratch can be reused at once.
template <int kThreads, class T, class Op>
__device__ T block_reduce(T value, Op op, T* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 1024 threads");
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  value = warp_reduce(value, op);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = scratch[0];
    for (int w = 1; w < kWarps; ++w) value = op(value, scratch[w]);
  }
  __syncthreads();
  return value;
}

}  // namespace halfstep::detail
