#include "model.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>

namespace train {

std::int64_t Dims::parameters() const {
  std::int64_t n = 0;
  for (const TensorShape& t : tensor_shapes(*this)) n += t.numel;
  return n;
}

std::vector<TensorShape> tensor_shapes(const Dims& dims) {
  std::vector<TensorShape> shapes;
  for (int l = 0; l < dims.layers(); ++l) {
    shapes.push_back({static_cast<std::int64_t>(dims.fan_out(l)) * dims.fan_in(l), 0, dims.fan_in(l)});
    shapes.push_back({dims.fan_out(l), 1, 0});
  }
  return shapes;
}

std::vector<std::vector<float>> teacher_masters(const Dims& dims, std::uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x5DEECE66Dull);
  const int k = teacher_width(dims);
  std::vector<std::vector<float>> w;
  for (int l = 0; l < dims.layers(); ++l) {
    const int in = dims.fan_in(l), out = dims.fan_out(l);
    const int live_in = l == 0 ? in : k, live_out = l == dims.layers() - 1 ? out : k;
    std::normal_distribution<double> normal(0.0, std::sqrt((l == dims.layers() - 1 ? 1.0 : 2.0) / live_in));
    std::vector<float> weight(static_cast<std::size_t>(out) * static_cast<std::size_t>(in), 0.0f);
    for (int o = 0; o < live_out; ++o) {
      for (int i = 0; i < live_in; ++i) {
        weight[static_cast<std::size_t>(o) * static_cast<std::size_t>(in) + static_cast<std::size_t>(i)] =
            static_cast<float>(normal(rng));
      }
    }
    w.push_back(std::move(weight));
    w.emplace_back(static_cast<std::size_t>(out), 0.0f);
  }
  return w;
}

std::vector<float> teacher_forward(const Dims& dims, const std::vector<std::vector<float>>& w,
                                   const float* x) {
  const int k = teacher_width(dims);
  std::vector<double> a(x, x + dims.d_in), next;
  for (int l = 0; l < dims.layers(); ++l) {
    const int in = dims.fan_in(l);
    const bool last = l == dims.layers() - 1;
    const int live_in = l == 0 ? in : k, live_out = last ? dims.fan_out(l) : k;
    const std::vector<float>& weight = w[static_cast<std::size_t>(2 * l)];
    const std::vector<float>& bias = w[static_cast<std::size_t>(2 * l + 1)];
    next.assign(static_cast<std::size_t>(live_out), 0.0);
    for (int o = 0; o < live_out; ++o) {
      double z = bias[static_cast<std::size_t>(o)];
      const float* row = &weight[static_cast<std::size_t>(o) * static_cast<std::size_t>(in)];
      for (int i = 0; i < live_in; ++i) z += static_cast<double>(row[i]) * a[static_cast<std::size_t>(i)];
      next[static_cast<std::size_t>(o)] = last ? z : std::max(z, 0.0);
    }
    a.swap(next);
  }
  return std::vector<float>(a.begin(), a.end());
}

Dataset make_dataset(const Dims& dims, const std::vector<std::vector<float>>& teacher,
                     std::uint64_t seed, halfstep::DType precision) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Dataset d;
  const auto n = static_cast<std::size_t>(dims.samples);
  d.x.resize(n * static_cast<std::size_t>(dims.d_in));
  d.y.resize(n * static_cast<std::size_t>(dims.d_out));
  for (std::size_t s = 0; s < n; ++s) {
    float* x = &d.x[s * static_cast<std::size_t>(dims.d_in)];
    for (int i = 0; i < dims.d_in; ++i) {
      x[i] = static_cast<float>(halfstep::from_bits16(precision, halfstep::to_bits16(precision, normal(rng))));
    }
    const std::vector<float> y = teacher_forward(dims, teacher, x);
    std::copy(y.begin(), y.end(), &d.y[s * static_cast<std::size_t>(dims.d_out)]);
  }
  return d;
}

std::vector<std::vector<float>> initial_masters(const Dims& dims, std::uint64_t seed) {
  std::mt19937_64 rng(seed ^ 0x9E3779B97F4A7C15ull);
  std::vector<std::vector<float>> masters;
  for (int l = 0; l < dims.layers(); ++l) {
    const double sd = std::sqrt((l == dims.layers() - 1 ? 1.0 : 2.0) / dims.fan_in(l));
    std::normal_distribution<double> normal(0.0, sd);
    std::vector<float> w(static_cast<std::size_t>(dims.fan_out(l)) * static_cast<std::size_t>(dims.fan_in(l)));
    for (float& x : w) x = static_cast<float>(normal(rng));
    masters.push_back(std::move(w));
    masters.emplace_back(static_cast<std::size_t>(dims.fan_out(l)), 0.0f);
  }
  return masters;
}

void check_engine_formats(const halfstep::StepConfig& config) {
  if (config.grad_dtype != config.model_dtype || config.model_dtype == halfstep::DType::f32) {
    throw std::invalid_argument(std::string("halfstep-train's engines hold gradients and model copies in one 16-bit format; ") +
                                "grad_dtype is " + halfstep::dtype_name(config.grad_dtype) + ", model_dtype " +
                                halfstep::dtype_name(config.model_dtype));
  }
}

InitialState initial_state(const halfstep::StepConfig& config, const std::vector<float>& master) {
  const std::size_t bytes = slot_bytes(config, halfstep::Slot::master);
  const bool bf16 = config.model_dtype == halfstep::DType::bf16;
  InitialState s;
  s.master.resize(master.size() * bytes);
  s.model.resize(master.size());
  for (std::size_t i = 0; i < master.size(); ++i) {
    std::uint32_t bits = 0;
    std::memcpy(&bits, &master[i], 4);
    if (bf16) bits = halfstep::canonical_master(bits);
    float value = 0.0f;
    std::memcpy(&value, &bits, 4);
    s.model[i] = halfstep::to_bits16(config.model_dtype, value);
    if (config.state.master == halfstep::MasterFormat::f32) {
      std::memcpy(&s.master[i * 4], &bits, 4);
    } else if (config.state.master == halfstep::MasterFormat::bf16_remainder) {
      std::int16_t rest = 0;
      std::uint16_t model = 0;
      if (!halfstep::split_master(bits, model, rest) || model != s.model[i]) {
        throw std::runtime_error("initial_state: the master " + std::to_string(value) + " has no bf16 remainder");
      }
      std::memcpy(&s.master[i * 2], &rest, 2);
    }
  }
  return s;
}

}  // namespace train
