// The exact norm on the device: pass 1's class sums and limbs give the reference's Σg² bit for
// bit, whatever the values (the extremes of each format, subnormals, bf16 values outside the
// window) and however the same gradients are laid out in tensors and chunks.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cmath>
#include <random>

#include "gpu_support.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

// `values` laid out as tensors of the given sizes (their sum is values.size()).
HostModel layout(const std::vector<std::uint16_t>& values, const std::vector<std::int64_t>& sizes, DType dtype) {
  HostModel m = random_model(7, sizes, 1.0f, dtype, dtype);
  std::size_t at = 0;
  for (auto& t : m.tensors) {
    for (auto& g : t.grad) g = values[at++];
  }
  REQUIRE(at == values.size());
  return m;
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
  for (const DType dtype : {DType::f16, DType::bf16}) {
    std::mt19937_64 rng(dtype == DType::f16 ? 81 : 82);
    const std::uint16_t max_bits = dtype == DType::f16 ? 0x7BFF : 0x7F7F;
    const std::int64_t n = 40000;  // two chunks and a tail
    std::vector<std::uint16_t> values(static_cast<std::size_t>(n));
    for (auto& v : values) {
      const int kind = static_cast<int>(rng() % 6);
      const std::uint16_t mag = kind == 0 ? max_bits
                                : kind == 1 ? std::uint16_t{1}
                                : kind == 2 ? static_cast<std::uint16_t>(rng() % 0x80)
                                : kind == 3 ? std::uint16_t{0}
                                            : static_cast<std::uint16_t>(rng() % (max_bits + 1u));
      v = static_cast<std::uint16_t>(mag | ((rng() & 1) != 0 ? 0x8000 : 0));
    }
    StepConfig c = config_for(dtype, dtype, 1.0f, 0.0f);
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

TEST_CASE("gpu f16 class boundaries and bf16 values outside the window sum exactly", "[gpu][exact_norm]") {
  // fp16: the values on either side of the class cuts 2^-1 and 2^12, many of each.
  std::vector<std::uint16_t> f16;
  for (std::uint16_t b : {std::uint16_t{0x37FF}, std::uint16_t{0x3800}, std::uint16_t{0x6BFF},
                          std::uint16_t{0x6C00}, std::uint16_t{0x7BFF}, std::uint16_t{0x0001}}) {
    for (int i = 0; i < 3000; ++i) f16.push_back(b);
  }
  StepConfig c = config_for(DType::f16, DType::f16, 1.0f, 0.0f);
  c.groups[0].lr = 0.0f;
  auto [got, want] = both(layout(f16, {static_cast<std::int64_t>(f16.size())}, DType::f16), c, false);
  CHECK(same_bits(got.grad_norm, want.grad_norm));

  // bf16: the window follows the last step's largest value. A run whose values jump far above
  // and below it (and into subnormals) takes the checked path and stays exact.
  std::mt19937_64 rng(83);
  StepConfig b = config_for(DType::bf16, DType::bf16, 1.0f, 0.0f);
  b.groups[0].lr = 0.0f;
  HostModel m = random_model(84, {5000, 30000}, 1.0f, DType::bf16, DType::bf16);
  DeviceModel dev(m);
  FusedAdamW opt(dev.views(), b);
  OptimizerState state = OptimizerState::initial(b);
  for (int step = 0; step < 6; ++step) {
    for (auto& t : m.tensors) {
      for (auto& g : t.grad) {
        // Steps 0, 2, 4: values near 1; 1, 3, 5: exponents anywhere from subnormal to 2^120.
        const int e = step % 2 == 0 ? 127 - static_cast<int>(rng() % 20) : static_cast<int>(rng() % 248);
        g = static_cast<std::uint16_t>((e << 7) | (rng() & 0x7F) | ((rng() & 1) << 15));
      }
    }
    dev.upload_grads(m);
    opt.step();
    const StepReport r = opt.last_report();
    HostModel ref = m;
    const StepReport w = reference::step(ref.views(), b, state);
    CAPTURE(step);
    REQUIRE(same_bits(r.grad_norm, w.grad_norm));
    REQUIRE(r.subnormal_count == w.subnormal_count);
    REQUIRE(r.max_abs_scaled == w.max_abs_scaled);
  }
}

TEST_CASE("gpu a tensor outside the norm adds only its inf/NaN and maximum", "[gpu][exact_norm][distributed]") {
  HostModel m = random_model(85, {3000, 40000, 17}, 1024.0f);
  DeviceModel dev(m);
  std::vector<ParamTensor> views = dev.views();
  views[1].in_norm = false;
  const StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 1.0f);
  FusedAdamW opt(views, c);
  opt.step();
  const StepReport got = opt.last_report();
  HostModel ref = m;
  std::vector<ParamTensor> ref_views = ref.views();
  ref_views[1].in_norm = false;
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
  m.tensors[1].grad[39999] = 0x7C00;
  dev.upload_grads(m);
  opt.step();
  const StepReport r = opt.last_report();
  CHECK(r.outcome == Outcome::skipped_overflow);
  CHECK(r.first_nonfinite_tensor == 1);
  CHECK(r.first_nonfinite_rank == 0);
  CHECK(r.nonfinite_count == 1);
}
