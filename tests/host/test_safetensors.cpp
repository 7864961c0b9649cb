// Full checkpoints (safetensors) on the reference backend: an exact resume, the model copy
// optional, and every bad file refused with the tensor or field named and nothing changed.
#include <catch2/catch.hpp>

#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/safetensors.hpp"
#include "host_buffers.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

const std::vector<std::string> kNames = {"a", "b", "c"};

HostModel sample(std::uint64_t seed, DType model = DType::bf16) {
  HostModel m = random_model(seed, {64, 0, 9}, 1024.0f, DType::f16, model);
  m.tensors[2].group = 1;
  return m;
}

StepConfig sample_config(DType model = DType::bf16) {
  StepConfig c;
  c.model_dtype = model;
  c.groups.resize(2);
  c.scaler.init_scale = 1024.0f;
  return c;
}

std::string temp_path(const std::string& name) { return "halfstep_test_" + name + ".safetensors"; }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Expects load_checkpoint to refuse `path` with `needle` in the message and change nothing.
void expect_refused(const std::string& path, const std::string& needle) {
  HostModel m = sample(99);
  const HostModel before = m;
  FusedAdamW opt(m.views(), sample_config(), Backend::reference);
  const OptimizerState state = opt.state();
  CAPTURE(needle);
  try {
    (void)load_checkpoint(opt, kNames, path);
    FAIL("a bad checkpoint was loaded");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::corrupt_state);
    CHECK_THAT(e.what(), Catch::Contains(needle));
  }
  for (std::size_t t = 0; t < m.tensors.size(); ++t) CHECK(m.tensors[t] == before.tensors[t]);
  CHECK(opt.state() == state);
}

}  // namespace

TEST_CASE("a full checkpoint resumes bit for bit, bf16 model copies included", "[safetensors]") {
  HostModel a = sample(1);
  FusedAdamW opt_a(a.views(), sample_config(), Backend::reference);
  std::mt19937_64 rng(2);
  for (int i = 0; i < 4; ++i) {
    for (auto& t : a.tensors) refill_grads(rng, t, DType::f16, opt_a.loss_scale());
    opt_a.step();
  }
  const std::string path = temp_path("resume");
  CheckpointOptions o;
  o.metadata["step"] = "4";
  save_checkpoint(opt_a, kNames, path, o);

  HostModel b = sample(3);  // other contents: everything must come from the file
  FusedAdamW opt_b(b.views(), sample_config(), Backend::reference);
  const auto meta = load_checkpoint(opt_b, kNames, path);
  CHECK(meta == std::map<std::string, std::string>{{"step", "4"}});
  for (std::size_t t = 0; t < a.tensors.size(); ++t) {
    CHECK(a.tensors[t].master == b.tensors[t].master);
    CHECK(a.tensors[t].exp_avg == b.tensors[t].exp_avg);
    CHECK(a.tensors[t].exp_avg_sq == b.tensors[t].exp_avg_sq);
    CHECK(a.tensors[t].model == b.tensors[t].model);
  }
  CHECK(opt_a.state() == opt_b.state());
  std::remove(path.c_str());
}

TEST_CASE("without model copies in the file they are recomputed from the masters", "[safetensors]") {
  HostModel a = sample(4, DType::f16);
  FusedAdamW opt_a(a.views(), sample_config(DType::f16), Backend::reference);
  opt_a.step();
  CheckpointOptions o;
  o.include_model = false;
  const std::string path = temp_path("no_model");
  save_checkpoint(opt_a, kNames, path, o);
  CHECK(read_file(path).find("a.model") == std::string::npos);
  HostModel b = sample(5, DType::f16);
  FusedAdamW opt_b(b.views(), sample_config(DType::f16), Backend::reference);
  load_checkpoint(opt_b, kNames, path);
  for (std::size_t t = 0; t < b.tensors.size(); ++t) {
    for (std::size_t i = 0; i < b.tensors[t].master.size(); ++i) {
      CHECK(b.tensors[t].model[i] == to_f16_bits(b.tensors[t].master[i]));
    }
    CHECK(b.tensors[t].model == a.tensors[t].model);
  }
  std::remove(path.c_str());
}

TEST_CASE("bad checkpoint files are refused with the reason named and nothing changed", "[safetensors]") {
  HostModel a = sample(6);
  FusedAdamW opt(a.views(), sample_config(), Backend::reference);
  opt.step();
  const std::string good = temp_path("good");
  save_checkpoint(opt, kNames, good);
  const std::string bytes = read_file(good);
  const std::string bad = temp_path("bad");

  write_file(bad, bytes.substr(0, bytes.size() - 10));
  expect_refused(bad, "inside the file");  // truncated data
  write_file(bad, bytes.substr(0, 5));
  expect_refused(bad, "truncated");
  write_file(bad, std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + bytes.substr(8));
  expect_refused(bad, "header length");
  std::string other = bytes;
  other.replace(other.find("\"c.exp_avg\""), 11, "\"x.exp_avg\"");
  write_file(bad, other);
  expect_refused(bad, "no tensor 'c.exp_avg'");
  other = bytes;
  other.replace(other.find("\"F32\""), 5, "\"F16\"");
  write_file(bad, other);
  expect_refused(bad, "this optimizer needs F32");
  other = bytes;
  other.replace(other.find("[64]"), 4, "[65]");
  write_file(bad, other);
  expect_refused(bad, "has 65 elements, this optimizer's tensor has 64");
  other = bytes;
  other.replace(8, 1, "[");
  write_file(bad, other);
  expect_refused(bad, "not JSON");

  // A checkpoint of another configuration: the state check names the field.
  StepConfig three = sample_config();
  three.groups.resize(3);
  HostModel c = sample(7);
  FusedAdamW opt3(c.views(), three, Backend::reference);
  save_checkpoint(opt3, kNames, bad);
  expect_refused(bad, "the number of groups");
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST_CASE("names must fit the tensors and be distinct, and halfstep's metadata keys are its own", "[safetensors]") {
  HostModel a = sample(8);
  FusedAdamW opt(a.views(), sample_config(), Backend::reference);
  const std::string path = temp_path("names");
  CHECK_THROWS_WITH(save_checkpoint(opt, {"a", "b"}, path), Catch::Contains("one name per tensor (3)"));
  CHECK_THROWS_WITH(save_checkpoint(opt, {"a", "a", "c"}, path), Catch::Contains("twice"));
  CHECK_THROWS_WITH(save_checkpoint(opt, {"a", "a.exp_avg", "c"}, path), Catch::Contains("twice"));
  CHECK_THROWS_WITH(save_checkpoint(opt, {"a", "", "c"}, path), Catch::Contains("names[1] is empty"));
  CheckpointOptions o;
  o.metadata["halfstep.mine"] = "x";
  CHECK_THROWS_WITH(save_checkpoint(opt, kNames, path, o), Catch::Contains("starts with 'halfstep.'"));
  std::ifstream none(path);
  CHECK(!none.good());  // nothing was written
}
