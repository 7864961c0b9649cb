// Test helper: host-side parameter tensors with owned buffers and seeded random contents.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "halfstep/formats.hpp"
#include "halfstep/step.hpp"

namespace halfstep_test {

/// Owns the five buffers of one parameter tensor on the host. 16-bit gradients live in `grad`,
/// fp32 gradients (grad_dtype f32) in `grad32`, as their bit patterns.
struct HostTensor {
  std::vector<float> master, exp_avg, exp_avg_sq;
  std::vector<std::uint16_t> grad, model;
  std::vector<std::uint32_t> grad32;
  halfstep::DType grad_dtype = halfstep::DType::f16;
  std::int32_t group = 0;
  bool with_model = true;

  halfstep::ParamTensor view() {
    halfstep::ParamTensor p;
    p.master = master.data();
    p.grad = grad_dtype == halfstep::DType::f32 ? static_cast<const void*>(grad32.data())
                                                : static_cast<const void*>(grad.data());
    p.exp_avg = exp_avg.data();
    p.exp_avg_sq = exp_avg_sq.data();
    p.model = with_model ? model.data() : nullptr;
    p.numel = static_cast<std::int64_t>(master.size());
    p.group = group;
    return p;
  }
  bool operator==(const HostTensor& o) const {  // bitwise equality of every buffer
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() &&
             (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
    };
    return same(master, o.master) && same(exp_avg, o.exp_avg) &&
           same(exp_avg_sq, o.exp_avg_sq) && same(grad, o.grad) && same(grad32, o.grad32) &&
           same(model, o.model);
  }
  /// Elements.
  std::size_t size() const { return master.size(); }
  /// Gradient i's value.
  double grad_value(std::size_t i) const {
    if (grad_dtype == halfstep::DType::f32) {
      float x;
      std::memcpy(&x, &grad32[i], sizeof x);
      return x;
    }
    return halfstep::from_bits16(grad_dtype, grad[i]);
  }
  /// Sets gradient i to `value` rounded to the gradient format (to nearest even).
  void set_grad(std::size_t i, double value) {
    if (grad_dtype == halfstep::DType::f32) {
      const float x = static_cast<float>(value);
      std::memcpy(&grad32[i], &x, sizeof x);
    } else {
      grad[i] = halfstep::to_bits16(grad_dtype, value);
    }
  }
  /// Sets gradient i to a bit pattern of the gradient format (16 or 32 bits).
  void set_grad_bits(std::size_t i, std::uint32_t bits) {
    if (grad_dtype == halfstep::DType::f32) {
      grad32[i] = bits;
    } else {
      grad[i] = static_cast<std::uint16_t>(bits);
    }
  }
  /// Gradient i's bit pattern.
  std::uint32_t grad_bits(std::size_t i) const {
    return grad_dtype == halfstep::DType::f32 ? grad32[i] : grad[i];
  }
};

/// Patterns of special values in a gradient format: +inf, a quiet NaN, a negative signalling NaN,
/// and the largest finite value.
struct SpecialBits {
  std::uint32_t inf, quiet_nan, signalling_nan, max_finite;
};
inline SpecialBits special_bits(halfstep::DType dtype) {
  switch (dtype) {
    case halfstep::DType::bf16: return {0x7F80u, 0x7FC0u, 0xFF81u, 0x7F7Fu};
    case halfstep::DType::f32: return {0x7F800000u, 0x7FC00000u, 0xFF800001u, 0x7F7FFFFFu};
    case halfstep::DType::f16:
    default: return {0x7C00u, 0x7E00u, 0xFC01u, 0x7BFFu};
  }
}

/// A set of tensors plus the ParamTensor list that points into them.
struct HostModel {
  std::vector<HostTensor> tensors;
  std::vector<halfstep::ParamTensor> views() {
    std::vector<halfstep::ParamTensor> v;
    for (auto& t : tensors) v.push_back(t.view());
    return v;
  }
};

/// Random master weights in [-1, 1], moments from a few earlier steps, and gradients
/// g·scale stored in `grad_dtype`, g drawn from N(0, sigma²).
inline HostTensor random_tensor(std::mt19937_64& rng, std::int64_t n, halfstep::DType grad_dtype,
                                halfstep::DType model_dtype, float scale, float sigma = 1e-2f) {
  std::uniform_real_distribution<float> w(-1.0f, 1.0f);
  std::normal_distribution<double> g(0.0, sigma);
  HostTensor t;
  const auto un = static_cast<std::size_t>(n);
  t.grad_dtype = grad_dtype;
  t.master.resize(un);
  t.exp_avg.resize(un);
  t.exp_avg_sq.resize(un);
  (grad_dtype == halfstep::DType::f32 ? t.grad32.resize(un) : t.grad.resize(un));
  t.model.resize(un);
  for (std::size_t i = 0; i < un; ++i) {
    t.master[i] = w(rng);
    t.exp_avg[i] = static_cast<float>(g(rng) * 0.1);
    const double earlier = g(rng);
    t.exp_avg_sq[i] = static_cast<float>(earlier * earlier * 1e-3);
    t.set_grad(i, g(rng) * scale);
    t.model[i] = halfstep::to_bits16(model_dtype, t.master[i]);
  }
  return t;
}

/// One random_tensor per size, from one seeded generator.
inline HostModel random_model(std::uint64_t seed, const std::vector<std::int64_t>& sizes, float scale,
                              halfstep::DType grad = halfstep::DType::f16,
                              halfstep::DType model = halfstep::DType::f16, float sigma = 1e-2f) {
  std::mt19937_64 rng(seed);
  HostModel m;
  for (std::int64_t n : sizes) m.tensors.push_back(random_tensor(rng, n, grad, model, scale, sigma));
  return m;
}

/// Fills every model copy with a NaN pattern, so a test can see that a step wrote each element.
inline void poison_model_copies(HostModel& m) {
  for (auto& t : m.tensors) std::fill(t.model.begin(), t.model.end(), std::uint16_t{0x7FFF});
}

/// random_model with poisoned model copies.
inline HostModel poisoned_model(std::uint64_t seed, const std::vector<std::int64_t>& sizes,
                                float scale, halfstep::DType grad, halfstep::DType model) {
  HostModel m = random_model(seed, sizes, scale, grad, model);
  poison_model_copies(m);
  return m;
}

/// Writes fresh gradients N(0, sigma²)·scale into `t`.
inline void refill_grads(std::mt19937_64& rng, HostTensor& t, halfstep::DType grad_dtype,
                         float scale, float sigma = 1e-2f) {
  std::normal_distribution<double> g(0.0, sigma);
  t.grad_dtype = grad_dtype;
  (grad_dtype == halfstep::DType::f32 ? t.grad32.resize(t.size()) : t.grad.resize(t.size()));
  for (std::size_t i = 0; i < t.size(); ++i) t.set_grad(i, g(rng) * scale);
}

}  // namespace halfstep_test
