// Internal: the host launchers of the step's kernels. Each sizes its grid, launches on the
// caller's stream and turns a launch error into halfstep::Error. No launcher allocates or
// synchronises, so a step made of them can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "halfstep/formats.hpp"
#include "step_types.hpp"

namespace halfstep::detail {

/// Pass 1: one block per chunk reads every gradient once and writes the chunk's partial.
void launch_check_and_norm(DType grad_dtype, const TensorDesc* tensors, const ChunkDesc* chunks,
                           std::int64_t n_chunks, ChunkPartial* partials, cudaStream_t stream);

/// Arguments of the finalize kernel.
struct FinalizeArgs {
  const ChunkPartial* partials;
  const ChunkDesc* chunks;
  std::int64_t n_chunks;
  DeviceState* state;
  StepReport* report;
  Decision* decision;
  const GroupParams* params;
  const float* lr;      // per group, in device memory (set_lr writes it)
  GroupConsts* consts;  // per group, written on applied steps
  std::int32_t n_groups;
  DecideParams decide;
};

/// Finalize: one block reduces the partials in a fixed order and runs decide().
void launch_finalize(const FinalizeArgs& args, cudaStream_t stream);

/// Pass 2: one block per chunk; every block returns at once unless the decision is to apply.
/// Elements held back because their update was not finite are added to report->held_elements.
void launch_apply(DType grad_dtype, DType model_dtype, const TensorDesc* tensors,
                  const ChunkDesc* chunks, std::int64_t n_chunks, const Decision* decision,
                  const GroupConsts* consts, StepReport* report, cudaStream_t stream);

/// Writes `value` to device memory `where`, ordered on `stream` (the learning rate of a group).
void launch_store(float* where, float value, cudaStream_t stream);

}  // namespace halfstep::detail
