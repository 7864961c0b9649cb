// The multi-rank step: the StepTotals record's public helpers and the checks of a Distributed
// (the NCCL all-reduce itself is in src/nccl.cpp).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "block8_geometry.hpp"
#include "check.hpp"
#include "distributed_impl.hpp"
#include "step_math.hpp"

namespace halfstep {

void combine(StepTotals& into, const StepTotals& other) {
  for (int i = 0; i < StepTotals::kSumWords; ++i) into.sum[i] += other.sum[i];
  for (int i = 0; i < StepTotals::kMaxWords; ++i) {
    if (other.max[i] > into.max[i]) into.max[i] = other.max[i];
  }
}

TotalsSummary summarize(const StepTotals& totals, DType grad_dtype) {
  detail::require(grad_dtype == DType::f16 || grad_dtype == DType::bf16 || grad_dtype == DType::f32,
                  "grad_dtype must be f16, bf16 or f32, got code ", static_cast<int>(grad_dtype));
  const detail::Totals t = detail::decode_totals(totals, grad_dtype);
  constexpr int n = StepTotals::kSumLimbs;
  switch (t.fault) {  // the rules the step checks before it acts on a record, by name
    case detail::TotalsFault::none: break;
    case detail::TotalsFault::count_past_int64:
      for (int i = n; i < StepTotals::kSumWords; ++i) {
        detail::require(totals.sum[i] < (std::uint64_t{1} << 63), "totals.sum[", i, "] = ", totals.sum[i],
                        " is past any count of elements");
      }
      break;
    case detail::TotalsFault::counts_past_numel:
      detail::fail("totals: subnormal (sum[", n + 1, "]) and zero (sum[", n + 2,
                   "]) elements outnumber the elements in the norm (sum[", n + 3, "])");
    case detail::TotalsFault::max_not_finite:
      detail::fail("totals.max[0] = ", totals.max[0], " is not the pattern of a finite |", dtype_name(grad_dtype), "| value");
    case detail::TotalsFault::key_count_mismatch:
      detail::fail("totals: max[1] (the first inf/NaN) and sum[", n, "] (the inf/NaN count) must be zero together");
    case detail::TotalsFault::malformed_key:
      detail::fail("totals.max[1] = ", totals.max[1], " is not a (rank, tensor) key");
    case detail::TotalsFault::half_refusal_mark:
      detail::fail("totals.max[2] holds a refusing rank's mark (2^64 - 1) and max[3] = ", totals.max[3], " does not");
    case detail::TotalsFault::sum_past_bound:
      detail::fail("totals: the sum of squares (sum[0..", n - 1, "]) exceeds the element count (sum[", n + 3,
                   "]) times the largest square (max[0])");
  }
  return t;  // the summary part
}

Shard shard(const std::vector<ParamTensor>& layout, std::int64_t begin, std::int64_t end,
            const ParamTensor& flat, DType grad_dtype) {
  detail::require(grad_dtype == DType::f16 || grad_dtype == DType::bf16 || grad_dtype == DType::f32,
                  "grad_dtype must be f16, bf16 or f32, got code ", static_cast<int>(grad_dtype));
  StepConfig config;  // fp32 state, a 16-bit model copy
  config.grad_dtype = grad_dtype;
  return shard(layout, begin, end, flat, config);
}

namespace {

// The elements of `layout` laid end to end, checked.
std::int64_t space_numel(const std::vector<ParamTensor>& layout) {
  std::int64_t total = 0;
  for (std::size_t t = 0; t < layout.size(); ++t) {
    detail::require(layout[t].numel >= 0, "layout[", t, "].numel must be >= 0, got ", layout[t].numel);
    detail::require(total <= std::numeric_limits<std::int64_t>::max() - layout[t].numel,
                    "layout: the tensors hold more than 2^63 - 1 elements");
    total += layout[t].numel;
  }
  return total;
}

// The piece [lo, hi) of layout[t] (t starting at `at` in the flat space) as a tensor of its own:
// its identity (tensor_id: 1 + t unless set) and place in the whole tensor (offset; with `blocks`,
// under MomentFormat::block8, whole_numel as well), no buffers.
ParamTensor piece_of(const std::vector<ParamTensor>& layout, std::size_t t, std::int64_t at, std::int64_t lo,
                     std::int64_t hi, bool blocks) {
  ParamTensor p = layout[t];
  for (int slot = 0; slot < kSlotCount; ++slot) set_slot_pointer(p, static_cast<Slot>(slot), nullptr);
  p.exp_avg_scale = p.exp_avg_sq_scale = nullptr;
  p.numel = hi - lo;
  // Stochastic rounding keys an element by its tensor and its index in it, never by the cut; so do
  // block8's blocks.
  p.tensor_id = layout[t].tensor_id != 0 ? layout[t].tensor_id : static_cast<std::uint32_t>(t + 1);
  p.offset = layout[t].offset + (lo - at);
  if (blocks) p.whole_numel = detail::whole_numel_of(layout[t]);
  return p;
}

std::int64_t round_up16(std::int64_t bytes) { return (bytes + 15) / 16 * 16; }

// Walks the pieces of the shard [begin, end): visit(t, piece, into_flat, moment_bytes, scales),
// the last two where the piece's moments and scales start in the flat buffers. Returns the sizes
// of the flat state buffers.
template <class Visit>
ShardState walk_shard(const std::vector<ParamTensor>& layout, std::int64_t begin, std::int64_t end,
                      const StepConfig& config, Visit visit) {
  const std::int64_t total = space_numel(layout);
  detail::require(begin >= 0 && begin <= end && end <= total, "the shard [", begin, ", ", end,
                  ") must lie in the parameter space [0, ", total, ")");
  const bool blocks = config.state.exp_avg == MomentFormat::block8;
  ShardState sizes;
  std::int64_t at = 0;  // where tensor t starts in the flat space
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const std::int64_t lo = std::max(at, begin), hi = std::min(at + layout[t].numel, end);
    if (lo < hi) {
      const ParamTensor p = piece_of(layout, t, at, lo, hi, blocks);
      std::int64_t moments = 0, scales = 0;
      if (blocks) {
        const MomentBlocks b = moment_blocks(config, p);
        if (b.quantized) {
          const detail::Block8Geometry g = detail::block8_geometry_of(p);
          detail::require(g.starts_block(p.offset) && g.starts_block(p.offset + p.numel), "the shard [", begin, ", ",
                          end, ") cuts layout[", t, "] (elements [", p.offset, ", ", p.offset + p.numel,
                          ") of ", p.whole_numel, " in rows of ", g.row,
                          ") inside a block of its block8 moments: cut where blocks start (block_cut, even_shard "
                          "with the layout)");
        }
        const std::int64_t element = b.quantized ? 1 : 4;
        detail::require(p.numel <= (std::numeric_limits<std::int64_t>::max() - 16 - sizes.exp_avg_bytes) / element,
                        "the shard [", begin, ", ", end, ")'s moments hold more than 2^63 - 1 bytes");
        moments = sizes.exp_avg_bytes = round_up16(sizes.exp_avg_bytes);
        const std::int64_t bytes = p.numel * element;
        sizes.exp_avg_bytes += bytes;
        sizes.exp_avg_sq_bytes = sizes.exp_avg_bytes;
        scales = sizes.scales;
        sizes.scales += b.blocks;
      }
      visit(t, p, lo - begin, moments, scales);
    }
    at += layout[t].numel;
  }
  if (!blocks) {
    const auto slots = slot_layouts(config);
    sizes.exp_avg_bytes = (end - begin) * static_cast<std::int64_t>(slots[static_cast<int>(Slot::exp_avg)].element_bytes);
    sizes.exp_avg_sq_bytes = (end - begin) * static_cast<std::int64_t>(slots[static_cast<int>(Slot::exp_avg_sq)].element_bytes);
  }
  return sizes;
}

}  // namespace

