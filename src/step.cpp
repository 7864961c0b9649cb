// Validation of step configurations, tensor lists and optimizer states, shared by both backends.
#include "halfstep/step.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "check.hpp"

namespace halfstep {

using detail::finite;
using detail::require;

void AdamWConfig::validate() const {
  require(finite(lr) && lr >= 0.0f, "AdamWConfig.lr must be finite and >= 0, got ", lr);
  require(beta1 >= 0.0f && beta1 < 1.0f, "AdamWConfig.beta1 must be in [0, 1), got ", beta1);
  require(beta2 >= 0.0f && beta2 < 1.0f, "AdamWConfig.beta2 must be in [0, 1), got ", beta2);
  require(finite(eps) && eps > 0.0f, "AdamWConfig.eps must be finite and > 0, got ", eps);
  require(finite(weight_decay) && weight_decay >= 0.0f,
          "AdamWConfig.weight_decay must be finite and >= 0, got ", weight_decay);
}

void StepConfig::validate() const {
  require(grad_dtype == DType::f16 || grad_dtype == DType::bf16,
          "StepConfig.grad_dtype must be f16 or bf16, got ", dtype_name(grad_dtype));
  require(model_dtype == DType::f16 || model_dtype == DType::bf16,
          "StepConfig.model_dtype must be f16 or bf16 (the master copy is already f32), got ",
          dtype_name(model_dtype));
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
}

namespace {

struct Span {
  std::uintptr_t begin, end;  // [begin, end)
  std::size_t tensor;
  const char* field;
};

void check_buffer(std::vector<Span>& spans, std::size_t t, const char* field, const void* ptr,
                  std::int64_t numel, std::size_t elem_bytes, bool may_be_null) {
  if (numel == 0) return;
  if (ptr == nullptr) {
    require(may_be_null, "tensors[", t, "].", field, " is null but numel = ", numel, " > 0");
    return;
  }
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  require(begin % elem_bytes == 0, "tensors[", t, "].", field, " must be aligned to ", elem_bytes,
          " bytes (its element size), got address ", ptr);
  spans.push_back({begin, begin + static_cast<std::uintptr_t>(numel) * elem_bytes, t, field});
}

}  // namespace

void validate(const std::vector<ParamTensor>& tensors, const StepConfig& config) {
  config.validate();
  std::vector<Span> spans;
  spans.reserve(tensors.size() * 5);
  const std::size_t grad_bytes = element_size(config.grad_dtype);
  const std::size_t model_bytes = element_size(config.model_dtype);
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ParamTensor& p = tensors[t];
    require(p.numel >= 0, "tensors[", t, "].numel must be >= 0, got ", p.numel);
    require(p.group >= 0 && static_cast<std::size_t>(p.group) < config.groups.size(), "tensors[",
            t, "].group must name one of the ", config.groups.size(),
            " StepConfig.groups, got ", p.group);
    // No buffer may reach past the end of the address space.
    require(static_cast<std::uint64_t>(p.numel) <= (UINT64_MAX >> 3), "tensors[", t,
            "].numel is too large, got ", p.numel);
    check_buffer(spans, t, "master", p.master, p.numel, sizeof(float), false);
    check_buffer(spans, t, "grad", p.grad, p.numel, grad_bytes, false);
    check_buffer(spans, t, "exp_avg", p.exp_avg, p.numel, sizeof(float), false);
    check_buffer(spans, t, "exp_avg_sq", p.exp_avg_sq, p.numel, sizeof(float), false);
    check_buffer(spans, t, "model", p.model, p.numel, model_bytes, true);
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

const char* outcome_name(Outcome outcome) {
  switch (outcome) {
    case Outcome::applied: return "applied";
    case Outcome::skipped_overflow: return "skipped_overflow";
    case Outcome::skipped_spike: return "skipped_spike";
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
  require(s.step >= 0 && s.attempts >= s.step, "OptimizerState.step must be in [0, attempts = ",
          s.attempts, "], got ", s.step);
  require(s.spike.seen >= 0 && s.spike.spikes >= 0 && s.spike.consecutive >= 0,
          "SpikeState counters (seen, spikes, consecutive) must be >= 0");
  require(finite(s.spike.mean) && finite(s.spike.var) && s.spike.var >= 0.0,
          "SpikeState.mean and var must be finite and var >= 0, got ", s.spike.mean, ", ",
          s.spike.var);
}

}  // namespace halfstep
