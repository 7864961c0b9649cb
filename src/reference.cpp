// The CPU reference step: scalar loops in double precision, one pass to measure, one to apply.
// It states every rule of the step on its own, without the kernels' code: the GPU suite compares
// the kernels against it.
#include "halfstep/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "reference_impl.hpp"

namespace halfstep {
namespace {

constexpr double kFp32Max = static_cast<double>(std::numeric_limits<float>::max());

double grad_value(const ParamTensor& p, DType dtype, std::int64_t i) {
  return from_bits16(dtype, static_cast<const std::uint16_t*>(p.grad)[i]);
}

// A 16-bit pattern is finite unless its exponent field is all ones.
bool finite_bits16(DType dtype, std::uint16_t bits) {
  const unsigned exponent = dtype == DType::bf16 ? 0x7F80u : 0x7C00u;
  return (bits & exponent) != exponent;
}

// Why an update from the largest unscaled, clipped gradient g_max could not be finite in fp32,
// before anything is written; `t` is the applied-step counter the step would have.
SkipReason update_range(const StepConfig& config, double g_max, std::int64_t t) {
  for (const AdamWConfig& h : config.groups) {
    const double lr = h.lr;
    if (!(lr >= 0.0 && lr <= kFp32Max)) return SkipReason::invalid_learning_rate;
    if (h.decoupled_weight_decay && lr * static_cast<double>(h.weight_decay) >= 1.0) {
      return SkipReason::invalid_learning_rate;
    }
  }
  if (!(g_max <= kFp32Max)) return SkipReason::gradient_exceeds_fp32;
  for (const AdamWConfig& h : config.groups) {
    if ((1.0 - static_cast<double>(h.beta2)) * g_max * g_max > kFp32Max) {
      return SkipReason::second_moment_exceeds_fp32;
    }
    const double bc1 = h.bias_correction ? 1.0 - std::pow(static_cast<double>(h.beta1), static_cast<double>(t)) : 1.0;
    if (!std::isfinite(static_cast<float>(static_cast<double>(h.lr) / bc1))) {
      return SkipReason::step_size_exceeds_fp32;
    }
  }
  return SkipReason::none;
}

// AdamW on every element of one tensor. `coef` is clip / S: it unscales and clips at once. An
// element whose new master, moments or model copy would not be finite keeps its old values;
// returns how many did.
std::int64_t apply_tensor(const ParamTensor& p, const StepConfig& config, double coef, std::int64_t t) {
  const AdamWConfig& h = config.groups[static_cast<std::size_t>(p.group)];
  const double lr = h.lr, beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, wd = h.weight_decay;
  const double bc1 = h.bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(t)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(t)) : 1.0;
  std::int64_t held = 0;
  for (std::int64_t i = 0; i < p.numel; ++i) {
    double w = p.master[i];
    double g = grad_value(p, config.grad_dtype, i) * coef;
    if (h.decoupled_weight_decay) {
      w = w * (1.0 - lr * wd);  // decoupled decay shrinks the weight itself
    } else {
      g = g + wd * w;  // classic L2: the decay joins the gradient
    }
    const double m = beta1 * p.exp_avg[i] + (1.0 - beta1) * g;
    const double v = beta2 * p.exp_avg_sq[i] + (1.0 - beta2) * g * g;
    w = w - (lr / bc1) * m / (std::sqrt(v) / std::sqrt(bc2) + eps);
    const float new_w = static_cast<float>(w), new_m = static_cast<float>(m), new_v = static_cast<float>(v);
    // The model copy is the stored fp32 master, rounded once.
    const std::uint16_t model = p.model != nullptr ? to_bits16(config.model_dtype, new_w) : 0;
    if (!std::isfinite(new_w) || !std::isfinite(new_m) || !std::isfinite(new_v) ||
        (p.model != nullptr && !finite_bits16(config.model_dtype, model))) {
      ++held;
      continue;
    }
    p.master[i] = new_w;
    p.exp_avg[i] = new_m;
    p.exp_avg_sq[i] = new_v;
    if (p.model != nullptr) static_cast<std::uint16_t*>(p.model)[i] = model;
  }
  return held;
}

}  // namespace

