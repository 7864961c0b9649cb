// Fuzzing helpers: typed fields from the fuzzer's bytes (zeros once they run out), small host
// models, and the step invariants both fuzz targets check.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "halfstep/formats.hpp"
#include "halfstep/step.hpp"

namespace halfstep_fuzz {

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  template <class T>
  T take() {
    unsigned char bytes[sizeof(T)] = {};
    for (std::size_t i = 0; i < sizeof(T) && pos_ < size_; ++i) bytes[i] = data_[pos_++];
    T v;
    std::memcpy(&v, bytes, sizeof(T));
    return v;
  }
  bool flag() { return (take<std::uint8_t>() & 1u) != 0; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

/// Stops the fuzzer with a message; libFuzzer saves the input that did it.
[[noreturn]] inline void violated(const char* what) {
  std::fprintf(stderr, "invariant violated: %s\n", what);
  std::abort();
}

/// A few small tensors in host memory, with gradients of the format the step reads (16 or 32 bits).
struct Model {
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<std::uint8_t>> grad;  // each element's bits, little-endian
  std::vector<std::vector<std::uint16_t>> model;
  std::vector<std::int32_t> group;
  std::vector<bool> with_model;
  std::size_t grad_bytes = 2;

  explicit Model(halfstep::DType grad_dtype = halfstep::DType::f16)
      : grad_bytes(grad_dtype == halfstep::DType::f32 ? 4 : 2) {}

  void add(std::size_t n, std::int32_t g, bool copy) {
    master.emplace_back(n, 0.5f);
    m.emplace_back(n, 0.0f);
    v.emplace_back(n, 0.0f);
    grad.emplace_back(n * grad_bytes, std::uint8_t{0});
    for (std::size_t i = 0; i < n; ++i) set_grad(grad.size() - 1, i, 0x3C00u);
    model.emplace_back(n, std::uint16_t{0});
    group.push_back(g);
    with_model.push_back(copy);
  }
  /// Element i of tensor t's gradient: the low 16 bits of `bits` for a 16-bit format, all 32
  /// for fp32.
  void set_grad(std::size_t t, std::size_t i, std::uint32_t bits) {
    for (std::size_t b = 0; b < grad_bytes; ++b) grad[t][i * grad_bytes + b] = static_cast<std::uint8_t>(bits >> (8 * b));
  }
  std::vector<halfstep::ParamTensor> views() {
    std::vector<halfstep::ParamTensor> out;
    for (std::size_t t = 0; t < master.size(); ++t) {
      out.push_back({master[t].data(), grad[t].data(), m[t].data(), v[t].data(),
                     with_model[t] ? model[t].data() : nullptr,
                     static_cast<std::int64_t>(master[t].size()), group[t]});
    }
    return out;
  }
};

/// A step that was not applied wrote nothing; an applied one wrote only finite values.
inline void check_step(const halfstep::StepReport& r, const Model& before, const Model& after,
                       halfstep::DType model_dtype) {
  using namespace halfstep;
  for (std::size_t t = 0; t < after.master.size(); ++t) {
    if (after.grad[t] != before.grad[t]) violated("a step wrote a gradient");
    for (std::size_t i = 0; i < after.master[t].size(); ++i) {
      const bool p = std::memcmp(&after.master[t][i], &before.master[t][i], 4) != 0;
      const bool m = std::memcmp(&after.m[t][i], &before.m[t][i], 4) != 0;
      const bool v = std::memcmp(&after.v[t][i], &before.v[t][i], 4) != 0;
      const bool c = after.model[t][i] != before.model[t][i];
      if (!(p || m || v || c)) continue;
      if (r.outcome != Outcome::applied) violated("a step that was not applied wrote a buffer");
      const BitClass k = classify_bits16(model_dtype, after.model[t][i]);
      if ((p && !std::isfinite(after.master[t][i])) || (m && !std::isfinite(after.m[t][i])) ||
          (v && !std::isfinite(after.v[t][i])) || (c && (k == BitClass::infinite || k == BitClass::nan))) {
        violated("an applied step wrote a value that is not finite");
      }
    }
  }
}

}  // namespace halfstep_fuzz
