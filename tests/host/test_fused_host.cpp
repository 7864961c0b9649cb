// FusedAdamW on the host: the reference backend end to end, and the setup checks of the CUDA
// backend that need no device (they run before CUDA is touched).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>

#include "halfstep/checkpoint.hpp"
#include "halfstep/error.hpp"
#include "halfstep/formats.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/reference.hpp"
#include "host_buffers.hpp"

using namespace halfstep;
using halfstep_test::HostModel;
using halfstep_test::random_tensor;
using halfstep_test::refill_grads;

namespace {

HostModel model(std::uint64_t seed, float scale = 65536.0f) {
  std::mt19937_64 rng(seed);
  HostModel m;
  for (std::int64_t n : {64, 3, 0, 17}) m.tensors.push_back(random_tensor(rng, n, DType::f16, DType::f16, scale));
  return m;
}

ErrorKind kind_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.kind();
  }
  FAIL("no halfstep::Error thrown");
  return ErrorKind::usage;
}

}  // namespace

// The step's rules stated once more, plainly, in long double: skip on any inf/NaN and halve the
// scale (the default hysteresis of 1); else the norm of the unscaled gradient, PyTorch's clip
// coefficient, and AdamW with bias correction on every element. No code of the library's step is
// used but the fp16 conversions.
struct PlainAdamW {
  const StepConfig& c;
  long double scale;
  std::int64_t t = 0;

  Outcome step(HostModel& m, long double& norm_out) {
    long double sum = 0.0L;
    for (const auto& x : m.tensors) {
      for (std::uint16_t g : x.grad) {
        const long double v = from_bits16(DType::f16, g);
        if (!std::isfinite(v)) {
          scale = std::max<long double>(scale / 2, c.scaler.min_scale);
          return Outcome::skipped_overflow;
        }
        sum += (v / scale) * (v / scale);
      }
    }
    norm_out = std::sqrt(sum);
    const long double clip = std::min<long double>(1.0L, c.max_grad_norm / (norm_out + 1e-6L));
    ++t;
    const AdamWConfig& h = c.groups[0];
    const long double bc1 = 1 - std::pow(static_cast<long double>(h.beta1), t);
    const long double bc2 = 1 - std::pow(static_cast<long double>(h.beta2), t);
    for (auto& x : m.tensors) {
      for (std::size_t i = 0; i < x.master.size(); ++i) {
        const long double g = from_bits16(DType::f16, x.grad[i]) / scale * clip;
        const long double mo = h.beta1 * static_cast<long double>(x.exp_avg[i]) + (1 - static_cast<long double>(h.beta1)) * g;
        const long double v = h.beta2 * static_cast<long double>(x.exp_avg_sq[i]) + (1 - static_cast<long double>(h.beta2)) * g * g;
        const long double p = x.master[i] * (1 - static_cast<long double>(h.lr) * h.weight_decay) -
                              h.lr / bc1 * mo / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
        x.master[i] = static_cast<float>(p);
        x.exp_avg[i] = static_cast<float>(mo);
        x.exp_avg_sq[i] = static_cast<float>(v);
      }
    }
    return Outcome::applied;
  }
};

// |a - b| in units of fp32's spacing at the larger of the two.
double ulps(float a, float b) {
  const float big = std::max(std::fabs(a), std::fabs(b));
  const double spacing = std::nextafter(big, std::numeric_limits<float>::infinity()) - big;
  return a == b ? 0.0 : std::fabs(static_cast<double>(a) - b) / std::max(spacing, 1e-45);
}