namespace detail {

StepReport reference_step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                          OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor) {
  StepReport r{};
  state.attempts = count_up(state.attempts);
  r.attempt = state.attempts;
  r.scale_used = state.scaler.scale;
  r.first_nonfinite_tensor = -1;
  r.reason = SkipReason::none;
  if (nonfinite_per_tensor) nonfinite_per_tensor->assign(tensors.size(), 0);

  // Pass 1: classify every stored gradient and measure its size.
  const double S = state.scaler.scale;
  double max_abs = 0.0;
  double sum_sq = 0.0;  // of the unscaled gradient
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const ParamTensor& p = tensors[t];
    std::int64_t bad = 0;
    for (std::int64_t i = 0; i < p.numel; ++i) {
      const double g = grad_value(p, config.grad_dtype, i);
      if (!std::isfinite(g)) {
        ++bad;
        continue;
      }
      const BitClass c =
          classify_bits16(config.grad_dtype, static_cast<const std::uint16_t*>(p.grad)[i]);
      if (c == BitClass::zero) ++r.zero_count;
      if (c == BitClass::subnormal) ++r.subnormal_count;
      max_abs = std::max(max_abs, std::fabs(g));
      sum_sq += (g / S) * (g / S);
    }
    if (bad > 0 && r.first_nonfinite_tensor < 0) r.first_nonfinite_tensor = static_cast<std::int32_t>(t);
    if (nonfinite_per_tensor) (*nonfinite_per_tensor)[t] = bad;
    r.nonfinite_count += bad;
    r.numel += p.numel;
  }
  r.max_abs_scaled = static_cast<float>(max_abs);
  r.headroom_log2 =
      max_abs > 0.0
          ? static_cast<float>(std::log2(static_cast<double>(format_info(config.grad_dtype).max) / max_abs))
          : std::numeric_limits<float>::infinity();

  auto finish = [&](Outcome outcome, SkipReason reason) {
    r.outcome = outcome;
    r.reason = reason;
    r.step = state.step;
    r.scale_next = state.scaler.scale;
    return r;
  };
  if (r.nonfinite_count > 0) {  // overflow: nothing is written, the scaler backs off
    state.scaler = next_state(state.scaler, config.scaler, true);
    r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    r.clip_coef = std::numeric_limits<float>::quiet_NaN();
    return finish(Outcome::skipped_overflow, SkipReason::nonfinite_gradient);
  }

  r.grad_norm = std::sqrt(sum_sq);
  const double clip = config.max_grad_norm > 0.0f
                          ? std::min(1.0, config.max_grad_norm / (r.grad_norm + 1e-6))
                          : 1.0;
  r.clip_coef = static_cast<float>(clip);
  // Finite gradients whose update could not be finite: nothing written, nothing advanced.
  const SkipReason range = update_range(config, max_abs * (clip / S), count_up(state.step));
  if (range != SkipReason::none) return finish(Outcome::skipped_nonfinite_update, range);

  const SpikeVerdict verdict = observe_norm(state.spike, config.spike, r.grad_norm);
  state.spike = verdict.next;
  r.spike = verdict.spike;
  if (verdict.spike && config.spike.action == SpikeConfig::Action::skip) {
    return finish(Outcome::skipped_spike, SkipReason::spike);  // the scale and the step counter stay
  }

  // Pass 2: AdamW with the applied-step counter after this step.
  state.step = count_up(state.step);
  for (const ParamTensor& p : tensors) r.held_elements += apply_tensor(p, config, clip / S, state.step);
  state.scaler = next_state(state.scaler, config.scaler, false, r.headroom_log2);
  return finish(Outcome::applied, SkipReason::none);
}

}  // namespace detail

namespace reference {

StepReport step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor) {
  validate(tensors, config);
  validate_state(state, config);
  return detail::reference_step(tensors, config, state, nonfinite_per_tensor);
}

}  // namespace reference
}  // namespace halfstep
