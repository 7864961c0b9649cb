// The CPU reference step: scalar loops in double precision, one pass to measure, one to apply.
#include "halfstep/reference.hpp"

#include <cmath>
#include <limits>

namespace halfstep::reference {
namespace {

double grad_value(const ParamTensor& p, DType dtype, std::int64_t i) {
  return from_bits16(dtype, static_cast<const std::uint16_t*>(p.grad)[i]);
}

// AdamW on every element of one tensor. `coef` is clip / S: it unscales and clips at once.
void apply_tensor(const ParamTensor& p, const StepConfig& config, double coef, std::int64_t t) {
  const AdamWConfig& h = config.groups[static_cast<std::size_t>(p.group)];
  const double lr = h.lr, beta1 = h.beta1, beta2 = h.beta2, eps = h.eps, wd = h.weight_decay;
  const double bc1 = h.bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(t)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(t)) : 1.0;
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
    p.master[i] = static_cast<float>(w);
    p.exp_avg[i] = static_cast<float>(m);
    p.exp_avg_sq[i] = static_cast<float>(v);
    if (p.model != nullptr) {  // the model copy is the stored fp32 master, rounded once
      static_cast<std::uint16_t*>(p.model)[i] =
          to_bits16(config.model_dtype, static_cast<double>(p.master[i]));
    }
  }
}

}  // namespace

StepReport step(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                OptimizerState& state, std::vector<std::int64_t>* nonfinite_per_tensor) {
  validate(tensors, config);
  validate_state(state, config);

  StepReport r{};
  r.attempt = state.attempts + 1;
  r.scale_used = state.scaler.scale;
  r.first_nonfinite_tensor = -1;
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

  state.attempts += 1;
  if (r.nonfinite_count > 0) {  // overflow: nothing is written, the scaler backs off
    state.scaler = next_state(state.scaler, config.scaler, true);
    r.outcome = Outcome::skipped_overflow;
    r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    r.clip_coef = std::numeric_limits<float>::quiet_NaN();
    r.step = state.step;
    r.scale_next = state.scaler.scale;
    return r;
  }

  r.grad_norm = std::sqrt(sum_sq);
  const SpikeVerdict verdict = observe_norm(state.spike, config.spike, r.grad_norm);
  state.spike = verdict.next;
  r.spike = verdict.spike;
  const double clip = config.max_grad_norm > 0.0f
                          ? std::min(1.0, config.max_grad_norm / (r.grad_norm + 1e-6))
                          : 1.0;
  r.clip_coef = static_cast<float>(clip);
  if (verdict.spike && config.spike.action == SpikeConfig::Action::skip) {
    r.outcome = Outcome::skipped_spike;  // the scale and the step counter stay
    r.step = state.step;
    r.scale_next = state.scaler.scale;
    return r;
  }

  // Pass 2: AdamW with the applied-step counter after this step.
  state.step += 1;
  for (const ParamTensor& p : tensors) apply_tensor(p, config, clip / S, state.step);
  state.scaler = next_state(state.scaler, config.scaler, false, r.headroom_log2);
  r.outcome = Outcome::applied;
  r.step = state.step;
  r.scale_next = state.scaler.scale;
  return r;
}

}  // namespace halfstep::reference
