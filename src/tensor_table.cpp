#include "tensor_table.hpp"

#include <algorithm>
#include <limits>

#include "check.hpp"

namespace halfstep::detail {
namespace {

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

}  // namespace

TensorTable build_tensor_table(const std::vector<ParamTensor>& tensors) {
  TensorTable table;
  table.tensors.reserve(tensors.size());
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ParamTensor& p = tensors[t];
    TensorDesc d{};
    d.master = p.master;
    d.grad = p.grad;
    d.exp_avg = p.exp_avg;
    d.exp_avg_sq = p.exp_avg_sq;
    d.model = p.numel > 0 ? p.model : nullptr;
    d.numel = p.numel;
    d.group = p.group;
    d.grad_vec = aligned16(p.grad) ? 1 : 0;
    d.all_vec = aligned16(p.master) && aligned16(p.grad) && aligned16(p.exp_avg) &&
                        aligned16(p.exp_avg_sq) && (d.model == nullptr || aligned16(d.model))
                    ? 1
                    : 0;
    table.tensors.push_back(d);
    table.chunks.reserve(table.chunks.size() + static_cast<std::size_t>(chunks_of(p.numel)));
    for (std::int64_t begin = 0; begin < p.numel; begin += kChunkElems) {
      const std::int64_t len = std::min(kChunkElems, p.numel - begin);
      table.chunks.push_back(ChunkDesc{begin, static_cast<std::int32_t>(t), static_cast<std::int32_t>(len)});
    }
    table.numel += p.numel;
  }
  require(table.chunks.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
          "tensors hold ", table.numel, " elements in ", table.chunks.size(),
          " chunks; one launch takes at most 2^31 - 1 chunks of ", kChunkElems, " elements");
  require(tensors.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
          "at most 2^31 - 1 tensors, got ", tensors.size());
  return table;
}

WorkspaceLayout WorkspaceLayout::make(std::size_t n_tensors, std::size_t n_chunks,
                                      std::size_t n_groups) {
  WorkspaceLayout w{};
  std::size_t at = 0;
  auto add = [&at](std::size_t bytes) {
    const std::size_t here = at;
    at += (bytes + 255) / 256 * 256;
    return here;
  };
  w.tensors = add(n_tensors * sizeof(TensorDesc));
  w.chunks = add(n_chunks * sizeof(ChunkDesc));
  w.partials = add(n_chunks * sizeof(ChunkPartial));
  w.state = add(sizeof(DeviceState));
  w.report = add(sizeof(StepReport));
  w.decision = add(sizeof(Decision));
  w.params = add(n_groups * sizeof(GroupParams));
  w.lr = add(n_groups * sizeof(float));
  w.consts = add(n_groups * sizeof(GroupConsts));
  w.bytes = at;
  return w;
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
