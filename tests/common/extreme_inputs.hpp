// Test helper: seeded random steps at the edges of what fp16, bf16 and fp32 can hold — huge and
// tiny gradients, extreme learning rates, betas, eps and weight decay, masters and moments near
// fp32's maximum, masters past fp16's — for the invariant that an applied step writes only finite
// values. Shared by the host test (reference backend) and the GPU suite (the kernels).
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "halfstep/step.hpp"
#include "host_buffers.hpp"

namespace halfstep_test {

/// One extreme case: the starting buffers, the configuration, and a learning rate to write
/// through device_lr before the steps (NaN-free `valid_lr` when none).
struct ExtremeCase {
  HostModel model;
  halfstep::StepConfig config;
  bool write_lr = false;
  float device_lr = 0.0f;  ///< written into group 0 through device_lr when write_lr
  std::string what;        ///< a description, for CAPTURE
};

template <class T>
T pick(std::mt19937_64& rng, std::initializer_list<T> values) {
  const auto* v = values.begin();
  return v[rng() % values.size()];
}

/// Fills the gradients of `m` with a mix of ordinary, huge, tiny and zero values in `dtype`
/// (finite unless `allow_nonfinite`).
inline void extreme_grads(std::mt19937_64& rng, HostModel& m, halfstep::DType dtype, float scale,
                          bool allow_nonfinite) {
  using namespace halfstep;
  const double fmax = format_info(dtype).max;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (HostTensor& t : m.tensors) {
    for (auto& g : t.grad) {
      const double sign = rng() % 2 ? 1.0 : -1.0;
      switch (rng() % 8) {
        case 0: g = to_bits16(dtype, sign * fmax); break;                       // the format's max
        case 1: g = to_bits16(dtype, sign * fmax * std::pow(2.0, -20 * u(rng))); break;  // huge
        case 2: g = to_bits16(dtype, sign * format_info(dtype).min_subnormal); break;
        case 3: g = to_bits16(dtype, 0.0 * sign); break;
        case 4:
          if (allow_nonfinite && u(rng) < 0.05) {
            g = to_bits16(dtype, HUGE_VAL);
            break;
          }
          [[fallthrough]];
        default: g = to_bits16(dtype, sign * std::min(fmax, 0.01 * scale * std::exp(4 * (u(rng) - 0.5))));
      }
    }
  }
}

/// A seeded extreme case.
inline ExtremeCase extreme_case(std::uint64_t seed) {
  using namespace halfstep;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  ExtremeCase x;
  StepConfig& c = x.config;
  c.grad_dtype = rng() % 2 ? DType::bf16 : DType::f16;
  c.model_dtype = rng() % 2 ? DType::bf16 : DType::f16;
  const float scale = pick(rng, {0x1p-126f, 0x1p-20f, 1.0f, 65536.0f, 0x1p24f, 0x1p100f});
  c.scaler = ScalerConfig::constant(scale);
  c.max_grad_norm = pick(rng, {0.0f, 0.0f, 1e-30f, 1.0f});
  AdamWConfig& h = c.groups[0];
  h.lr = pick(rng, {1e-8f, 1e-3f, 1.0f, 1e10f, 1e30f, 4e31f, 1e37f});
  h.beta1 = pick(rng, {0.0f, 0.9f, 0.999999f});
  h.beta2 = pick(rng, {0.0f, 0.5f, 0.999f, 0.9999999f});
  h.eps = pick(rng, {0x1p-126f, 1e-8f, 1e10f});
  h.decoupled_weight_decay = rng() % 2 == 0;
  h.bias_correction = rng() % 4 != 0;
  // Decoupled decay needs lr·wd < 1 to be a valid config; classic L2 may be huge.
  const float wd = pick(rng, {0.0f, 0.01f, 0.5f, 1e10f});
  h.weight_decay = h.decoupled_weight_decay ? (static_cast<double>(wd) * h.lr < 0.9 ? wd : 0.0f) : wd;
  const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % 40);
  x.model = random_model(rng(), {n, 9, 1}, 1.0f, c.grad_dtype, c.model_dtype);
  x.model.tensors[1].group = 1;
  x.model.tensors[2].with_model = false;
  for (HostTensor& t : x.model.tensors) {
    for (std::size_t i = 0; i < t.master.size(); ++i) {
      const double sign = rng() % 2 ? 1.0 : -1.0;
      switch (rng() % 6) {
        case 0: t.master[i] = static_cast<float>(sign * 3.0e38); break;     // near fp32's max
        case 1: t.master[i] = static_cast<float>(sign * 70000.0); break;    // past fp16's max
        case 2: t.exp_avg[i] = static_cast<float>(sign * 3.0e38); break;
        case 3: t.exp_avg_sq[i] = 3.0e38f; break;
        default: break;
      }
      t.model[i] = to_bits16(c.model_dtype, t.master[i]);
    }
  }
  extreme_grads(rng, x.model, c.grad_dtype, scale, true);
  if (rng() % 5 == 0) {  // a learning rate written on the device: invalid ones must skip the step
    x.write_lr = true;
    x.device_lr = pick(rng, {std::numeric_limits<float>::quiet_NaN(), -1.0f,
                             std::numeric_limits<float>::infinity(), 3e38f, 1e-3f});
  }
  c.groups.push_back(AdamWConfig{});  // a quiet second group (after the last use of `h`)
  x.what = "seed " + std::to_string(seed) + ", grad " + dtype_name(c.grad_dtype) + ", model " +
           dtype_name(c.model_dtype) + ", S " + std::to_string(scale) + ", lr " + std::to_string(c.groups[0].lr) +
           ", beta1 " + std::to_string(c.groups[0].beta1) + ", beta2 " + std::to_string(c.groups[0].beta2) +
           ", eps " + std::to_string(c.groups[0].eps) + ", wd " + std::to_string(c.groups[0].weight_decay) +
           (c.groups[0].decoupled_weight_decay ? " decoupled" : " L2") + ", clip " + std::to_string(c.max_grad_norm);
  return x;
}

