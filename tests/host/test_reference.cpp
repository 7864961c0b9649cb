// The CPU reference step and the rules of docs/design.md it pins.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/reference.hpp"
#include "host_buffers.hpp"

using namespace halfstep;
using halfstep_test::HostModel;
using halfstep_test::HostTensor;
using halfstep_test::random_model;
using halfstep_test::random_tensor;
using halfstep_test::refill_grads;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double ulp(float x) {
  const float a = std::fabs(x);
  return static_cast<double>(std::nextafter(a, INFINITY) - a);
}

StepConfig config_with_scale(float scale) {
  StepConfig c;
  c.scaler.init_scale = scale;
  return c;
}

}  // namespace

TEST_CASE("a non-finite gradient anywhere skips the whole step and changes no buffer", "[reference]") {
  const std::vector<std::int64_t> sizes = {7, 33, 1, 64, 9};
  const std::uint16_t specials[] = {0x7C00, 0xFC00, 0x7E00, 0x7C01};  // +inf -inf qNaN sNaN
  for (std::size_t t : {std::size_t{0}, std::size_t{2}, std::size_t{4}}) {
    for (int where = 0; where < 3; ++where) {
      for (std::uint16_t bad : specials) {
        for (float max_norm : {0.0f, 1.0f}) {  // (d): clipping on must not hide the inf
          HostModel m = random_model(100 + t, sizes, 1024.0f);
          HostTensor& victim = m.tensors[t];
          const std::size_t n = victim.grad.size();
          const std::size_t i = where == 0 ? 0 : where == 1 ? n / 2 : n - 1;
          victim.grad[i] = bad;
          const HostModel before = m;
          StepConfig c = config_with_scale(1024.0f);
          c.max_grad_norm = max_norm;
          OptimizerState s = OptimizerState::initial(c);
          s.step = 5;
          s.attempts = 9;
          std::vector<std::int64_t> per_tensor;
          CAPTURE(t, i, bad, max_norm);
          const StepReport r = reference::step(m.views(), c, s, &per_tensor);
          REQUIRE(r.outcome == Outcome::skipped_overflow);
          for (std::size_t k = 0; k < sizes.size(); ++k) REQUIRE(m.tensors[k] == before.tensors[k]);
          REQUIRE(s.step == 5);
          REQUIRE(r.step == 5);
          REQUIRE(s.attempts == 10);
          REQUIRE(r.attempt == 10);
          REQUIRE(r.scale_used == 1024.0f);
          REQUIRE(r.scale_next == 512.0f);
          REQUIRE(s.scaler.scale == 512.0f);
          REQUIRE(r.nonfinite_count == 1);
          REQUIRE(r.first_nonfinite_tensor == static_cast<std::int32_t>(t));
          REQUIRE(per_tensor[t] == 1);
          REQUIRE(std::isnan(r.grad_norm));
          REQUIRE(std::isnan(r.clip_coef));
        }
      }
    }
  }
}

TEST_CASE("the first tensor holding a non-finite value is reported with per-tensor counts", "[reference]") {
  HostModel m = random_model(3, {10, 10, 10, 10}, 1024.0f);
  m.tensors[3].grad[0] = 0x7C00;
  m.tensors[1].grad[4] = 0x7E00;
  m.tensors[1].grad[9] = 0xFC00;
  OptimizerState s = OptimizerState::initial(StepConfig{});
  std::vector<std::int64_t> per_tensor;
  const StepReport r = reference::step(m.views(), StepConfig{}, s, &per_tensor);
  CHECK(r.first_nonfinite_tensor == 1);
  CHECK(r.nonfinite_count == 3);
  CHECK(per_tensor == std::vector<std::int64_t>{0, 2, 0, 1});
}

