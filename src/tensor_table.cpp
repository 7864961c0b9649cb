#include "tensor_table.hpp"

#include <algorithm>
#include <limits>

#include "block8_geometry.hpp"
#include "check.hpp"
#include "exact_sum.hpp"
#include "halfstep/distributed.hpp"
#include "halfstep/fused_adamw.hpp"

namespace halfstep::detail {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

}  // namespace

bool all_aligned(const ParamTensor& p, const StepConfig& config) {
  const bool buffers = aligned16(p.master) && p.grad != nullptr && aligned16(p.grad) && aligned16(p.exp_avg) &&
                       aligned16(p.exp_avg_sq) && (p.numel == 0 || p.model == nullptr || aligned16(p.model));
  if (!buffers || !moment_blocks(config, p).quantized) return buffers;
  // A lane of pass 2's block loop accesses 8 consecutive elements of a block from an element that
  // is a multiple of 8 from the block's start: every block must start at a multiple of 8 in the
  // piece's buffers (rows of a multiple of 8, a piece starting at a multiple of 8).
  return block8_geometry_of(p).row % 8 == 0 && p.offset % 8 == 0;
}

std::int64_t numel_in_norm(const std::vector<ParamTensor>& tensors) {
  std::int64_t n = 0;  // < 2^31 chunks of 2^15 elements: no overflow
  for (const ParamTensor& p : tensors) {
    if (!p.duplicate && p.grad != nullptr) n += p.numel;
  }
  return n;
}

TensorTable build_tensor_table(const std::vector<ParamTensor>& tensors, const StepConfig& config) {
  require(tensors.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
          "at most 2^31 - 1 tensors, got ", tensors.size());
  // Count first, so a table too large for one launch is refused before anything is allocated.
  std::uint64_t n_chunks = 0;
  for (const ParamTensor& p : tensors) {
    n_chunks += static_cast<std::uint64_t>(chunks_of(p.numel));  // each < 2^49: no overflow
    require(n_chunks <= kMaxChunks, "the tensors need more than ", kMaxChunks, " chunks of ",
            kChunkElems, " elements (one launch's grid)");
  }
  TensorTable table;
  table.numel_in_norm = numel_in_norm(tensors);
  table.tensors.reserve(tensors.size());
  table.chunks.reserve(static_cast<std::size_t>(n_chunks));
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ParamTensor& p = tensors[t];
    TensorDesc d{};
    d.master = p.master;
    d.grad = p.grad;
    d.exp_avg = p.exp_avg;
    d.exp_avg_sq = p.exp_avg_sq;
    d.model = p.numel > 0 ? p.model : nullptr;
    d.numel = p.numel;
    d.key_offset = p.offset;
    d.key_id = p.tensor_id != 0 ? p.tensor_id : static_cast<std::uint32_t>(t + 1);
    d.group = p.group;
    d.grad_vec = p.grad != nullptr && aligned16(p.grad) ? 1 : 0;
    d.in_norm = p.duplicate ? 0 : 1;
    d.all_vec = all_aligned(p, config) ? 1 : 0;
    const MomentBlocks blocks = moment_blocks(config, p);
    if (blocks.quantized) {
      d.quantized = 1;
      d.exp_avg_scale = p.exp_avg_scale;
      d.exp_avg_sq_scale = p.exp_avg_sq_scale;
      d.blocks = block8_geometry_of(p);
      d.first_block = blocks.first;
      d.blocks32 = d.blocks.blocks <= 0xFFFFFFFF ? 1 : 0;
      if (d.blocks32) d.per_row = divisor32(static_cast<std::uint32_t>(d.blocks.blocks_per_row));
    }
    table.tensors.push_back(d);
    for (std::int64_t begin = 0; begin < p.numel; begin += kChunkElems) {
      const std::int64_t len = std::min(kChunkElems, p.numel - begin);
      table.chunks.push_back(ChunkDesc{begin, static_cast<std::int32_t>(t), static_cast<std::int32_t>(len)});
    }
  }
  return table;
}

