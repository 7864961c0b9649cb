// Finalize: one block turns pass 1's partials into the step's verdict. The partials are folded
// in a fixed order (thread i takes chunks i, i + T, ... and a fixed tree combines the threads),
// in fp64, so the norm is bitwise reproducible. Then one thread runs decide() — the overflow
// verdict, norm, spike check, clip coefficient, scaler transition and report — and the block
// computes each group's constants for pass 2.
#include "device.cuh"

#include <cstdint>

#include "block_reduce.cuh"
#include "cuda_check.hpp"
#include "launch.hpp"
#include "step_math.hpp"

namespace halfstep::detail {
namespace {

__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(const FinalizeArgs a) {
  constexpr std::int64_t kNone = INT64_MAX;
  double sum_sq = 0.0;
  float max_abs = 0.0f;
  std::int64_t nonfinite = 0, subnormal = 0, zero = 0, first_bad = kNone;
  for (std::int64_t i = threadIdx.x; i < a.n_chunks; i += kFinalizeThreads) {
    const ChunkPartial q = a.partials[i];
    sum_sq += q.sum_sq;
    max_abs = fmaxf(max_abs, q.max_abs);
    nonfinite += q.nonfinite;
    subnormal += q.subnormal;
    zero += q.zero;
    if (q.nonfinite != 0 && first_bad == kNone) first_bad = i;
  }

  HALFSTEP_SHARED(double[kFinalizeThreads / 32], sum_scratch);
  HALFSTEP_SHARED(float[kFinalizeThreads / 32], max_scratch);
  HALFSTEP_SHARED(std::int64_t[kFinalizeThreads / 32], count_scratch);
  HALFSTEP_SHARED(std::int64_t, applied_step);
  HALFSTEP_SHARED(int, apply);
  Totals t;
  t.sum_sq = block_reduce<kFinalizeThreads>(sum_sq, Sum{}, sum_scratch);
  t.max_abs = block_reduce<kFinalizeThreads>(max_abs, Max{}, max_scratch);
  t.nonfinite = block_reduce<kFinalizeThreads>(nonfinite, Sum{}, count_scratch);
  t.subnormal = block_reduce<kFinalizeThreads>(subnormal, Sum{}, count_scratch);
  t.zero = block_reduce<kFinalizeThreads>(zero, Sum{}, count_scratch);
  first_bad = block_reduce<kFinalizeThreads>(first_bad, Min{}, count_scratch);

  if (threadIdx.x == 0) {
    // Chunks are ordered by tensor, so the first bad chunk belongs to the first bad tensor.
    t.first_nonfinite_tensor = first_bad == kNone ? -1 : a.chunks[first_bad].tensor;
    DeviceState state = *a.state;
    StepReport report{};
    Decision decision{};
    decide(t, state, a.decide, a.params, a.lr, a.n_groups, report, decision);
    *a.state = state;
    *a.report = report;
    *a.decision = decision;
    apply = decision.apply;
    applied_step = state.step;
  }
  __syncthreads();
  if (apply) {  // bias corrections use the applied-step counter after this step
    for (int g = static_cast<int>(threadIdx.x); g < a.n_groups; g += kFinalizeThreads) {
      a.consts[g] = group_consts(a.params[g], a.lr[g], applied_step);
    }
  }
}

__global__ void store_kernel(float* where, float value) { *where = value; }

}  // namespace

void launch_finalize(const FinalizeArgs& args, cudaStream_t stream) {
  HALFSTEP_LAUNCH(1, kFinalizeThreads, 0, stream, finalize_kernel)(args);
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

void launch_store(float* where, float value, cudaStream_t stream) {
  HALFSTEP_LAUNCH(1, 1, 0, stream, store_kernel)(where, value);
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace halfstep::detail
