// The invariant that an applied step writes only finite values, on the reference backend: the
// findings it was written for, and a seeded random search over extreme inputs. The GPU suite runs
// the same search on the kernels (tests/gpu/test_finite_updates.cpp).
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>

#include "extreme_inputs.hpp"
#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/reference.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

// Every gradient of `m` set to `bits`.
HostModel with_grads(HostModel m, std::uint16_t bits) {
  for (auto& t : m.tensors) std::fill(t.grad.begin(), t.grad.end(), bits);
  return m;
}

// One step on the reference backend.
StepReport one_step(const StepConfig& c, HostModel& m) {
  FusedAdamW opt(m.views(), c, Backend::reference);
  opt.step();
  return opt.last_report();
}

}  // namespace

TEST_CASE("a finite bf16 gradient whose second moment overflows fp32 skips the step with its reason", "[invariant]") {
  // 0x7F7F at S = 65536: |g| = 3.39e38 / 65536 = 5.2e33 unscaled; (1 - beta2)·g² = 2.7e64.
  // |g| = 6e20 at S = 1: (1 - beta2)·g² = 3.6e38, just past fp32's 3.4e38.
  struct Case {
    std::uint16_t bits;
    float scale;
  };
  for (const Case& k : {Case{0x7F7F, 65536.0f}, Case{to_bf16_bits(6e20), 1.0f}}) {
    StepConfig c;
    c.grad_dtype = DType::bf16;
    c.scaler = ScalerConfig::constant(k.scale);
    HostModel m = with_grads(random_model(3, {64}, 1.0f, DType::bf16, DType::f16), k.bits);
    const HostModel before = m;
    const StepReport r = one_step(c, m);
    CAPTURE(k.bits, k.scale);
    CHECK(r.outcome == Outcome::skipped_nonfinite_update);
    CHECK(r.reason == SkipReason::second_moment_exceeds_fp32);
    CHECK(r.step == 0);
    CHECK(r.scale_next == k.scale);
    CHECK(std::isfinite(r.grad_norm));
    CHECK(m.tensors[0] == before.tensors[0]);  // nothing written
  }
  // Just inside: |g| = 5e20 gives (1 - beta2)·g² = 2.5e38, which fits: applied, finite.
  StepConfig c;
  c.grad_dtype = DType::bf16;
  c.scaler = ScalerConfig::constant(1.0f);
  HostModel m = with_grads(random_model(4, {64}, 1.0f, DType::bf16, DType::f16), to_bf16_bits(5e20));
  const StepReport r = one_step(c, m);
  CHECK(r.outcome == Outcome::applied);
  for (float v : m.tensors[0].exp_avg_sq) CHECK(std::isfinite(v));
}

TEST_CASE("huge learning rates never leave a non-finite master", "[invariant]") {
  // lr 4e31 without decay: applied, and any element whose update would pass fp32 keeps its value.
  for (const float lr : {4e31f, 1e30f, 1e38f}) {
    StepConfig c;
    c.groups[0].lr = lr;
    c.scaler = ScalerConfig::constant(1.0f);
    HostModel m = random_model(5, {256}, 1.0f, DType::f16, DType::f16);
    for (std::size_t i = 0; i < 256; i += 3) m.tensors[0].master[i] = 3e38f;  // large weights
    FusedAdamW opt(m.views(), c, Backend::reference);
    std::mt19937_64 rng(6);
    for (int step = 0; step < 5; ++step) {
      refill_grads(rng, m.tensors[0], DType::f16, 1.0f);
      const HostModel before = m;
      opt.step();
      const StepReport r = opt.last_report();
      CAPTURE(lr, step);
      require_finite_or_untouched(r, before, m, DType::f16);
      if (lr == 1e38f) CHECK(r.reason == SkipReason::step_size_exceeds_fp32);  // lr / 0.1 > fp32
    }
  }
  // With decoupled decay, lr = 1e30 and wd = 0.01 would multiply every weight by 1 - 1e28:
  // refused when configured, and a skipped step when written on the device.
  StepConfig c;
  c.groups[0].weight_decay = 0.01f;
  c.groups[0].lr = 1e30f;
  HostModel m = random_model(7, {16}, 1.0f, DType::f16, DType::f16);
  CHECK_THROWS_WITH(FusedAdamW(m.views(), c, Backend::reference), Catch::Contains("lr * weight_decay must be < 1"));
  c.groups[0].lr = 1e-3f;
  FusedAdamW opt(m.views(), c, Backend::reference);
  *opt.device_lr(0) = 1e30f;
  opt.step();
  CHECK(opt.last_report().reason == SkipReason::invalid_learning_rate);
}

TEST_CASE("an applied step writes only finite values: seeded search over extreme inputs (reference)", "[invariant]") {
  int applied = 0, range_skips = 0, invalid_lr = 0, held = 0, overflows = 0;
  for (std::uint64_t seed = 0; seed < 400; ++seed) {
    ExtremeCase x = extreme_case(seed);
    CAPTURE(x.what);
    FusedAdamW opt(x.model.views(), x.config, Backend::reference);
    if (x.write_lr) *opt.device_lr(0) = x.device_lr;
    std::mt19937_64 rng(seed + 1000);
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      const HostModel before = x.model;
      opt.step();
      const StepReport r = opt.last_report();
      require_finite_or_untouched(r, before, x.model, x.config.model_dtype);
      applied += r.outcome == Outcome::applied;
      overflows += r.outcome == Outcome::skipped_overflow;
      range_skips += r.outcome == Outcome::skipped_nonfinite_update && r.reason != SkipReason::invalid_learning_rate;
      invalid_lr += r.reason == SkipReason::invalid_learning_rate;
      held += r.held_elements > 0;
      REQUIRE((r.outcome == Outcome::skipped_nonfinite_update) ==
              (r.reason != SkipReason::none && r.reason != SkipReason::nonfinite_gradient &&
               r.reason != SkipReason::spike));
      extreme_grads(rng, x.model, x.config.grad_dtype, opt.loss_scale(), true);
    }
  }
  INFO("applied " << applied << ", overflow " << overflows << ", range skips " << range_skips
                  << ", invalid lr " << invalid_lr << ", steps with held elements " << held);
  // The search reaches every branch of the rule.
  CHECK(applied > 100);
  CHECK(overflows > 20);
  CHECK(range_skips > 20);
  CHECK(invalid_lr > 5);
  CHECK(held > 20);
}