TEST_CASE("the Adam step counter counts applied steps only", "[reference]") {
  HostModel m = random_model(4, {16, 5}, 256.0f);
  StepConfig c = config_with_scale(256.0f);
  c.scaler.growth_interval = 1000;
  OptimizerState s = OptimizerState::initial(c);
  std::mt19937_64 rng(5);
  const std::vector<int> overflow_at = {1, 4, 5, 9};
  for (int i = 0; i < 12; ++i) {
    for (auto& t : m.tensors) refill_grads(rng, t, DType::f16, s.scaler.scale);
    const bool inject = std::find(overflow_at.begin(), overflow_at.end(), i) != overflow_at.end();
    if (inject) m.tensors[1].grad[2] = 0x7C00;
    const StepReport r = reference::step(m.views(), c, s);
    CHECK(r.outcome == (inject ? Outcome::skipped_overflow : Outcome::applied));
  }
  CHECK(s.attempts == 12);
  CHECK(s.step == 8);
  CHECK(s.scaler.overflows == 4);
}

TEST_CASE("runs at S = 1 and S = 2^12 give bitwise equal masters over 50 steps", "[reference]") {
  // Gradients are drawn as f16 values with magnitudes in [2^-10, 4]: normal at S = 1 and still
  // representable at S = 2^12 (at most 2^14), so unscaling by a power of two is exact.
  const std::vector<std::int64_t> sizes = {40, 7, 100};
  for (float max_norm : {0.0f, 0.5f}) {
    HostModel a = random_model(6, sizes, 1.0f);
    HostModel b = a;
    StepConfig ca, cb;
    ca.scaler = ScalerConfig::constant(1.0f);
    cb.scaler = ScalerConfig::constant(4096.0f);
    ca.max_grad_norm = cb.max_grad_norm = max_norm;
    ca.groups[0].weight_decay = cb.groups[0].weight_decay = 0.01f;
    OptimizerState sa = OptimizerState::initial(ca), sb = OptimizerState::initial(cb);
    std::mt19937_64 rng(7);
    std::uniform_real_distribution<double> log_mag(-10.0, 2.0);
    for (int step = 0; step < 50; ++step) {
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        for (std::size_t i = 0; i < a.tensors[t].grad.size(); ++i) {
          const double g = from_f16_bits(to_f16_bits(std::exp2(log_mag(rng)))) * (i % 3 ? 1 : -1);
          a.tensors[t].grad[i] = to_f16_bits(g);
          b.tensors[t].grad[i] = to_f16_bits(g * 4096.0);
          REQUIRE(from_f16_bits(b.tensors[t].grad[i]) == g * 4096.0);
        }
      }
      const StepReport ra = reference::step(a.views(), ca, sa);
      const StepReport rb = reference::step(b.views(), cb, sb);
      CAPTURE(max_norm, step);
      REQUIRE(ra.grad_norm == rb.grad_norm);
      REQUIRE(ra.clip_coef == rb.clip_coef);
      if (max_norm > 0.0f) REQUIRE(ra.clip_coef < 1.0f);
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        REQUIRE(a.tensors[t].master == b.tensors[t].master);
        REQUIRE(a.tensors[t].exp_avg == b.tensors[t].exp_avg);
        REQUIRE(a.tensors[t].exp_avg_sq == b.tensors[t].exp_avg_sq);
        REQUIRE(a.tensors[t].model == b.tensors[t].model);
      }
    }
  }
}

TEST_CASE("the first bias-corrected step moves each weight by lr times the gradient sign", "[reference]") {
  // With m = (1-b1)g and v = (1-b2)g^2 the first update is lr·g/(|g| + eps): lr·sign(g) up to
  // lr·eps/|g|, plus the final rounding of the master to fp32 (one ulp at its magnitude).
  HostModel m = random_model(8, {257}, 1.0f);
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> mag(1e-3, 10.0);
  auto& t = m.tensors[0];
  for (std::size_t i = 0; i < t.grad.size(); ++i) {
    t.grad[i] = to_f16_bits(mag(rng) * (i % 2 ? 1.0 : -1.0));
    t.exp_avg[i] = 0.0f;
    t.exp_avg_sq[i] = 0.0f;
  }
  const HostTensor before = t;
  StepConfig c = config_with_scale(1.0f);
  c.groups[0].lr = 0.01f;
  OptimizerState s = OptimizerState::initial(c);
  reference::step(m.views(), c, s);
  const double lr = c.groups[0].lr, eps = c.groups[0].eps;
  for (std::size_t i = 0; i < t.grad.size(); ++i) {
    const double g = from_f16_bits(before.grad[i]);
    const double expected = before.master[i] - lr * (g > 0 ? 1.0 : -1.0);
    CAPTURE(i, g);
    REQUIRE(std::fabs(t.master[i] - expected) <= lr * eps / std::fabs(g) + ulp(t.master[i]));
  }
}