ShardState shard_state(const std::vector<ParamTensor>& layout, std::int64_t begin, std::int64_t end,
                       const StepConfig& config) {
  return walk_shard(layout, begin, end, config, [](std::size_t, const ParamTensor&, std::int64_t, std::int64_t, std::int64_t) {});
}

Shard shard(const std::vector<ParamTensor>& layout, std::int64_t begin, std::int64_t end,
            const ParamTensor& flat, const StepConfig& config) {
  const auto slots = slot_layouts(config);
  const bool blocks = config.state.exp_avg == MomentFormat::block8;
  const ShardState sizes = shard_state(layout, begin, end, config);  // the range, and the cuts
  detail::require(flat.numel == end - begin, "flat.numel must be end - begin = ", end - begin,
                  ", got ", flat.numel);
  if (blocks) {
    detail::require(sizes.scales == 0 || (flat.exp_avg_scale != nullptr && flat.exp_avg_sq_scale != nullptr),
                    "flat.exp_avg_scale and flat.exp_avg_sq_scale must hold the shard's ", sizes.scales,
                    " block scales each (shard_state), got null");
  }
  Shard s;
  walk_shard(layout, begin, end, config,
             [&](std::size_t t, const ParamTensor& piece, std::int64_t into_flat, std::int64_t moment_bytes,
                 std::int64_t scales) {
               ParamTensor p = piece;
               for (const SlotLayout& slot : slots) {  // each buffer at its own element size; a null one stays null
                 auto* base = static_cast<unsigned char*>(const_cast<void*>(slot_pointer(flat, slot.slot)));
                 const bool moment = slot.slot == Slot::exp_avg || slot.slot == Slot::exp_avg_sq;
                 const std::int64_t at = blocks && moment ? moment_bytes
                                                          : into_flat * static_cast<std::int64_t>(slot.element_bytes);
                 set_slot_pointer(p, slot.slot, base != nullptr ? base + at : nullptr);
               }
               if (moment_blocks(config, p).quantized) {
                 p.exp_avg_scale = flat.exp_avg_scale + scales;
                 p.exp_avg_sq_scale = flat.exp_avg_sq_scale + scales;
               }
               s.tensors.push_back(p);
               s.source.push_back(static_cast<std::int32_t>(t));
               s.offset.push_back(p.offset - layout[t].offset);
             });
  return s;
}

