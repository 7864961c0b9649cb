// Internal: the reference step without its validation, for callers that validated the tensors
// and config once already (the reference backend of FusedAdamW validates at setup).
#pragma once

#include <cstdint>
#include <vector>

#include "halfstep/step.hpp"

namespace halfstep::detail {

/// reference::step on tensors and a config that passed validate(); the state's learning rates
/// are read as they are now, and an invalid one skips the step (SkipReason::invalid_learning_rate).
StepReport reference_step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                          OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor);

}  // namespace halfstep::detail
