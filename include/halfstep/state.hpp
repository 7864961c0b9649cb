// halfstep: how the optimizer state of an element is stored (the state formats), and the buffers
// of a tensor as one list (the slots) that validation, sharding, the tensor table, checkpoints,
// the C API and the planner all read, so that a format is described once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "halfstep/formats.hpp"

namespace halfstep {

struct StepConfig;
struct ParamTensor;

/// How a master weight is stored.
enum class MasterFormat : std::uint8_t {
  f32,             ///< an fp32 value (ParamTensor::master)
  bf16_remainder,  ///< no fp32 copy: the bf16 model copy (ParamTensor::model, required) and an
                   ///< int16 remainder (ParamTensor::master) rebuild the fp32 master exactly
                   ///< (split_master / join_master)
  none,            ///< no master: the bf16 model copy (ParamTensor::model, required) is the weight;
                   ///< the update is computed in fp32 and written to it with StateFormat::rounding
                   ///< (ParamTensor::master must be null)
};

/// How a moment (exp_avg, exp_avg_sq) is stored.
enum class MomentFormat : std::uint8_t {
  f32,   ///< fp32
  bf16,  ///< bfloat16: decoded to fp32 for the update, stored with StateFormat::rounding
  /// Block-wise 8-bit codes: a code per element and one fp32 scale per block of up to 256
  /// elements of a row of the whole tensor (ParamTensor::exp_avg_scale, exp_avg_sq_scale).
  /// exp_avg takes a signed map, rounded to nearest; exp_avg_sq is stored as the codes of its
  /// square root in an unsigned map, with StateFormat::rounding. Both moments take it or neither.
  /// A tensor of fewer than 4096 elements, or with rows shorter than 32, keeps fp32 moments
  /// (moment_blocks), decided by the whole tensor's shape, never a shard's.
  block8,
};

/// How an fp32 result is stored in a narrower moment format.
enum class Rounding : std::uint8_t {
  nearest,     ///< to nearest, ties to even
  stochastic,  ///< up with probability equal to the discarded fraction (unbiased), the random
               ///< bits a hash of (seed, applied step, tensor id, element index): the same on
               ///< any number of ranks and across a resume
};

/// "f32", "bf16_remainder" or "none"; "f32", "bf16" or "block8"; "nearest" or "stochastic".
HALFSTEP_API const char* master_format_name(MasterFormat format);
HALFSTEP_API const char* moment_format_name(MomentFormat format);
HALFSTEP_API const char* rounding_name(Rounding rounding);

/// How the optimizer holds the state of every element of a step.
struct StateFormat {
  MasterFormat master = MasterFormat::f32;
  MomentFormat exp_avg = MomentFormat::f32;
  MomentFormat exp_avg_sq = MomentFormat::f32;
  /// How bf16 moments, and with MasterFormat::none the bf16 weights, are rounded. Stochastic by
  /// default: with beta2 = 0.999, exp_avg_sq moves by 0.1% a step, less than half a bf16 ulp
  /// (0.2-0.4%), and rounding to nearest freezes it; an update below half a weight's ulp is lost
  /// to nearest rounding but kept in expectation by stochastic rounding (docs/design.md, "Lean
  /// state"; measured in bench/RESULTS.md).
  Rounding rounding = Rounding::stochastic;
  std::uint64_t seed = 0;  ///< key of stochastic rounding's random bits
};

/// The buffers of a ParamTensor.
enum class Slot : std::uint8_t { master, grad, exp_avg, exp_avg_sq, model };
inline constexpr int kSlotCount = 5;

/// What a buffer's elements are.
enum class Storage : std::uint8_t { f32, f16, bf16, i16, u8 };

/// "F32", "F16", "BF16", "I16", "U8": the element types of safetensors files.
HALFSTEP_API const char* storage_name(Storage storage);

/// One buffer of a tensor under a configuration.
struct SlotLayout {
  Slot slot;
  const char* name;           ///< "master", "grad", "exp_avg", "exp_avg_sq", "model"
  Storage storage;            ///< its elements
  std::size_t element_bytes;  ///< bytes per element
  bool state;                 ///< optimizer state, held between steps (master, moments)
  bool read;                  ///< a step (pass 1 or pass 2 of an applied step) reads it
  bool written;               ///< an applied step writes it
  bool nullable;              ///< may be null: a gradient (none this step), a model copy (none)
  bool present;               ///< the format has this buffer; an absent one (the master under
                              ///< MasterFormat::none) has element_bytes 0 and must be null
};

/// The five buffers of every tensor of a step with `config`, in Slot order. Under
/// MomentFormat::block8 the moments are the 8-bit codes of a quantized tensor (one byte an
/// element; the scales are apart, moment_blocks); slot_layouts(config, tensor) says what one
/// tensor holds.
HALFSTEP_API std::array<SlotLayout, kSlotCount> slot_layouts(const StepConfig& config);
/// The five buffers of `tensor` under `config`: slot_layouts(config), except that a tensor that
/// keeps wide moments under MomentFormat::block8 holds them in fp32.
HALFSTEP_API std::array<SlotLayout, kSlotCount> slot_layouts(const StepConfig& config, const ParamTensor& tensor);

/// How one tensor (or a piece of it) holds its moments under MomentFormat::block8.
struct MomentBlocks {
  bool quantized = false;    ///< 8-bit codes and scales; false: fp32 moments (every other format,
                             ///< and block8 tensors of fewer than 4096 elements or rows shorter
                             ///< than 32)
  std::int64_t blocks = 0;   ///< scales per moment the piece holds: the blocks its elements lie in
  std::int64_t first = 0;    ///< the index of the piece's first block in the whole tensor
};

/// The blocks of `tensor` under `config`, from the whole tensor's shape (ParamTensor::whole_numel
/// and row) and the piece's place in it (offset, numel). Blocks are 256 consecutive elements of a
/// row, a row's last block holding what is left, a row shorter than 256 one block; a piece of a
/// quantized tensor must start and end where blocks do (validate checks it).
HALFSTEP_API MomentBlocks moment_blocks(const StepConfig& config, const ParamTensor& tensor);

/// Moment values as the block8 codes and scales of `tensor` (a tensor whose shape has blocks under
/// MomentFormat::block8, or a piece of one cut where blocks start: moment_blocks), as a conversion stores them: to nearest,
/// exp_avg_sq as its square root (a positive root never the map's 0) — a step's encoding without
/// its random bits. `slot` is Slot::exp_avg or Slot::exp_avg_sq; `values` holds tensor.numel
/// finite values (exp_avg_sq's >= 0) in host memory; `codes` receives numel bytes and `scales`
/// moment_blocks(...).blocks floats. Throws halfstep::Error naming the rule, before
/// writing anything.
HALFSTEP_API void encode_moment(const ParamTensor& tensor, Slot slot, const float* values, std::uint8_t* codes,
                                float* scales);
/// The values block8 codes and scales hold (the inverse of encode_moment up to its rounding):
/// map[code] · scale, exp_avg_sq's squared in double and rounded once to fp32. Here `tensor` may be
/// any piece of a tensor with blocks, cut anywhere: `scales` holds those of the blocks its elements
/// lie in, from its first element's, each finite and >= 0. Throws halfstep::Error naming the rule, before writing anything.
HALFSTEP_API void decode_moment(const ParamTensor& tensor, Slot slot, const std::uint8_t* codes, const float* scales,
                                float* values);

/// A tensor's buffer for `slot`.
HALFSTEP_API const void* slot_pointer(const ParamTensor& tensor, Slot slot);
/// Sets a tensor's buffer for `slot` (the gradient's is const: it is read only).
HALFSTEP_API void set_slot_pointer(ParamTensor& tensor, Slot slot, void* pointer);

/// Bytes per parameter element of a step with `config`.
struct StateBytes {
  std::size_t state;     ///< held by the optimizer between steps: master and moments
  std::size_t gradient;  ///< the gradient
  std::size_t model;     ///< the model copy (0 without one: fp32 parameters that are the masters)
  std::size_t moved;     ///< read and written by one applied step: pass 1 reads the gradients,
                         ///< pass 2 reads the gradients and the state and writes the state and
                         ///< the model copy (the clip and the norm add nothing: pass 1 measures
                         ///< them from the same read)
};

/// The bytes per element of a step with `config`, for tensors with a model copy (`model_copy`)
/// or without (fp32 parameters that are their own masters). Throws halfstep::Error for tensors
/// without one under MasterFormat::bf16_remainder (the model copy is half of the master) or
/// MasterFormat::none (the model copy is the weight).
HALFSTEP_API StateBytes state_bytes(const StepConfig& config, bool model_copy = true);

/// The fp32 master `bits` as a bf16 model copy and an int16 remainder (MasterFormat::
/// bf16_remainder): model = bf16 rounded to nearest even, remainder = bits - model·2^16 as a
/// signed 16-bit integer. Exact for every finite fp32 pattern but one per even bf16 pattern P,
/// the upper tie P·2^16 + 0x8000 (it rounds to P and would need a remainder of +2^15): 65,537
/// fp32 values round to each even bf16 value and 16 bits hold 65,536. A step with a bf16 model
/// copy never writes that value (canonical_master), in either master format. Returns false, and
/// writes nothing, for that tie and for a master whose bf16 rounding is not finite.
HALFSTEP_API bool split_master(std::uint32_t bits, std::uint16_t& model, std::int16_t& remainder);
/// The fp32 master's bits from a bf16 model copy and its remainder.
HALFSTEP_API std::uint32_t join_master(std::uint16_t model, std::int16_t remainder);
/// The master a step with a bf16 model copy stores for the fp32 result `bits`: itself, except the
/// upper tie above an even bf16 pattern, which becomes its neighbour one fp32 ulp towards zero
/// (the same bf16 rounding; a change of 2^-24 relative at most, at one fp32 pattern in 2^16).
HALFSTEP_API std::uint32_t canonical_master(std::uint32_t bits);

}  // namespace halfstep
