// The unfused baseline pipeline and the benchmark's random fills. Each stage is a plain
// grid-stride kernel, as a trainer assembling the step from separate operations would have.
#include <cub/cub.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "unfused.hpp"

namespace bench {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}
#define BENCH_CHECK(expr) check((expr), #expr)

constexpr int kThreads = 256;
unsigned grid_for(std::int64_t n) {
  const std::int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

__device__ std::uint64_t mix(std::uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__device__ float unit(std::uint64_t seed, std::int64_t i) {  // in [0, 1)
  return static_cast<float>(mix(seed ^ mix(static_cast<std::uint64_t>(i))) >> 40) * 0x1p-24f;
}

__global__ void fill_uniform_kernel(float* x, std::int64_t n, float lo, float hi, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    x[i] = lo + (hi - lo) * unit(seed, i);
  }
}

__global__ void fill_grads_kernel(std::uint16_t* g, bool bf16, std::int64_t n, float scale, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float u = unit(seed, i);
    const float magnitude = exp2f(-8.0f * unit(seed + 1, i));
    const float x = (u < 0.5f ? -1.0f : 1.0f) * magnitude * scale;
    g[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
  }
}

struct Scratch {
  int found_inf;
  float norm_sq;
  long long step;
  float clip, step_size, sqrt_bc2;
};

__device__ float load16(const std::uint16_t* g, std::int64_t i, bool bf16) {
  return bf16 ? __uint_as_float(static_cast<unsigned>(g[i]) << 16) : __half2float(__ushort_as_half(g[i]));
}

// 1. Upcast, unscale and check.
__global__ void unscale_check_kernel(const std::uint16_t* g, bool bf16, float* g32, std::int64_t n,
                                     float inv_scale, Scratch* s) {
  bool bad = false;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float x = load16(g, i, bf16) * inv_scale;
    bad |= !isfinite(x);
    g32[i] = x;
  }
  if (bad) atomicOr(&s->found_inf, 1);
}

struct Square {
  __host__ __device__ float operator()(float x) const { return x * x; }
};

// 3. The decision and the constants.
__global__ void prepare_kernel(Scratch* s, float max_norm, float lr, float beta1, float beta2) {
  const float norm = sqrtf(s->norm_sq);
  s->clip = max_norm > 0.0f ? fminf(1.0f, max_norm / (norm + 1e-6f)) : 1.0f;
  if (s->found_inf) return;
  s->step += 1;
  const double t = static_cast<double>(s->step);
  s->step_size = static_cast<float>(lr / (1.0 - pow(static_cast<double>(beta1), t)));
  s->sqrt_bc2 = static_cast<float>(sqrt(1.0 - pow(static_cast<double>(beta2), t)));
}

// 4. Clip.
__global__ void clip_kernel(float* g32, std::int64_t n, const Scratch* s) {
  const float clip = s->clip;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    g32[i] *= clip;
  }
}

// 5. AdamW.
__global__ void adamw_kernel(const float* g32, float* p, float* m, float* v, std::int64_t n,
                             const Scratch* s, float lr, float wd, float beta1, float beta2, float eps) {
  if (s->found_inf) return;
  const float step_size = s->step_size, sqrt_bc2 = s->sqrt_bc2, decay = 1.0f - lr * wd;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float g = g32[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) / sqrt_bc2 + eps);
  }
}

// 6. The model copy.
__global__ void cast_kernel(const float* p, std::uint16_t* model, bool bf16, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    model[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(p[i])) : __half_as_ushort(__float2half_rn(p[i]));
  }
}

constexpr float kLr = 1e-3f, kWd = 0.01f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f;

}  // namespace

void fill_uniform(float* x, std::int64_t n, float lo, float hi, std::uint64_t seed, cudaStream_t s) {
  fill_uniform_kernel<<<grid_for(n), kThreads, 0, s>>>(x, n, lo, hi, seed);
  BENCH_CHECK(cudaGetLastError());
}

void fill_grads(void* g, halfstep::DType dtype, std::int64_t n, float scale, std::uint64_t seed, cudaStream_t s) {
  fill_grads_kernel<<<grid_for(n), kThreads, 0, s>>>(static_cast<std::uint16_t*>(g),
                                                     dtype == halfstep::DType::bf16, n, scale, seed);
  BENCH_CHECK(cudaGetLastError());
}

UnfusedPipeline::UnfusedPipeline(std::int64_t n, halfstep::DType grad_dtype, halfstep::DType model_dtype,
                                 float max_grad_norm, float loss_scale, const void* grad, float* master,
                                 float* m, float* v, void* model)
    : n_(n), grad_dtype_(grad_dtype), model_dtype_(model_dtype), max_grad_norm_(max_grad_norm),
      loss_scale_(loss_scale), grad_(grad), master_(master), m_(m), v_(v), model_(model) {
  BENCH_CHECK(cudaMalloc(&grad32_, static_cast<std::size_t>(n) * sizeof(float)));
  BENCH_CHECK(cub::DeviceReduce::TransformReduce(nullptr, cub_bytes_, grad32_, static_cast<float*>(nullptr),
                                                 n, cuda::std::plus<>{}, Square{}, 0.0f));
  BENCH_CHECK(cudaMalloc(&scratch_, 256 + cub_bytes_));
  BENCH_CHECK(cudaMemset(scratch_, 0, 256));
}

UnfusedPipeline::~UnfusedPipeline() {
  cudaFree(grad32_);
  cudaFree(scratch_);
}

void UnfusedPipeline::step(cudaStream_t stream) {
  auto* s = static_cast<Scratch*>(scratch_);
  const bool grad_bf16 = grad_dtype_ == halfstep::DType::bf16;
  BENCH_CHECK(cudaMemsetAsync(&s->found_inf, 0, sizeof(int), stream));
  unscale_check_kernel<<<grid_for(n_), kThreads, 0, stream>>>(static_cast<const std::uint16_t*>(grad_), grad_bf16,
                                                               grad32_, n_, 1.0f / loss_scale_, s);
  BENCH_CHECK(cudaGetLastError());
  std::size_t bytes = cub_bytes_;
  BENCH_CHECK(cub::DeviceReduce::TransformReduce(static_cast<char*>(scratch_) + 256, bytes, grad32_, &s->norm_sq,
                                                 n_, cuda::std::plus<>{}, Square{}, 0.0f, stream));
  prepare_kernel<<<1, 1, 0, stream>>>(s, max_grad_norm_, kLr, kBeta1, kBeta2);
  BENCH_CHECK(cudaGetLastError());
  if (max_grad_norm_ > 0.0f) {
    clip_kernel<<<grid_for(n_), kThreads, 0, stream>>>(grad32_, n_, s);
    BENCH_CHECK(cudaGetLastError());
  }
  adamw_kernel<<<grid_for(n_), kThreads, 0, stream>>>(grad32_, master_, m_, v_, n_, s, kLr, kWd, kBeta1, kBeta2, kEps);
  BENCH_CHECK(cudaGetLastError());
  cast_kernel<<<grid_for(n_), kThreads, 0, stream>>>(master_, static_cast<std::uint16_t*>(model_),
                                                      model_dtype_ == halfstep::DType::bf16, n_);
  BENCH_CHECK(cudaGetLastError());
}

}  // namespace bench
