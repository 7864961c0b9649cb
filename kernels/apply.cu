// Pass 2 of the step: unscale, clip and AdamW on the fp32 masters and moments from fp16, bf16 or
// fp32 gradients, and the model copy in its 16-bit format. Every block reads finalize's decision
// first and returns at once on a skipped step, so a skipped step writes nothing anywhere. An element whose new master, moments
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

// One vector of a pass: kW consecutive elements of every buffer, read and written with 16-byte
// accesses (the model copy's, for four elements, with one 8-byte access). kW is 8 for 16-bit
// gradients (16 bytes of them) and 4 for fp32 gradients, so that a thread's registers hold one
// vector of each of the five buffers within the kernel's 64.
template <DType kGrad>
inline constexpr int kWidth = kGrad == DType::f32 ? 4 : 8;

template <int kW>
__device__ inline void load_floats(const float* src, float (&dst)[kW]) {
#pragma unroll
  for (int q = 0; q < kW / 4; ++q) {
    const float4 a = load16<float4>(src + 4 * q);
    dst[4 * q] = a.x;
    dst[4 * q + 1] = a.y;
    dst[4 * q + 2] = a.z;
    dst[4 * q + 3] = a.w;
  }
}
template <int kW>
__device__ inline void store_floats(float* dst, const float (&src)[kW]) {
#pragma unroll
  for (int q = 0; q < kW / 4; ++q) store16(dst + 4 * q, make_float4(src[4 * q], src[4 * q + 1], src[4 * q + 2], src[4 * q + 3]));
}

// A vector of gradients as stored: 16-bit patterns packed two to a word, or fp32 values.
template <DType kGrad>
struct GradVector {
  uint4 bits;
  __device__ void load(const void* grad, std::int64_t at) { bits = load16<uint4>(static_cast<const std::uint16_t*>(grad) + at); }
  __device__ float operator[](int j) const {  // converted one at a time: the packed vector is the smaller
    const unsigned w = j < 2 ? bits.x : j < 4 ? bits.y : j < 6 ? bits.z : bits.w;
    return Format16<kGrad>::to_float(static_cast<std::uint16_t>((j & 1) != 0 ? w >> 16 : w & 0xFFFFu));
  }
};
template <>
struct GradVector<DType::f32> {
  float4 v;
  __device__ void load(const void* grad, std::int64_t at) { v = load16<float4>(static_cast<const float*>(grad) + at); }
  __device__ float operator[](int j) const { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }
};

// kW model-copy patterns: one 16-byte access for eight, one 8-byte access for four.
template <int kW>
__device__ inline void load_model(const std::uint16_t* src, std::uint16_t (&dst)[kW]) {
  if constexpr (kW == 8) {
    unpack8(load16<uint4>(src), dst);
  } else {
    const uint2 q = load8b<uint2>(src);
    dst[0] = static_cast<std::uint16_t>(q.x & 0xFFFFu);
    dst[1] = static_cast<std::uint16_t>(q.x >> 16);
    dst[2] = static_cast<std::uint16_t>(q.y & 0xFFFFu);
    dst[3] = static_cast<std::uint16_t>(q.y >> 16);
  }
}
template <int kW>
__device__ inline void store_model(std::uint16_t* dst, const std::uint16_t (&src)[kW]) {
  if constexpr (kW == 8) {
    store16(dst, pack8(src));
  } else {
    store8b(dst, make_uint2(static_cast<unsigned>(src[0]) | (static_cast<unsigned>(src[1]) << 16),
                            static_cast<unsigned>(src[2]) | (static_cast<unsigned>(src[3]) << 16)));
  }
}

template <DType kGrad>
__device__ inline float load_grad(const void* grad, std::int64_t i) {
  if constexpr (kGrad == DType::f32) {
    return static_cast<const float*>(grad)[i];
  } else {
    return Format16<kGrad>::to_float(static_cast<const std::uint16_t*>(grad)[i]);
  }
}

