// The exact norm on the device: pass 1's split part sums and limbs give the reference's Σg² bit
// for bit, whatever the values (the extremes of each format, subnormals, bf16 and fp32 values
// outside the window) and however the same gradients are laid out in tensors and chunks.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cmath>
#include <random>

#include "gpu_support.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

// The model copy's format for gradients in `dtype`.
DType model_for(DType dtype) { return dtype == DType::f32 ? DType::bf16 : dtype; }

// `values` (bit patterns of `dtype`) laid out as tensors of the given sizes (their sum is
// values.size()).
HostModel layout(const std::vector<std::uint32_t>& values, const std::vector<std::int64_t>& sizes, DType dtype) {
  HostModel m = random_model(7, sizes, 1.0f, dtype, model_for(dtype));
  std::size_t at = 0;
  for (auto& t : m.tensors) {
    for (std::size_t i = 0; i < t.size(); ++i) t.set_grad_bits(i, values[at++]);
  }
  REQUIRE(at == values.size());
  return m;
}

// A random pattern of `dtype`: its largest finite value, its smallest subnormal, a subnormal, zero
// or anything finite, with a random sign.
std::uint32_t adversarial_bits(std::mt19937_64& rng, DType dtype) {
  const SpecialBits sp = special_bits(dtype);
  const std::uint32_t sign = dtype == DType::f32 ? 0x80000000u : 0x8000u;
  const std::uint32_t subnormal_mask = dtype == DType::f32 ? 0x7FFFFFu : dtype == DType::bf16 ? 0x7Fu : 0x3FFu;
  const int kind = static_cast<int>(rng() % 6);
  const std::uint32_t mag = kind == 0   ? sp.max_finite
                            : kind == 1 ? 1u
                            : kind == 2 ? static_cast<std::uint32_t>(rng()) & subnormal_mask
                            : kind == 3 ? 0u
                                        : static_cast<std::uint32_t>(rng() % (sp.max_finite + 1ull));
  return mag | ((rng() & 1) != 0 ? sign : 0u);
}

// Random sizes summing to n, some of them zero.
std::vector<std::int64_t> random_sizes(std::mt19937_64& rng, std::int64_t n) {
  std::vector<std::int64_t> sizes;
  while (n > 0) {
    const std::int64_t s = std::min<std::int64_t>(n, static_cast<std::int64_t>(rng() % 9000));
    sizes.push_back(s);
    n -= s;
  }
  return sizes;
}

// The device's report of one step on `m` (with `misalign`: every buffer off 16-byte alignment, so
// pass 1 takes its scalar path), and the reference's.
std::pair<StepReport, StepReport> both(const HostModel& m, const StepConfig& c, bool misalign) {
  DeviceModel dev(m, misalign);
  FusedAdamW opt(dev.views(), c);
  opt.step();
  HostModel ref = m;
  OptimizerState state = OptimizerState::initial(c);
  return {opt.last_report(), reference::step(ref.views(), c, state)};
}

}  // namespace

TEST_CASE("gpu norm equals the reference bit for bit on adversarial gradients in any layout", "[gpu][exact_norm]") {
  for (const DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    std::mt19937_64 rng(81 + static_cast<int>(dtype));
    const std::int64_t n = 40000;  // two chunks and a tail
    std::vector<std::uint32_t> values(static_cast<std::size_t>(n));
    for (auto& v : values) v = adversarial_bits(rng, dtype);
    StepConfig c = config_for(dtype, model_for(dtype), 1.0f, 0.0f);
    c.groups[0].lr = 0.0f;  // the values are extreme; only the measurement matters here
    double first = 0.0;
    for (int trial = 0; trial < 4; ++trial) {
      const std::vector<std::int64_t> sizes = trial == 0 ? std::vector<std::int64_t>{n} : random_sizes(rng, n);
      const HostModel m = layout(values, sizes, dtype);
      const auto [got, want] = both(m, c, trial == 3);
      CAPTURE(dtype_name(dtype), trial, sizes.size());
      REQUIRE(same_bits(got.grad_norm, want.grad_norm));
      REQUIRE(got.subnormal_count == want.subnormal_count);
      REQUIRE(got.zero_count == want.zero_count);
      REQUIRE(got.max_abs_scaled == want.max_abs_scaled);
      if (trial == 0) first = got.grad_norm;
      REQUIRE(same_bits(got.grad_norm, first));  // the layout changes no bit
    }
  }
}

