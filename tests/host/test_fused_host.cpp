// FusedAdamW on the host: the reference backend end to end, and the setup checks of the CUDA
// backend that need no device (they run before CUDA is touched).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>

#include "halfstep/checkpoint.hpp"
#include "halfstep/error.hpp"
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

TEST_CASE("the reference backend steps exactly like reference::step", "[fused][reference]") {
  HostModel a = model(40), b = a;
  StepConfig c;
  c.max_grad_norm = 1.0f;
  FusedAdamW opt(a.views(), c, Backend::reference);
  OptimizerState s = OptimizerState::initial(c);
  std::mt19937_64 rng(41);
  for (int i = 0; i < 30; ++i) {
    for (std::size_t t = 0; t < a.tensors.size(); ++t) {
      refill_grads(rng, a.tensors[t], DType::f16, opt.loss_scale());
      b.tensors[t].grad = a.tensors[t].grad;
    }
    if (i % 9 == 4) a.tensors[3].grad[2] = b.tensors[3].grad[2] = 0x7C00;
    opt.step();
    const StepReport r = reference::step(b.views(), c, s);
    const StepReport mine = opt.last_report();
    REQUIRE(mine.outcome == r.outcome);
    REQUIRE(mine.step == r.step);
    if (r.outcome != Outcome::skipped_overflow) REQUIRE(mine.grad_norm == r.grad_norm);
    REQUIRE(*opt.device_loss_scale() == s.scaler.scale);
    for (std::size_t t = 0; t < a.tensors.size(); ++t) REQUIRE(a.tensors[t] == b.tensors[t]);
  }
  CHECK(opt.state() == s);
  CHECK(opt.backend() == Backend::reference);
}

TEST_CASE("last_report before any step is a usage error", "[fused]") {
  HostModel m = model(42);
  FusedAdamW opt(m.views(), StepConfig{}, Backend::reference);
  CHECK(kind_of([&] { opt.last_report(); }) == ErrorKind::usage);
  CHECK(kind_of([&] { opt.nonfinite_counts(); }) == ErrorKind::usage);
}

TEST_CASE("nonfinite_counts names the tensors that overflowed", "[fused]") {
  HostModel m = model(43);
  m.tensors[3].grad[16] = 0x7E00;
  m.tensors[3].grad[0] = 0xFC00;
  m.tensors[1].grad[1] = 0x7C00;
  FusedAdamW opt(m.views(), StepConfig{}, Backend::reference);
  opt.step();
  CHECK(opt.nonfinite_counts() == std::vector<std::int64_t>{0, 1, 0, 2});
  CHECK(opt.last_report().first_nonfinite_tensor == 1);
}

TEST_CASE("set_lr changes the next step and rejects bad groups and rates", "[fused]") {
  HostModel a = model(44), b = a;
  StepConfig c;
  FusedAdamW opt(a.views(), c, Backend::reference);
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
  HostModel m = model(45);
  FusedAdamW opt(m.views(), StepConfig{}, Backend::reference);
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
  HostModel m = model(46);
  StepConfig c;
  c.scaler.max_scale = 1024.0f;
  c.scaler.init_scale = 1024.0f;
  FusedAdamW opt(m.views(), c, Backend::reference);
  const StepConfig other;  // max_scale 2^24
  CHECK_THROWS_WITH(opt.load_state(encode_state(OptimizerState::initial(other), other)),
                    Catch::Contains("ScalerConfig.max_scale"));
  CHECK(opt.loss_scale() == 1024.0f);
}

TEST_CASE("a save/load round trip restores the learning rates set by set_lr and device_lr", "[fused][checkpoint]") {
  HostModel m = model(50);
  StepConfig c;
  c.groups.resize(2);
  m.tensors[1].group = 1;
  FusedAdamW opt(m.views(), c, Backend::reference);
  opt.set_lr(0, 2.5e-4f);
  *opt.device_lr(1) = 7e-3f;
  opt.step();
  const std::string saved = opt.save_state();
  FusedAdamW fresh(m.views(), c, Backend::reference);
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
  for (float bad : {NAN, -1e-3f, INFINITY, 20.0f}) {  // 20 · wd 0.1 >= 1
    HostModel m = model(51), before = m;
    StepConfig c;
    c.groups[0].weight_decay = 0.1f;
    FusedAdamW opt(m.views(), c, Backend::reference);
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
  HostModel m = model(52);
  StepConfig c;
  c.groups[0].weight_decay = 0.5f;
  FusedAdamW opt(m.views(), c, Backend::reference);
  CHECK_THROWS_WITH(opt.set_lr(0, 2.0f), Catch::Contains("lr * weight_decay must be < 1"));
  CHECK(opt.config().groups[0].lr == 1e-3f);
  opt.set_lr(0, 1.9f);
}

TEST_CASE("setup rejects bad input before touching CUDA", "[fused][validate]") {
  HostModel m = model(47);
  for (Backend backend : {Backend::cuda, Backend::reference}) {
    auto v = m.views();
    v[1].grad = nullptr;
    CHECK_THROWS_WITH(FusedAdamW(v, StepConfig{}, backend), Catch::Contains("tensors[1].grad is null"));
    v = m.views();
    v[3].group = 2;
    CHECK_THROWS_WITH(FusedAdamW(v, StepConfig{}, backend), Catch::Contains("tensors[3].group"));
    StepConfig c;
    c.grad_dtype = DType::f32;
    CHECK_THROWS_WITH(FusedAdamW(m.views(), c, backend), Catch::Contains("StepConfig.grad_dtype"));
    c = StepConfig{};
    c.groups.clear();
    CHECK_THROWS_WITH(FusedAdamW(m.views(), c, backend), Catch::Contains("StepConfig.groups"));
    v = m.views();
    v[0].exp_avg_sq = v[0].exp_avg + 1;
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
  HostModel m = model(49);
  FusedAdamW a(m.views(), StepConfig{}, Backend::reference);
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
  HostModel m = model(53);
  FusedAdamW opt(m.views(), StepConfig{}, Backend::reference);
  CHECK_THROWS_WITH(opt.nonfinite_counts(), Catch::StartsWith("nonfinite_counts: no step has run yet"));
  CHECK_THROWS_WITH(opt.last_report(), Catch::StartsWith("last_report: no step has run yet"));
}

TEST_CASE("a step past kCounterLimit attempts is refused", "[fused]") {
  HostModel m = model(54);
  StepConfig c;
  FusedAdamW opt(m.views(), c, Backend::reference);
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
  // A billion parameters in one tensor: 30518 chunks of 52 bytes each (a 16-byte descriptor and a
  // 36-byte partial: five Σg² digits and four counts).
  const std::size_t big = workspace_bytes({1000000000}, 2);
  CHECK(big > 30518u * 52u);
  CHECK(big < 30518u * 52u + 8192u);
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
