// Validation of step configurations, tensor lists and optimizer states, shared by both backends.
#include "halfstep/step.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "block8_geometry.hpp"
#include "check.hpp"
#include "fused_impl.hpp"

namespace halfstep {

using detail::finite;
using detail::require;

namespace detail {
void check_decay_rate(const AdamWConfig& h, float lr, const char* what) {
  if (!h.decoupled_weight_decay) return;
  const double rate = static_cast<double>(lr) * static_cast<double>(h.weight_decay);
  require(rate < 1.0, what, " * weight_decay must be < 1 with decoupled weight decay (the factor 1 - lr·wd "
          "multiplies every weight each step), got ", lr, " * ", h.weight_decay, " = ", rate);
}
}  // namespace detail

void AdamWConfig::validate() const {
  require(finite(lr) && lr >= 0.0f, "AdamWConfig.lr must be finite and >= 0, got ", lr);
  require(beta1 >= 0.0f && beta1 < 1.0f, "AdamWConfig.beta1 must be in [0, 1), got ", beta1);
  require(beta2 >= 0.0f && beta2 < 1.0f, "AdamWConfig.beta2 must be in [0, 1), got ", beta2);
  require(finite(eps) && eps >= 0x1p-126f,
          "AdamWConfig.eps must be a normal fp32 number >= 2^-126 (1.18e-38) and finite, got ",
          eps, " (a subnormal eps lets m / eps overflow where the update is small)");
  require(finite(weight_decay) && weight_decay >= 0.0f,
          "AdamWConfig.weight_decay must be finite and >= 0, got ", weight_decay);
  detail::check_decay_rate(*this, lr, "AdamWConfig.lr");
  require(step_offset >= 0 && step_offset <= kCounterLimit, "AdamWConfig.step_offset must be in [0, kCounterLimit = ",
          kCounterLimit, "], got ", step_offset);
}

void StepConfig::validate() const {
  require(grad_dtype == DType::f16 || grad_dtype == DType::bf16 || grad_dtype == DType::f32,
          "StepConfig.grad_dtype must be f16, bf16 or f32, got code ", static_cast<int>(grad_dtype));
  require(model_dtype == DType::f16 || model_dtype == DType::bf16,
          "StepConfig.model_dtype must be f16 or bf16 (the master copy is already f32; tensors "
          "without a model copy leave ParamTensor::model null), got ", dtype_name(model_dtype));
  require(compute_dtype == DType::f16 || compute_dtype == DType::bf16 || compute_dtype == DType::f32,
          "StepConfig.compute_dtype must be f16, bf16 or f32, got code ", static_cast<int>(compute_dtype));
  require(!groups.empty(), "StepConfig.groups must hold at least one AdamWConfig, got none");
  for (std::size_t g = 0; g < groups.size(); ++g) {
    try {
      groups[g].validate();
    } catch (const Error& e) {
      throw Error(ErrorKind::invalid_argument,
                  detail::concat("StepConfig.groups[", g, "]: ", e.what()));
    }
  }
  require(finite(max_grad_norm) && max_grad_norm >= 0.0f,
          "StepConfig.max_grad_norm must be finite and >= 0 (0: no clipping), got ",
          max_grad_norm);
  scaler.validate();
  spike.validate();
  require(state.master == MasterFormat::f32 || state.master == MasterFormat::bf16_remainder ||
              state.master == MasterFormat::none,
          "StepConfig.state.master must be f32, bf16_remainder or none, got code ", static_cast<int>(state.master));
  require(state.master == MasterFormat::f32 || model_dtype == DType::bf16, "StepConfig.state.master = ",
          master_format_name(state.master), " needs a bf16 model copy (",
          state.master == MasterFormat::none ? "the bf16 model copy is the weight"
                                             : "the master is the bf16 model copy and an int16 remainder",
          "), but StepConfig.model_dtype is ", dtype_name(model_dtype));
  for (const auto& [name, format] : {std::pair{"exp_avg", state.exp_avg}, std::pair{"exp_avg_sq", state.exp_avg_sq}}) {
    require(format == MomentFormat::f32 || format == MomentFormat::bf16 || format == MomentFormat::block8,
            "StepConfig.state.", name, " must be f32, bf16 or block8, got code ", static_cast<int>(format));
  }
  require((state.exp_avg == MomentFormat::block8) == (state.exp_avg_sq == MomentFormat::block8),
          "StepConfig.state.exp_avg and exp_avg_sq must both be block8 or neither (the blocks of a tensor ",
          "hold both moments' scales), got ", moment_format_name(state.exp_avg), " and ",
          moment_format_name(state.exp_avg_sq));
  require(state.rounding == Rounding::nearest || state.rounding == Rounding::stochastic,
          "StepConfig.state.rounding must be nearest or stochastic, got code ", static_cast<int>(state.rounding));
}

namespace {

struct Span {
  std::uintptr_t begin, end;  // [begin, end)
  std::size_t tensor;
  const char* field;
};

// Why a buffer may not be null, for the message: the model copy under a master format that reads it.
const char* needed_because(const StepConfig& config, Slot slot) {
  if (slot != Slot::model) return "";
  return config.state.master == MasterFormat::none ? " (StepConfig.state.master = none: the bf16 model copy is the weight)"
         : config.state.master == MasterFormat::bf16_remainder
             ? " (StepConfig.state.master = bf16_remainder: the bf16 model copy is half of the master)"
             : "";
}

void check_buffer(std::vector<Span>& spans, std::size_t t, const char* field, const void* ptr,
                  std::int64_t numel, std::size_t elem_bytes, bool may_be_null, const char* because = "") {
  if (elem_bytes == 0) {  // a buffer the state format does not have, also for an empty tensor
    require(ptr == nullptr, "tensors[", t, "].", field, " must be null: StepConfig.state.master = none has no master ",
            "(the bf16 model copy is the weight), got ", ptr);
    return;
  }
  if (numel == 0) return;
  if (ptr == nullptr) {
    require(may_be_null, "tensors[", t, "].", field, " is null but numel = ", numel, " > 0", because);
    return;
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  require(begin % elem_bytes == 0, "tensors[", t, "].", field, " must be aligned to ", elem_bytes,
          " bytes (its element size), got address ", ptr);
  const auto bytes = static_cast<std::uintptr_t>(numel) * elem_bytes;  // numel < 2^61: no wrap
  require(bytes <= UINTPTR_MAX - begin, "tensors[", t, "].", field, " at ", ptr, " with numel ",
          numel, " would run past the end of the address space");
  spans.push_back({begin, begin + bytes, t, field});
}

// The spans of a quantized tensor's two scale buffers, checked as every buffer is.
void check_scales(std::vector<Span>& spans, std::size_t t, const ParamTensor& p, const MomentBlocks& b) {
  check_buffer(spans, t, "exp_avg_scale", p.exp_avg_scale, b.blocks, sizeof(float), false);
  check_buffer(spans, t, "exp_avg_sq_scale", p.exp_avg_sq_scale, b.blocks, sizeof(float), false);
}

// The whole tensor's shape and the block scales of tensor t under MomentFormat::block8 (its
// scale pointers must be null under every other format, and for tensors that keep wide moments).
void check_blocks(std::vector<Span>& spans, std::size_t t, const ParamTensor& p, const StepConfig& config) {
  detail::check_block_shape(detail::concat("tensors[", t, "]"), p, config);
  const MomentBlocks b = moment_blocks(config, p);
  if (!b.quantized) {
    const bool block8 = config.state.exp_avg == MomentFormat::block8;
    for (const auto& [name, scale] : {std::pair{"exp_avg_scale", p.exp_avg_scale}, std::pair{"exp_avg_sq_scale", p.exp_avg_sq_scale}}) {
      require(scale == nullptr, "tensors[", t, "].", name, " must be null: ",
              block8 ? "the tensor keeps fp32 moments (fewer than 4096 elements, or rows shorter than 32)"
                     : "only block8 moments have block scales", ", got ", static_cast<const void*>(scale));
    }
    return;
  }
  check_scales(spans, t, p, b);
}

}  // namespace

namespace detail {

void check_block_shape(const std::string& what, const ParamTensor& p, const StepConfig& config) {
  require(p.numel >= 0, what, ".numel must be >= 0, got ", p.numel);
  require(p.offset >= 0 && p.offset <= INT64_MAX - p.numel, what,
          ".offset must be >= 0 and offset + numel must fit an int64, got offset ", p.offset);
  require(p.whole_numel >= 0, what, ".whole_numel must be >= 0 (0: the buffer is the whole tensor), got ",
          p.whole_numel);
  require(p.row >= 0, what, ".row must be >= 0 (0: one row), got ", p.row);
  if (config.state.exp_avg != MomentFormat::block8) return;
  require(p.offset == 0 || p.whole_numel != 0, what, ".whole_numel must be set for a piece of a tensor ",
          "(offset ", p.offset, " > 0) under block8 moments: the blocks follow the whole tensor's shape");
  const std::int64_t whole = whole_numel_of(p);
  require(p.offset <= whole - p.numel, what, ": offset + numel = ", p.offset, " + ", p.numel,
          " must be <= whole_numel = ", whole);
  require(p.row == 0 || (whole % p.row == 0), what, ".row = ", p.row, " must divide the whole tensor's ", whole,
          " elements");
  const Block8Geometry g = block8_geometry_of(p);
  if (!g.quantized) return;
  for (const std::int64_t at : {p.offset, p.offset + p.numel}) {
    require(g.starts_block(at), what, ": a piece of a tensor with block8 moments must start and end where ",
            "blocks do (256 elements of a row of ", g.row, ", a row's last block holding the rest), but element ", at,
            " of the whole tensor is inside block ", g.block_of(at));
  }
}

}  // namespace detail

void validate(const std::vector<ParamTensor>& tensors, const StepConfig& config) {
  config.validate();
  std::vector<Span> spans;
  spans.reserve(tensors.size() * (kSlotCount + 2));
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ParamTensor& p = tensors[t];
    require(p.numel >= 0, "tensors[", t, "].numel must be >= 0, got ", p.numel);
    require(p.group >= 0 && static_cast<std::size_t>(p.group) < config.groups.size(), "tensors[",
            t, "].group must name one of the ", config.groups.size(),
            " StepConfig.groups, got ", p.group);
    // Every buffer's end must be an address: numel * 4 bytes may not wrap past 2^64.
    require(static_cast<std::uint64_t>(p.numel) <= (UINT64_MAX >> 3), "tensors[", t,
            "].numel is too large, got ", p.numel);
    check_blocks(spans, t, p, config);  // offset, whole_numel, row and block8's rules
    for (const SlotLayout& s : slot_layouts(config, p)) {  // a null gradient: none this step
      check_buffer(spans, t, s.name, slot_pointer(p, s.slot), p.numel, s.element_bytes, s.nullable,
                   needed_because(config, s.slot));
    }
  }
  // Two buffers of one step overlapping would make the update depend on the order of writes.
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.tensor < b.tensor;
            });
  for (std::size_t i = 1; i < spans.size(); ++i) {
    const Span& a = spans[i - 1];
    const Span& b = spans[i];
    require(b.begin >= a.end, "tensors[", a.tensor, "].", a.field, " and tensors[", b.tensor, "].",
            b.field, " overlap; every buffer of a step must be distinct");
  }
}

