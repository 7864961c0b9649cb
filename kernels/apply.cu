// Pass 2 of the step: unscale, clip and AdamW on the fp32 masters and moments, and the model copy
// in its 16-bit format. Every block reads finalize's decision first and returns at once on a
// skipped step, so a skipped step writes nothing anywhere. An element whose new master, moments
// or model copy would not be finite (which finalize cannot see: it depends on the stored values)
// keeps its old values and is counted in the report's held_elements, so no step ever writes a
// non-finite value.
#include "device.cuh"

#include "cuda_check.hpp"
#include "gradient.cuh"
#include "launch.hpp"
#include "step_math.hpp"

namespace halfstep::detail {
namespace {

// Eight consecutive floats through two 16-byte accesses, held in registers.
__device__ inline void load8(const float* src, float (&dst)[kVecElems]) {
  const float4 a = load16<float4>(src);
  const float4 b = load16<float4>(src + 4);
  dst[0] = a.x; dst[1] = a.y; dst[2] = a.z; dst[3] = a.w;
  dst[4] = b.x; dst[5] = b.y; dst[6] = b.z; dst[7] = b.w;
}
__device__ inline void store8(float* dst, const float (&src)[kVecElems]) {
  store16(dst, make_float4(src[0], src[1], src[2], src[3]));
  store16(dst + 4, make_float4(src[4], src[5], src[6], src[7]));
}

// At most 64 registers a thread, so an H100/H200 SM holds 4 blocks (half occupancy) to keep
// enough loads in flight.
template <DType kGrad, DType kModel>
__global__ void __launch_bounds__(kPassThreads, 4)
    apply_kernel(const TensorDesc* __restrict__ tensors, const ChunkDesc* __restrict__ chunks,
                 const Decision* __restrict__ decision, const GroupConsts* __restrict__ consts,
                 unsigned long long* __restrict__ held_elements) {
  if (decision->apply == 0) return;
  const Decision d = *decision;
  const ChunkDesc chunk = chunks[blockIdx.x];
  const TensorDesc tensor = tensors[chunk.tensor];
  const GroupConsts k = consts[tensor.group];
  using G = Format16<kGrad>;
  using M = Format16<kModel>;

  const auto* grad = static_cast<const std::uint16_t*>(tensor.grad) + chunk.begin;
  float* master = tensor.master + chunk.begin;
  float* exp_avg = tensor.exp_avg + chunk.begin;
  float* exp_avg_sq = tensor.exp_avg_sq + chunk.begin;
  auto* model = tensor.model ? static_cast<std::uint16_t*>(tensor.model) + chunk.begin : nullptr;

  unsigned held = 0;  // elements this thread kept because their update was not finite
  int done = 0;
  if (tensor.all_vec) {  // 8 elements per thread: 16-byte accesses to all five buffers
    const int n_vec = chunk.len / kVecElems;
    for (int i = static_cast<int>(threadIdx.x); i < n_vec; i += kPassThreads) {
      const std::int64_t at = static_cast<std::int64_t>(i) * kVecElems;
      std::uint16_t g_bits[kVecElems];
      unpack8(load16<uint4>(grad + at), g_bits);
      float p[kVecElems], m[kVecElems], v[kVecElems];
      load8(master + at, p);
      load8(exp_avg + at, m);
      load8(exp_avg_sq + at, v);
      std::uint16_t out[kVecElems];  // the model copy is the new fp32 master, rounded once
      unsigned kept = 0;             // bit j: element j keeps its old values
#pragma unroll
      for (int j = 0; j < kVecElems; ++j) {
        const float p0 = p[j], m0 = m[j], v0 = v[j];
        adamw_update(p[j], m[j], v[j], unscale(G::to_float(g_bits[j]), d), k);
        out[j] = model != nullptr ? M::from_float(p[j]) : 0;
        if (!(finite32(p[j]) && finite32(m[j]) && finite32(v[j]) && (model == nullptr || M::finite(out[j])))) {
          p[j] = p0;
          m[j] = m0;
          v[j] = v0;
          kept |= 1u << j;
        }
      }
      store8(master + at, p);
      store8(exp_avg + at, m);
      store8(exp_avg_sq + at, v);
      if (model != nullptr) {
        if (kept != 0) {  // rare: keep the held elements' model copies as they are
          std::uint16_t old[kVecElems];
          unpack8(load16<uint4>(model + at), old);
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) {
            if (kept >> j & 1u) out[j] = old[j];
          }
        }
        store16(model + at, pack8(out));
      }
      held += static_cast<unsigned>(__popc(kept));
    }
    done = n_vec * kVecElems;
  }
  for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len; i += kPassThreads) {
    float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update(p, m, v, unscale(G::to_float(grad[i]), d), k);
    const std::uint16_t out = model != nullptr ? M::from_float(p) : 0;
    if (finite32(p) && finite32(m) && finite32(v) && (model == nullptr || M::finite(out))) {
      master[i] = p;
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      if (model != nullptr) model[i] = out;
    } else {
      ++held;
    }
  }
  if (held != 0) atomicAdd(held_elements, static_cast<unsigned long long>(held));  // integer: exact
}

template <DType kGrad>
void launch_for_grad(DType model_dtype, dim3 grid, const TensorDesc* tensors,
                     const ChunkDesc* chunks, const Decision* decision, const GroupConsts* consts,
                     unsigned long long* held, cudaStream_t stream) {
  if (model_dtype == DType::bf16) {
    HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, apply_kernel<kGrad, DType::bf16>)(tensors, chunks, decision, consts, held);
  } else {
    HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, apply_kernel<kGrad, DType::f16>)(tensors, chunks, decision, consts, held);
  }
}

}  // namespace

void launch_apply(const ApplyArgs& a, cudaStream_t stream) {
  if (a.n_chunks == 0) return;
  const dim3 grid(static_cast<unsigned>(a.n_chunks));
  auto* held = reinterpret_cast<unsigned long long*>(&a.report->held_elements);
  if (a.grad_dtype == DType::bf16) {
    launch_for_grad<DType::bf16>(a.model_dtype, grid, a.tensors, a.chunks, a.decision, a.consts, held, stream);
  } else {
    launch_for_grad<DType::f16>(a.model_dtype, grid, a.tensors, a.chunks, a.decision, a.consts, held, stream);
  }
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace halfstep::detail