TEST_CASE("the reference backend steps as the rules, stated plainly, say", "[fused][reference]") {
  HostModel a = model(40), plain = a;
  StepConfig c;
  c.max_grad_norm = 1.0f;
  c.groups[0].weight_decay = 0.01f;
  FusedAdamW opt(a.views(), c, Backend::reference);
  PlainAdamW rules{c, c.scaler.init_scale};
  std::mt19937_64 rng(41);
  int skipped = 0;
  for (int i = 0; i < 30; ++i) {
    for (std::size_t t = 0; t < a.tensors.size(); ++t) {
      refill_grads(rng, a.tensors[t], DType::f16, opt.loss_scale());
      plain.tensors[t].grad = a.tensors[t].grad;
    }
    if (i % 9 == 4) a.tensors[3].grad[2] = plain.tensors[3].grad[2] = 0x7C00;
    const HostModel before = a;
    opt.step();
    long double norm = 0;
    const Outcome want = rules.step(plain, norm);
    const StepReport r = opt.last_report();
    CAPTURE(i);
    REQUIRE(r.outcome == want);
    REQUIRE(r.step == rules.t);
    REQUIRE(r.scale_next == static_cast<float>(rules.scale));  // powers of two: exact
    if (want != Outcome::applied) {
      ++skipped;
      for (std::size_t t = 0; t < a.tensors.size(); ++t) REQUIRE(a.tensors[t] == before.tensors[t]);
      continue;
    }
    // The norm: both are Σg² rounded once (double) or nearly exact (long double), so they agree
    // to double's precision.
    REQUIRE(std::fabs(r.grad_norm - static_cast<double>(norm)) <= 1e-14 * static_cast<double>(norm));
    // The library computes each element in double and rounds once; the plain rules in long double
    // and round once: the fp32 results differ by at most one rounding, 1 ulp. The plain run keeps
    // its own state, so the error could grow by a step's worth per step; copying the library's
    // values back keeps each step's comparison to one step.
    for (std::size_t t = 0; t < a.tensors.size(); ++t) {
      for (std::size_t k = 0; k < a.tensors[t].master.size(); ++k) {
        REQUIRE(ulps(a.tensors[t].master[k], plain.tensors[t].master[k]) <= 1.0);
        REQUIRE(ulps(a.tensors[t].exp_avg[k], plain.tensors[t].exp_avg[k]) <= 1.0);
        REQUIRE(ulps(a.tensors[t].exp_avg_sq[k], plain.tensors[t].exp_avg_sq[k]) <= 1.0);
        REQUIRE(a.tensors[t].model[k] == to_bits16(DType::f16, a.tensors[t].master[k]));
      }
      plain.tensors[t] = a.tensors[t];
    }
  }
  CHECK(skipped == 3);  // steps 4, 13 and 22
  CHECK(opt.backend() == Backend::reference);
}

TEST_CASE("last_report before any step is a usage error", "[fused]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(42);
  FusedAdamW opt(m.views(), StepConfig{}, backend);
  CHECK(kind_of([&] { opt.last_report(); }) == ErrorKind::usage);
  CHECK(kind_of([&] { opt.nonfinite_counts(); }) == ErrorKind::usage);
}

TEST_CASE("nonfinite_counts names the tensors that overflowed", "[fused]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(43);
  m.tensors[3].grad[16] = 0x7E00;
  m.tensors[3].grad[0] = 0xFC00;
  m.tensors[1].grad[1] = 0x7C00;
  FusedAdamW opt(m.views(), StepConfig{}, backend);
  opt.step();
  CHECK(opt.nonfinite_counts() == std::vector<std::int64_t>{0, 1, 0, 2});
  CHECK(opt.last_report().first_nonfinite_tensor == 1);
}

TEST_CASE("set_lr changes the next step and rejects bad groups and rates", "[fused]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel a = model(44), b = a;
  StepConfig c;
  FusedAdamW opt(a.views(), c, backend);
  opt.set_lr(0, 0.0f);
  opt.step();
  for (std::size_t t = 0; t < a.tensors.size(); ++t) CHECK(a.tensors[t].master == b.tensors[t].master);
  CHECK(opt.config().groups[0].lr == 0.0f);
  CHECK(*opt.device_lr(0) == 0.0f);
  CHECK_THROWS_WITH(opt.set_lr(1, 0.1f), Catch::Contains("group must name one of the 1"));
  CHECK_THROWS_WITH(opt.set_lr(0, -0.1f), Catch::Contains("lr must be finite and >= 0"));
  CHECK_THROWS_WITH(opt.set_lr(0, NAN), Catch::Contains("lr must be finite"));
  CHECK_THROWS_AS(opt.device_lr(-1), Error);
}