// At most 64 registers a thread, so an H100/H200 SM holds 4 blocks (half occupancy) to keep
// enough loads in flight.
template <DType kGrad, DType kModel>
__global__ void __launch_bounds__(kPassThreads, 4)
    apply_kernel(const TensorDesc* __restrict__ tensors, const ChunkDesc* __restrict__ chunks,
                 const Decision* __restrict__ decision, const GroupConsts* __restrict__ consts,
                 unsigned long long* __restrict__ held_elements) {
  constexpr int kW = kWidth<kGrad>;
  if (decision->apply == 0) return;
  const Decision d = *decision;
  const ChunkDesc chunk = chunks[blockIdx.x];
  const TensorDesc tensor = tensors[chunk.tensor];
  const GroupConsts k = consts[tensor.group];
  using M = Format16<kModel>;

  if (tensor.grad == nullptr) return;  // no gradient for this tensor in this step: left alone
  const void* grad = kGrad == DType::f32 ? static_cast<const void*>(static_cast<const float*>(tensor.grad) + chunk.begin)
                                          : static_cast<const void*>(static_cast<const std::uint16_t*>(tensor.grad) + chunk.begin);
  float* master = tensor.master + chunk.begin;
  float* exp_avg = tensor.exp_avg + chunk.begin;
  float* exp_avg_sq = tensor.exp_avg_sq + chunk.begin;
  auto* model = tensor.model ? static_cast<std::uint16_t*>(tensor.model) + chunk.begin : nullptr;

  unsigned held = 0;  // elements this thread kept because their update was not finite
  int done = 0;
  if (tensor.all_vec) {  // kW elements per thread: vector accesses to all five buffers
    const int n_vec = chunk.len / kW;
    for (int i = static_cast<int>(threadIdx.x); i < n_vec; i += kPassThreads) {
      const std::int64_t at = static_cast<std::int64_t>(i) * kW;
      GradVector<kGrad> g;
      g.load(grad, at);
      float p[kW], m[kW], v[kW];
      load_floats(master + at, p);
      load_floats(exp_avg + at, m);
      load_floats(exp_avg_sq + at, v);
      std::uint16_t out[kW];  // the model copy is the new fp32 master, rounded once
      unsigned kept = 0;      // bit j: element j keeps its old values
#pragma unroll
      for (int j = 0; j < kW; ++j) {
        const float p0 = p[j], m0 = m[j], v0 = v[j];
        adamw_update(p[j], m[j], v[j], unscale(g[j], d), k);
        out[j] = model != nullptr ? M::from_float(p[j]) : 0;
        if (!(finite32(p[j]) && finite32(m[j]) && finite32(v[j]) && (model == nullptr || M::finite(out[j])))) {
          p[j] = p0;
          m[j] = m0;
          v[j] = v0;
          kept |= 1u << j;
        }
      }
      store_floats(master + at, p);
      store_floats(exp_avg + at, m);
      store_floats(exp_avg_sq + at, v);
      if (model != nullptr) {
        if (kept != 0) {  // rare: keep the held elements' model copies as they are
          std::uint16_t old[kW];
          load_model(model + at, old);
#pragma unroll
          for (int j = 0; j < kW; ++j) {
            if (kept >> j & 1u) out[j] = old[j];
          }
        }
        store_model(model + at, out);
      }
      held += static_cast<unsigned>(__popc(kept));
    }
    done = n_vec * kW;
  }
  for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len; i += kPassThreads) {
    float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
    adamw_update(p, m, v, unscale(load_grad<kGrad>(grad, i), d), k);
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
  switch (a.grad_dtype) {
    case DType::bf16:
      launch_for_grad<DType::bf16>(a.model_dtype, grid, a.tensors, a.chunks, a.decision, a.consts, held, stream);
      break;
    case DType::f32:
      launch_for_grad<DType::f32>(a.model_dtype, grid, a.tensors, a.chunks, a.decision, a.consts, held, stream);
      break;
    default:
      launch_for_grad<DType::f16>(a.model_dtype, grid, a.tensors, a.chunks, a.decision, a.consts, held, stream);
      break;
  }
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace halfstep::detail
