// halfstep: what one optimizer step works on and what it reports.
#pragma once

#include <cstdint>
#include <vector>

#include "halfstep/formats.hpp"
#include "halfstep/scaler.hpp"
#include "halfstep/spike.hpp"
#include "halfstep/state.hpp"

namespace halfstep {

/// Hyperparameters of one parameter group (PyTorch's AdamW/Adam formula, see docs/design.md).
struct HALFSTEP_API AdamWConfig {
  float lr = 1e-3f;                    ///< learning rate; finite and >= 0; lr·weight_decay < 1
                                       ///< with decoupled decay
  float beta1 = 0.9f;                  ///< first-moment decay; in [0, 1)
  float beta2 = 0.999f;                ///< second-moment decay; in [0, 1)
  float eps = 1e-8f;                   ///< denominator guard; a normal fp32 number (>= 2^-126)
  float weight_decay = 0.0f;           ///< finite and >= 0
  bool decoupled_weight_decay = true;  ///< AdamW (p *= 1 - lr*wd); false: Adam + L2 (g += wd*p)
  bool bias_correction = true;         ///< divide the moments by 1 - beta^t
  /// Applied steps taken before this group joined the run (a parameter group added to a running
  /// optimizer): its bias corrections count t - step_offset, so its first step is its step 1, as
  /// torch.optim counts it (and 1 while t <= step_offset). In [0, kCounterLimit].
  std::int64_t step_offset = 0;

  /// Throws halfstep::Error naming the first field that breaks its rule.
  void validate() const;
};

/// One parameter tensor: device pointers for Backend::cuda, host pointers for Backend::reference.
/// Each buffer holds numel elements in the format StepConfig says (slot_layouts lists them).
struct ParamTensor {
  void* master = nullptr;       ///< master weights, updated in place: fp32 values, or the int16
                                ///< remainders that rebuild them with the bf16 model copy
                                ///< (StepConfig::state.master); null with MasterFormat::none
  const void* grad = nullptr;   ///< scaled gradients in StepConfig::grad_dtype
  void* exp_avg = nullptr;      ///< first moment in StepConfig::state.exp_avg's format
  void* exp_avg_sq = nullptr;   ///< second moment in StepConfig::state.exp_avg_sq's format
  void* model = nullptr;        ///< reduced-precision copy in StepConfig::model_dtype; may be null
                                ///< (required with MasterFormat::bf16_remainder and ::none)
  std::int64_t numel = 0;       ///< elements; >= 0 (zero-length tensors are allowed)
  std::int32_t group = 0;       ///< index into StepConfig::groups
  /// Another rank of the reduction holds this tensor too and counts it (a bias or norm weight
  /// replicated across a tensor-parallel group: one rank counts it): left out of the global norm
  /// and the subnormal, zero and element counts here. Its inf/NaN still skip the step, its largest
  /// |gradient| still counts (a maximum is not changed by duplicates), and it is updated like any
  /// other tensor. False, the default: counted.
  bool duplicate = false;
  /// The tensor's identity in stochastic rounding's random bits, which must not depend on how the
  /// tensors are cut among ranks: 1 + its index in the model's list of tensors, the same on every
  /// rank that holds a piece of it (halfstep::shard sets it). 0, the default: 1 + its index in the
  /// list the step is built on.
  std::uint32_t tensor_id = 0;
  /// The index, in the whole tensor, of this buffer's first element (a shard's start; shard sets it).
  std::int64_t offset = 0;
  /// Elements of the whole tensor this buffer is a piece of; 0: the buffer is the whole tensor
  /// (numel elements). Read by MomentFormat::block8, whose blocks and small-tensor rule follow
  /// the whole tensor's shape: there a piece (offset > 0) must set it, and so must a first piece.
  std::int64_t whole_numel = 0;
  /// Elements per row of the whole tensor (the product of every dimension but the
  /// first); 0: one row. Read by MomentFormat::block8: blocks never straddle a
  /// row, so a shard that starts at a row (FSDP2's Shard(0)) holds whole blocks.
  std::int64_t row = 0;
  /// MomentFormat::block8, a quantized tensor (moment_blocks): exp_avg's fp32 scale per block of
  /// this piece, moment_blocks(...).blocks of them; null otherwise.
  float* exp_avg_scale = nullptr;
  /// The same for exp_avg_sq (the scales of its square root).
  float* exp_avg_sq_scale = nullptr;
};

/// Everything that shapes a step.
struct HALFSTEP_API StepConfig {
  DType grad_dtype = DType::f16;            ///< f16, bf16 or f32
  DType model_dtype = DType::f16;           ///< f16 or bf16 (tensors with a null model skip it)
  /// The format the backward pass computed f32 gradients in: f16 (autocast to float16, the
  /// default), bf16 or f32. The headroom and the subnormal count are measured against its range,
  /// so that they say what they say for 16-bit gradients. For f16 and bf16 gradients their own
  /// format is used, whatever this holds.
  DType compute_dtype = DType::f16;
  std::vector<AdamWConfig> groups = std::vector<AdamWConfig>(1);  ///< at least one
  float max_grad_norm = 0.0f;               ///< clip the unscaled global norm to this; 0: no clip
  ScalerConfig scaler;                      ///< loss-scale rules
  SpikeConfig spike;                        ///< spike detection, off by default
  StateFormat state;                        ///< how masters and moments are stored (fp32 by default)
  bool host_driven = false;                 ///< decide on the host (one sync per step)