TEST_CASE("clipping and the norm follow the documented formulas", "[reference]") {
  // Unscaled gradient (3, 4): norm 5, clip = min(1, 1/(5 + 1e-6)).
  HostModel m = random_model(10, {2}, 1.0f);
  m.tensors[0].grad = {to_f16_bits(3.0 * 512), to_f16_bits(4.0 * 512)};
  StepConfig c = config_with_scale(512.0f);
  c.max_grad_norm = 1.0f;
  OptimizerState s = OptimizerState::initial(c);
  HostModel unclipped = m;
  const StepReport r = reference::step(m.views(), c, s);
  CHECK(r.grad_norm == 5.0);
  CHECK(r.clip_coef == static_cast<float>(1.0 / (5.0 + 1e-6)));
  CHECK(r.outcome == Outcome::applied);

  c.max_grad_norm = 10.0f;  // above the norm: no clipping
  OptimizerState s2 = OptimizerState::initial(c);
  const StepReport r2 = reference::step(unclipped.views(), c, s2);
  CHECK(r2.clip_coef == 1.0f);
  c.max_grad_norm = 0.0f;  // off
  OptimizerState s3 = OptimizerState::initial(c);
  HostModel again = random_model(10, {2}, 1.0f);
  again.tensors[0].grad = m.tensors[0].grad;
  CHECK(reference::step(again.views(), c, s3).clip_coef == 1.0f);
}

TEST_CASE("decoupled and classic weight decay follow their formulas on one element", "[reference]") {
  for (bool decoupled : {true, false}) {
    HostModel m = random_model(11, {1}, 1.0f);
    auto& t = m.tensors[0];
    t.master = {0.75f};
    t.exp_avg = {0.02f};
    t.exp_avg_sq = {3e-4f};
    t.grad = {to_f16_bits(-0.125 * 64)};
    StepConfig c = config_with_scale(64.0f);
    AdamWConfig& h = c.groups[0];
    h.lr = 0.05f;
    h.weight_decay = 0.1f;
    h.decoupled_weight_decay = decoupled;
    OptimizerState s = OptimizerState::initial(c);
    s.step = 2;  // this is the third applied step
    s.attempts = 2;
    reference::step(m.views(), c, s);
    const double lr = h.lr, b1 = h.beta1, b2 = h.beta2, eps = h.eps, wd = h.weight_decay;
    double w = 0.75, g = -0.125;
    if (decoupled) w *= 1.0 - lr * wd; else g += wd * w;
    const double mm = b1 * static_cast<double>(0.02f) + (1 - b1) * g;
    const double vv = b2 * static_cast<double>(3e-4f) + (1 - b2) * g * g;
    const double mhat = mm / (1 - std::pow(b1, 3)), vhat = vv / (1 - std::pow(b2, 3));
    w -= lr * mhat / (std::sqrt(vhat) + eps);
    CAPTURE(decoupled);
    CHECK(t.master[0] == Approx(w).epsilon(1e-6));
    CHECK(t.exp_avg[0] == static_cast<float>(mm));
    CHECK(t.exp_avg_sq[0] == static_cast<float>(vv));
    CHECK(s.step == 3);
  }
}

TEST_CASE("bias correction off uses the raw moments", "[reference]") {
  HostModel m = random_model(12, {1}, 1.0f);
  auto& t = m.tensors[0];
  t.master = {0.0f};
  t.exp_avg = {0.0f};
  t.exp_avg_sq = {0.0f};
  t.grad = {to_f16_bits(0.5)};
  StepConfig c = config_with_scale(1.0f);
  c.groups[0].bias_correction = false;
  OptimizerState s = OptimizerState::initial(c);
  reference::step(m.views(), c, s);
  // m = (1-b1)·0.5, v = (1-b2)·0.25: the step is lr·m/(sqrt(v) + eps) ≈ 3.1623·lr
  const double b1 = 0.9f, b2 = 0.999f, lr = 1e-3f, eps = 1e-8f;
  const double expected = -lr * (1 - b1) * 0.5 / (std::sqrt((1 - b2) * 0.25) + eps);
  CHECK(t.master[0] == Approx(expected).epsilon(1e-6));
}