TEST_CASE("save_state and load_state round-trip and refuse corrupt input", "[fused][checkpoint]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(45);
  FusedAdamW opt(m.views(), StepConfig{}, backend);
  for (int i = 0; i < 3; ++i) opt.step();
  const std::string saved = opt.save_state();
  const OptimizerState at_save = opt.state();
  opt.step();
  CHECK(opt.state() != at_save);
  std::string bad = saved;
  bad[bad.size() / 2] = static_cast<char>(bad[bad.size() / 2] ^ 0x20);
  const OptimizerState before_bad = opt.state();
  CHECK(kind_of([&] { opt.load_state(bad); }) == ErrorKind::corrupt_state);
  CHECK(kind_of([&] { opt.load_state(saved.substr(0, 10)); }) == ErrorKind::corrupt_state);
  CHECK(opt.state() == before_bad);
  opt.load_state(saved);
  CHECK(opt.state() == at_save);
  CHECK(decode_state(opt.save_state()).state == at_save);
}

TEST_CASE("load_state refuses a state that does not fit the config", "[fused][checkpoint]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(46);
  StepConfig c;
  c.scaler.max_scale = 1024.0f;
  c.scaler.init_scale = 1024.0f;
  FusedAdamW opt(m.views(), c, backend);
  const StepConfig other;  // max_scale 2^24
  CHECK_THROWS_WITH(opt.load_state(encode_state(OptimizerState::initial(other), other)),
                    Catch::Contains("ScalerConfig.max_scale"));
  CHECK(opt.loss_scale() == 1024.0f);
}

TEST_CASE("a save/load round trip restores the learning rates set by set_lr and device_lr", "[fused][checkpoint]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(50);
  StepConfig c;
  c.groups.resize(2);
  m.tensors[1].group = 1;
  FusedAdamW opt(m.views(), c, backend);
  opt.set_lr(0, 2.5e-4f);
  *opt.device_lr(1) = 7e-3f;
  opt.step();
  const std::string saved = opt.save_state();
  FusedAdamW fresh(m.views(), c, backend);
  CHECK(fresh.learning_rates() == std::vector<float>{1e-3f, 1e-3f});
  fresh.load_state(saved);
  CHECK(fresh.learning_rates() == std::vector<float>{2.5e-4f, 7e-3f});
  CHECK(fresh.config().groups[1].lr == 7e-3f);
  CHECK(fresh.state() == opt.state());
  // A NaN written through device_lr cannot be checkpointed.
  *opt.device_lr(0) = NAN;
  CHECK(kind_of([&] { opt.save_state(); }) == ErrorKind::usage);
}

TEST_CASE("an invalid learning rate written through device_lr skips the step with a reason", "[fused]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  for (float bad : {NAN, -1e-3f, INFINITY, 20.0f}) {  // 20 · wd 0.1 >= 1
    HostModel m = model(51), before = m;
    StepConfig c;
    c.groups[0].weight_decay = 0.1f;
    FusedAdamW opt(m.views(), c, backend);
    *opt.device_lr(0) = bad;
    opt.step();
    const StepReport r = opt.last_report();
    CAPTURE(bad);
    CHECK(r.outcome == Outcome::skipped_nonfinite_update);
    CHECK(r.reason == SkipReason::invalid_learning_rate);
    CHECK(r.step == 0);
    CHECK(r.scale_next == r.scale_used);
    for (std::size_t t = 0; t < m.tensors.size(); ++t) CHECK(m.tensors[t] == before.tensors[t]);
    *opt.device_lr(0) = 1e-3f;  // repaired: the next step applies
    opt.step();
    CHECK(opt.last_report().outcome == Outcome::applied);
  }
}

TEST_CASE("set_lr refuses a rate whose decoupled decay would flip the weights", "[fused][validate]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(52);
  StepConfig c;
  c.groups[0].weight_decay = 0.5f;
  FusedAdamW opt(m.views(), c, backend);
  CHECK_THROWS_WITH(opt.set_lr(0, 2.0f), Catch::Contains("lr * weight_decay must be < 1"));
  CHECK(opt.config().groups[0].lr == 1e-3f);
  opt.set_lr(0, 1.9f);
}

