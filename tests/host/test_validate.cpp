// Validation of step configurations and tensor lists: each bad input is named, nothing runs.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "halfstep/error.hpp"
#include "halfstep/reference.hpp"
#include "host_buffers.hpp"

using namespace halfstep;
using halfstep_test::HostModel;
using halfstep_test::random_tensor;

namespace {

HostModel three_tensors(std::uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  HostModel m;
  for (std::int64_t n : {5, 8, 3}) m.tensors.push_back(random_tensor(rng, n, DType::f16, DType::f16, 1024.0f));
  return m;
}

// Expects `tensors` + `config` to be rejected with a message containing `needle`, by validate()
// and by the reference step, leaving the optimizer state unchanged.
void expect_rejected(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                     const std::string& needle) {
  CAPTURE(needle);
  REQUIRE_THROWS_AS(validate(tensors, config), Error);
  REQUIRE_THROWS_WITH(validate(tensors, config), Catch::Contains(needle));
  OptimizerState state = OptimizerState::initial(StepConfig{});
  const OptimizerState before = state;
  REQUIRE_THROWS_WITH(reference::step(tensors, config, state), Catch::Contains(needle));
  REQUIRE(state == before);
}

}  // namespace

TEST_CASE("a well-formed step passes validation", "[validate]") {
  HostModel m = three_tensors();
  CHECK_NOTHROW(validate(m.views(), StepConfig{}));
}

TEST_CASE("AdamWConfig rejects a negative or non-finite learning rate", "[validate]") {
  AdamWConfig h;
  h.lr = -1e-3f;
  CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.lr"));
  h.lr = std::nanf("");
  CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.lr"));
  h.lr = INFINITY;
  CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.lr"));
  h.lr = 0.0f;
  CHECK_NOTHROW(h.validate());
}

TEST_CASE("AdamWConfig rejects betas outside the half-open unit interval", "[validate]") {
  for (float b : {-0.1f, 1.0f, 1.5f, std::nanf("")}) {
    AdamWConfig h;
    h.beta1 = b;
    CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.beta1"));
    h = AdamWConfig{};
    h.beta2 = b;
    CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.beta2"));
  }
  AdamWConfig h;
  h.beta1 = 0.0f;
  CHECK_NOTHROW(h.validate());
}

TEST_CASE("AdamWConfig rejects eps <= 0 and negative weight decay", "[validate]") {
  AdamWConfig h;
  h.eps = 0.0f;
  CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.eps"));
  h = AdamWConfig{};
  h.weight_decay = -0.01f;
  CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.weight_decay"));
}

TEST_CASE("limits that match what the device computes: eps and min_scale normal, lr * wd < 1", "[validate]") {
  AdamWConfig h;
  for (float eps : {1e-45f, 1e-39f, 0x1p-127f}) {  // subnormal: m / eps overflows on the device
    h.eps = eps;
    CAPTURE(eps);
    CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.eps must be a normal fp32 number"));
  }
  h.eps = 0x1p-126f;
  CHECK_NOTHROW(h.validate());
  h = AdamWConfig{};
  h.lr = 10.0f;
  h.weight_decay = 0.1f;  // 10 · 0.1 = 1: every weight multiplied by 0
  CHECK_THROWS_WITH(h.validate(), Catch::Contains("AdamWConfig.lr * weight_decay must be < 1"));
  h.lr = 1e30f;
  h.weight_decay = 0.01f;
  CHECK_THROWS_WITH(h.validate(), Catch::Contains("lr * weight_decay must be < 1"));
  h.decoupled_weight_decay = false;  // classic L2 multiplies nothing by 1 - lr·wd
  CHECK_NOTHROW(h.validate());
  h = AdamWConfig{};
  h.lr = 9.0f;
  h.weight_decay = 0.1f;
  CHECK_NOTHROW(h.validate());

  ScalerConfig s;
  for (float min : {1e-39f, 1e-45f, 0x1p-127f}) {  // 1 / S overflows fp32
    s.min_scale = min;
    s.init_scale = 1.0f;
    CAPTURE(min);
    CHECK_THROWS_WITH(s.validate(), Catch::Contains("ScalerConfig.min_scale must be a normal fp32 number"));
  }
  s.min_scale = 0x1p-126f;
  CHECK_NOTHROW(s.validate());
}

TEST_CASE("buffers whose end would wrap past the address space are rejected", "[validate]") {
  HostModel m = three_tensors();
  auto v = m.views();
  v[0].numel = std::int64_t{1} << 60;  // 2^62 bytes of master from a heap address
  v[0].master = reinterpret_cast<float*>(std::uintptr_t{0xFFFF000000000000ull});
  CHECK_THROWS_WITH(validate(v, StepConfig{}), Catch::Contains("would run past the end of the address space"));
  v = m.views();
  v[1].numel = std::numeric_limits<std::int64_t>::max();
  CHECK_THROWS_WITH(validate(v, StepConfig{}), Catch::Contains("tensors[1].numel is too large"));
}

TEST_CASE("a step config without groups is rejected", "[validate]") {
  HostModel m = three_tensors();
  StepConfig c;
  c.groups.clear();
  expect_rejected(m.views(), c, "StepConfig.groups must hold at least one");
}

TEST_CASE("a bad group is rejected with its index", "[validate]") {
  HostModel m = three_tensors();
  StepConfig c;
  c.groups.resize(3);
  c.groups[2].eps = -1.0f;
  expect_rejected(m.views(), c, "StepConfig.groups[2]: AdamWConfig.eps");
}

