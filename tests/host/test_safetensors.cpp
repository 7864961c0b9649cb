// Full checkpoints (safetensors) on the reference backend: an exact resume, the model copy
// optional, every bad file refused with the tensor or field named and nothing changed (values a
// step never writes, byte ranges that do not tile the data, headers nested past any stack), and
// saves that replace only a regular file and report a failed write.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/halfstep.h"
#include "c_tensor.hpp"
#include "safetensors_file.hpp"
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

// A header nested `depth` lists deep at `where` ("VALUE" in it is replaced).
std::string nested(const std::string& where, std::size_t depth) {
  std::string out = where;
  replace(out, "VALUE", std::string(depth, '[') + std::string(depth, ']'));
  return out;
}

// A fresh directory under the system's temporary directory.
std::string temp_dir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "halfstep_test_XXXXXX").string();
  REQUIRE(mkdtemp(pattern.data()) != nullptr);
  return pattern;
}

// Expects load_checkpoint to refuse `path` with `needle` in the message and change nothing.
void expect_refused(const std::string& path, const std::string& needle, DType model_dtype = DType::bf16) {
  HostModel m = sample(99, model_dtype);
  const HostModel before = m;
  FusedAdamW opt(m.views(), sample_config(model_dtype), Backend::reference);
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
  File f = split(bytes);
  replace(f.header, "\"a\":{\"dtype\":\"F32\",\"shape\":[64]", "\"a\":{\"dtype\":\"F16\",\"shape\":[128]");
  write_file(bad, join(f));
  expect_refused(bad, "tensor 'a' is F16, this optimizer needs F32");
  f = split(bytes);  // 32 elements and 128 bytes of another tensor in a's place
  replace(f.header, "\"a\":{\"dtype\":\"F32\",\"shape\":[64],\"data_offsets\":[0,256]}",
          "\"a\":{\"dtype\":\"F32\",\"shape\":[32],\"data_offsets\":[0,128]},"
          "\"pad\":{\"dtype\":\"U8\",\"shape\":[128],\"data_offsets\":[128,256]}");
  write_file(bad, join(f));
  expect_refused(bad, "tensor 'a' has 32 elements, this optimizer's tensor has 64");
  other = bytes;
  other.replace(8, 1, "[");
  write_file(bad, other);
  expect_refused(bad, "the header is a list, not a JSON object");
  other = bytes;
  other.replace(other.find(':'), 1, ";");
  write_file(bad, other);
  expect_refused(bad, "the header is not JSON");

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

TEST_CASE("checkpoint values a step never writes are refused by tensor, element and rule, nothing loaded", "[safetensors]") {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (DType model : {DType::f16, DType::bf16}) {
    const std::string type = dtype_name(model);
    CAPTURE(type);
    HostModel a = sample(10, model);
    FusedAdamW opt(a.views(), sample_config(model), Backend::reference);
    opt.step();
    const std::string good = temp_path("values"), bad = temp_path("values_bad");
    save_checkpoint(opt, kNames, good);
    const std::string bytes = read_file(good);
    CheckpointOptions without_model;
    without_model.include_model = false;
    save_checkpoint(opt, kNames, good, without_model);
    const std::string bytes_without_model = read_file(good);

    struct Case {
      const char* tensor;
      std::size_t element;
      float value;
      const char* needle;
    };
    const Case cases[] = {
        {"a", 5, nan, "tensor 'a' element 5 is nan: a master must be finite"},
        {"c", 8, -inf, "tensor 'c' element 8 is -inf: a master must be finite"},
        {"a.exp_avg", 0, nan, "tensor 'a.exp_avg' element 0 is nan: a moment must be finite"},
        {"c.exp_avg", 2, inf, "tensor 'c.exp_avg' element 2 is inf: a moment must be finite"},
        {"a.exp_avg_sq", 63, nan, "tensor 'a.exp_avg_sq' element 63 is nan: a moment must be finite"},
        {"a.exp_avg_sq", 1, inf, "tensor 'a.exp_avg_sq' element 1 is inf: a moment must be finite"},
        {"c.exp_avg_sq", 3, -1.0f, "tensor 'c.exp_avg_sq' element 3 is -1: a second moment must be >= 0"},
        {"c.exp_avg_sq", 4, -1e-30f, "tensor 'c.exp_avg_sq' element 4 is -1e-30: a second moment must be >= 0"},
    };
    for (const Case& c : cases) {
      write_file(bad, with_element(bytes, c.tensor, c.element, c.value));
      expect_refused(bad, c.needle, model);
    }

    // A master whose model copy would not be finite, whether or not the file holds the copy: past
    // 65504 for fp16; for bf16 only the largest fp32 values round past its largest value.
    const float big = model == DType::f16 ? 1e6f : std::numeric_limits<float>::max();
    const std::string rule = "a master must round to a finite " + type + " model copy (the largest " + type + " value is ";
    for (const std::string* file : {&bytes, &bytes_without_model}) {
      write_file(bad, with_element(*file, "c", 2, big));
      expect_refused(bad, "tensor 'c' element 2 is " + (model == DType::f16 ? std::string("1000000") : "3.40282347e+38") +
                              ": " + rule,
                     model);
    }
    if (model == DType::bf16) {  // 1e6 is a bf16 number: loaded
      write_file(bad, with_element(bytes, "c", 2, 1e6f));
      HostModel b = sample(12, model);
      FusedAdamW opt_b(b.views(), sample_config(model), Backend::reference);
      CHECK_NOTHROW(load_checkpoint(opt_b, kNames, bad));
      CHECK(b.tensors[2].master[2] == 1e6f);
    }

    // A stored model copy that is inf or NaN.
    const std::uint16_t inf_bits = to_bits16(model, inf), nan_bits = to_bits16(model, nan);
    write_file(bad, with_element(bytes, "a.model", 7, inf_bits));
    expect_refused(bad, "tensor 'a.model' element 7 is infinite (" + type + " bits 0x" +
                            (model == DType::f16 ? "7c00" : "7f80") + "): a model copy must be finite", model);
    write_file(bad, with_element(bytes, "c.model", 8, static_cast<std::uint16_t>(nan_bits | 0x8000u)));
    expect_refused(bad, "tensor 'c.model' element 8 is NaN", model);
    std::remove(good.c_str());
    std::remove(bad.c_str());
  }

  // Without a model copy a master has no 16-bit range to fit.
  HostModel a = sample(13, DType::f16);
  a.tensors[2].with_model = false;
  a.tensors[2].master[1] = 1e6f;
  FusedAdamW opt(a.views(), sample_config(DType::f16), Backend::reference);
  const std::string path = temp_path("no_model_copy");
  save_checkpoint(opt, kNames, path);
  HostModel b = sample(14, DType::f16);
  b.tensors[2].with_model = false;
  FusedAdamW opt_b(b.views(), sample_config(DType::f16), Backend::reference);
  load_checkpoint(opt_b, kNames, path);
  CHECK(b.tensors[2].master == a.tensors[2].master);
  std::remove(path.c_str());
}

TEST_CASE("save_checkpoint refuses to write a checkpoint load_checkpoint would refuse", "[safetensors]") {
  HostModel a = sample(15, DType::f16);
  a.tensors[0].exp_avg_sq[3] = -2.0f;
  FusedAdamW opt(a.views(), sample_config(DType::f16), Backend::reference);
  const std::string path = temp_path("unloadable");
  std::remove(path.c_str());
  try {
    save_checkpoint(opt, kNames, path);
    FAIL("a checkpoint that cannot be loaded was written");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::usage);
    CHECK_THAT(e.what(), Catch::Contains("tensor 'a.exp_avg_sq' element 3 is -2: a second moment must be >= 0"));
  }
  CHECK(access(path.c_str(), F_OK) != 0);
  CHECK(access((path + ".partial").c_str(), F_OK) != 0);
}

