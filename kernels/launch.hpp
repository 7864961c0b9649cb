// Internal: the host launchers of the step's kernels. Each sizes its grid, launches on the
// caller's stream and turns a launch error into halfstep::Error. No launcher allocates or
// synchronises, so a step made of them can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "halfstep/formats.hpp"
#include "halfstep/distributed.hpp"
#include "step_math.hpp"
#include "step_types.hpp"

namespace halfstep::detail {

struct Codec8;  // block8.hpp

/// Arguments of pass 1.
struct Pass1Args {
  const TensorDesc* tensors;
  const ChunkDesc* chunks;
  ChunkPartial* partials;          // one per chunk
  const std::uint32_t* window_hint;  // the previous step's largest |g| pattern (bf16, f32: where
                                     // the split's window lies)
  unsigned long long* spill;       // limbs of squares outside the window (kSumLimbs); the reduce
                                   // stage adds them and clears them
  std::uint32_t normal_bits;       // f32: the compute format's smallest normal, as an f32 pattern
};

/// Pass 1: one block per chunk reads every gradient once and writes the chunk's partial.
void launch_check_and_norm(DType grad_dtype, const Pass1Args& args, std::int64_t n_chunks,
                           cudaStream_t stream);

/// The stages of the finalize kernel: reduce pass 1's partials into this rank's StepTotals
/// record; decide from the (reduced) record. A single-rank step runs both in one launch.
enum FinalizeStage : int { kReduceStage = 1, kDecideStage = 2, kRefuseStage = 4 };

/// Arguments of the finalize kernel.
struct FinalizeArgs {
  const ChunkPartial* partials;
  const ChunkDesc* chunks;
  std::int64_t n_chunks;
  std::uint32_t* window_hint;      // read by the reduce stage, updated by the decide stage
  unsigned long long* spill;
  StepTotals* totals;              // written by the reduce stage, read by the decide stage
  StepInputs* inputs;              // the step's numel (reduce) and scale inputs (decide clears them)
  std::int32_t rank;               // this rank in the record's first-inf/NaN key
  DType grad_dtype;
  OptimizerState* state;
  StepReport* report;
  Decision* decision;
  const GroupParams* params;
  const float* lr;      // per group, in device memory (set_lr writes it)
  GroupConsts* consts;  // per group, written on applied steps
  std::int32_t n_groups;
  DecideParams decide;
};

/// Finalize: one block runs the `stages` (FinalizeStage bits) asked for.
void launch_finalize(const FinalizeArgs& args, int stages, cudaStream_t stream);

/// The reduce stage's record from the sums of this rank's partials (digits of Σg² from the limb
/// of the launch's grid, counts, the largest finite magnitude, the first tensor with an inf/NaN
/// or -1) and the squares outside the window in a.spill, which it consumes. The finalize kernel
/// and the host backend both make the record with it.
HALFSTEP_HD inline StepTotals rank_record(const FinalizeArgs& a, const unsigned long long (&digit)[kPartialDigits],
                                          unsigned long long nonfinite, unsigned long long subnormal,
                                          unsigned long long zero, std::uint32_t max_bits, std::int32_t first_bad_tensor) {
  // Every chunk's digits start at the same limb: the grid of this launch's split.
  const int base = split_grid_offset(square_split(a.grad_dtype, *a.window_hint)) / 32;
  std::uint64_t limbs[kSumLimbs];
  for (int i = 0; i < kSumLimbs; ++i) limbs[i] = 0;
  for (int k = 0; k < kPartialDigits && base + k < kSumLimbs; ++k) {
    limbs[base + k] = digit[k];  // each < 2^31 chunks · 2^32; digits past the limbs are zero
  }
  limbs_normalize(limbs);
  for (int i = 0; i < kSumLimbs; ++i) {  // squares outside the window, consumed here
    limbs[i] += a.spill[i];
    a.spill[i] = 0;
  }
  limbs_normalize(limbs);

  StepTotals r;
  for (int i = 0; i < kSumLimbs; ++i) r.sum[i] = limbs[i];
  r.sum[kSumLimbs] = nonfinite;
  r.sum[kSumLimbs + 1] = subnormal;
  r.sum[kSumLimbs + 2] = zero;
  r.sum[kSumLimbs + 3] = static_cast<std::uint64_t>(a.inputs->numel);
  r.max[0] = max_bits;
  // Chunks are ordered by tensor, so the first bad chunk belongs to the first bad tensor.
  r.max[1] = first_bad_tensor < 0 ? 0 : first_bad_key(a.rank, first_bad_tensor);
  set_fingerprint(r, hyperparameter_fingerprint(a.params, a.lr, a.n_groups, a.decide.max_grad_norm,
                                                a.inputs->scale, a.state->scaler.scale, a.inputs->grads_key));
  return r;
}

/// The decide stage but for the groups' constants: decodes the (reduced) record, decides, and
/// writes the state, the report and the decision; clears the step's scale inputs and moves the
/// window to this step's largest gradient. Returns whether the step applies, and the applied-step
/// counter the constants use in `applied_step`.
HALFSTEP_HD inline bool decide_record(const FinalizeArgs& a, std::int64_t& applied_step) {
  const StepTotals r = *a.totals;
  const Totals t = decode_totals(r, a.grad_dtype);
  OptimizerState state = *a.state;
  StepReport report{};
  Decision decision{};
  decide(t, state, a.decide, a.params, a.lr, a.n_groups, a.inputs->scale, report, decision);
  a.inputs->scale = ScaleInputs{};  // it held for this step only
  *a.state = state;
  *a.report = report;
  *a.decision = decision;
  applied_step = state.step;
  // The next step's window follows this step's largest gradient, on every rank alike.
  if (t.fault == TotalsFault::none && r.max[0] != 0) *a.window_hint = static_cast<std::uint32_t>(r.max[0]);
  return decision.apply != 0;
}

/// Arguments of pass 2.
struct ApplyArgs {
  DType grad_dtype;
  DType model_dtype;
  StateFormat state;          // the formats of masters and moments, and their rounding
  const TensorDesc* tensors;
  const ChunkDesc* chunks;
  std::int64_t n_chunks;
  const Decision* decision;   // finalize's verdict
  const GroupConsts* consts;  // per group, for this step
  StepReport* report;         // held_elements: elements held back, added to
  const Codec8* codecs;       // block8 moments: exp_avg's (signed) and exp_avg_sq's (unsigned) codec
};

/// Pass 2: one block per chunk; every block returns at once unless the decision is to apply.
/// Elements held back because their update was not finite are added to report->held_elements.
void launch_apply(const ApplyArgs& args, cudaStream_t stream);

/// Writes `value` to device memory `where`, ordered on `stream` (the learning rate of a group, the
/// loss scale).
void launch_store(float* where, float value, cudaStream_t stream);

/// Writes a group's hyperparameters and learning rate, ordered on `stream`.
void launch_store_group(GroupParams* where, const GroupParams& value, float* lr_where, float lr,
                        cudaStream_t stream);

/// Marks the next step's gradients as already unscaled (StepInputs::unscaled), ordered on `stream`.
void launch_mark_unscaled(StepInputs* inputs, cudaStream_t stream);

/// The next step's gradients were scaled by *scale (null: they are already unscaled), a scale
/// another scaler owns, whose own check found an inf/NaN where *found_inf is nonzero (null: no
/// check): both read when the launch runs, into StepInputs::scale, ordered on `stream`.
void launch_external_scale(StepInputs* inputs, const float* scale, const float* found_inf, cudaStream_t stream);

/// Writes a batch of gradient pointers into the tensor table and the step's numel, ordered on
/// `stream` (the pointers travel as kernel arguments: no staging memory, no synchronisation).
void launch_set_grads(TensorDesc* tensors, StepInputs* inputs, const GradBatch& batch, cudaStream_t stream);

}  // namespace halfstep::detail
