// Internal: the reference step without its validation, for callers that validated the tensors
// and config once already (the reference backend of FusedAdamW validates at setup).
#pragma once

#include <cstdint>
#include <vector>

#include "halfstep/distributed.hpp"
#include "halfstep/step.hpp"

namespace halfstep::detail {

/// reference::step on tensors and a config that passed validate(); the state's learning rates
/// are read as they are now, and an invalid one skips the step (SkipReason::invalid_learning_rate).
StepReport reference_step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                          OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor);

/// The first half of reference_step: this rank's StepTotals record (the documented layout), and
/// the inf/NaN count of each tensor. Reads the gradients only.
StepTotals reference_measure(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                             std::int32_t rank, std::vector<std::int64_t>* nonfinite_per_tensor);

/// The record's Σg², rounded once to the nearest double (ties to even): the reference's own
/// big-integer arithmetic, independent of the kernels' (kernels/exact_sum.hpp).
double reference_sum_of_squares(const StepTotals& totals);

/// The second half: decides from a record (this rank's, or one reduced over all ranks) and applies.
/// `unscaled`: the gradients were already divided by the loss scale (FusedAdamW::mark_unscaled).
StepReport reference_finish(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                            OptimizerState& state, const StepTotals& totals, bool unscaled = false);

}  // namespace halfstep::detail