std::int64_t block_cut(const std::vector<ParamTensor>& layout, const StepConfig& config, std::int64_t index) {
  const std::int64_t total = space_numel(layout);
  detail::require(index >= 0 && index <= total, "index must lie in the parameter space [0, ", total, "], got ", index);
  if (config.state.exp_avg != MomentFormat::block8) return index;
  std::int64_t at = 0;
  for (std::size_t t = 0; t < layout.size(); ++t) {
    if (index > at && index < at + layout[t].numel) {  // inside tensor t
      const ParamTensor p = piece_of(layout, t, at, at, at + layout[t].numel, true);
      if (!moment_blocks(config, p).quantized) return index;
      const detail::Block8Geometry g = detail::block8_geometry_of(p);
      const std::int64_t b = g.first_block_from(p.offset + (index - at));
      const std::int64_t start = b == g.blocks ? g.numel : g.block_start(b);
      return at + std::min(start - p.offset, layout[t].numel);
    }
    at += layout[t].numel;
  }
  return index;  // a tensor's start or the space's end
}

std::pair<std::int64_t, std::int64_t> even_shard(std::int64_t numel, std::int32_t ranks, std::int32_t rank) {
  detail::require(numel >= 0, "numel must be >= 0, got ", numel);
  detail::require(ranks >= 1, "ranks must be >= 1, got ", ranks);
  detail::require(rank >= 0 && rank < ranks, "rank must be in [0, ", ranks, "), got ", rank);
  const std::int64_t chunk = numel / ranks + (numel % ranks != 0 ? 1 : 0);
  // Where range k starts: k·chunk, cut at numel. The last range ends at numel, which k·chunk for
  // k = ranks could pass 2^63 - 1 to reach; for k < ranks, k·chunk <= numel + ranks - 1 - numel/ranks
  // fits (numel near 2^63 gives numel/ranks >= 2^32 > ranks).
  auto start = [&](std::int64_t k) { return k == ranks ? numel : std::min(numel, k * chunk); };
  return {start(rank), start(std::int64_t{rank} + 1)};
}

std::pair<std::int64_t, std::int64_t> even_shard(const std::vector<ParamTensor>& layout, const StepConfig& config,
                                                 std::int32_t ranks, std::int32_t rank) {
  const auto [begin, end] = even_shard(space_numel(layout), ranks, rank);
  return {block_cut(layout, config, begin), block_cut(layout, config, end)};
}

namespace detail {

void validate_distributed(const Distributed& dist) {
  require(dist.rank >= 0 && dist.rank < std::numeric_limits<std::int32_t>::max(),
          "Distributed.rank must be in [0, 2^31 - 1), got ", dist.rank);
  require(dist.comms.empty() || has_nccl(), "Distributed.comms holds ", dist.comms.size(),
          " communicators, but this libhalfstep was built without NCCL (HALFSTEP_NCCL=OFF): reduce the "
          "totals record yourself between step_local and step_finish, or build with NCCL");
  for (std::size_t c = 0; c < dist.comms.size(); ++c) {
    require(dist.comms[c] != nullptr, "Distributed.comms[", c, "] is null");
    for (std::size_t d = 0; d < c; ++d) {
      require(dist.comms[d] != dist.comms[c], "Distributed.comms[", c, "] repeats comms[", d,
              "]: reducing twice over one group counts its ranks twice");
    }
  }
}

}  // namespace detail
}  // namespace halfstep