TEST_CASE("two groups use their own lr and weight decay", "[reference]") {
  HostModel m = random_model(13, {20, 20}, 1024.0f);
  m.tensors[1].group = 1;
  StepConfig c = config_with_scale(1024.0f);
  c.groups.resize(2);
  c.groups[0].lr = 1e-2f;
  c.groups[0].weight_decay = 0.1f;
  c.groups[1].lr = 0.0f;  // frozen group: weights stay, moments still track the gradient
  c.groups[1].weight_decay = 0.5f;
  const HostModel before = m;
  OptimizerState s = OptimizerState::initial(c);
  reference::step(m.views(), c, s);
  CHECK(m.tensors[1].master == before.tensors[1].master);
  CHECK(m.tensors[1].exp_avg != before.tensors[1].exp_avg);
  for (std::size_t i = 0; i < 20; ++i) {
    CHECK(m.tensors[0].master[i] != before.tensors[0].master[i]);
  }
}

TEST_CASE("empty tensors and empty groups are fine anywhere", "[reference]") {
  HostModel with = random_model(14, {0, 12, 0, 30, 0}, 256.0f);
  HostModel without;
  without.tensors = {with.tensors[1], with.tensors[3]};
  StepConfig c = config_with_scale(256.0f);
  c.groups.resize(3);  // group 1 holds no tensor
  c.groups[2].lr = 5e-3f;
  with.tensors[3].group = without.tensors[1].group = 2;
  OptimizerState sw = OptimizerState::initial(c), so = OptimizerState::initial(c);
  const StepReport rw = reference::step(with.views(), c, sw);
  const StepReport ro = reference::step(without.views(), c, so);
  CHECK(rw.outcome == Outcome::applied);
  CHECK(rw.numel == 42);
  CHECK(rw.grad_norm == ro.grad_norm);
  CHECK(with.tensors[1] == without.tensors[0]);
  CHECK(with.tensors[3] == without.tensors[1]);
  CHECK(sw == so);
  std::vector<ParamTensor> nothing;
  OptimizerState se = OptimizerState::initial(c);
  const StepReport re = reference::step(nothing, c, se);
  CHECK(re.outcome == Outcome::applied);
  CHECK(re.grad_norm == 0.0);
  CHECK(re.headroom_log2 == std::numeric_limits<float>::infinity());
}

TEST_CASE("gradient telemetry counts zeros and subnormals and measures headroom", "[reference]") {
  HostModel m = random_model(15, {8}, 1.0f);
  m.tensors[0].grad = {0x0000, 0x8000, 0x0001, 0x83FF, 0x3C00, to_f16_bits(-2048.0), 0x0400, 0x0400};
  StepConfig c = config_with_scale(2.0f);
  OptimizerState s = OptimizerState::initial(c);
  const StepReport r = reference::step(m.views(), c, s);
  CHECK(r.zero_count == 2);
  CHECK(r.subnormal_count == 2);
  CHECK(r.numel == 8);
  CHECK(r.max_abs_scaled == 2048.0f);
  CHECK(r.headroom_log2 == static_cast<float>(std::log2(65504.0 / 2048.0)));
  CHECK(r.nonfinite_count == 0);
  CHECK(r.first_nonfinite_tensor == -1);
}

TEST_CASE("telemetry of an overflow step measures the finite elements", "[reference]") {
  HostModel m = random_model(16, {4}, 1.0f);
  m.tensors[0].grad = {to_f16_bits(100.0), 0x7C00, 0x0002, 0x7E00};
  OptimizerState s = OptimizerState::initial(StepConfig{});
  const StepReport r = reference::step(m.views(), StepConfig{}, s);
  CHECK(r.nonfinite_count == 2);
  CHECK(r.max_abs_scaled == 100.0f);
  CHECK(r.subnormal_count == 1);
}