TEST_CASE("tensors' bytes must tile the data section, aligned, for every entry of the header", "[safetensors]") {
  HostModel a = sample(16);
  FusedAdamW opt(a.views(), sample_config(), Backend::reference);
  opt.step();
  const std::string good = temp_path("tiling"), bad = temp_path("tiling_bad");
  save_checkpoint(opt, kNames, good);
  const std::string bytes = read_file(good);
  const File base = split(bytes);
  const auto offsets = [&](const std::string& name, std::size_t n) {
    const std::size_t b = begin_of(base, name);
    return "[" + std::to_string(b) + "," + std::to_string(b + n) + "]";
  };
  const std::string rule = "(safetensors: the tensors' bytes, in order of their offsets, cover the data section exactly";

  // Two tensors the optimizer loads share bytes: a.exp_avg would be read from a's.
  File f = base;
  replace(f.header, "\"a.exp_avg\":{\"dtype\":\"F32\",\"shape\":[64],\"data_offsets\":" + offsets("a.exp_avg", 256),
          "\"a.exp_avg\":{\"dtype\":\"F32\",\"shape\":[64],\"data_offsets\":" + offsets("a", 256));
  write_file(bad, join(f));
  expect_refused(bad, ") overlap tensor '");
  expect_refused(bad, rule);

  // An entry this optimizer does not load overlaps one it does.
  f = base;
  replace(f.header, "{", "{\"other\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]},");
  write_file(bad, join(f));
  expect_refused(bad, "overlap tensor '");

  // Bytes after the last tensor.
  f = base;
  f.data += std::string(8, '\0');
  write_file(bad, join(f));
  const std::string end = std::to_string(base.data.size());
  expect_refused(bad, "bytes [" + end + ", " + std::to_string(base.data.size() + 8) +
                          ") of the data section, after the last tensor, belong to no tensor");

  // A gap before a tensor.
  f = base;
  const std::size_t c_model = begin_of(base, "c.model");
  replace(f.header, "\"c.model\":{\"dtype\":\"BF16\",\"shape\":[9],\"data_offsets\":" + offsets("c.model", 18),
          "\"c.model\":{\"dtype\":\"BF16\",\"shape\":[9],\"data_offsets\":[" + std::to_string(c_model + 2) + "," +
              std::to_string(c_model + 20) + "]");
  f.data += std::string(2, '\0');
  write_file(bad, join(f));
  expect_refused(bad, "bytes [" + std::to_string(c_model) + ", " + std::to_string(c_model + 2) +
                          ") of the data section, before tensor 'c.model', belong to no tensor");

  // begin after end.
  f = base;
  replace(f.header, "\"data_offsets\":" + offsets("a", 256), "\"data_offsets\":[256,0]");
  write_file(bad, join(f));
  expect_refused(bad, "tensor 'a': data_offsets [256, 0) do not hold the 256 bytes of its shape");

  // An entry of a dtype safetensors does not know, a tensor named twice, a field given twice.
  f = base;
  replace(f.header, "{", "{\"other\":{\"dtype\":\"Q8\",\"shape\":[0],\"data_offsets\":[0,0]},");
  write_file(bad, join(f));
  expect_refused(bad, "tensor 'other': dtype 'Q8' is not a safetensors dtype");
  f = base;
  replace(f.header, "{", "{\"c\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},");
  write_file(bad, join(f));
  expect_refused(bad, "the header names tensor 'c' twice");
  f = base;
  replace(f.header, "\"a\":{\"dtype\":\"F32\",", "\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",");
  write_file(bad, join(f));
  expect_refused(bad, "tensor 'a' gives its dtype twice");

  // Misaligned for its dtype, though the bytes tile: read alone (checkpoint_metadata) and loaded.
  write_file(bad, join({R"({"x":{"dtype":"F16","shape":[1],"data_offsets":[0,2]},)"
                        R"("y":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}})",
                        std::string(6, '\0')}));
  CHECK_THROWS_WITH(checkpoint_metadata(bad), Catch::Contains("tensor 'y': its bytes begin at 2, not a multiple of the 4-byte size of F32"));
  expect_refused(bad, "not a multiple of the 4-byte size of F32");

  // What Python's safetensors package accepts is read: entries in any order, tensors of zero
  // elements anywhere the tiling allows, other dtypes, fields other writers add, no padding.
  write_file(bad, join({R"({"__metadata__":{"k":"v"},"z":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                        R"("y":{"dtype":"F64","shape":[1],"data_offsets":[0,8],"extra":{"a":[1,[2.5,null]]}},)"
                        R"("x":{"dtype":"F4","shape":[2,1],"data_offsets":[8,9]},"w":{"dtype":"U8","shape":[0],"data_offsets":[9,9]}})",
                        std::string(9, '\0')}));
  CHECK(checkpoint_metadata(bad) == std::map<std::string, std::string>{{"k", "v"}});
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

TEST_CASE("every tensor of a saved checkpoint begins at a multiple of its element size", "[safetensors]") {
  // Odd lengths: an fp16 copy of 9 elements before another tensor's master would misalign it.
  std::mt19937_64 rng(17);
  HostModel a;
  for (std::int64_t n : {9, 64, 3}) a.tensors.push_back(random_tensor(rng, n, DType::f16, DType::f16, 1024.0f));
  FusedAdamW opt(a.views(), sample_config(DType::f16), Backend::reference);
  const std::string path = temp_path("aligned");
  save_checkpoint(opt, kNames, path);
  const File f = split(read_file(path));
  for (const std::string& name : kNames) {
    for (const std::string suffix : {"", ".exp_avg", ".exp_avg_sq"}) CHECK(begin_of(f, name + suffix) % 4 == 0);
    CHECK(begin_of(f, name + ".model") % 2 == 0);
  }
  HostModel b;
  for (std::int64_t n : {9, 64, 3}) b.tensors.push_back(random_tensor(rng, n, DType::f16, DType::f16, 1024.0f));
  FusedAdamW opt_b(b.views(), sample_config(DType::f16), Backend::reference);
  load_checkpoint(opt_b, kNames, path);
  for (std::size_t t = 0; t < a.tensors.size(); ++t) {
    CHECK(a.tensors[t].master == b.tensors[t].master);
    CHECK(a.tensors[t].exp_avg == b.tensors[t].exp_avg);
    CHECK(a.tensors[t].exp_avg_sq == b.tensors[t].exp_avg_sq);
    CHECK(a.tensors[t].model == b.tensors[t].model);
  }
  std::remove(path.c_str());
}

TEST_CASE("a header nested deeper than safetensors needs is refused before it is read, also through the C API", "[safetensors]") {
  const std::string path = temp_path("deep");
  const std::string depth = "the header nests lists or objects deeper than 8 levels";
  // A million levels, 2 MB of header: a tree of them cannot be copied or printed recursively (a
  // key after the deep value made nlohmann's ordered_json copy it, and a message printed it) in
  // any stack. Refused where the schema has no place for a list, else at the ninth level.
  const std::pair<std::string, std::string> cases[] = {
      {R"({"__metadata__":{"x":VALUE,"y":"z"}})", "metadata 'x' is a list, not a string"},
      {R"({"a":VALUE,"b":{}})", "tensor 'a' is a list, not an object"},
      {R"({"a":{"dtype":VALUE,"shape":[64],"data_offsets":[0,256]}})", "tensor 'a': dtype is a list, not a string"},
      {R"(VALUE)", "the header is a list, not a JSON object"},
      {R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":VALUE,"y":0}})", depth},
  };
  for (const auto& [where, needle] : cases) {
    CAPTURE(where);
    write_file(path, join({nested(where, 1000000), ""}));
    try {
      (void)checkpoint_metadata(path);
      FAIL("a deep header was read");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::corrupt_state);
      CHECK_THAT(e.what(), Catch::Contains(needle));
    }
    expect_refused(path, needle);
    std::size_t size = 0;
    CHECK(halfstep_checkpoint_metadata(path.c_str(), "x", nullptr, 0, &size) == HALFSTEP_ERROR_CORRUPT_STATE);
    CHECK_THAT(halfstep_last_error(), Catch::Contains(needle));

    HostModel m = sample(18);
    const HostModel before = m;
    std::vector<halfstep_tensor> ts;
    for (const ParamTensor& p : m.views()) {
      ts.push_back(halfstep_test::c_tensor(p));
    }
    halfstep_config c;
    halfstep_config_init(&c);
    c.backend = HALFSTEP_BACKEND_REFERENCE;
    c.model_dtype = 1;  // bf16
    halfstep_group groups[2];
    halfstep_group_init(&groups[0]);
    halfstep_group_init(&groups[1]);
    halfstep_optimizer* opt = nullptr;
    REQUIRE(halfstep_create(ts.data(), static_cast<int64_t>(ts.size()), groups, 2, &c, &opt) == HALFSTEP_OK);
    const char* names[] = {"a", "b", "c"};
    CHECK(halfstep_load_checkpoint(opt, names, 3, path.c_str()) == HALFSTEP_ERROR_CORRUPT_STATE);
    CHECK_THAT(halfstep_last_error(), Catch::Contains(needle));
    halfstep_destroy(opt);
    for (std::size_t t = 0; t < m.tensors.size(); ++t) CHECK(m.tensors[t] == before.tensors[t]);
  }
  // Room for fields other writers add to an entry: eight levels in all are read, nine are not.
  const std::string extra = R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[0,0],"x":VALUE}})";
  write_file(path, join({nested(extra, 6), ""}));
  CHECK(checkpoint_metadata(path).empty());
  write_file(path, join({nested(extra, 7), ""}));
  CHECK_THROWS_WITH(checkpoint_metadata(path), Catch::Contains(depth));
  std::remove(path.c_str());
}

