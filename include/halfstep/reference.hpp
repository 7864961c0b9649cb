// halfstep: the CPU oracle. A plain, double-precision implementation of the whole step, written
// independently of the kernels' element math; the GPU tests compare against it, and it is the
// backend of FusedAdamW when no GPU is present.
#pragma once

#include <cstdint>
#include <vector>

#include "halfstep/step.hpp"

namespace halfstep::reference {

/// One step over host buffers: check, unscale, clip, AdamW, model copy, scaler and spike updates.
/// Validates everything first (throws halfstep::Error, nothing changed). On a skipped step no
/// buffer is written and `state.step` stays; `state` always advances its attempt count and the
/// scaler and spike statistics as docs/design.md describes. When `nonfinite_per_tensor` is given it
/// receives the count of inf and NaN gradient elements of each tensor.
HALFSTEP_API StepReport step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor = nullptr);

}  // namespace halfstep::reference