TEST_CASE("the model copy is the stored master rounded to nearest even", "[reference]") {
  for (DType model : {DType::f16, DType::bf16}) {
    for (DType grad : {DType::f16, DType::bf16}) {
      HostModel m = random_model(17, {100, 3}, 128.0f, grad, model);
      m.tensors[1].with_model = false;
      const auto untouched = m.tensors[1].model;
      StepConfig c = config_with_scale(128.0f);
      c.grad_dtype = grad;
      c.model_dtype = model;
      OptimizerState s = OptimizerState::initial(c);
      REQUIRE(reference::step(m.views(), c, s).outcome == Outcome::applied);
      CAPTURE(dtype_name(grad), dtype_name(model));
      for (std::size_t i = 0; i < 100; ++i) {
        REQUIRE(m.tensors[0].model[i] == to_bits16(model, m.tensors[0].master[i]));
      }
      REQUIRE(m.tensors[1].model == untouched);
    }
  }
}

TEST_CASE("a bf16 infinity is an overflow", "[reference]") {
  HostModel m = random_model(18, {9}, 1.0f, DType::bf16, DType::bf16);
  m.tensors[0].grad[8] = 0xFF80;
  StepConfig c;
  c.grad_dtype = c.model_dtype = DType::bf16;
  c.scaler = ScalerConfig::constant(1.0f);
  OptimizerState s = OptimizerState::initial(c);
  const StepReport r = reference::step(m.views(), c, s);
  CHECK(r.outcome == Outcome::skipped_overflow);
  CHECK(r.scale_next == 1.0f);
}

TEST_CASE("a bf16 gradient too large to square in fp32 still gives a finite norm", "[reference]") {
  HostModel m = random_model(19, {2}, 1.0f, DType::bf16, DType::bf16);
  m.tensors[0].grad = {to_bf16_bits(1e30), to_bf16_bits(-1e30)};
  StepConfig c;
  c.grad_dtype = c.model_dtype = DType::bf16;
  c.scaler = ScalerConfig::constant(1.0f);
  c.max_grad_norm = 1.0f;
  OptimizerState s = OptimizerState::initial(c);
  const StepReport r = reference::step(m.views(), c, s);
  CHECK(r.outcome == Outcome::applied);
  CHECK(r.grad_norm == Approx(std::sqrt(2.0) * from_bf16_bits(to_bf16_bits(1e30))));
  CHECK(r.clip_coef > 0.0f);
}

TEST_CASE("a spike skip leaves buffers scale and step counter alone", "[reference]") {
  HostModel m = random_model(20, {64}, 1024.0f);
  StepConfig c = config_with_scale(1024.0f);
  c.spike.enabled = true;
  c.spike.warmup_steps = 20;
  c.spike.action = SpikeConfig::Action::skip;
  OptimizerState s = OptimizerState::initial(c);
  std::mt19937_64 rng(21);
  for (int i = 0; i < 30; ++i) {
    refill_grads(rng, m.tensors[0], DType::f16, 1024.0f);
    REQUIRE(reference::step(m.views(), c, s).outcome == Outcome::applied);
  }
  refill_grads(rng, m.tensors[0], DType::f16, 1024.0f, 1.0f);  // 100x the usual deviation
  const HostModel before = m;
  const OptimizerState state_before = s;
  const StepReport r = reference::step(m.views(), c, s);
  CHECK(r.outcome == Outcome::skipped_spike);
  CHECK(r.spike);
  CHECK(m.tensors[0] == before.tensors[0]);
  CHECK(s.step == state_before.step);
  CHECK(s.scaler == state_before.scaler);
  CHECK(r.scale_next == r.scale_used);
  CHECK(s.attempts == state_before.attempts + 1);
  CHECK(s.spike.spikes == 1);
  CHECK(std::isfinite(r.grad_norm));

  c.spike.action = SpikeConfig::Action::log;  // logged spikes are applied
  OptimizerState logged = state_before;
  HostModel m2 = before;
  const StepReport r2 = reference::step(m2.views(), c, logged);
  CHECK(r2.outcome == Outcome::applied);
  CHECK(r2.spike);
  CHECK(logged.step == state_before.step + 1);
}

