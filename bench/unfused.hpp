// The benchmark's baseline and helpers: an unfused pipeline of separate simple kernels doing the
// step's work the way most trainers do it today, and device-side random fills.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "halfstep/formats.hpp"

namespace bench {

/// Uniform values in [lo, hi) from a counter-based hash of (seed, index): no zeros unless the
/// range holds 0, and the same values on every run.
void fill_uniform(float* x, std::int64_t n, float lo, float hi, std::uint64_t seed, cudaStream_t s);

/// Finite, non-zero gradients: sign · magnitude with magnitude log-uniform in [2^-8, 1], times
/// `scale`, stored in `dtype` (f16 or bf16).
void fill_grads(void* g, halfstep::DType dtype, std::int64_t n, float scale, std::uint64_t seed,
                cudaStream_t s);

/// The same step from separate kernels over one flat range of n elements:
///   1. check + unscale: fp32 gradient = grad / S, inf/NaN flag      (reads 2 B, writes 4 B)
///   2. CUB DeviceReduce of g² (the norm)                             (reads 4 B)
///   3. one thread: clip coefficient, skip decision, bias corrections
///   4. clip: g *= clip                                               (reads 4 B, writes 4 B)
///   5. AdamW on master, m, v (returns at once on a skipped step)     (reads 16 B, writes 12 B)
///   6. cast the master to the model format                           (reads 4 B, writes 2 B)
/// 52 bytes per parameter, about what PyTorch's GradScaler + clip_grad_norm_ + fused AdamW move.
class UnfusedPipeline {
 public:
  UnfusedPipeline(std::int64_t n, halfstep::DType grad_dtype, halfstep::DType model_dtype,
                  float max_grad_norm, float loss_scale, const void* grad, float* master, float* m,
                  float* v, void* model);
  ~UnfusedPipeline();
  UnfusedPipeline(const UnfusedPipeline&) = delete;
  UnfusedPipeline& operator=(const UnfusedPipeline&) = delete;
  /// Enqueues one step.
  void step(cudaStream_t stream);
  /// Launches per step: the flag reset, unscale, CUB's two-kernel reduction, prepare, clip (when
  /// clipping), AdamW, cast.
  int launches() const { return max_grad_norm_ > 0.0f ? 8 : 7; }

 private:
  std::int64_t n_;
  halfstep::DType grad_dtype_, model_dtype_;
  float max_grad_norm_, loss_scale_;
  const void* grad_;
  float *master_, *m_, *v_;
  void* model_;
  float* grad32_ = nullptr;
  void* scratch_ = nullptr;  // flag, norm, step counter, constants, CUB's temporary storage
  std::size_t cub_bytes_ = 0;
};

}  // namespace bench
