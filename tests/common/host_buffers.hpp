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

/// Owns the five buffers of one parameter tensor on the host.
struct HostTensor {
  std::vector<float> master, exp_avg, exp_avg_sq;
  std::vector<std::uint16_t> grad, model;
  std::int32_t group = 0;
  bool with_model = true;

  halfstep::ParamTensor view() {
    halfstep::ParamTensor p;
    p.master = master.data();
    p.grad = grad.data();
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
           same(exp_avg_sq, o.exp_avg_sq) && same(grad, o.grad) && same(model, o.model);
  }
};

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
  t.master.resize(un);
  t.exp_avg.resize(un);
  t.exp_avg_sq.resize(un);
  t.grad.resize(un);
  t.model.resize(un);
  for (std::size_t i = 0; i < un; ++i) {
    t.master[i] = w(rng);
    t.exp_avg[i] = static_cast<float>(g(rng) * 0.1);
    const double earlier = g(rng);
    t.exp_avg_sq[i] = static_cast<float>(earlier * earlier * 1e-3);
    t.grad[i] = halfstep::to_bits16(grad_dtype, g(rng) * scale);
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
  for (auto& x : t.grad) x = halfstep::to_bits16(grad_dtype, g(rng) * scale);
}

}  // namespace halfstep_test
