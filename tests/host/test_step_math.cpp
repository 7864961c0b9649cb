// The kernels' scalar math, run on the host: decide() (what finalize runs after its reduction),
// group_consts() and adamw_update() (what every pass-2 thread runs), and the tensor table.
// The thread-level parts of the kernels need a GPU (tests/gpu); the arithmetic does not.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "adam_bound.hpp"
#include "halfstep/error.hpp"
#include "halfstep/reference.hpp"
#include "host_buffers.hpp"
#include "reference_impl.hpp"
#include "step_math.hpp"
#include "tensor_table.hpp"

using namespace halfstep;
using namespace halfstep::detail;
using halfstep_test::HostModel;
using halfstep_test::random_tensor;

namespace {

// Pass 1's record as the reference measures it, decoded by the kernels' code (decode_totals).
Totals host_totals(const std::vector<ParamTensor>& tensors, const StepConfig& c) {
  return decode_totals(reference_measure(tensors, c, 0, nullptr), c.grad_dtype);
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// decide() with the groups and learning rates of `c`, as finalize passes them.
void decide_for(const Totals& totals, OptimizerState& state, const StepConfig& c, StepReport& report,
                Decision& decision, bool device_scaler = true) {
  std::vector<GroupParams> groups;
  std::vector<float> lr;
  for (const AdamWConfig& h : c.groups) {
    groups.push_back(group_params(h));
    lr.push_back(h.lr);
  }
  DecideParams p = decide_params(c);
  p.device_scaler = device_scaler;
  decide(totals, state, p, groups.data(), lr.data(), static_cast<std::int32_t>(groups.size()), ScaleInputs{}, report,
         decision);
}

}  // namespace

TEST_CASE("decide reproduces the reference report and state exactly", "[step_math]") {
  // With power-of-two scales sqrt(Σx²)/S equals sqrt(Σ(x/S)²) bit for bit, so every field,
  // floating-point ones included, must agree exactly.
  std::mt19937_64 rng(31);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  StepConfig c;
  c.scaler.init_scale = 4096.0f;
  c.scaler.growth_interval = 5;
  c.scaler.hysteresis = 2;
  c.spike.enabled = true;
  c.spike.warmup_steps = 10;
  c.spike.action = SpikeConfig::Action::skip;
  c.max_grad_norm = 0.3f;
  c.scaler.max_scale = 8192.0f;  // keeps the 100x steps finite in f16
  c.scaler.headroom_growth = true;
  HostModel m;
  for (std::int64_t n : {33, 0, 200, 5}) m.tensors.push_back(random_tensor(rng, n, DType::f16, DType::f16, 1.0f));
  OptimizerState ref = OptimizerState::initial(c);
  OptimizerState dev = ref;
  int overflows = 0, spikes = 0, applied = 0;
  for (int step = 0; step < 300; ++step) {
    const float sigma = u(rng) < 0.03 ? 1.0f : 0.01f;  // occasional 100x steps: spikes
    for (auto& t : m.tensors) halfstep_test::refill_grads(rng, t, DType::f16, dev.scaler.scale, sigma);
    if (u(rng) < 0.1) m.tensors[2].grad[static_cast<std::size_t>(step % 200)] = 0x7E00;
    auto views = m.views();
    const Totals totals = host_totals(views, c);
    StepReport mine{};
    Decision decision{};
    decide_for(totals, dev, c, mine, decision);
    HostModel copy = m;
    const StepReport r = reference::step(copy.views(), c, ref);
    CAPTURE(step);
    REQUIRE(mine.outcome == r.outcome);
    REQUIRE(mine.attempt == r.attempt);
    REQUIRE(mine.step == r.step);
    REQUIRE(mine.spike == r.spike);
    REQUIRE(same_bits(mine.scale_used, r.scale_used));
    REQUIRE(same_bits(mine.scale_next, r.scale_next));
    REQUIRE((same_bits(mine.grad_norm, r.grad_norm) || (std::isnan(mine.grad_norm) && std::isnan(r.grad_norm))));
    REQUIRE((same_bits(mine.clip_coef, r.clip_coef) || (std::isnan(mine.clip_coef) && std::isnan(r.clip_coef))));
    REQUIRE(mine.nonfinite_count == r.nonfinite_count);
    REQUIRE(mine.first_nonfinite_tensor == r.first_nonfinite_tensor);
    REQUIRE(same_bits(mine.max_abs_scaled, r.max_abs_scaled));
    REQUIRE(same_bits(mine.headroom_log2, r.headroom_log2));
    REQUIRE(mine.subnormal_count == r.subnormal_count);
    REQUIRE(mine.zero_count == r.zero_count);
    REQUIRE(mine.numel == r.numel);
    REQUIRE(dev.scaler == ref.scaler);
    REQUIRE(dev.spike == ref.spike);
    REQUIRE(dev.step == ref.step);
    REQUIRE(dev.attempts == ref.attempts);
    REQUIRE(decision.apply == (r.outcome == Outcome::applied ? 1 : 0));
    if (decision.apply) {
      const double clip = std::min(1.0, static_cast<double>(c.max_grad_norm) / (r.grad_norm + 1e-6));
      // The factor is clip / S to within one fp32 rounding of its mantissa; the scales are exact.
      const double factor = static_cast<double>(decision.pre) * decision.coef * decision.post_a * decision.post_b;
      REQUIRE(std::fabs(factor - clip / r.scale_used) <= std::ldexp(clip / r.scale_used, -24));
    }
    overflows += r.outcome == Outcome::skipped_overflow;
    spikes += r.outcome == Outcome::skipped_spike;
    applied += r.outcome == Outcome::applied;
    m = copy;
  }
  CHECK(overflows > 10);
  CHECK(spikes > 2);
  CHECK(applied > 200);
}

TEST_CASE("decide in host-driven mode leaves the scaler to the host", "[step_math]") {
  StepConfig c;
  OptimizerState s = OptimizerState::initial(c);
  OptimizerState dev = s;
  Totals overflow;
  overflow.nonfinite = 3;
  overflow.first_nonfinite_tensor = 1;
  StepReport r{};
  Decision d{};
  decide_for(overflow, dev, c, r, d, /*device_scaler=*/false);
  CHECK(r.outcome == Outcome::skipped_overflow);
  CHECK(dev.scaler == s.scaler);
  CHECK(r.scale_next == r.scale_used);
  CHECK(d.apply == 0);
  CHECK(dev.attempts == 1);
}

TEST_CASE("the fp32 element update stays within the derived bound of the reference", "[step_math]") {
  std::mt19937_64 rng(32);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::size_t checked = 0;
  double worst = 0.0;  // largest error as a fraction of its bound
  for (int trial = 0; trial < 64; ++trial) {
    StepConfig c;
    AdamWConfig& h = c.groups[0];
    h.lr = static_cast<float>(std::pow(10.0, -1 - 4 * u(rng)));
    h.beta1 = trial % 5 == 0 ? 0.0f : static_cast<float>(0.8 + 0.19 * u(rng));
    h.beta2 = static_cast<float>(0.9 + 0.0999 * u(rng));
    h.eps = static_cast<float>(std::pow(10.0, -12 + 8 * u(rng)));
    h.weight_decay = trial % 3 == 0 ? 0.0f : static_cast<float>(0.1 * u(rng));
    h.decoupled_weight_decay = trial % 2 == 0;
    h.bias_correction = trial % 7 != 0;
    c.max_grad_norm = trial % 4 == 0 ? 0.0f : static_cast<float>(0.05 + u(rng));
    const float scale = std::ldexp(1.0f, static_cast<int>(24 * u(rng)));
    c.scaler.init_scale = scale;
    HostModel m;
    const double sigma = std::min(std::pow(10.0, -6 + 5 * u(rng)), 5000.0 / scale);  // stays finite
    m.tensors.push_back(random_tensor(rng, 2048, DType::f16, DType::f16, scale, static_cast<float>(sigma)));
    auto& t = m.tensors[0];
    if (trial % 6 == 0) {  // fresh moments, and some exact zeros
      std::fill(t.exp_avg.begin(), t.exp_avg.end(), 0.0f);
      std::fill(t.exp_avg_sq.begin(), t.exp_avg_sq.end(), 0.0f);
      for (std::size_t i = 0; i < t.grad.size(); i += 17) t.grad[i] = 0;
    }
    OptimizerState ref = OptimizerState::initial(c);
    ref.step = ref.attempts = static_cast<std::int64_t>(u(rng) * 3000);
    OptimizerState dev = ref;
    HostModel before = m;
    const StepReport r = reference::step(m.views(), c, ref);
    REQUIRE(r.outcome == Outcome::applied);
    const double clip = c.max_grad_norm > 0.0f
                            ? std::min(1.0, static_cast<double>(c.max_grad_norm) / (r.grad_norm + 1e-6))
                            : 1.0;
    StepReport mine{};
    Decision d{};
    decide_for(host_totals(before.views(), c), dev, c, mine, d);
    const GroupConsts k = group_consts(group_params(h), h.lr, dev.step);
    for (std::size_t i = 0; i < t.grad.size(); ++i) {
      float p = before.tensors[0].master[i], mm = before.tensors[0].exp_avg[i], vv = before.tensors[0].exp_avg_sq[i];
      const double x = from_f16_bits(before.tensors[0].grad[i]);
      adamw_update(p, mm, vv, unscale(static_cast<float>(x), d), k);
      const auto b = halfstep_test::adam_bound(before.tensors[0].master[i], before.tensors[0].exp_avg[i],
                                               before.tensors[0].exp_avg_sq[i], x, scale, clip, 0.0, h, ref.step);
      CAPTURE(trial, i, x, p, t.master[i]);
      REQUIRE(std::fabs(p - t.master[i]) <= b.p);
      REQUIRE(std::fabs(mm - t.exp_avg[i]) <= b.m);
      REQUIRE(std::fabs(vv - t.exp_avg_sq[i]) <= b.v);
      worst = std::max(worst, std::fabs(p - t.master[i]) / b.p);
      ++checked;
    }
  }
  CHECK(checked == 64 * 2048);
  CHECK(worst > 0.0);  // the fp32 path does differ from the reference: the bound is exercised
  INFO("largest master error / bound: " << worst);
  CHECK(worst <= 1.0);
}

TEST_CASE("the fp32 element update is bitwise scale invariant for power-of-two scales", "[step_math]") {
  std::mt19937_64 rng(33);
  std::uniform_real_distribution<double> mag(-10.0, 2.0);
  StepConfig c;
  c.max_grad_norm = 0.5f;
  c.groups[0].weight_decay = 0.01f;
  const GroupParams gp = group_params(c.groups[0]);
  std::vector<float> p1(500), m1(500), v1(500);
  std::vector<std::uint16_t> x1(500), x2(500);
  for (std::size_t i = 0; i < 500; ++i) {
    p1[i] = static_cast<float>(mag(rng) / 10);
    const double g = from_f16_bits(to_f16_bits(std::exp2(mag(rng)))) * (i % 2 ? 1 : -1);
    x1[i] = to_f16_bits(g);
    x2[i] = to_f16_bits(g * 4096);
  }
  auto p2 = p1, m2 = m1, v2 = v1;
  for (float s : {1.0f, 4096.0f}) {
    auto& x = s == 1.0f ? x1 : x2;
    auto& p = s == 1.0f ? p1 : p2;
    auto& m = s == 1.0f ? m1 : m2;
    auto& v = s == 1.0f ? v1 : v2;
    ParamTensor view{p.data(), x.data(), m.data(), v.data(), nullptr, 500, 0};
    c.scaler = ScalerConfig::constant(s);
    OptimizerState dev = OptimizerState::initial(c);
    for (int step = 0; step < 20; ++step) {
      StepReport r{};
      Decision d{};
      decide_for(host_totals({view}, c), dev, c, r, d);
      REQUIRE(d.apply == 1);
      const GroupConsts k = group_consts(gp, c.groups[0].lr, dev.step);
      for (std::size_t i = 0; i < 500; ++i) {
        adamw_update(p[i], m[i], v[i], unscale(static_cast<float>(from_f16_bits(x[i])), d), k);
      }
    }
  }
  CHECK(std::memcmp(p1.data(), p2.data(), 500 * sizeof(float)) == 0);
  CHECK(std::memcmp(v1.data(), v2.data(), 500 * sizeof(float)) == 0);
}

TEST_CASE("the unscale factor keeps fp32 precision where clip / S is subnormal or past fp32", "[step_math]") {
  // clip / S from 1 down to 1e-60 and up to 2^140 (S below fp32's normal range): raw · factor must
  // be raw · (clip / S) rounded once, wherever that product is an fp32 normal number.
  std::mt19937_64 rng(41);
  std::uniform_real_distribution<double> mantissa(0.5, 1.0);
  int checked = 0;
  for (int e = -200; e <= 140; e += 3) {
    const double c = std::ldexp(mantissa(rng), e);
    Decision d{};
    set_coefficient(d, c);
    CHECK(d.coef >= 0.5f);
    CHECK(d.coef <= 1.0f);
    CHECK(std::fabs(static_cast<double>(d.pre) * d.coef * d.post_a * d.post_b - c) <= std::ldexp(c, -24));
    for (int k = 0; k < 50; ++k) {
      const float raw = static_cast<float>(from_bf16_bits(static_cast<std::uint16_t>(rng() & 0x7F7Fu)));
      const double exact = static_cast<double>(raw) * c;
      if (!(std::fabs(exact) >= 0x1p-126 && std::fabs(exact) <= 0x1.fffffep127)) continue;
      // Two roundings at most (of the mantissa and of the product): 2 ulps.
      const double got = unscale(raw, d);
      CAPTURE(e, raw, c, got, exact);
      REQUIRE(std::fabs(got - exact) <= std::ldexp(std::fabs(exact), -23));
      ++checked;
    }
  }
  CHECK(checked > 2000);
  // The single fp32 factor this replaces: clip / S = 2.1e-43 is 149.86 times fp32's smallest
  // subnormal, so it rounds to 150 of them, an error of 2^-10.
  const double c = 2.1e-43;
  Decision d{};
  set_coefficient(d, c);
  const float raw = 1.0e10f;
  CHECK(std::fabs(unscale(raw, d) - raw * c) <= std::ldexp(raw * c, -23));
  CHECK(std::fabs(raw * static_cast<float>(c) - raw * c) > std::ldexp(raw * c, -11));
}

TEST_CASE("the second moment of a gradient beyond 1.8e19 stays finite where (1 - beta2) g^2 fits", "[step_math]") {
  AdamWConfig h;
  const GroupConsts k = group_consts(group_params(h), h.lr, 1);
  for (const double g : {2.0e19, 6.0e19, 1.0e20, 4.0e20}) {
    float p = 0.5f, m = 0.0f, v = 0.0f;
    adamw_update(p, m, v, static_cast<float>(g), k);
    const double want = (1.0 - static_cast<double>(h.beta2)) * g * g;
    CAPTURE(g, v, want);
    REQUIRE(std::isfinite(v));
    REQUIRE(std::fabs(v - want) <= 4 * std::ldexp(want, -24));
    REQUIRE(std::isfinite(p));
  }
}

TEST_CASE("group constants follow the bias-corrected formula", "[step_math]") {
  AdamWConfig h;
  h.weight_decay = 0.1f;
  GroupConsts k = group_consts(group_params(h), 0.01f, 3);
  CHECK(k.step_size == static_cast<float>(0.01f / (1 - std::pow(static_cast<double>(0.9f), 3))));
  CHECK(k.inv_sqrt_bc2 == static_cast<float>(1 / std::sqrt(1 - std::pow(static_cast<double>(0.999f), 3))));
  CHECK(k.decay == static_cast<float>(1 - static_cast<double>(0.01f) * static_cast<double>(0.1f)));
  CHECK(k.classic == 0);
  CHECK(k.l2 == 0.0f);
  h.decoupled_weight_decay = false;
  h.bias_correction = false;
  k = group_consts(group_params(h), 0.01f, 3);
  CHECK(k.step_size == 0.01f);
  CHECK(k.inv_sqrt_bc2 == 1.0f);
  CHECK(k.decay == 1.0f);
  CHECK(k.classic == 1);
  CHECK(k.l2 == 0.1f);
}

TEST_CASE("sizes derived from numel never overflow", "[step_math]") {
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  CHECK(chunks_of(huge) == huge / kChunkElems + 1);
  CHECK(chunks_of(0) == 0);
  CHECK(chunks_of(kChunkElems) == 1);
  CHECK(chunks_of(kChunkElems + 1) == 2);
  // A tensor too large for one launch's grid is refused before anything is allocated.
  std::vector<float> x(1);
  std::vector<std::uint16_t> g(1);
  ParamTensor p{x.data(), g.data(), x.data(), x.data(), nullptr, std::int64_t{1} << 50, 0};
  try {
    (void)build_tensor_table({p});
    FAIL("a table of 2^35 chunks was built");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("chunks of 32768 elements"));
  }
  std::vector<ParamTensor> many(3, p);
  many[0].numel = many[1].numel = many[2].numel = std::int64_t{1} << 45;  // 2^30 chunks each
  CHECK_THROWS_AS(build_tensor_table(many), Error);
  CHECK_THROWS_AS(WorkspaceLayout::make(1, 1, SIZE_MAX / 8), Error);
  CHECK_THROWS_AS(WorkspaceLayout::make(SIZE_MAX / 16, 1, 1), Error);
}

