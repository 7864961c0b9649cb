// Internal: the plain data shared by the host orchestration (src/cuda_backend.cpp) and the
// kernels. Built once at setup in device memory; the kernels receive pointers to it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "block8_geometry.hpp"
#include "exact_sum.hpp"
#include "halfstep/distributed.hpp"
#include "halfstep/scaler.hpp"
#include "halfstep/spike.hpp"
#include "halfstep/step.hpp"

namespace halfstep::detail {

/// Elements per chunk: the unit of work of one thread block in both passes. A multiple of the
/// 8-element vector width, so every chunk of an aligned tensor starts 16-byte aligned.
inline constexpr std::int64_t kChunkElems = 32768;
/// Threads per block of pass 1 and pass 2.
inline constexpr int kPassThreads = 256;
/// Threads of the single finalize block.
inline constexpr int kFinalizeThreads = 512;
/// Elements per vector access: 16 bytes of 16-bit gradients (pass 2 reads fp32 gradients as two
/// such accesses).
inline constexpr int kVecElems = 8;

/// One row of the tensor table. The state buffers hold the StepConfig::state formats.
struct TensorDesc {
  void* master;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* model;             // null: no model copy for this tensor
  std::int64_t numel;
  std::int64_t key_offset; // element 0's index in the whole tensor (ParamTensor::offset)
  std::int32_t group;
  std::uint32_t key_id;    // the tensor's id in stochastic rounding's bits (ParamTensor::tensor_id)
  std::uint8_t grad_vec;   // grad is 16-byte aligned: pass 1 may use vector loads
  std::uint8_t all_vec;    // every buffer is 16-byte aligned (block8 moments: and every block starts
                           // at a multiple of 8 elements): pass 2 may use vector accesses
  std::uint8_t in_norm;    // counted in Σg² and the subnormal/zero counts (no ParamTensor::duplicate)
  std::uint8_t quantized;  // block8 moments as codes and scales (moment_blocks); else fp32 moments
  std::uint8_t blocks32;   // quantized: the whole tensor's blocks are numbered below 2^32
  std::uint8_t pad_[3];
  // A quantized tensor's blocks: a scale per block of this piece, from block first_block of the
  // whole tensor, whose blocks lie as `blocks` says; per_row divides a block number by
  // blocks.blocks_per_row (with blocks32).
  float* exp_avg_scale;
  float* exp_avg_sq_scale;
  Block8Geometry blocks;
  std::int64_t first_block;
  Divisor32 per_row;
};

/// One chunk: elements [begin, begin + len) of tensor `tensor`. Chunks are ordered by tensor.
struct ChunkDesc {
  std::int64_t begin;
  std::int32_t tensor;
  std::int32_t len;
};

/// How the next step's gradients were scaled, where that is not simply the optimizer's own loss
/// scale: mark_unscaled and use_external_scale set it, and it holds for one step (the decision
/// clears it). Zero: scaled by the optimizer's own scale.
struct ScaleInputs {
  std::int32_t unscaled;   // 1: already divided by the scale: divide by 1
  std::int32_t external;   // 1: scaled by external_scale, a scale another scaler owns; the
                           // optimizer's own scaler does not move
  float external_scale;    // the external scale (1 with unscaled gradients of an external scaler)
  float found_inf;         // the external scaler's own inf/NaN check: nonzero (or NaN) skips
};

/// What a step reads besides the tables, which set_gradients, mark_unscaled and
/// use_external_scale write on the stream.
struct StepInputs {
  std::int64_t numel;      // elements of this rank's tensors in the norm that have a gradient
  std::uint64_t grads_key; // set_gradients' key: which of the model's tensors have a gradient
  ScaleInputs scale;
};

/// Gradient pointers per set_grads launch (its arguments stay below 4 KiB).
inline constexpr int kGradBatch = 256;

/// A batch of new gradient pointers for tensors [first, first + count) of the table.
struct GradBatch {
  std::int32_t first, count;
  std::int64_t numel;                  // the step's new StepInputs::numel
  std::uint64_t key;                   // and StepInputs::grads_key
  const void* grad[kGradBatch];        // null: no gradient for that tensor
  std::uint8_t flags[kGradBatch];      // bit 0: grad 16-byte aligned; bit 1: every buffer is
};

/// What pass 1 measured on one chunk.
struct ChunkPartial {
  std::uint32_t digit[kPartialDigits];  // Σg² of the finite scaled gradients: base-2^32 digits from
                                        // limb split_grid_offset / 32 (the same for every chunk of
                                        // a launch)
  std::uint32_t max_bits;   // the largest finite |g|, as its pattern in the gradient format
  std::uint32_t nonfinite;  // inf and NaN elements
  std::uint32_t subnormal;  // elements below the smallest normal of the compute format
  std::uint32_t zero;       // elements stored as ±0
};

/// A group's hyperparameters besides its learning rate (set_group changes them between steps; lr
/// lives apart, in device memory that set_lr and device_lr write).
struct GroupParams {
  float beta1, beta2, eps, weight_decay;
  std::uint8_t decoupled, bias_correction;
  std::uint8_t pad_[2];
  std::int64_t step_offset;  // AdamWConfig::step_offset
};

/// Per-step constants of a group, computed by finalize from the applied-step counter.
struct GroupConsts {
  float step_size;        // lr / (1 - beta1^t)
  float inv_sqrt_bc2;     // 1 / sqrt(1 - beta2^t)
  float decay;            // 1 - lr·wd for decoupled decay, else 1
  float l2;               // wd for classic L2 decay, else 0
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  std::uint8_t classic;   // classic (L2) weight decay: g += wd·p
  std::uint8_t pad_[3];
};

/// Finalize's verdict, read by every block of pass 2. The factor clip / S that unscales and clips
/// is pre · coef · post_a · post_b: a mantissa rounded once to fp32 and exact powers of two, so
/// the factor keeps fp32's full precision even where clip / S itself would be subnormal in fp32
/// (a huge norm against a small max_grad_norm) or past its range (S below ~2^-128).
struct Decision {
  std::int32_t apply;  // 1: pass 2 updates; 0: it returns at once
  float coef;          // in [0.5, 1]
  float pre;           // a power of two >= 1, applied before coef
  float post_a;        // powers of two applied after coef: both >= 1 or both <= 1
  float post_b;
  std::uint32_t pad_;
  std::uint64_t rounding_key;  // step_key(seed, applied step) for stochastic rounding (state_codec.hpp)
};

/// The rule a (reduced) totals record breaks, or none. Every rule holds for any SUM/MAX reduction
/// of records pass 1 wrote, whatever the ranks held; a record that breaks one came from a faulty
/// or mismatched all-reduce (or was written by hand), and is never applied.
enum class TotalsFault : std::uint8_t {
  none,
  count_past_int64,      // a count word is at or past 2^63
  counts_past_numel,     // subnormal + zero elements outnumber the elements in the norm
  max_not_finite,        // max[0] is not the pattern of a finite |g| of the format
  key_count_mismatch,    // an inf/NaN count without a first-inf/NaN key, or a key without one
  malformed_key,         // max[1]'s halves are not 0xFFFFFFFF - an index below 2^31
  sum_past_bound,        // Σg² exceeds numel · max|g|²
  half_refusal_mark,     // max[2] holds a refusing rank's mark and max[3] does not
};

/// The sums over all chunks (and ranks) that the decision needs: a decoded StepTotals (what
/// summarize() returns), and the rule the record breaks, if any.
struct Totals : TotalsSummary {
  TotalsFault fault = TotalsFault::none;
};

/// The device holds the optimizer state as its bytes.
static_assert(std::is_trivially_copyable<OptimizerState>::value, "OptimizerState is copied as bytes");

/// Everything the decision reads besides the totals and the state.
struct DecideParams {
  ScalerConfig scaler;
  SpikeConfig spike;
  float max_grad_norm;
  float format_max;       // largest finite value of the format the gradients were computed in
                          // (the headroom is measured against it)
  bool device_scaler;     // run the scaler transition here (device-resident mode)
  std::uint64_t seed;     // StateFormat::seed: the key of stochastic rounding
};

/// A group's hyperparameters besides its learning rate, as the device holds them (set_group
/// changes them between steps; the learning rate lives apart, in memory set_lr and device_lr write).
inline GroupParams group_params(const AdamWConfig& h) {
  return GroupParams{h.beta1, h.beta2, h.eps, h.weight_decay,
                     static_cast<std::uint8_t>(h.decoupled_weight_decay ? 1 : 0),
                     static_cast<std::uint8_t>(h.bias_correction ? 1 : 0), {0, 0}, h.step_offset};
}

/// The bit pattern of an fp32 value.
inline std::uint32_t f32_pattern(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

/// The first step's window hint (exact_sum.hpp): gradients near the initial loss scale, as a
/// magnitude pattern of the gradient format (any value is correct; the window follows the largest
/// gradient from then on).
inline std::uint32_t initial_window_hint(const StepConfig& c) {
  if (c.grad_dtype == DType::f32) return f32_pattern(c.scaler.init_scale) & format_bits(DType::f32).magnitude();
  return to_bits16(DType::bf16, c.scaler.init_scale) & format_bits(DType::bf16).magnitude();
}

/// What decide() needs from the step's configuration.
inline DecideParams decide_params(const StepConfig& c) {
  DecideParams p{};
  p.scaler = c.scaler;
  p.spike = c.spike;
  p.max_grad_norm = c.max_grad_norm;
  p.format_max = format_info(measured_dtype(c)).max;
  p.device_scaler = !c.host_driven;
  p.seed = c.state.seed;
  return p;
}

}  // namespace halfstep::detail