TEST_CASE("save_checkpoint replaces only a regular file in a writable directory, and reports write errors", "[safetensors]") {
  HostModel a = sample(19);
  FusedAdamW opt(a.views(), sample_config(), Backend::reference);
  const std::string dir = temp_dir();
  const auto refused = [&](const std::string& target, const std::string& needle) {
    CAPTURE(target);
    try {
      save_checkpoint(opt, kNames, target);
      FAIL("saved");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains(needle));
    }
    CHECK(access((target + ".partial").c_str(), F_OK) != 0);
  };
  struct stat st {};

  // A FIFO, a directory and a character device stay what they are (renaming over /dev/null as
  // root replaced the device with a file). The device is a /dev/null made here where that is
  // allowed: root could lose the real one if this ever failed; others test /dev/null itself.
  const std::string fifo = dir + "/fifo.safetensors";
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
  refused(fifo, "it exists and is not a regular file (a FIFO); a checkpoint replaces only a regular file");
  CHECK((stat(fifo.c_str(), &st) == 0 && S_ISFIFO(st.st_mode)));
  refused(dir, "it exists and is not a regular file (a directory)");
  std::string device = dir + "/null";
  if (mknod(device.c_str(), S_IFCHR | 0666, makedev(1, 3)) != 0) device = geteuid() == 0 ? "" : "/dev/null";
  if (!device.empty()) {
    refused(device, "it exists and is not a regular file (a character device)");
    CHECK((stat(device.c_str(), &st) == 0 && S_ISCHR(st.st_mode) && st.st_rdev == makedev(1, 3)));
  }

  // A directory that does not exist, or is not writable (root writes anywhere: not checked then).
  refused(dir + "/missing/x.safetensors", "its directory '" + dir + "/missing' does not exist");
  refused(fifo + "/x.safetensors", "its directory '" + fifo + "' is not a directory");
  if (geteuid() != 0) {
    const std::string locked = dir + "/locked";
    REQUIRE(mkdir(locked.c_str(), 0555) == 0);
    refused(locked + "/x.safetensors", "its directory '" + locked + "' is not writable");
    rmdir(locked.c_str());
  }

  // A FIFO where the file is written first is not opened (which would wait for a reader).
  const std::string target = dir + "/ckpt.safetensors";
  REQUIRE(mkfifo((target + ".partial").c_str(), 0600) == 0);
  try {
    save_checkpoint(opt, kNames, target);
    FAIL("saved");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains(".partial, where it is written first, exists and is not a regular file"));
  }
  CHECK(access(target.c_str(), F_OK) != 0);
  unlink((target + ".partial").c_str());

  // Loading refuses what is not a regular file too, rather than wait on a FIFO.
  CHECK_THROWS_WITH(load_checkpoint(opt, kNames, fifo), Catch::Contains("not a regular file"));
  CHECK_THROWS_WITH(checkpoint_metadata(dir), Catch::Contains("not a regular file"));

  // A write that fails (here: past the file size limit, EFBIG; a full disk is ENOSPC) is reported,
  // and the checkpoint that was there stays.
  save_checkpoint(opt, kNames, target);
  const std::string saved = read_file(target);
  opt.step();
  rlimit limit {};
  REQUIRE(getrlimit(RLIMIT_FSIZE, &limit) == 0);
  const rlimit small{512, limit.rlim_max};
  void (*handler)(int) = signal(SIGXFSZ, SIG_IGN);
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::string message;
  try {
    save_checkpoint(opt, kNames, target);
  } catch (const Error& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &limit);
  signal(SIGXFSZ, handler);
  CHECK_THAT(message, Catch::Contains("writing " + target + ".partial failed: " + std::strerror(EFBIG)));
  CHECK(read_file(target) == saved);
  CHECK(access((target + ".partial").c_str(), F_OK) != 0);

  unlink(target.c_str());
  unlink(fifo.c_str());
  unlink((dir + "/null").c_str());
  rmdir(dir.c_str());
}