TEST_CASE("a tensor naming a missing group is rejected", "[validate]") {
  HostModel m = three_tensors();
  auto v = m.views();
  v[1].group = 1;
  expect_rejected(v, StepConfig{}, "tensors[1].group must name one of the 1");
  v[1].group = -1;
  expect_rejected(v, StepConfig{}, "tensors[1].group");
}

TEST_CASE("a negative numel is rejected", "[validate]") {
  HostModel m = three_tensors();
  auto v = m.views();
  v[2].numel = -4;
  expect_rejected(v, StepConfig{}, "tensors[2].numel must be >= 0, got -4");
}

TEST_CASE("null buffers are rejected where numel is positive, but a null gradient is none", "[validate]") {
  HostModel m = three_tensors();
  auto v = m.views();
  v[0].master = nullptr;
  expect_rejected(v, StepConfig{}, "tensors[0].master is null");
  v = m.views();
  v[1].grad = nullptr;  // a tensor without a gradient (torch.optim: .grad is None)
  CHECK_NOTHROW(validate(v, StepConfig{}));
  v = m.views();
  v[2].exp_avg = nullptr;
  expect_rejected(v, StepConfig{}, "tensors[2].exp_avg is null");
  v = m.views();
  v[2].exp_avg_sq = nullptr;
  expect_rejected(v, StepConfig{}, "tensors[2].exp_avg_sq is null");
}

TEST_CASE("a null model copy and null buffers of empty tensors are allowed", "[validate]") {
  HostModel m = three_tensors();
  auto v = m.views();
  v[1].model = nullptr;
  ParamTensor empty;
  empty.numel = 0;
  v.insert(v.begin(), empty);
  v.push_back(empty);
  CHECK_NOTHROW(validate(v, StepConfig{}));
}

TEST_CASE("f32 model copies and formats outside the three are rejected", "[validate]") {
  HostModel m = three_tensors();
  StepConfig c;
  c.model_dtype = DType::f32;
  expect_rejected(m.views(), c, "StepConfig.model_dtype must be f16 or bf16");
  c = StepConfig{};
  c.grad_dtype = static_cast<DType>(3);
  expect_rejected(m.views(), c, "StepConfig.grad_dtype must be f16, bf16 or f32, got code 3");
  c = StepConfig{};
  c.compute_dtype = static_cast<DType>(9);
  expect_rejected(m.views(), c, "StepConfig.compute_dtype must be f16, bf16 or f32, got code 9");
  // fp32 gradients: validated with 4-byte elements (a 16-bit gradient buffer is too small for
  // them, which validate cannot see; its alignment it can).
  HostModel f = halfstep_test::random_model(3, {5, 9}, 1.0f, DType::f32, DType::bf16);
  c = StepConfig{};
  c.grad_dtype = DType::f32;
  c.model_dtype = DType::bf16;
  CHECK_NOTHROW(validate(f.views(), c));
  auto v = f.views();
  v[1].grad = static_cast<const char*>(v[1].grad) + 2;
  expect_rejected(v, c, "tensors[1].grad must be aligned to 4 bytes");
}

TEST_CASE("a negative or non-finite max_grad_norm is rejected", "[validate]") {
  HostModel m = three_tensors();
  for (float bad : {-1.0f, INFINITY, std::nanf("")}) {
    StepConfig c;
    c.max_grad_norm = bad;
    expect_rejected(m.views(), c, "StepConfig.max_grad_norm");
  }
}

TEST_CASE("bad scaler and spike configs are rejected through StepConfig", "[validate]") {
  HostModel m = three_tensors();
  StepConfig c;
  c.scaler.growth_interval = 0;
  expect_rejected(m.views(), c, "ScalerConfig.growth_interval");
  c = StepConfig{};
  c.spike.ema_beta = 2.0f;
  expect_rejected(m.views(), c, "SpikeConfig.ema_beta");
}

TEST_CASE("overlapping buffers are rejected naming both", "[validate]") {
  HostModel m = three_tensors();
  auto v = m.views();
  v[1].exp_avg = static_cast<float*>(v[1].master) + 2;  // moment shares memory with the master
  expect_rejected(v, StepConfig{}, "overlap");
  v = m.views();
  v[2].master = v[0].master;  // two tensors share a master (sizes 5 and 3)
  expect_rejected(v, StepConfig{}, "tensors[0].master and tensors[2].master overlap");
  v = m.views();
  v[0].model = const_cast<void*>(v[0].grad);  // model copy written over the gradient
  expect_rejected(v, StepConfig{}, "overlap");
}

TEST_CASE("buffers that only touch end to end do not overlap", "[validate]") {
  std::vector<float> block(40);
  std::vector<std::uint16_t> halves(20);
  ParamTensor a{block.data(), halves.data(), block.data() + 10, block.data() + 20, halves.data() + 10, 10, 0};
  ParamTensor b = a;
  b.master = block.data() + 30;
  b.grad = halves.data() + 10;
  b.model = nullptr;
  b.exp_avg = nullptr;
  b.numel = 0;  // an empty tensor anywhere is fine
  CHECK_NOTHROW(validate({a, b}, StepConfig{}));
}

TEST_CASE("misaligned buffers are rejected", "[validate]") {
  HostModel m = three_tensors();
  std::vector<unsigned char> raw(64);
  auto v = m.views();
  v[0].master = reinterpret_cast<float*>(raw.data() + 2);
  expect_rejected(v, StepConfig{}, "tensors[0].master must be aligned to 4 bytes");
  v = m.views();
  v[1].grad = raw.data() + 1;
  expect_rejected(v, StepConfig{}, "tensors[1].grad must be aligned to 2 bytes");
}

TEST_CASE("an empty tensor list is a valid step", "[validate]") {
  CHECK_NOTHROW(validate({}, StepConfig{}));
}
