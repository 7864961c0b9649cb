// halfstep: one step over many ranks. Pass 1 measures each rank's gradients into a StepTotals
// record; the records are all-reduced (SUM over one part, MAX over the other) so that every rank
// decides from the same global totals, bit for bit; then each rank applies the step to the
// tensors it holds. halfstep all-reduces over NCCL communicators the caller created, or the caller
// reduces the record with its own engine between step_local and step_finish.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "halfstep/formats.hpp"
#include "halfstep/step.hpp"

struct ncclComm;  // NCCL's communicator: ncclComm_t is ncclComm*

namespace halfstep {

/// What pass 1 measured, in a layout any all-reduce can combine: reduce `sum` with SUM and `max`
/// with MAX, both as unsigned 64-bit integers (ncclUint64, torch.uint64 / torch.int64). Every
/// field is an integer, so the reduced record is bitwise the same whatever the order and grouping
/// of the reduction.
///
///   sum[0..19]  Σg² of the scaled gradients, exactly: base-2^32 digits, least significant first,
///               in units of 2^-298 (every fp16, bf16 and fp32 square is an integer multiple of
///               it). One rank's digits are each below 2^32, so 2^31 ranks cannot overflow a word.
///   sum[20]     inf and NaN gradient elements
///   sum[21]     subnormal gradient elements (of tensors in the norm): nonzero, below the smallest
///               normal of measured_dtype (the gradients' format, or compute_dtype for f32 ones)
///   sum[22]     zero gradient elements (of tensors in the norm)
///   sum[23]     gradient elements of tensors in the norm
///   max[0]      the largest finite |gradient| as stored (scaled), as its pattern in the gradient
///               format (16 bits of f16 or bf16, 31 of f32)
///   max[1]      the first inf/NaN: (0xFFFFFFFF - rank) << 32 | (0xFFFFFFFF - tensor), 0 if none
///               (the largest key is the lowest rank, then the lowest tensor index)
///   max[2]      a 64-bit fingerprint of the hyperparameters the rank steps with (every group's
///               lr, betas, eps, weight decay and its flags, and max_grad_norm), and
///   max[3]      its complement: after MAX, max[2] == ~max[3] exactly when every rank's
///               fingerprint is the same (max[2] is the largest, ~max[3] the smallest).
///               Fingerprints lie in [1, 2^64 - 2]; a rank that refused its step
///               (step_local_refused, step_refused) writes 2^64 - 1 into both words and no
///               elements: after MAX, max[2] = 2^64 - 1 exactly when some rank refused
///
/// A record that no reduction of halfstep records could give (a count past 2^63, more zero and
/// subnormal elements than elements, an inf/NaN count without a key or a key without one, a
/// maximum that is not a finite pattern, Σg² above numel · max²) is never applied: the step is
/// skipped with SkipReason::inconsistent_totals (so is a refusal mark in max[2] without one in
/// max[3]). A rank's refusal makes every rank skip with SkipReason::rank_refused; ranks whose
/// fingerprints differ skip with SkipReason::hyperparameters_differ, every one of them.
struct StepTotals {
  static constexpr int kSumLimbs = 20;
  static constexpr int kSumWords = 24;
  static constexpr int kMaxWords = 4;
  std::uint64_t sum[kSumWords];
  std::uint64_t max[kMaxWords];
};
static_assert(sizeof(StepTotals) == 224, "StepTotals has a documented layout");

/// Combines `other` into `into` as the all-reduce does: SUM over `sum`, MAX over `max`.
HALFSTEP_API void combine(StepTotals& into, const StepTotals& other);

/// What a (reduced) record says, decoded.
struct TotalsSummary {
  double sum_sq = 0.0;                       ///< Σg² of the scaled gradients, rounded once to nearest
  float max_abs = 0.0f;                      ///< largest finite |gradient| as stored (scaled)
  std::int64_t nonfinite = 0, subnormal = 0, zero = 0, numel = 0;
  std::int32_t first_nonfinite_rank = -1;    ///< -1 if none
  std::int32_t first_nonfinite_tensor = -1;  ///< index in that rank's tensor list; -1 if none
  bool hyperparameters_agree = true;         ///< every rank reduced stepped with the same hyperparameters
  bool rank_refused = false;                 ///< a rank refused its step (step_local_refused)
};

/// Decodes a record of gradients in `grad_dtype` (f16, bf16 or f32). Throws halfstep::Error naming the
/// word and the rule if the record could not have come from a reduction of halfstep records (the
/// step skips such a record as SkipReason::inconsistent_totals).
HALFSTEP_API TotalsSummary summarize(const StepTotals& totals, DType grad_dtype);

/// Whether this libhalfstep was built with NCCL (CMake HALFSTEP_NCCL): without it, a Distributed
/// with communicators is refused, and the caller reduces the record between step_local and
/// step_finish (the Python package does, through torch.distributed).
HALFSTEP_API bool has_nccl();

/// How a FusedAdamW takes part in a multi-rank step.
struct Distributed {
  /// This rank's identity in reports (StepReport::first_nonfinite_rank): unique among all the
  /// ranks the record is reduced over, in [0, 2^31 - 1).
  std::int32_t rank = 0;
  /// NCCL communicators step() all-reduces the record over, in order, on the step's stream (for
  /// data parallelism with sharded optimizer state, the data-parallel group; with tensor
  /// parallelism as well, both groups: the reduction then covers every rank of their product).
  /// Each must belong to the current device. Empty: step() reduces nothing, and a caller with
  /// another engine reduces the record itself between step_local and step_finish.
  std::vector<ncclComm*> comms;
};

/// One rank's part of a flat parameter space (ZeRO-1/2 sharding of the optimizer state).
struct Shard {
  std::vector<ParamTensor> tensors;  ///< one per tensor that overlaps the range, pointing into the
                                     ///< flat buffers: what this rank's FusedAdamW is built on
  std::vector<std::int32_t> source;  ///< for each, its index in the layout
  std::vector<std::int64_t> offset;  ///< for each, the element of its source tensor it starts at
};

/// Cuts the flat parameter space made of the tensors of `layout` laid end to end (only numel,
/// group, duplicate, tensor_id, offset, whole_numel and row are read) at [begin, end), which may
/// fall anywhere inside tensors — under MomentFormat::block8 anywhere a block starts (block_cut). `flat` holds this rank's five buffers for exactly that range (flat.numel == end - begin,
/// each in its slot's format under `config`: slot_layouts; flat.model may be null unless the
/// masters are remainders or there is no master, and flat.master is null then) — e.g. the output of a reduce-scatter of the flat gradients, and the
/// rank's slices of the masters and moments. Each piece keeps its tensor's identity for
/// stochastic rounding (tensor_id: 1 + its index in `layout` unless set; offset: where the piece
/// starts in the tensor), so a sharded step rounds every element as an unsharded one. Tensors of
/// zero elements belong to no shard. Under MomentFormat::block8 each moment's flat buffer holds
/// the pieces' moments one after another in each piece's own format (8-bit codes, or fp32 where a
/// tensor keeps wide moments), each starting at a multiple of 16 bytes, and flat.exp_avg_scale and
/// exp_avg_sq_scale hold their quantized pieces' block scales one after another: shard_state says
/// how large. Throws halfstep::Error on a range outside the space, a flat buffer of another size,
/// or a cut inside a block.
HALFSTEP_API Shard shard(const std::vector<ParamTensor>& layout, std::int64_t begin, std::int64_t end,
                         const ParamTensor& flat, const StepConfig& config);
/// The same for fp32 state, gradients in `grad_dtype` and a 16-bit model copy.
HALFSTEP_API Shard shard(const std::vector<ParamTensor>& layout, std::int64_t begin, std::int64_t end,
                         const ParamTensor& flat, DType grad_dtype = DType::f16);

/// What a shard's flat moment and scale buffers hold (shard()): for every format but
/// MomentFormat::block8, numel elements of each moment's format and no scales.
struct ShardState {
  std::int64_t exp_avg_bytes = 0;     ///< bytes of flat.exp_avg
  std::int64_t exp_avg_sq_bytes = 0;  ///< bytes of flat.exp_avg_sq
  std::int64_t scales = 0;            ///< floats of flat.exp_avg_scale, and of flat.exp_avg_sq_scale
};
/// The sizes of the flat state buffers of the shard [begin, end) of `layout` under `config`.
HALFSTEP_API ShardState shard_state(const std::vector<ParamTensor>& layout, std::int64_t begin, std::int64_t end,
                                    const StepConfig& config);

/// The first place at or after `index` in the flat space of `layout` where a shard may start or
/// end under `config`: `index` itself, except inside a tensor whose moments are in blocks
/// (MomentFormat::block8, a quantized tensor), where it is the next block's start (or the
/// tensor's end). Blocks lie in each tensor's own index space (its whole_numel and row), so where
/// they start never depends on how the space is cut.
HALFSTEP_API std::int64_t block_cut(const std::vector<ParamTensor>& layout, const StepConfig& config, std::int64_t index);

/// The range [begin, end) rank `rank` of `ranks` holds when `numel` elements are split in order
/// into chunks of ceil(numel / ranks): [rank·chunk, (rank + 1)·chunk), cut at numel. Every rank's
/// range starts at a multiple of the chunk, so collectives over the flat space use `chunk`
/// elements per rank (ncclReduceScatter, ncclAllGather), with flat buffers padded to
/// ranks·chunk; the last ranks' ranges are shorter (or empty).
HALFSTEP_API std::pair<std::int64_t, std::int64_t> even_shard(std::int64_t numel, std::int32_t ranks, std::int32_t rank);
/// even_shard over the flat space of `layout`, each cut moved to block_cut: under
/// MomentFormat::block8 the ranges start and end where blocks do, so a range may be up to a
/// block (255 elements) longer or shorter than ceil(numel / ranks) and no longer starts at
/// rank · count. Collectives over equal counts (ncclReduceScatter, ncclAllGather) then need a
/// flat buffer that holds rank r's range at r · L (L the longest range), each padded to L — not
/// the contiguous flat space. For every other format, even_shard's ranges.
HALFSTEP_API std::pair<std::int64_t, std::int64_t> even_shard(const std::vector<ParamTensor>& layout,
                                                              const StepConfig& config, std::int32_t ranks,
                                                              std::int32_t rank);

}  // namespace halfstep