TEST_CASE("the tensor table covers every element once in tensor order", "[step_math]") {
  std::vector<float> f(1 << 20);
  std::vector<std::uint16_t> h(1 << 20);
  const std::int64_t C = kChunkElems;
  const std::vector<std::int64_t> sizes = {0, 1, C - 1, C, C + 1, 0, 3 * C + 7, 0};
  std::vector<ParamTensor> ts;
  std::size_t at = 0, hat = 0;
  for (std::int64_t n : sizes) {
    ParamTensor p;
    p.numel = n;
    if (n > 0) {
      p.master = f.data() + at;
      p.exp_avg = f.data() + at + static_cast<std::size_t>(n);
      p.exp_avg_sq = f.data() + at + 2 * static_cast<std::size_t>(n);
      p.grad = h.data() + hat;
      p.model = h.data() + hat + static_cast<std::size_t>(n) + 1;  // odd offset: not 16-byte aligned
      at += 3 * static_cast<std::size_t>(n);
      hat += 2 * static_cast<std::size_t>(n) + 1;
    }
    ts.push_back(p);
  }
  const TensorTable table = build_tensor_table(ts);
  REQUIRE(table.tensors.size() == sizes.size());
  CHECK(table.numel_in_norm == 0 + 1 + (C - 1) + C + (C + 1) + 3 * C + 7);
  std::vector<std::int64_t> covered(sizes.size(), 0);
  std::int32_t last_tensor = -1;
  std::int64_t next_begin = 0;
  for (const ChunkDesc& c : table.chunks) {
    REQUIRE(c.len > 0);
    REQUIRE(c.len <= C);
    REQUIRE(c.tensor >= last_tensor);
    if (c.tensor != last_tensor) next_begin = 0;
    REQUIRE(c.begin == next_begin);  // contiguous, no gaps, no overlap
    REQUIRE(c.begin % C == 0);
    next_begin = c.begin + c.len;
    last_tensor = c.tensor;
    covered[static_cast<std::size_t>(c.tensor)] += c.len;
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) CHECK(covered[t] == sizes[t]);
  CHECK(table.chunks.size() == 0 + 1 + 1 + 1 + 2 + 0 + 4 + 0);
  CHECK(table.tensors[1].grad_vec == 1);
  CHECK(table.tensors[1].all_vec == 0);  // the model copy sits at an odd offset
  CHECK(table.tensors[0].model == nullptr);

  std::vector<std::uint32_t> counts(table.chunks.size(), 1);
  const auto per_tensor = per_tensor_counts(table.chunks, counts, sizes.size());
  CHECK(per_tensor == std::vector<std::int64_t>{0, 1, 1, 1, 2, 0, 4, 0});
}