/// The invariant, on one step's before and after: a step that was not applied changed nothing;
/// an applied one wrote only finite values — every element of every buffer is either as it was
/// (held back, or kept by the caller's own non-finite start) or finite.
inline void require_finite_or_untouched(const halfstep::StepReport& r, const HostModel& before,
                                        const HostModel& after, halfstep::DType model_dtype) {
  using namespace halfstep;
  auto same = [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  for (std::size_t t = 0; t < after.tensors.size(); ++t) {
    const HostTensor& a = after.tensors[t];
    const HostTensor& b = before.tensors[t];
    CAPTURE(t, outcome_name(r.outcome), skip_reason_name(r.reason), r.held_elements);
    REQUIRE(a.grad == b.grad);
    if (r.outcome != Outcome::applied) {
      REQUIRE(a == b);
      continue;
    }
    for (std::size_t i = 0; i < a.master.size(); ++i) {
      const BitClass mc = classify_bits16(model_dtype, a.model[i]);
      const bool model_written = a.with_model && a.model[i] != b.model[i];
      const bool bad = (!same(a.master[i], b.master[i]) && !std::isfinite(a.master[i])) ||
                       (!same(a.exp_avg[i], b.exp_avg[i]) && !std::isfinite(a.exp_avg[i])) ||
                       (!same(a.exp_avg_sq[i], b.exp_avg_sq[i]) && !std::isfinite(a.exp_avg_sq[i])) ||
                       (model_written && (mc == BitClass::infinite || mc == BitClass::nan));
      if (bad) {
        CAPTURE(i, b.master[i], a.master[i], a.exp_avg[i], a.exp_avg_sq[i], a.model[i]);
        FAIL("an applied step wrote a value that is not finite");
      }
    }
  }
}

}  // namespace halfstep_test