TEST_CASE("setup rejects bad input before touching CUDA", "[fused][validate]") {
  HostModel m = model(47);
  for (Backend backend : {Backend::cuda, Backend::reference, Backend::host}) {
    auto v = m.views();
    v[1].exp_avg = nullptr;
    CHECK_THROWS_WITH(FusedAdamW(v, StepConfig{}, backend), Catch::Contains("tensors[1].exp_avg is null"));
    v = m.views();
    v[3].group = 2;
    CHECK_THROWS_WITH(FusedAdamW(v, StepConfig{}, backend), Catch::Contains("tensors[3].group"));
    StepConfig c;
    c.model_dtype = DType::f32;
    CHECK_THROWS_WITH(FusedAdamW(m.views(), c, backend), Catch::Contains("StepConfig.model_dtype"));
    c = StepConfig{};
    c.groups.clear();
    CHECK_THROWS_WITH(FusedAdamW(m.views(), c, backend), Catch::Contains("StepConfig.groups"));
    v = m.views();
    v[0].exp_avg_sq = static_cast<float*>(v[0].exp_avg) + 1;
    CHECK_THROWS_WITH(FusedAdamW(v, StepConfig{}, backend), Catch::Contains("overlap"));
    c = StepConfig{};
    c.scaler.backoff_factor = 2.0f;
    CHECK_THROWS_WITH(FusedAdamW(m.views(), c, backend), Catch::Contains("ScalerConfig.backoff_factor"));
    CHECK(kind_of([&] { FusedAdamW(m.views(), c, backend); }) == ErrorKind::invalid_argument);
  }
  CHECK_THROWS_WITH(FusedAdamW(m.views(), StepConfig{}, static_cast<Backend>(9)), Catch::Contains("backend must be"));
}

TEST_CASE("the CUDA backend refuses host buffers", "[fused][validate]") {
  // Without a GPU the constructor stops at the missing device; with one, at the first buffer
  // that is not device memory. Either way nothing is allocated and an Error says why.
  HostModel m = model(48);
  try {
    FusedAdamW opt(m.views(), StepConfig{});
    FAIL("host buffers were accepted by Backend::cuda");
  } catch (const Error& e) {
    const std::string what = e.what();
    const bool no_device = what.find("needs a CUDA device") != std::string::npos;
    const bool host_memory = what.find("tensors[0].master must be device memory") != std::string::npos;
    CAPTURE(what);
    CHECK((no_device || host_memory));
    CHECK(e.kind() == (no_device ? ErrorKind::cuda : ErrorKind::invalid_argument));
  }
}

TEST_CASE("a moved-from FusedAdamW hands its state to the new owner and refuses every call", "[fused]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(49);
  FusedAdamW a(m.views(), StepConfig{}, backend);
  a.step();
  FusedAdamW b = std::move(a);
  CHECK(b.last_report().attempt == 1);
  b.step();
  CHECK(b.state().attempts == 2);
  // The moved-from object: every call is a usage error, never a crash.
  const std::vector<std::function<void()>> calls = {
      [&] { a.step(); }, [&] { a.last_report(); }, [&] { a.nonfinite_counts(); },
      [&] { a.set_lr(0, 1e-3f); }, [&] { a.device_lr(0); }, [&] { a.device_loss_scale(); },
      [&] { a.loss_scale(); }, [&] { a.state(); }, [&] { a.save_state(); },
      [&] { a.load_state(b.save_state()); }, [&] { a.config(); }, [&] { a.backend(); },
      [&] { a.chunk_count(); }, [&] { a.launches_per_step(); }, [&] { a.learning_rates(); }};
  for (const auto& call : calls) {
    CHECK(kind_of(call) == ErrorKind::usage);
  }
  CHECK_THROWS_WITH(a.step(), Catch::Contains("moved from"));
}

