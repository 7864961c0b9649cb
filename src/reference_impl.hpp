// Internal: the reference step without its validation, for callers that validated the tensors
// and config once already (the reference backend of FusedAdamW validates at setup).
#pragma once

#include <cstdint>
#include <vector>

#include "halfstep/distributed.hpp"
#include "halfstep/step.hpp"
#include "step_types.hpp"

namespace halfstep::detail {

/// reference::step on tensors and a config that passed validate(); the state's learning rates
/// are read as they are now, and an invalid one skips the step (SkipReason::invalid_learning_rate).
StepReport reference_step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                          OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor);

/// The first half of reference_step: this rank's StepTotals record (the documented layout), and
/// the inf/NaN count of each tensor. Reads the gradients only. `scale` says how the gradients were
/// scaled and `own_scale` is the optimizer's loss scale: the fingerprint covers them.
StepTotals reference_measure(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                             std::int32_t rank, std::vector<std::int64_t>* nonfinite_per_tensor,
                             const ScaleInputs& scale, float own_scale, std::uint64_t grads_key);
/// The same for gradients scaled by the initial loss scale of `config`.
StepTotals reference_measure(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                             std::int32_t rank, std::vector<std::int64_t>* nonfinite_per_tensor);

/// The record's Σg², rounded once to the nearest double (ties to even): the reference's own
/// big-integer arithmetic, independent of the kernels' (kernels/exact_sum.hpp).
double reference_sum_of_squares(const StepTotals& totals);

/// The second half: decides from a record (this rank's, or one reduced over all ranks) and applies.
/// `scale`: how the gradients were scaled, when not by the state's scale (FusedAdamW::mark_unscaled,
/// FusedAdamW::use_external_scale).
StepReport reference_finish(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                            OptimizerState& state, const StepTotals& totals, const ScaleInputs& scale = {});

}  // namespace halfstep::detail