TEST_CASE("a 200-step random trajectory matches an independent recomputation", "[reference]") {
  // The test keeps its own copy of every buffer (fp32 between steps, as the API stores them)
  // and applies the textbook form m_hat = m/(1-b1^t), v_hat = v/(1-b2^t),
  // w -= lr·m_hat/(sqrt(v_hat) + eps), with its own PyTorch-rule scaler and clip. Both sides work
  // in double and round to fp32 per step; they can disagree by one fp32 ulp per rounding, and such
  // differences carry forward through m and v, so after t steps the masters agree to
  // t·(2 ulp(w) + 1e-6·lr).
  const std::vector<std::int64_t> sizes = {50, 1, 77};
  HostModel m = random_model(22, sizes, 1.0f);
  HostModel mine = m;
  StepConfig c;
  c.scaler.init_scale = 32768.0f;
  c.scaler.growth_interval = 7;
  c.max_grad_norm = 0.05f;
  AdamWConfig& h = c.groups[0];
  h.lr = 2e-3f;
  h.weight_decay = 0.02f;
  OptimizerState s = OptimizerState::initial(c);
  float my_scale = 32768.0f;
  int my_good = 0;
  std::int64_t my_t = 0;
  std::mt19937_64 rng(23);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::normal_distribution<double> n(0.0, 0.01);
  for (int step = 1; step <= 200; ++step) {
    const bool inject = u(rng) < 0.1;
    double sum_sq = 0.0;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t i = 0; i < m.tensors[t].grad.size(); ++i) {
        const std::uint16_t bits = to_f16_bits(n(rng) * my_scale);
        m.tensors[t].grad[i] = mine.tensors[t].grad[i] = bits;
        sum_sq += std::pow(from_f16_bits(bits) / my_scale, 2);
      }
    }
    if (inject) m.tensors[2].grad[76] = mine.tensors[2].grad[76] = 0xFC00;
    bool overflow = false;  // injected, or a scaled gradient past the f16 range
    for (const auto& t : mine.tensors) {
      for (std::uint16_t bits : t.grad) overflow = overflow || !std::isfinite(from_f16_bits(bits));
    }
    const StepReport r = reference::step(m.views(), c, s);
    CAPTURE(step, inject);
    REQUIRE(r.scale_used == my_scale);
    if (overflow) {
      REQUIRE(r.outcome == Outcome::skipped_overflow);
      my_scale = std::max(my_scale * 0.5f, 1.0f);
      my_good = 0;
    } else {
      REQUIRE(r.outcome == Outcome::applied);
      const double norm = std::sqrt(sum_sq);
      REQUIRE(r.grad_norm == Approx(norm).epsilon(1e-12));
      const double clip = std::min(1.0, static_cast<double>(c.max_grad_norm) / (norm + 1e-6));
      ++my_t;
      const double bc1 = 1 - std::pow(static_cast<double>(h.beta1), static_cast<double>(my_t));
      const double bc2 = 1 - std::pow(static_cast<double>(h.beta2), static_cast<double>(my_t));
      for (auto& t : mine.tensors) {
        for (std::size_t i = 0; i < t.grad.size(); ++i) {
          const double g = from_f16_bits(t.grad[i]) / my_scale * clip;
          double w = t.master[i] * (1.0 - static_cast<double>(h.lr) * h.weight_decay);
          const double mm = h.beta1 * static_cast<double>(t.exp_avg[i]) + (1 - static_cast<double>(h.beta1)) * g;
          const double vv = h.beta2 * static_cast<double>(t.exp_avg_sq[i]) + (1 - static_cast<double>(h.beta2)) * g * g;
          w -= h.lr * (mm / bc1) / (std::sqrt(vv / bc2) + h.eps);
          t.master[i] = static_cast<float>(w);
          t.exp_avg[i] = static_cast<float>(mm);
          t.exp_avg_sq[i] = static_cast<float>(vv);
        }
      }
      if (++my_good == 7) {
        my_scale = std::min(my_scale * 2.0f, 16777216.0f);
        my_good = 0;
      }
    }
    REQUIRE(r.scale_next == my_scale);
    REQUIRE(s.step == my_t);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t i = 0; i < m.tensors[t].master.size(); ++i) {
        const float a = m.tensors[t].master[i], b = mine.tensors[t].master[i];
        REQUIRE(std::fabs(a - b) <= step * (2 * ulp(b) + 1e-6 * h.lr));
      }
    }
  }
  CHECK(s.attempts == 200);
  CHECK(s.step < 200);  // some steps were skipped
}

