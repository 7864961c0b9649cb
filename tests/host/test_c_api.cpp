// The C API over FusedAdamW, on the reference backend: the same results as the C++ API, errors as
// status codes with messages, checkpoints through caller-owned buffers.
#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <cmath>
#include <random>
#include <vector>

#include "halfstep/halfstep.h"
#include "block8_pieces.hpp"
#include "c_tensor.hpp"
#include "halfstep/reference.hpp"
#include "host_buffers.hpp"
#include "sharded_run.hpp"
#include "halfstep/fused_adamw.hpp"
#include <string>

using halfstep_test::HostModel;
using halfstep_test::random_tensor;

namespace {

std::vector<halfstep_tensor> c_tensors(HostModel& m) {
  std::vector<halfstep_tensor> out;
  for (const halfstep::ParamTensor& p : m.views()) {
    out.push_back(halfstep_test::c_tensor(p));
  }
  return out;
}

HostModel model(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostModel m;
  for (std::int64_t n : {40, 0, 9}) {
    m.tensors.push_back(random_tensor(rng, n, halfstep::DType::f16, halfstep::DType::f16, 65536.0f));
  }
  return m;
}

halfstep_config reference_config() {
  halfstep_config c;
  halfstep_config_init(&c);
  c.backend = HALFSTEP_BACKEND_REFERENCE;
  c.max_grad_norm = 1.0f;
  return c;
}

}  // namespace

TEST_CASE("c api defaults match the C++ defaults", "[c_api]") {
  halfstep_config c;
  halfstep_config_init(&c);
  const halfstep::StepConfig s;
  CHECK(c.init_scale == s.scaler.init_scale);
  CHECK(c.growth_interval == s.scaler.growth_interval);
  CHECK(c.spike_enabled == 0);
  CHECK(c.backend == HALFSTEP_BACKEND_CUDA);
  halfstep_group g;
  halfstep_group_init(&g);
  CHECK(g.lr == s.groups[0].lr);
  CHECK(g.beta2 == s.groups[0].beta2);
  CHECK(g.decoupled_weight_decay == 1);
}

TEST_CASE("c api steps exactly like the C++ reference step", "[c_api]") {
  HostModel a = model(60), b = a;
  auto ts = c_tensors(a);
  halfstep_group g;
  halfstep_group_init(&g);
  const halfstep_config c = reference_config();
  halfstep_optimizer* opt = nullptr;
  REQUIRE(halfstep_create(ts.data(), static_cast<int64_t>(ts.size()), &g, 1, &c, &opt) == HALFSTEP_OK);
  REQUIRE(opt != nullptr);
  halfstep::StepConfig sc;
  sc.max_grad_norm = 1.0f;
  halfstep::OptimizerState s = halfstep::OptimizerState::initial(sc);
  for (int i = 0; i < 5; ++i) {
    if (i == 2) a.tensors[2].grad[3] = b.tensors[2].grad[3] = 0x7C00;
    if (i == 3) a.tensors[2].grad[3] = b.tensors[2].grad[3] = 0x3C00;
    REQUIRE(halfstep_step(opt, nullptr) == HALFSTEP_OK);
    const halfstep::StepReport want = halfstep::reference::step(b.views(), sc, s);
    halfstep_report got;
    REQUIRE(halfstep_last_report(opt, &got) == HALFSTEP_OK);
    CHECK(got.outcome == static_cast<int32_t>(want.outcome));
    CHECK(got.attempt == want.attempt);
    CHECK(got.scale_next == want.scale_next);
    CHECK(got.first_nonfinite_tensor == want.first_nonfinite_tensor);
    for (std::size_t t = 0; t < a.tensors.size(); ++t) CHECK(a.tensors[t] == b.tensors[t]);
  }
  int64_t applied = 0, attempts = 0;
  REQUIRE(halfstep_step_count(opt, &applied, &attempts) == HALFSTEP_OK);
  CHECK(applied == 4);
  CHECK(attempts == 5);
  float scale = 0.0f;
  REQUIRE(halfstep_loss_scale(opt, &scale) == HALFSTEP_OK);
  CHECK(scale == 32768.0f);
  CHECK(*halfstep_device_loss_scale(opt) == 32768.0f);
  halfstep_destroy(opt);
}