namespace detail {

WrittenSpans written_spans(const std::vector<ParamTensor>& tensors, const StepConfig& config) {
  std::vector<Span> spans;
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ParamTensor& p = tensors[t];
    for (const SlotLayout& s : slot_layouts(config, p)) {
      if (s.written) check_buffer(spans, t, s.name, slot_pointer(p, s.slot), p.numel, s.element_bytes, s.nullable);
    }
    const MomentBlocks b = moment_blocks(config, p);
    if (b.quantized) check_scales(spans, t, p, b);
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  WrittenSpans w;
  for (const Span& s : spans) w.spans.push_back({s.begin, s.end, s.tensor, s.field});
  return w;
}

void validate_gradients(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                        const WrittenSpans& written, const std::vector<const void*>& grads) {
  require(grads.size() == tensors.size(), "set_gradients: grads must hold one pointer per tensor (",
          tensors.size(), "), got ", grads.size());
  std::vector<Span> spans;
  const std::size_t grad_bytes = element_size(config.grad_dtype);
  for (std::size_t t = 0; t < grads.size(); ++t) {
    try {
      check_buffer(spans, t, "grad", grads[t], tensors[t].numel, grad_bytes, true);
    } catch (const Error& e) {
      fail("set_gradients: ", e.what());
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < spans.size(); ++i) {
    require(spans[i].begin >= spans[i - 1].end, "set_gradients: grads[", spans[i - 1].tensor, "] and grads[",
            spans[i].tensor, "] overlap; every buffer of a step must be distinct");
  }
  // The written spans are disjoint and sorted, so their ends are sorted too: the first that ends
  // past a gradient's start is the only one that can overlap it first.
  for (const Span& g : spans) {
    const auto w = std::upper_bound(written.spans.begin(), written.spans.end(), g.begin,
                                    [](std::uintptr_t at, const WrittenSpans::Span& s) { return at < s.end; });
    require(w == written.spans.end() || w->begin >= g.end, "set_gradients: grads[", g.tensor, "] and tensors[",
            w == written.spans.end() ? 0 : w->tensor, "].", w == written.spans.end() ? "" : w->field,
            " overlap; every buffer of a step must be distinct");
  }
}

}  // namespace detail

const char* outcome_name(Outcome outcome) {
  switch (outcome) {
    case Outcome::applied: return "applied";
    case Outcome::skipped_overflow: return "skipped_overflow";
    case Outcome::skipped_spike: return "skipped_spike";
    case Outcome::skipped_nonfinite_update: return "skipped_nonfinite_update";
    case Outcome::skipped_inconsistent: return "skipped_inconsistent";
  }
  return "unknown";
}

const char* skip_reason_name(SkipReason reason) {
  switch (reason) {
    case SkipReason::none: return "none";
    case SkipReason::nonfinite_gradient: return "nonfinite_gradient";
    case SkipReason::spike: return "spike";
    case SkipReason::gradient_exceeds_fp32: return "gradient_exceeds_fp32";
    case SkipReason::second_moment_exceeds_fp32: return "second_moment_exceeds_fp32";
    case SkipReason::step_size_exceeds_fp32: return "step_size_exceeds_fp32";
    case SkipReason::invalid_learning_rate: return "invalid_learning_rate";
    case SkipReason::inconsistent_totals: return "inconsistent_totals";
    case SkipReason::hyperparameters_differ: return "hyperparameters_differ";
    case SkipReason::rank_refused: return "rank_refused";
    case SkipReason::external_found_inf: return "external_found_inf";
    case SkipReason::invalid_loss_scale: return "invalid_loss_scale";
  }
  return "unknown";
}

OptimizerState OptimizerState::initial(const StepConfig& config) {
  OptimizerState s;
  s.scaler = ScalerState::initial(config.scaler);
  s.spike = SpikeState{};
  s.step = 0;
  s.attempts = 0;
  return s;
}

bool operator==(const OptimizerState& a, const OptimizerState& b) {
  return a.scaler == b.scaler && a.spike == b.spike && a.step == b.step && a.attempts == b.attempts;
}

void validate_state(const OptimizerState& s, const StepConfig& config) {
  validate_state(s.scaler, config.scaler);
  auto counter = [](std::int64_t value, const char* name, std::int64_t at_most, const char* bound) {
    require(value >= 0 && value <= at_most, name, " must be in [0, ", bound, " = ", at_most, "], got ",
            value);
  };
  counter(s.attempts, "OptimizerState.attempts", kCounterLimit, "kCounterLimit");
  counter(s.step, "OptimizerState.step", s.attempts, "attempts");
  counter(s.scaler.overflows, "ScalerState.overflows", s.attempts - s.step, "attempts - step");
  counter(s.scaler.growths, "ScalerState.growths", s.step, "step");
  counter(s.scaler.backoffs, "ScalerState.backoffs", s.scaler.overflows, "overflows");
  counter(s.scaler.good_steps, "ScalerState.good_steps", s.step, "step");
  counter(s.spike.seen, "SpikeState.seen", s.attempts, "attempts");
  counter(s.spike.spikes, "SpikeState.spikes", s.attempts, "attempts");
  counter(s.spike.consecutive, "SpikeState.consecutive",
          std::min<std::int64_t>(s.spike.spikes, config.spike.max_consecutive),
          "min(spikes, SpikeConfig.max_consecutive)");
  // log‖g‖ of a finite positive double norm lies in [-745, 710]; its EMA too, and the EMA of its
  // squared deviations stays below the square of that range.
  require(finite(s.spike.mean) && s.spike.mean >= -746.0 && s.spike.mean <= 710.0,
          "SpikeState.mean must be a log-norm in [-746, 710], got ", s.spike.mean);
  require(finite(s.spike.var) && s.spike.var >= 0.0 && s.spike.var <= 1456.0 * 1456.0,
          "SpikeState.var must be in [0, 1456^2], got ", s.spike.var);
  if (!config.spike.enabled) {
    require(s.spike == SpikeState{}, "SpikeState must be empty when SpikeConfig.enabled is false");
  }
  // A group joins a run at some applied step: it cannot have joined after the steps taken so far.
  for (std::size_t g = 0; g < config.groups.size(); ++g) {
    require(config.groups[g].step_offset <= s.step, "groups[", g, "].step_offset must be at most OptimizerState.step = ",
            s.step, " (the applied steps before the group joined), got ", config.groups[g].step_offset);
  }
}

}  // namespace halfstep
