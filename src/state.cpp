// The state formats and the slots of a tensor: the one description of what each buffer holds.
#include "halfstep/state.hpp"

#include "block8_geometry.hpp"
#include "check.hpp"
#include "halfstep/step.hpp"

namespace halfstep {

const char* master_format_name(MasterFormat format) {
  switch (format) {
    case MasterFormat::f32: return "f32";
    case MasterFormat::bf16_remainder: return "bf16_remainder";
    case MasterFormat::none: return "none";
  }
  return "unknown";
}

const char* moment_format_name(MomentFormat format) {
  switch (format) {
    case MomentFormat::f32: return "f32";
    case MomentFormat::bf16: return "bf16";
    case MomentFormat::block8: return "block8";
  }
  return "unknown";
}

const char* rounding_name(Rounding rounding) {
  switch (rounding) {
    case Rounding::nearest: return "nearest";
    case Rounding::stochastic: return "stochastic";
  }
  return "unknown";
}

const char* storage_name(Storage storage) {
  switch (storage) {
    case Storage::f32: return "F32";
    case Storage::f16: return "F16";
    case Storage::bf16: return "BF16";
    case Storage::i16: return "I16";
    case Storage::u8: return "U8";
  }
  return "unknown";
}

namespace {

Storage storage_of(DType dtype) {
  return dtype == DType::f32 ? Storage::f32 : dtype == DType::bf16 ? Storage::bf16 : Storage::f16;
}
Storage storage_of(MomentFormat format) {
  return format == MomentFormat::bf16 ? Storage::bf16 : format == MomentFormat::block8 ? Storage::u8 : Storage::f32;
}
std::size_t bytes_of(Storage storage) { return storage == Storage::f32 ? 4 : storage == Storage::u8 ? 1 : 2; }

SlotLayout make(Slot slot, const char* name, Storage storage, bool state, bool read, bool written, bool nullable) {
  return SlotLayout{slot, name, storage, bytes_of(storage), state, read, written, nullable, true};
}

}  // namespace

std::array<SlotLayout, kSlotCount> slot_layouts(const StepConfig& c) {
  const bool remainder = c.state.master == MasterFormat::bf16_remainder;
  const bool none = c.state.master == MasterFormat::none;
  SlotLayout master = make(Slot::master, "master", remainder ? Storage::i16 : Storage::f32, true, true, true, false);
  if (none) master = SlotLayout{Slot::master, "master", Storage::f32, 0, false, false, false, true, false};
  // The model copy is written from the master; with remainders it is half of the master, without
  // a master it is the weight: read as well, and every tensor has one.
  const bool model_read = remainder || none;
  return {master,
          make(Slot::grad, "grad", storage_of(c.grad_dtype), false, true, false, true),
          make(Slot::exp_avg, "exp_avg", storage_of(c.state.exp_avg), true, true, true, false),
          make(Slot::exp_avg_sq, "exp_avg_sq", storage_of(c.state.exp_avg_sq), true, true, true, false),
          make(Slot::model, "model", storage_of(c.model_dtype), false, model_read, true, !model_read)};
}

std::array<SlotLayout, kSlotCount> slot_layouts(const StepConfig& c, const ParamTensor& tensor) {
  auto slots = slot_layouts(c);
  if (c.state.exp_avg == MomentFormat::block8 && !moment_blocks(c, tensor).quantized) {
    for (SlotLayout& s : slots) {
      if (s.slot == Slot::exp_avg || s.slot == Slot::exp_avg_sq) {
        s.storage = Storage::f32;
        s.element_bytes = 4;
      }
    }
  }
  return slots;
}

MomentBlocks moment_blocks(const StepConfig& c, const ParamTensor& t) {
  MomentBlocks b;
  if (c.state.exp_avg != MomentFormat::block8) return b;
  const std::int64_t whole = detail::whole_numel_of(t);
  const detail::Block8Geometry g = detail::block8_geometry_of(t);
  if (!g.quantized) return b;
  b.quantized = true;
  if (t.offset < 0 || t.numel < 0 || t.offset > whole - t.numel) return b;  // validate names the rule
  b.first = t.offset < whole ? g.block_of(t.offset) : g.blocks;
  b.blocks = g.blocks_in(t.offset, t.offset + t.numel);
  return b;
}

const void* slot_pointer(const ParamTensor& t, Slot slot) {
  switch (slot) {
    case Slot::master: return t.master;
    case Slot::grad: return t.grad;
    case Slot::exp_avg: return t.exp_avg;
    case Slot::exp_avg_sq: return t.exp_avg_sq;
    case Slot::model: return t.model;
  }
  return nullptr;
}

void set_slot_pointer(ParamTensor& t, Slot slot, void* pointer) {
  switch (slot) {
    case Slot::master: t.master = pointer; return;
    case Slot::grad: t.grad = pointer; return;
    case Slot::exp_avg: t.exp_avg = pointer; return;
    case Slot::exp_avg_sq: t.exp_avg_sq = pointer; return;
    case Slot::model: t.model = pointer; return;
  }
}

StateBytes state_bytes(const StepConfig& config, bool model_copy) {
  detail::require(model_copy || config.state.master == MasterFormat::f32, "state_bytes: with StepConfig.state.master = ",
                  master_format_name(config.state.master), " every tensor has a model copy (",
                  config.state.master == MasterFormat::none ? "it is the weight: there is no master"
                                                            : "the master is the bf16 model copy and an int16 remainder",
                  "); model_copy must be true");
  StateBytes b{0, 0, 0, 0};
  for (const SlotLayout& s : slot_layouts(config)) {
    if (s.slot == Slot::model && !model_copy) continue;
    if (s.state) b.state += s.element_bytes;
    if (s.slot == Slot::grad) b.gradient = s.element_bytes;
    if (s.slot == Slot::model) b.model = s.element_bytes;
    // Pass 1 reads the gradients once; pass 2 reads what it reads and writes what it writes.
    b.moved += s.element_bytes * ((s.slot == Slot::grad ? 2u : s.read ? 1u : 0u) + (s.written ? 1u : 0u));
  }
  return b;
}

namespace {

constexpr std::uint32_t kBf16Upper = 0x8000u;  // the low half of the upper tie above a bf16 pattern

// Round to nearest even of fp32 bits to bf16 bits (finite input; carries into the exponent and
// past the largest finite value as the format's rounding does).
std::uint32_t round_bf16(std::uint32_t bits) { return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16; }

}  // namespace

std::uint32_t canonical_master(std::uint32_t bits) {
  // The upper tie above an even bf16 pattern: low half 0x8000, bit 16 (the pattern's lowest) clear.
  return (bits & 0x1FFFFu) == kBf16Upper ? bits - 1u : bits;
}

bool split_master(std::uint32_t bits, std::uint16_t& model, std::int16_t& remainder) {
  const FormatBits f32 = format_bits(DType::f32);
  if ((bits & f32.exponent) == f32.exponent) return false;  // inf or NaN
  if ((bits & 0x1FFFFu) == kBf16Upper) return false;         // the one pattern 16 bits cannot hold
  const std::uint32_t rounded = round_bf16(bits);
  const FormatBits bf16 = format_bits(DType::bf16);
  if ((rounded & bf16.exponent) == bf16.exponent) return false;  // rounds past bf16's range
  const auto diff = static_cast<std::int32_t>(bits - (rounded << 16));  // in [-2^15, 2^15)
  model = static_cast<std::uint16_t>(rounded);
  remainder = static_cast<std::int16_t>(diff);
  return true;
}

std::uint32_t join_master(std::uint16_t model, std::int16_t remainder) {
  return (static_cast<std::uint32_t>(model) << 16) + static_cast<std::uint32_t>(static_cast<std::int32_t>(remainder));
}

}  // namespace halfstep