TEST_CASE("c api reports errors as codes with a message", "[c_api]") {
  HostModel m = model(61);
  auto ts = c_tensors(m);
  halfstep_group g;
  halfstep_group_init(&g);
  halfstep_config c = reference_config();
  halfstep_optimizer* opt = reinterpret_cast<halfstep_optimizer*>(0x1);
  ts[2].exp_avg = nullptr;
  CHECK(halfstep_create(ts.data(), 3, &g, 1, &c, &opt) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  CHECK(opt == nullptr);
  CHECK_THAT(halfstep_last_error(), Catch::Contains("tensors[2].exp_avg is null"));
  ts = c_tensors(m);
  c.grad_dtype = 7;
  CHECK(halfstep_create(ts.data(), 3, &g, 1, &c, &opt) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(halfstep_last_error(), Catch::Contains("halfstep_config.grad_dtype"));
  c = reference_config();
  c.backoff_factor = 3.0f;
  CHECK(halfstep_create(ts.data(), 3, &g, 1, &c, &opt) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(halfstep_last_error(), Catch::Contains("ScalerConfig.backoff_factor"));
  CHECK(halfstep_create(ts.data(), 3, &g, 0, &c, &opt) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  c = reference_config();
  // A tensor count no array could hold is an invalid argument, not an allocation failure.
  CHECK(halfstep_create(ts.data(), std::int64_t{1} << 62, &g, 1, &c, &opt) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(halfstep_last_error(), Catch::Contains("n_tensors must be in [0, 2^31 - 1]"));
  REQUIRE(halfstep_create(ts.data(), 3, &g, 1, &c, &opt) == HALFSTEP_OK);
  halfstep_report r;
  CHECK(halfstep_last_report(opt, &r) == HALFSTEP_ERROR_USAGE);
  CHECK(halfstep_set_lr(opt, 3, 0.1f, nullptr) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(halfstep_last_error(), Catch::Contains("group must name one of the 1"));
  CHECK(halfstep_step(nullptr, nullptr) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  CHECK(halfstep_device_loss_scale(nullptr) == nullptr);
  halfstep_destroy(opt);
  halfstep_destroy(nullptr);
}

TEST_CASE("c api checkpoints through caller buffers and refuses corrupt ones", "[c_api]") {
  HostModel m = model(62);
  auto ts = c_tensors(m);
  halfstep_group g;
  halfstep_group_init(&g);
  const halfstep_config c = reference_config();
  halfstep_optimizer* opt = nullptr;
  REQUIRE(halfstep_create(ts.data(), 3, &g, 1, &c, &opt) == HALFSTEP_OK);
  REQUIRE(halfstep_step(opt, nullptr) == HALFSTEP_OK);
  size_t size = 0;
  REQUIRE(halfstep_save_state(opt, nullptr, 0, &size) == HALFSTEP_OK);
  std::vector<unsigned char> buf(size);
  CHECK(halfstep_save_state(opt, buf.data(), size - 1, &size) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  REQUIRE(halfstep_save_state(opt, buf.data(), buf.size(), &size) == HALFSTEP_OK);
  REQUIRE(halfstep_step(opt, nullptr) == HALFSTEP_OK);
  std::vector<unsigned char> bad = buf;
  bad[20] ^= 0x40;
  CHECK(halfstep_load_state(opt, bad.data(), bad.size()) == HALFSTEP_ERROR_CORRUPT_STATE);
  CHECK_THAT(halfstep_last_error(), Catch::Contains("checksum mismatch"));
  int64_t applied = 0, attempts = 0;
  REQUIRE(halfstep_step_count(opt, &applied, &attempts) == HALFSTEP_OK);
  CHECK(attempts == 2);  // unchanged by the refused load
  REQUIRE(halfstep_load_state(opt, buf.data(), buf.size()) == HALFSTEP_OK);
  REQUIRE(halfstep_step_count(opt, &applied, &attempts) == HALFSTEP_OK);
  CHECK(attempts == 1);
  std::vector<int64_t> counts(3, -1);
  REQUIRE(halfstep_nonfinite_counts(opt, counts.data(), 3) == HALFSTEP_OK);
  CHECK(counts == std::vector<int64_t>{0, 0, 0});
  CHECK(halfstep_nonfinite_counts(opt, counts.data(), 2) == HALFSTEP_ERROR_INVALID_ARGUMENT);
  halfstep_destroy(opt);
}

TEST_CASE("c api reports a step skipped for a non-finite update and its reason", "[c_api]") {
  HostModel m = model(63);
  for (auto& t : m.tensors) std::fill(t.grad.begin(), t.grad.end(), std::uint16_t{0x7F7F});  // bf16 max
  auto ts = c_tensors(m);
  halfstep_group g;
  halfstep_group_init(&g);
  halfstep_config c = reference_config();
  c.grad_dtype = HALFSTEP_BF16;
  c.max_grad_norm = 0.0f;
  halfstep_optimizer* opt = nullptr;
  REQUIRE(halfstep_create(ts.data(), 3, &g, 1, &c, &opt) == HALFSTEP_OK);
  REQUIRE(halfstep_step(opt, nullptr) == HALFSTEP_OK);
  halfstep_report r;
  REQUIRE(halfstep_last_report(opt, &r) == HALFSTEP_OK);
  CHECK(r.outcome == HALFSTEP_SKIPPED_NONFINITE_UPDATE);
  CHECK(r.reason == HALFSTEP_REASON_SECOND_MOMENT_EXCEEDS_FP32);
  CHECK(r.held_elements == 0);
  CHECK(r.step == 0);
  halfstep_destroy(opt);
}

extern "C" int halfstep_c_api_exercise(const char* dir);

TEST_CASE("every C API function works from a C translation unit", "[c_api]") {
  const int failed = halfstep_c_api_exercise(std::filesystem::temp_directory_path().c_str());
  INFO("C check " << failed << " failed; halfstep_last_error: " << halfstep_last_error());
  CHECK(failed == 0);
}

TEST_CASE("c api lean state steps bitwise like the C++ API with the same formats", "[c_api][state]") {
  for (const int master_code : {HALFSTEP_MASTER_BF16_REMAINDER, HALFSTEP_MASTER_NONE}) {
    halfstep::StateFormat lean;
    lean.master = static_cast<halfstep::MasterFormat>(master_code);
    CAPTURE(master_code);
    lean.exp_avg = lean.exp_avg_sq = halfstep::MomentFormat::bf16;
    lean.seed = 42;
    const halfstep_test::ShardedCase c = halfstep_test::ShardedCase::make(77, halfstep::DType::bf16, 30, 300, lean);
    halfstep_test::FlatBuffers cpp = c.initial, capi = c.initial;
    halfstep::FusedAdamW mine(c.whole(cpp), c.config, halfstep::Backend::reference);
    halfstep_config cfg;
    halfstep_config_init(&cfg);
    cfg.backend = HALFSTEP_BACKEND_REFERENCE;
    cfg.grad_dtype = cfg.model_dtype = HALFSTEP_BF16;
    cfg.max_grad_norm = c.config.max_grad_norm;
    cfg.init_scale = c.config.scaler.init_scale;
    cfg.growth_interval = c.config.scaler.growth_interval;
    cfg.hysteresis = c.config.scaler.hysteresis;
    cfg.spike_enabled = 1;
    cfg.spike_skip = 1;
    cfg.spike_warmup_steps = c.config.spike.warmup_steps;
    cfg.spike_z_threshold = c.config.spike.z_threshold;
    cfg.master_format = master_code;
    cfg.exp_avg_format = cfg.exp_avg_sq_format = HALFSTEP_MOMENT_BF16;
    cfg.rounding = HALFSTEP_ROUND_STOCHASTIC;
    cfg.seed = 42;
    std::vector<halfstep_tensor> tensors;
    for (const halfstep::ParamTensor& p : c.whole(capi)) {
      tensors.push_back(halfstep_test::c_tensor(p));
    }
    std::vector<halfstep_group> groups(c.config.groups.size());
    for (std::size_t g = 0; g < groups.size(); ++g) {
      halfstep_group_init(&groups[g]);
      groups[g].lr = c.config.groups[g].lr;
      groups[g].weight_decay = c.config.groups[g].weight_decay;
    }
    halfstep_optimizer* opt = nullptr;
    REQUIRE(halfstep_create(tensors.data(), static_cast<int64_t>(tensors.size()), groups.data(),
                            static_cast<int32_t>(groups.size()), &cfg, &opt) == HALFSTEP_OK);
    for (const auto& g : c.grads) {
      cpp.grad = g;
      capi.grad = g;
      mine.step();
      REQUIRE(halfstep_step(opt, nullptr) == HALFSTEP_OK);
    }
    halfstep_report r;
    REQUIRE(halfstep_last_report(opt, &r) == HALFSTEP_OK);
    CHECK(r.step == mine.last_report().step);
    CHECK(capi == cpp);
    halfstep_destroy(opt);
    // A format code outside the enum, and remainders without a bf16 model copy, are refused by name.
    cfg.exp_avg_format = 7;
    CHECK(halfstep_create(tensors.data(), static_cast<int64_t>(tensors.size()), groups.data(),
                          static_cast<int32_t>(groups.size()), &cfg, &opt) == HALFSTEP_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(halfstep_last_error()).find("exp_avg") != std::string::npos);
  }
}

TEST_CASE("c api block8 moments step bitwise like the C++ API and are refused without their scales",
          "[c_api][block8]") {
  using halfstep_test::Piece;
  for (const int master_code : {HALFSTEP_MASTER_F32, HALFSTEP_MASTER_NONE}) {
    CAPTURE(master_code);
    halfstep::StepConfig c;
    c.grad_dtype = c.model_dtype = c.compute_dtype = halfstep::DType::bf16;
    c.scaler.init_scale = 1024.0f;
    c.max_grad_norm = 1.0f;
    c.groups[0].lr = 1e-3f;
    c.groups[0].weight_decay = 0.01f;
    c.state.master = static_cast<halfstep::MasterFormat>(master_code);
    c.state.exp_avg = c.state.exp_avg_sq = halfstep::MomentFormat::block8;
    c.state.seed = 5;
    halfstep_config cfg;
    halfstep_config_init(&cfg);
    cfg.backend = HALFSTEP_BACKEND_REFERENCE;
    cfg.grad_dtype = cfg.model_dtype = cfg.compute_dtype = HALFSTEP_BF16;
    cfg.init_scale = 1024.0f;
    cfg.max_grad_norm = 1.0f;
    cfg.master_format = master_code;
    cfg.exp_avg_format = cfg.exp_avg_sq_format = HALFSTEP_MOMENT_BLOCK8;
    cfg.rounding = HALFSTEP_ROUND_STOCHASTIC;
    cfg.seed = 5;
    halfstep_group group;
    halfstep_group_init(&group);
    group.lr = 1e-3f;
    group.weight_decay = 0.01f;
    // A quantized tensor in rows of 300, a piece of another cut where a block starts, and one small
    // enough to keep fp32 moments.
    std::mt19937_64 gen(21);
    std::vector<Piece> cpp = halfstep_test::make_pieces(
        c, {{9000, 300, 0, 9000, 0}, {42000, 0, 15360, 26640, 0}, {1000, 0, 0, 1000, 0}}, gen);
    std::vector<Piece> capi = cpp;
    std::vector<halfstep::ParamTensor> views;
    std::vector<halfstep_tensor> tensors;
    for (std::size_t i = 0; i < cpp.size(); ++i) {
      views.push_back(halfstep_test::host_view(cpp[i], c));
      const halfstep::ParamTensor p = halfstep_test::host_view(capi[i], c);
      halfstep_tensor t = halfstep_test::c_tensor(p);
      halfstep_moment_blocks mb;
      REQUIRE(halfstep_moment_blocks_of(&cfg, &t, &mb) == HALFSTEP_OK);
      const halfstep::MomentBlocks want = halfstep::moment_blocks(c, p);
      CHECK(mb.quantized == (want.quantized ? 1 : 0));
      CHECK(mb.blocks == want.blocks);
      CHECK(mb.first == want.first);
      tensors.push_back(t);
    }
    REQUIRE(halfstep::moment_blocks(c, views[0]).quantized);
    REQUIRE(!halfstep::moment_blocks(c, views[2]).quantized);
    halfstep::FusedAdamW mine(views, c, halfstep::Backend::reference);
    halfstep_optimizer* opt = nullptr;
    REQUIRE(halfstep_create(tensors.data(), static_cast<int64_t>(tensors.size()), &group, 1, &cfg, &opt) == HALFSTEP_OK);
    for (int s = 0; s < 4; ++s) {
      halfstep_test::fill_grads(cpp, c.grad_dtype, mine.loss_scale(), gen);
      for (std::size_t i = 0; i < cpp.size(); ++i) capi[i].grad = cpp[i].grad;
      if (s == 2) {  // an overflow in the middle of the first tensor: skipped, nothing written
        cpp[0].grad[4500] = capi[0].grad[4500] = 0x7F80;
      }
      mine.step();
      REQUIRE(halfstep_step(opt, nullptr) == HALFSTEP_OK);
      halfstep_report r;
      REQUIRE(halfstep_last_report(opt, &r) == HALFSTEP_OK);
      CHECK(r.outcome == static_cast<int32_t>(mine.last_report().outcome));
      CHECK(r.outcome == (s == 2 ? HALFSTEP_SKIPPED_OVERFLOW : HALFSTEP_APPLIED));
    }
    for (std::size_t i = 0; i < cpp.size(); ++i) {
      CAPTURE(i);
      CHECK(capi[i].master == cpp[i].master);
      CHECK(capi[i].model == cpp[i].model);
      CHECK(capi[i].m8 == cpp[i].m8);
      CHECK(capi[i].v8 == cpp[i].v8);
      CHECK(capi[i].ms == cpp[i].ms);
      CHECK(capi[i].vs == cpp[i].vs);
      CHECK(capi[i].m32 == cpp[i].m32);
      CHECK(capi[i].v32 == cpp[i].v32);
    }
    CHECK(!cpp[0].ms.empty());
    CHECK(cpp[0].ms[0] != 0.0f);  // the steps wrote the scales
    halfstep_destroy(opt);
    // A quantized tensor without its scales is refused by name, before anything is built.
    tensors[0].exp_avg_sq_scale = nullptr;
    opt = nullptr;
    CHECK(halfstep_create(tensors.data(), static_cast<int64_t>(tensors.size()), &group, 1, &cfg, &opt) ==
          HALFSTEP_ERROR_INVALID_ARGUMENT);
    CHECK(opt == nullptr);
    CHECK(std::string(halfstep_last_error()).find("exp_avg_sq_scale") != std::string::npos);
  }
}
