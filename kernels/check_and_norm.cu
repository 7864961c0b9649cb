// Pass 1 of the step: one read of every gradient of every tensor, in one launch. Each block owns
// one chunk and writes its partial: Σg² of the finite values, max|g|, and the counts of inf/NaN,
// subnormal and zero elements. Nothing is decided here; finalize reduces the partials.
#include "device.cuh"

#include "block_reduce.cuh"
#include "cuda_check.hpp"
#include "gradient.cuh"
#include "launch.hpp"

namespace halfstep::detail {
namespace {

// What one thread has measured so far.
template <DType kFormat>
struct Measure {
  using F = Format16<kFormat>;
  typename F::SumType sum_sq = 0;
  float max_abs = 0.0f;
  unsigned nonfinite = 0, subnormal = 0, zero = 0;

  // Classifies the element by its exponent field, then folds in its size if it is finite.
  __device__ void add(std::uint16_t bits) {
    const unsigned exponent = (bits >> F::kExpShift) & F::kExpMask;
    const unsigned fraction = bits & F::kFracMask;
    const bool finite = exponent != F::kExpMask;
    nonfinite += finite ? 0u : 1u;
    subnormal += (exponent == 0u && fraction != 0u) ? 1u : 0u;
    zero += (exponent == 0u && fraction == 0u) ? 1u : 0u;
    const float magnitude = fabsf(F::to_float(bits));  // converted unconditionally: a select,
    const float a = finite ? magnitude : 0.0f;           // not a branch
    using S = typename F::SumType;
    sum_sq += static_cast<S>(a) * static_cast<S>(a);
    max_abs = fmaxf(max_abs, a);
  }
};

template <DType kFormat>
__global__ void __launch_bounds__(kPassThreads)
    check_and_norm_kernel(const TensorDesc* __restrict__ tensors,
                          const ChunkDesc* __restrict__ chunks,
                          ChunkPartial* __restrict__ partials) {
  const ChunkDesc chunk = chunks[blockIdx.x];
  const TensorDesc& tensor = tensors[chunk.tensor];
  const auto* grad = static_cast<const std::uint16_t*>(tensor.grad) + chunk.begin;

  Measure<kFormat> m;
  int done = 0;
  if (tensor.grad_vec) {  // 16-byte loads; the chunk start keeps the tensor's alignment
    const int n_vec = chunk.len / kVecElems;
    const auto* vec = reinterpret_cast<const uint4*>(grad);
    // kBatch loads are issued before any is used, so each thread keeps 64 bytes in flight.
    constexpr int kBatch = 4;
    for (int base = static_cast<int>(threadIdx.x); base < n_vec; base += kBatch * kPassThreads) {
      uint4 q[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kPassThreads;
        if (i < n_vec) q[u] = __ldg(vec + i);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (base + u * kPassThreads < n_vec) {
          std::uint16_t bits[kVecElems];
          unpack8(q[u], bits);
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) m.add(bits[j]);
        }
      }
    }
    done = n_vec * kVecElems;
  }
  for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len; i += kPassThreads) {
    m.add(__ldg(grad + i));
  }

  // The chunk's partial: Σg² widened to fp64 before the block combines it.
  HALFSTEP_SHARED(double[kPassThreads / 32], sum_scratch);
  HALFSTEP_SHARED(float[kPassThreads / 32], max_scratch);
  HALFSTEP_SHARED(unsigned[kPassThreads / 32], count_scratch);
  const double sum_sq =
      block_reduce<kPassThreads>(static_cast<double>(m.sum_sq), Sum{}, sum_scratch);
  const float max_abs = block_reduce<kPassThreads>(m.max_abs, Max{}, max_scratch);
  const unsigned nonfinite = block_reduce<kPassThreads>(m.nonfinite, Sum{}, count_scratch);
  const unsigned subnormal = block_reduce<kPassThreads>(m.subnormal, Sum{}, count_scratch);
  const unsigned zero = block_reduce<kPassThreads>(m.zero, Sum{}, count_scratch);
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = ChunkPartial{sum_sq, max_abs, nonfinite, subnormal, zero};
  }
}

}  // namespace

void launch_check_and_norm(DType grad_dtype, const TensorDesc* tensors, const ChunkDesc* chunks,
                           std::int64_t n_chunks, ChunkPartial* partials, cudaStream_t stream) {
  if (n_chunks == 0) return;  // only empty tensors: finalize sees no partials
  const dim3 grid(static_cast<unsigned>(n_chunks));
  if (grad_dtype == DType::bf16) {
    HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, check_and_norm_kernel<DType::bf16>)(tensors, chunks, partials);
  } else {
    HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, check_and_norm_kernel<DType::f16>)(tensors, chunks, partials);
  }
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace halfstep::detail
