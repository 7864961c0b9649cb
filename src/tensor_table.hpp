// Internal: the table of tensors and fixed-size chunks that both passes iterate over, built once
// at setup on the host and then copied to device memory.
#pragma once

#include <cstdint>
#include <vector>

#include "halfstep/distributed.hpp"
#include "halfstep/step.hpp"
#include "step_types.hpp"

namespace halfstep::detail {

struct TensorTable {
  std::vector<TensorDesc> tensors;  // one row per ParamTensor, in order
  std::vector<ChunkDesc> chunks;    // every element of every tensor in exactly one chunk
  std::int64_t numel_in_norm = 0;   // elements of the tensors in the norm (no ParamTensor::duplicate)
                                    // that have a gradient
};

/// Whether pass 2 may use vector accesses on `p` under `config`: every buffer is 16-byte aligned,
/// and with block8 moments every block starts at a multiple of 8 elements.
bool all_aligned(const ParamTensor& p, const StepConfig& config);

/// Elements of the tensors in the norm (no ParamTensor::duplicate) that have a gradient this step.
std::int64_t numel_in_norm(const std::vector<ParamTensor>& tensors);

/// Splits every tensor into chunks of kChunkElems elements (the last one shorter), in tensor
/// order; zero-length tensors get a row and no chunk. Marks which tensors may use 16-byte
/// accesses. Pass 2 runs a chunk of a tensor with block8 moments (`config`) a block at a time:
/// the blocks that start in it, the last running past the chunk's end. Throws halfstep::Error if
/// the chunks would not fit one launch's grid.
TensorTable build_tensor_table(const std::vector<ParamTensor>& tensors, const StepConfig& config = StepConfig{});

/// Where each piece of the step's device workspace sits in its one allocation (byte offsets,
/// each 256-byte aligned), and the allocation's size. Throws halfstep::Error if the size does not
/// fit a size_t.
struct WorkspaceLayout {
  std::size_t tensors, chunks, partials, state, report, decision, params, lr, consts, totals,
      window_hint, spill, inputs, bytes;
  static WorkspaceLayout make(std::size_t n_tensors, std::size_t n_chunks, std::size_t n_groups);
};

/// The step's device workspace: a typed pointer to each piece of its one allocation.
struct Workspace {
  TensorDesc* tensors;
  ChunkDesc* chunks;
  ChunkPartial* partials;
  OptimizerState* state;  // scaler.scale: the loss scale the backward pass reads
  StepReport* report;
  Decision* decision;
  GroupParams* params;
  float* lr;
  GroupConsts* consts;
  StepTotals* totals;
  std::uint32_t* window_hint;
  unsigned long long* spill;
  StepInputs* inputs;

  /// The pieces of an allocation of layout.bytes at `base`.
  static Workspace in(void* base, const WorkspaceLayout& layout);
};

/// Number of chunks a tensor of `numel` >= 0 elements splits into (no overflow at INT64_MAX).
inline std::int64_t chunks_of(std::int64_t numel) {
  return numel / kChunkElems + (numel % kChunkElems != 0 ? 1 : 0);
}

/// Chunks one launch's grid can hold (gridDim.x is at most 2^31 - 1).
inline constexpr std::uint64_t kMaxChunks = 0x7FFFFFFF;

/// Sums per-chunk counts into per-tensor counts.
std::vector<std::int64_t> per_tensor_counts(const std::vector<ChunkDesc>& chunks,
                                            const std::vector<std::uint32_t>& chunk_counts,
                                            std::size_t n_tensors);

}  // namespace halfstep::detail