TEST_CASE("gpu squares at the split points and values outside the window sum exactly", "[gpu][exact_norm]") {
  // fp16: the largest values (squares near 2^32, the hi part's bound), values whose squares are
  // just above and below the split point 2^-8 and half-way between its multiples, the smallest
  // subnormal; many of each, so that every thread's sums reach their bounds.
  std::vector<std::uint32_t> f16;
  for (std::uint16_t b : {std::uint16_t{0x7BFF}, std::uint16_t{0x7BFE}, std::uint16_t{0x2C00}, std::uint16_t{0x2BFF},
                          std::uint16_t{0x2C01}, std::uint16_t{0x2E00}, std::uint16_t{0x0001}, std::uint16_t{0x03FF}}) {
    for (int i = 0; i < 3000; ++i) f16.push_back(b);
  }
  StepConfig c = config_for(DType::f16, DType::f16, 1.0f, 0.0f);
  c.groups[0].lr = 0.0f;
  auto [got, want] = both(layout(f16, {static_cast<std::int64_t>(f16.size())}, DType::f16), c, false);
  CHECK(same_bits(got.grad_norm, want.grad_norm));

  // bf16 and fp32: the window follows the last step's largest value. Runs whose values jump far
  // above and below it (and into subnormals) take the checked path and stay exact; values at the
  // window's top and bottom sum in it.
  for (const DType dtype : {DType::bf16, DType::f32}) {
    std::mt19937_64 rng(83 + static_cast<int>(dtype));
    StepConfig b = config_for(dtype, model_for(dtype), 1.0f, 0.0f);
    b.groups[0].lr = 0.0f;
    HostModel m = random_model(84, {5000, 30000}, 1.0f, dtype, model_for(dtype));
    DeviceModel dev(m);
    FusedAdamW opt(dev.views(), b);
    OptimizerState state = OptimizerState::initial(b);
    const bool f32 = dtype == DType::f32;
    const int fraction_bits = f32 ? 23 : 7;
    for (int step = 0; step < 8; ++step) {
      for (auto& t : m.tensors) {
        for (std::size_t i = 0; i < t.size(); ++i) {
          // Steps 0, 2, 4: values near 1; 1, 3, 5: exponents anywhere from subnormal to 2^120;
          // 6: the largest values; 7: values within a few binades of the last window's edges.
          int e = step % 2 == 0 ? 127 - static_cast<int>(rng() % 20) : static_cast<int>(rng() % 248);
          if (step == 6) e = 254 - static_cast<int>(rng() % 2);
          if (step == 7) e = (rng() & 1) ? 254 - 8 + static_cast<int>(rng() % 12) - 6
                                         : 254 - (f32 ? 38 : 31) + static_cast<int>(rng() % 6) - 3;
          const std::uint64_t fraction = rng() & ((std::uint64_t{1} << fraction_bits) - 1);
          t.set_grad_bits(i, static_cast<std::uint32_t>((static_cast<std::uint64_t>(e) << fraction_bits) | fraction |
                                                        ((rng() & 1) << (f32 ? 31 : 15))));
        }
      }
      dev.upload_grads(m);
      opt.step();
      const StepReport r = opt.last_report();
      HostModel ref = m;
      const StepReport w = reference::step(ref.views(), b, state);
      CAPTURE(dtype_name(dtype), step);
      REQUIRE(same_bits(r.grad_norm, w.grad_norm));
      REQUIRE(r.subnormal_count == w.subnormal_count);
      REQUIRE(r.max_abs_scaled == w.max_abs_scaled);
    }
  }
}

TEST_CASE("gpu a tensor outside the norm adds only its inf/NaN and maximum", "[gpu][exact_norm][distributed]") {
  HostModel m = random_model(85, {3000, 40000, 17}, 1024.0f);
  DeviceModel dev(m);
  std::vector<ParamTensor> views = dev.views();
  views[1].duplicate = true;
  const StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 1.0f);
  FusedAdamW opt(views, c);
  opt.step();
  const StepReport got = opt.last_report();
  HostModel ref = m;
  std::vector<ParamTensor> ref_views = ref.views();
  ref_views[1].duplicate = true;
  OptimizerState state = OptimizerState::initial(c);
  const StepReport want = reference::step(ref_views, c, state);
  check_step(got, want, m, dev.download(m), ref, c, state.step);
  CHECK(got.numel == 3017);
  // The norm without the excluded tensor: the reference over the other two alone.
  HostModel two = m;
  two.tensors.erase(two.tensors.begin() + 1);
  OptimizerState s2 = OptimizerState::initial(c);
  CHECK(same_bits(reference::step(two.views(), c, s2).grad_norm, got.grad_norm));

  // Its inf still skips the step, on every tensor.
  m.tensors[1].set_grad_bits(39999, special_bits(DType::f16).inf);
  dev.upload_grads(m);
  opt.step();
  const StepReport r = opt.last_report();
  CHECK(r.outcome == Outcome::skipped_overflow);
  CHECK(r.first_nonfinite_tensor == 1);
  CHECK(r.first_nonfinite_rank == 0);
  CHECK(r.nonfinite_count == 1);
}
