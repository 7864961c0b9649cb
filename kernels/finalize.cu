// Finalize: one block turns pass 1's partials into the step's verdict, in two stages.
//
// Reduce: the partials of this rank are added into its StepTotals record. Every quantity is an
// integer (Σg² as exact limbs, counts, a bit pattern for the maximum, a key for the first inf/NaN),
// so the order of the additions cannot change a bit.
// Decide: one thread decodes the record — this rank's, or the one all ranks all-reduced — checks
// it (a record no reduction gives, or ranks with different hyperparameters, is never applied),
// rounds Σg² once to double and runs decide(): the overflow verdict, norm, spike check, clip
// coefficient, scaler transition and report; then the block computes each group's constants for
// pass 2.
#include "device.cuh"

#include <cstdint>

#include "block_reduce.cuh"
#include "cuda_check.hpp"
#include "launch.hpp"
#include "step_math.hpp"

namespace halfstep::detail {
namespace {

__device__ void reduce_partials(const FinalizeArgs& a) {
  constexpr std::int64_t kNone = INT64_MAX;
  unsigned long long digit[kPartialDigits] = {};
  unsigned long long nonfinite = 0, subnormal = 0, zero = 0;
  unsigned max_bits = 0;
  std::int64_t first_bad = kNone;
  for (std::int64_t i = threadIdx.x; i < a.n_chunks; i += kFinalizeThreads) {
    const ChunkPartial& q = a.partials[i];
#pragma unroll
    for (int k = 0; k < kPartialDigits; ++k) digit[k] += q.digit[k];
    nonfinite += q.nonfinite;
    subnormal += q.subnormal;
    zero += q.zero;
    max_bits = max_bits < q.max_bits ? q.max_bits : max_bits;
    if (q.nonfinite != 0 && first_bad == kNone) first_bad = i;
  }

  HALFSTEP_SHARED(unsigned long long[kFinalizeThreads / 32], sum_scratch);
  HALFSTEP_SHARED(unsigned[kFinalizeThreads / 32], max_scratch);
  HALFSTEP_SHARED(std::int64_t[kFinalizeThreads / 32], min_scratch);
#pragma unroll
  for (int k = 0; k < kPartialDigits; ++k) digit[k] = block_reduce<kFinalizeThreads>(digit[k], Sum{}, sum_scratch);
  nonfinite = block_reduce<kFinalizeThreads>(nonfinite, Sum{}, sum_scratch);
  subnormal = block_reduce<kFinalizeThreads>(subnormal, Sum{}, sum_scratch);
  zero = block_reduce<kFinalizeThreads>(zero, Sum{}, sum_scratch);
  max_bits = block_reduce<kFinalizeThreads>(max_bits, Max{}, max_scratch);
  first_bad = block_reduce<kFinalizeThreads>(first_bad, Min{}, min_scratch);
  if (threadIdx.x != 0) return;
  *a.totals = rank_record(a, digit, nonfinite, subnormal, zero, max_bits,
                          first_bad == kNone ? -1 : a.chunks[first_bad].tensor);
}

__device__ void decide_step(const FinalizeArgs& a) {
  HALFSTEP_SHARED(std::int64_t, applied_step);
  HALFSTEP_SHARED(int, apply);
  if (threadIdx.x == 0) {
    std::int64_t step = 0;
    apply = decide_record(a, step) ? 1 : 0;
    applied_step = step;
  }
  __syncthreads();
  if (apply) {  // bias corrections use the applied-step counter after this step
    for (int g = static_cast<int>(threadIdx.x); g < a.n_groups; g += kFinalizeThreads) {
      a.consts[g] = group_consts(a.params[g], a.lr[g], applied_step);
    }
  }
}

__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(const FinalizeArgs a, const int stages) {
  if ((stages & kRefuseStage) && threadIdx.x == 0) *a.totals = refused_record();  // pass 1 did not run
  if (stages & kReduceStage) reduce_partials(a);
  if (stages == (kReduceStage | kDecideStage)) __syncthreads();  // thread 0 wrote the record
  if (stages & kDecideStage) decide_step(a);
}

__global__ void store_kernel(float* where, float value) { *where = value; }

__global__ void store_group_kernel(GroupParams* where, GroupParams value, float* lr_where, float lr) {
  *where = value;
  *lr_where = lr;
}

__global__ void mark_unscaled_kernel(StepInputs* inputs) { inputs->scale.unscaled = 1; }

__global__ void external_scale_kernel(StepInputs* inputs, const float* scale, const float* found_inf) {
  ScaleInputs& in = inputs->scale;
  in.external = 1;
  in.external_scale = scale != nullptr ? *scale : 1.0f;
  if (scale == nullptr) in.unscaled = 1;
  in.found_inf = found_inf != nullptr ? *found_inf : 0.0f;
}

__global__ void set_grads_kernel(TensorDesc* tensors, StepInputs* inputs, const GradBatch b) {
  for (int i = static_cast<int>(threadIdx.x); i < b.count; i += static_cast<int>(blockDim.x)) {
    TensorDesc& d = tensors[b.first + i];
    d.grad = b.grad[i];
    d.grad_vec = b.flags[i] & 1u;
    d.all_vec = (b.flags[i] >> 1) & 1u;
  }
  if (threadIdx.x == 0) {  // every batch of one call carries the same
    inputs->numel = b.numel;
    inputs->grads_key = b.key;
  }
}

}  // namespace

void launch_finalize(const FinalizeArgs& args, int stages, cudaStream_t stream) {
  HALFSTEP_LAUNCH(1, kFinalizeThreads, 0, stream, finalize_kernel)(args, stages);
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

void launch_store(float* where, float value, cudaStream_t stream) {
  HALFSTEP_LAUNCH(1, 1, 0, stream, store_kernel)(where, value);
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

void launch_store_group(GroupParams* where, const GroupParams& value, float* lr_where, float lr,
                        cudaStream_t stream) {
  HALFSTEP_LAUNCH(1, 1, 0, stream, store_group_kernel)(where, value, lr_where, lr);
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

void launch_mark_unscaled(StepInputs* inputs, cudaStream_t stream) {
  HALFSTEP_LAUNCH(1, 1, 0, stream, mark_unscaled_kernel)(inputs);
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

void launch_external_scale(StepInputs* inputs, const float* scale, const float* found_inf, cudaStream_t stream) {
  HALFSTEP_LAUNCH(1, 1, 0, stream, external_scale_kernel)(inputs, scale, found_inf);
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

void launch_set_grads(TensorDesc* tensors, StepInputs* inputs, const GradBatch& batch, cudaStream_t stream) {
  HALFSTEP_LAUNCH(1, 256, 0, stream, set_grads_kernel)(tensors, inputs, batch);
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace halfstep::detail