  /// Throws halfstep::Error naming the first field that breaks its rule.
  void validate() const;
};

/// The format the headroom and the subnormal count are measured against: the gradients' own for
/// f16 and bf16 gradients, StepConfig::compute_dtype for f32 ones.
inline DType measured_dtype(const StepConfig& config) {
  return config.grad_dtype == DType::f32 ? config.compute_dtype : config.grad_dtype;
}

/// Validates `config` and every tensor against it: group index in range, numel >= 0, non-null
/// and element-aligned pointers where numel > 0, no two buffers of the step overlapping.
/// Throws halfstep::Error naming the tensor, the field and the rule.
HALFSTEP_API void validate(const std::vector<ParamTensor>& tensors, const StepConfig& config);

/// What a step did.
enum class Outcome : std::uint8_t {
  applied,                  ///< masters, moments and model copies were updated
  skipped_overflow,         ///< a gradient was inf or NaN; the scaler backed off
  skipped_spike,            ///< the norm was a spike and SpikeConfig::action is skip
  skipped_nonfinite_update, ///< the gradients were finite but the update would not be (reason says why)
  skipped_inconsistent,     ///< the (all-reduced) totals record cannot be acted on: it is not one a
                            ///< reduction of halfstep records gives, or the ranks' hyperparameters
                            ///< differ (reason says which); only the attempt counter advances
};

/// "applied", "skipped_overflow", "skipped_spike", "skipped_nonfinite_update" or
/// "skipped_inconsistent".
HALFSTEP_API const char* outcome_name(Outcome outcome);

/// Why a step was not applied. A step is skipped for a non-finite update when finalize can tell
/// from what pass 1 measured that some update would not be an fp32 number; nothing is written,
/// the scale, the spike statistics and the applied-step counter stay as they were.
enum class SkipReason : std::uint8_t {
  none,                        ///< the step was applied
  nonfinite_gradient,          ///< an inf or NaN gradient (Outcome::skipped_overflow)
  spike,                       ///< a gradient spike (Outcome::skipped_spike)
  gradient_exceeds_fp32,       ///< max|g|·clip/S, the largest unscaled gradient, is past fp32's range
  second_moment_exceeds_fp32,  ///< (1 - beta2)·max|g|², the second-moment increment, is past it
  step_size_exceeds_fp32,      ///< lr / (1 - beta1^t) is past it
  invalid_learning_rate,       ///< a group's learning rate, read at this step, is negative, not
                               ///< finite, or makes lr·weight_decay >= 1 with decoupled decay
  inconsistent_totals,         ///< the totals record breaks a rule every reduction of halfstep
                               ///< records keeps (a faulty or mismatched all-reduce)
  hyperparameters_differ,      ///< the ranks stepped with different hyperparameters or loss scales
                               ///< (a learning rate changed on one rank only, a rank whose scaler
                               ///< drifted): every rank skips
  rank_refused,                ///< a rank refused its own step (step_local_refused, step_refused:
                               ///< its inputs failed its checks) and took part without gradients,
                               ///< so that no rank waits for it: every rank skips
  external_found_inf,          ///< the external scaler's own check found an inf or NaN
                               ///< (FusedAdamW::use_external_scale; Outcome::skipped_overflow)
  invalid_loss_scale,          ///< the external loss scale is not a finite positive number
};

/// The reason's name: "none", "nonfinite_gradient", "spike", "gradient_exceeds_fp32", ...
HALFSTEP_API const char* skip_reason_name(SkipReason reason);

/// Everything a step measured and decided.
struct StepReport {
  std::int64_t attempt;                ///< calls so far, this one included
  std::int64_t step;                   ///< applied steps so far, this one included (the Adam t)
  Outcome outcome;                     ///< what the step did
  SkipReason reason;                   ///< why it was not applied (none when it was)
  bool spike;                          ///< the norm was flagged as a spike (logged or skipped)
  float scale_used;                    ///< loss scale the gradients were computed with
  float scale_next;                    ///< loss scale for the next step
  double grad_norm;                    ///< unscaled global norm before clipping; NaN on overflow
  float clip_coef;                     ///< factor applied to the gradients (1: none); NaN on overflow
  std::int64_t nonfinite_count;        ///< inf and NaN elements over all tensors
  std::int32_t first_nonfinite_tensor; ///< index of the first tensor with one (in the tensor list
                                       ///< of first_nonfinite_rank); -1 if none
  std::int32_t first_nonfinite_rank;   ///< lowest rank holding one (Distributed::rank; 0 in a
                                       ///< single-rank step); -1 if none
  float max_abs_scaled;                ///< largest finite |gradient| as stored (scaled)
  float headroom_log2;                 ///< log2(format max / max_abs_scaled), the format's max that
                                       ///< of measured_dtype; +inf if all zero
  std::int64_t subnormal_count;        ///< gradient elements below the smallest normal of
                                       ///< measured_dtype, zeros aside (in the norm)
  std::int64_t zero_count;             ///< gradient elements stored as ±0 (in the norm)
  std::int64_t numel;                  ///< gradient elements in the norm, over all ranks
  /// Elements of an applied step whose update would have written a value that is not finite —
  /// a master, moment or model copy past its format's range, which pass 1 cannot see (a master
  /// near 3.4e38, a model copy past 65504 in fp16, weight decay on a huge weight). Each keeps
  /// its previous values; 0 in a healthy run. Waits for pass 2 (last_report does).
  std::int64_t held_elements;
};

/// The optimizer's own state (the parameters and moments live in the user's buffers).
/// Checkpointable with encode_state / decode_state.
struct HALFSTEP_API OptimizerState {
  ScalerState scaler;         ///< loss scaler
  SpikeState spike;           ///< spike detector
  std::int64_t step = 0;      ///< applied steps (the Adam t)
  std::int64_t attempts = 0;  ///< steps tried, applied or skipped

  /// The state before the first step of a run with `config`.
  static OptimizerState initial(const StepConfig& config);
};

/// Equality of every field, floating-point fields compared bitwise.
HALFSTEP_API bool operator==(const OptimizerState& a, const OptimizerState& b);
inline bool operator!=(const OptimizerState& a, const OptimizerState& b) { return !(a == b); }

/// Throws halfstep::Error if `state` could not have come from a run with `config`: every counter
/// in [0, kCounterLimit], overflows, growths, spikes and applied steps at most the attempts,
/// backoffs at most the overflows, the scaler's counters within its config, the spike statistics
/// those of a finite log-norm, and no group's step_offset past the applied steps.
HALFSTEP_API void validate_state(const OptimizerState& state, const StepConfig& config);

}  // namespace halfstep
