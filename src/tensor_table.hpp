// Internal: the table of tensors and fixed-size chunks that both passes iterate over, built once
// at setup on the host and then copied to device memory.
#pragma once

#include <cstdint>
#include <vector>

#include "halfstep/step.hpp"
#include "step_types.hpp"

namespace halfstep::detail {

struct TensorTable {
  std::vector<TensorDesc> tensors;  // one row per ParamTensor, in order
  std::vector<ChunkDesc> chunks;    // every element of every tensor in exactly one chunk
  std::int64_t numel = 0;           // elements over all tensors
};

/// Splits every tensor into chunks of kChunkElems elements (the last one shorter), in tensor
/// order; zero-length tensors get a row and no chunk. Marks which tensors may use 16-byte
/// accesses. Throws halfstep::Error if the chunks would not fit one launch's grid.
TensorTable build_tensor_table(const std::vector<ParamTensor>& tensors);

/// Sums per-chunk counts into per-tensor counts.
std::vector<std::int64_t> per_tensor_counts(const std::vector<ChunkDesc>& chunks,
                                            const std::vector<std::uint32_t>& chunk_counts,
                                            std::size_t n_tensors);

}  // namespace halfstep::detail