TEST_CASE("each call before the first step names itself", "[fused]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(53);
  FusedAdamW opt(m.views(), StepConfig{}, backend);
  CHECK_THROWS_WITH(opt.nonfinite_counts(), Catch::StartsWith("nonfinite_counts: no step has run yet"));
  CHECK_THROWS_WITH(opt.last_report(), Catch::StartsWith("last_report: no step has run yet"));
}

TEST_CASE("a step past kCounterLimit attempts is refused", "[fused]") {
  const Backend backend = GENERATE(Backend::reference, Backend::host);  // the same rules on both host backends
  HostModel m = model(54);
  StepConfig c;
  FusedAdamW opt(m.views(), c, backend);
  OptimizerState full = OptimizerState::initial(c);
  full.attempts = kCounterLimit;
  full.step = 10;
  opt.load_state(encode_state(full, c));
  CHECK(kind_of([&] { opt.step(); }) == ErrorKind::usage);
  CHECK(opt.state() == full);
  full.attempts = kCounterLimit - 1;
  opt.load_state(encode_state(full, c));
  opt.step();
  CHECK(opt.state().attempts == kCounterLimit);
}

TEST_CASE("reference::step at kCounterLimit attempts is refused and changes nothing", "[fused]") {
  // Found by the checkpoint fuzzer: a checkpoint at attempts = overflows = 2^53 loaded, the free
  // step ran (attempts saturated, step became 1) and the next validation refused the state
  // (overflows > attempts - step).
  HostModel m = model(55);
  StepConfig c;
  OptimizerState full = OptimizerState::initial(c);
  full.attempts = kCounterLimit;
  full.scaler.overflows = kCounterLimit;
  OptimizerState state = full;
  const HostModel before = m;
  CHECK(kind_of([&] { (void)reference::step(m.views(), c, state); }) == ErrorKind::usage);
  CHECK(state == full);
  for (std::size_t t = 0; t < m.tensors.size(); ++t) CHECK(m.tensors[t].master == before.tensors[t].master);
  state.attempts = kCounterLimit - 1;
  state.scaler.overflows = kCounterLimit - 1;
  (void)reference::step(m.views(), c, state);
  CHECK(state.attempts == kCounterLimit);
  CHECK_NOTHROW(validate_state(state, c));
}

TEST_CASE("workspace_bytes counts the table the partials and the state", "[fused]") {
  const std::size_t one = workspace_bytes({1}, 1);
  const std::size_t many = workspace_bytes(std::vector<std::int64_t>(1000, 1), 1);
  CHECK(one > 0);
  CHECK(many > one);  // a table row and a chunk per tensor
  // A billion parameters in one tensor: 30518 chunks of 56 bytes each (a 16-byte descriptor and a
  // 40-byte partial: six Σg² digits and four counts).
  const std::size_t big = workspace_bytes({1000000000}, 2);
  CHECK(big > 30518u * 56u);
  CHECK(big < 30518u * 56u + 8192u);
  CHECK(workspace_bytes({0, 0}, 1) < workspace_bytes({1, 1}, 1));
  CHECK_THROWS_WITH(workspace_bytes({5, -1}, 1), Catch::Contains("tensor_numels[1] must be >= 0"));
}

TEST_CASE("workspace_bytes refuses sizes that would wrap instead of returning fewer bytes", "[fused][validate]") {
  const std::size_t one_group = workspace_bytes({1}, 1);
  CHECK(workspace_bytes({1}, 1000) > one_group);
  for (std::size_t groups : {std::size_t{1} << 60, SIZE_MAX, SIZE_MAX / 4}) {
    CAPTURE(groups);
    CHECK(kind_of([&] { workspace_bytes({1}, groups); }) == ErrorKind::invalid_argument);
  }
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  CHECK_THROWS_WITH(workspace_bytes({huge}, 1), Catch::Contains("chunks of 32768 elements"));
  CHECK_THROWS_WITH(workspace_bytes(std::vector<std::int64_t>(3, std::int64_t{1} << 46), 1),
                    Catch::Contains("chunks"));
}