TEST_CASE("an invalid optimizer state is rejected before anything runs", "[reference]") {
  HostModel m = random_model(24, {4}, 1.0f);
  const HostModel before = m;
  OptimizerState s = OptimizerState::initial(StepConfig{});
  s.scaler.scale = 0.0f;
  CHECK_THROWS_WITH(reference::step(m.views(), StepConfig{}, s), Catch::Contains("ScalerState.scale"));
  CHECK(m.tensors[0] == before.tensors[0]);
  s = OptimizerState::initial(StepConfig{});
  s.step = 3;  // more applied steps than attempts
  CHECK_THROWS_WITH(reference::step(m.views(), StepConfig{}, s), Catch::Contains("OptimizerState.step"));
}

TEST_CASE("the reference grows the scale early when headroom growth is on", "[reference]") {
  HostModel m = random_model(25, {64}, 16.0f);  // |g·S| ~ 0.16: headroom ~ 18 binades
  StepConfig c = config_with_scale(16.0f);
  c.scaler.headroom_growth = true;
  OptimizerState s = OptimizerState::initial(c);
  const StepReport r = reference::step(m.views(), c, s);
  CHECK(r.headroom_log2 > 10.0f);
  CHECK(r.scale_next == 32.0f);
  c.scaler.headroom_growth = false;
  OptimizerState s2 = OptimizerState::initial(c);
  HostModel m2 = random_model(25, {64}, 16.0f);
  CHECK(reference::step(m2.views(), c, s2).scale_next == 16.0f);
}

TEST_CASE("a group that joins a running optimizer counts its bias corrections from its own first step", "[reference]") {
  // Two runs from the same buffers: a fresh optimizer's first step, and the step of a group added
  // after 40 applied steps (step_offset 40). torch.optim counts a parameter's steps from its first
  // one: both steps must write the same bits, on both backends.
  for (const DType grad : {DType::f16, DType::f32}) {
    HostModel fresh = random_model(91, {17, 5}, 1.0f, grad, DType::bf16);
    HostModel joined = fresh;
    StepConfig c;
    c.grad_dtype = grad;
    c.model_dtype = DType::bf16;
    c.scaler = ScalerConfig::constant(1.0f);
    OptimizerState s0 = OptimizerState::initial(c);
    reference::step(fresh.views(), c, s0);
    StepConfig later = c;
    later.groups[0].step_offset = 40;
    OptimizerState s40 = OptimizerState::initial(later);
    s40.step = s40.attempts = 40;
    reference::step(joined.views(), later, s40);
    CAPTURE(dtype_name(grad));
    for (std::size_t t = 0; t < 2; ++t) CHECK(fresh.tensors[t] == joined.tensors[t]);
    // And a group without the offset, 40 steps in, takes another (smaller) first step.
    HostModel old = random_model(91, {17, 5}, 1.0f, grad, DType::bf16);
    OptimizerState s = OptimizerState::initial(c);
    s.step = s.attempts = 40;
    reference::step(old.views(), c, s);
    CHECK(!(old.tensors[0] == fresh.tensors[0]));
    // The backend reads the offset too, and a checkpoint restores it.
    HostModel b = random_model(91, {17, 5}, 1.0f, grad, DType::bf16);
    FusedAdamW opt(b.views(), later, Backend::reference);
    OptimizerState st = OptimizerState::initial(later);
    st.step = st.attempts = 40;
    opt.set_state(st);
    opt.step();
    for (std::size_t t = 0; t < 2; ++t) CHECK(b.tensors[t] == fresh.tensors[t]);
    const std::string saved = opt.save_state();
    AdamWConfig moved = later.groups[0];
    moved.step_offset = 3;
    opt.set_group(0, moved);
    opt.load_state(saved);
    CHECK(opt.config().groups[0].step_offset == 40);
  }
}