WorkspaceLayout WorkspaceLayout::make(std::size_t n_tensors, std::size_t n_chunks,
                                      std::size_t n_groups) {
  WorkspaceLayout w{};
  std::size_t at = 0;
  // Appends `count` items of `size` bytes at the next 256-byte boundary, refusing to wrap.
  auto add = [&at](std::size_t count, std::size_t size, const char* what) {
    const std::size_t limit = std::numeric_limits<std::size_t>::max() - 255;
    require(count <= limit / size && at <= limit - count * size, "the workspace for ", count, " ",
            what, " does not fit a size_t");
    const std::size_t here = at;
    at += (count * size + 255) / 256 * 256;
    return here;
  };
  w.tensors = add(n_tensors, sizeof(TensorDesc), "tensors");
  w.chunks = add(n_chunks, sizeof(ChunkDesc), "chunks");
  w.partials = add(n_chunks, sizeof(ChunkPartial), "chunks");
  w.state = add(1, sizeof(OptimizerState), "states");
  w.report = add(1, sizeof(StepReport), "reports");
  w.decision = add(1, sizeof(Decision), "decisions");
  w.params = add(n_groups, sizeof(GroupParams), "groups");
  w.lr = add(n_groups, sizeof(float), "groups");
  w.consts = add(n_groups, sizeof(GroupConsts), "groups");
  w.totals = add(1, sizeof(StepTotals), "records");
  w.window_hint = add(1, sizeof(std::uint32_t), "hints");
  w.spill = add(kSumLimbs, sizeof(std::uint64_t), "limbs");
  w.inputs = add(1, sizeof(StepInputs), "inputs");
  w.bytes = at;
  return w;
}

namespace {

// The piece of the workspace at `offset`: 256-byte aligned, so aligned for any of its types.
template <class T>
T* piece(void* base, std::size_t offset) {
  return static_cast<T*>(static_cast<void*>(static_cast<unsigned char*>(base) + offset));
}

}  // namespace

Workspace Workspace::in(void* base, const WorkspaceLayout& l) {
  return Workspace{piece<TensorDesc>(base, l.tensors),       piece<ChunkDesc>(base, l.chunks),
                   piece<ChunkPartial>(base, l.partials),    piece<OptimizerState>(base, l.state),
                   piece<StepReport>(base, l.report),        piece<Decision>(base, l.decision),
                   piece<GroupParams>(base, l.params),       piece<float>(base, l.lr),
                   piece<GroupConsts>(base, l.consts),       piece<StepTotals>(base, l.totals),
                   piece<std::uint32_t>(base, l.window_hint), piece<unsigned long long>(base, l.spill),
                   piece<StepInputs>(base, l.inputs)};
}

std::vector<std::int64_t> per_tensor_counts(const std::vector<ChunkDesc>& chunks,
                                            const std::vector<std::uint32_t>& chunk_counts,
                                            std::size_t n_tensors) {
  std::vector<std::int64_t> out(n_tensors, 0);
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    out[static_cast<std::size_t>(chunks[c].tensor)] += chunk_counts[c];
  }
  return out;
}

}  // namespace halfstep::detail

namespace halfstep {

std::size_t workspace_bytes(const std::vector<std::int64_t>& tensor_numels, std::size_t groups) {
  std::uint64_t chunks = 0;
  for (std::size_t t = 0; t < tensor_numels.size(); ++t) {
    detail::require(tensor_numels[t] >= 0, "tensor_numels[", t, "] must be >= 0, got ", tensor_numels[t]);
    chunks += static_cast<std::uint64_t>(detail::chunks_of(tensor_numels[t]));  // < 2^49 per tensor
    detail::require(chunks <= detail::kMaxChunks, "tensor_numels need more than ", detail::kMaxChunks,
                    " chunks of ", detail::kChunkElems, " elements (one launch's grid)");
  }
  return detail::WorkspaceLayout::make(tensor_numels.size(), static_cast<std::size_t>(chunks), groups).bytes;
}

std::size_t workspace_bytes(std::uint64_t tensors, std::uint64_t chunks, std::size_t groups) {
  detail::require(tensors <= 0x7FFFFFFF, "at most 2^31 - 1 tensors in one step, got ", tensors);
  detail::require(chunks <= detail::kMaxChunks, "at most ", detail::kMaxChunks, " chunks of ",
                  detail::kChunkElems, " elements in one step, got ", chunks);
  return detail::WorkspaceLayout::make(static_cast<std::size_t>(tensors), static_cast<std::size_t>(chunks), groups).bytes;
}

std::int64_t chunk_elements() { return detail::kChunkElems; }

std::int64_t chunk_count(std::int64_t numel) {
  detail::require(numel >= 0, "numel must be >= 0, got ", numel);
  return detail::chunks_of(numel);
}

}  // namespace halfstep
