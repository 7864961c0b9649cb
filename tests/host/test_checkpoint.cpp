// The checkpoint format: exact round trips, every kind of corruption rejected, every field bounded,
// the configuration recorded and matched, and checkpoints that pass all of that resumable.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "halfstep/checkpoint.hpp"
#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "host_buffers.hpp"

using namespace halfstep;

namespace {

StepConfig sample_config() {
  StepConfig c;
  c.grad_dtype = DType::bf16;
  c.model_dtype = DType::f16;
  c.max_grad_norm = 1.5f;
  c.scaler.growth_interval = 100;
  c.scaler.hysteresis = 2;
  c.spike.enabled = true;
  c.spike.warmup_steps = 20;
  c.groups.resize(2);
  c.groups[0].lr = 3e-4f;
  c.groups[0].weight_decay = 0.1f;
  c.groups[1].lr = 1e-3f;
  c.groups[1].decoupled_weight_decay = false;
  c.groups[1].weight_decay = 0.01f;
  return c;
}

OptimizerState sample_state() {
  OptimizerState s;
  s.scaler = ScalerState{0x1.234568p+13f, 17, 1, 5, 3, 4};
  s.spike = SpikeState{-0.3333333333333333, 4.9406564584124654e-324, 1234, 7, 2};
  s.step = 987654321012LL;
  s.attempts = 987654321999LL;
  return s;
}

// CRC-32 (IEEE, reflected), written here independently of the library's zlib call.
std::uint32_t crc32_of(const std::string& s, std::size_t n) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) {
    c ^= static_cast<unsigned char>(s[i]);
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return c ^ 0xFFFFFFFFu;
}

// `bytes` with its checksum recomputed, as an attacker or a buggy writer would.
std::string with_crc(std::string bytes) {
  const std::uint32_t c = crc32_of(bytes, bytes.size() - 4);
  for (int i = 0; i < 4; ++i) bytes[bytes.size() - 4 + static_cast<std::size_t>(i)] = static_cast<char>((c >> (8 * i)) & 0xFFu);
  return bytes;
}

// Offsets of state fields in the payload (after the 12-byte header).
constexpr std::size_t kScale = 12, kGood = 16, kHyst = 20, kOverflows = 24, kGrowths = 32,
                      kBackoffs = 40, kMean = 48, kVar = 56, kSeen = 64, kSpikes = 72,
                      kConsecutive = 80, kStep = 88, kAttempts = 96;

template <class T>
std::string with_field(std::string bytes, std::size_t at, T value) {
  std::memcpy(&bytes[at], &value, sizeof value);  // little-endian host, as the format
  return with_crc(bytes);
}

void expect_corrupt(const std::string& bytes, const std::string& needle) {
  CAPTURE(needle, bytes.size());
  try {
    (void)decode_state(bytes);
    FAIL("decode_state accepted corrupt input");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::corrupt_state);
    CHECK_THAT(e.what(), Catch::Contains(needle));
  }
}

void expect_mismatch(const std::string& bytes, const StepConfig& here, const std::string& needle) {
  CAPTURE(needle);
  try {
    (void)load_state(bytes, here);
    FAIL("load_state accepted a checkpoint from another configuration");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::corrupt_state);
    CHECK_THAT(e.what(), Catch::Contains(needle));
  }
}

// Every field set apart from its default and from its neighbours, so that a field written in
// another place, width or encoding changes the bytes.
StepConfig distinct_config() {
  StepConfig c;
  c.grad_dtype = DType::bf16;
  c.model_dtype = DType::f16;
  c.max_grad_norm = 1.5f;
  c.scaler.init_scale = 1024.0f;
  c.scaler.growth_factor = 3.0f;
  c.scaler.backoff_factor = 0.25f;
  c.scaler.growth_interval = 100;
  c.scaler.hysteresis = 2;
  c.scaler.consecutive_hysteresis = true;
  c.scaler.min_scale = 2.0f;
  c.scaler.max_scale = 1048576.0f;
  c.scaler.headroom_growth = true;
  c.scaler.headroom_margin_log2 = 3.5f;
  c.spike.enabled = true;
  c.spike.z_threshold = 5.0f;
  c.spike.ema_beta = 0.98f;
  c.spike.warmup_steps = 20;
  c.spike.action = SpikeConfig::Action::skip;
  c.spike.min_std = 0.125f;
  c.spike.max_consecutive = 9;
  c.groups.resize(2);
  c.groups[0] = AdamWConfig{3e-4f, 0.85f, 0.995f, 1e-6f, 0.1f, true, false};
  c.groups[1] = AdamWConfig{1e-3f, 0.8f, 0.99f, 1e-7f, 0.01f, false, true};
  c.state.exp_avg = MomentFormat::bf16;
  c.state.rounding = Rounding::nearest;
  c.state.seed = 0x0123456789ABCDEFull;
  return c;
}

std::string hex(const std::string& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += digits[b >> 4];
    out += digits[b & 15];
  }
  return out;
}

}  // namespace

TEST_CASE("a state and its configuration round-trip bit-exactly", "[checkpoint]") {
  const OptimizerState s = sample_state();
  const StepConfig c = sample_config();
  const std::string bytes = encode_state(s, c);
  const SavedState back = decode_state(bytes);
  CHECK(back.state == s);
  CHECK(std::memcmp(&back.state.spike.var, &s.spike.var, sizeof(double)) == 0);  // a subnormal
  CHECK(back.config.groups.size() == 2);
  CHECK(back.config.groups[0].lr == 3e-4f);
  CHECK(back.config.groups[1].decoupled_weight_decay == false);
  CHECK(back.config.grad_dtype == DType::bf16);
  CHECK(back.config.spike.warmup_steps == 20);
  CHECK(encode_state(back.state, back.config) == bytes);
}

TEST_CASE("the format's bytes are fixed: a known state and configuration encode to known bytes", "[checkpoint]") {
  // What version 4 is for these values: a change to any of these bytes breaks every checkpoint
  // already saved.
  const std::string golden =
      // "HSTP", version 4, 231 bytes of payload
      "4853545004000000e7000000"
      // the state
      "b4a21146110000000100000005000000000000000300000000000000040000000000000055555555"
      "5555d5bf0100000000000000d2040000000000000700000000000000020000000000000074f3c8f4"
      "e50000004ff7c8f4e5000000"
      // the configuration (grad, model and compute dtype first; the state formats, rounding and
      // seed last), then 2 groups
      "0100000000c03f00008044000040400000803e64000000020000000100000040000080490100006040"
      "010000a04048e17a3f14000000010000003e09000000" "00010000efcdab8967452301" "02000000"
      // the groups
      "52499d399a99593f52b87e3fbd378635cdcccc3d01000000000000000000"
      "6f12833acdcc4c3fa4707d3f95bfd6330ad7233c00010000000000000000"
      // CRC-32
      "784b185d";
  const std::string bytes = encode_state(sample_state(), distinct_config());
  CHECK(hex(bytes) == golden);
  const SavedState back = decode_state(bytes);
  CHECK(back.state == sample_state());
  CHECK(encode_state(back.state, back.config) == bytes);  // every field read back where it was written
}

TEST_CASE("version 3 checkpoints still load: the same values, the state in fp32, stochastic rounding with seed 0", "[checkpoint]") {
  // The version 3 bytes of the same state and configuration (no state formats).
  const std::string golden =
      // "HSTP", version 3, 219 bytes of payload
      "4853545003000000db000000"
      // the state
      "b4a21146110000000100000005000000000000000300000000000000040000000000000055555555"
      "5555d5bf0100000000000000d2040000000000000700000000000000020000000000000074f3c8f4"
      "e50000004ff7c8f4e5000000"
      // the configuration (grad, model and compute dtype first), then 2 groups
      "0100000000c03f00008044000040400000803e64000000020000000100000040000080490100006040"
      "010000a04048e17a3f14000000010000003e0900000002000000"
      // the groups
      "52499d399a99593f52b87e3fbd378635cdcccc3d01000000000000000000"
      "6f12833acdcc4c3fa4707d3f95bfd6330ad7233c00010000000000000000"
      // CRC-32
      "de14d727";
  std::string bytes;
  for (std::size_t i = 0; i + 1 < golden.size(); i += 2) bytes.push_back(static_cast<char>(std::stoi(golden.substr(i, 2), nullptr, 16)));
  const SavedState back = decode_state(bytes);
  CHECK(back.version == 3);
  CHECK(back.state == sample_state());
  CHECK(back.config.state.exp_avg == MomentFormat::f32);
  CHECK(back.config.state.rounding == Rounding::stochastic);
  CHECK(back.config.state.seed == 0);
  StepConfig v3 = distinct_config();
  v3.state = StateFormat{};
  CHECK(encode_state(back.state, back.config) == encode_state(sample_state(), v3));
}

TEST_CASE("version 2 checkpoints still load: the same values, compute_dtype f16, step offsets 0", "[checkpoint]") {
  // The version 2 bytes of the same state and configuration (no compute_dtype, no step_offset).
  const std::string v2 =
      "4853545002000000ca000000"
      "b4a21146110000000100000005000000000000000300000000000000040000000000000055555555"
      "5555d5bf0100000000000000d2040000000000000700000000000000020000000000000074f3c8f4"
      "e50000004ff7c8f4e5000000"
      "01000000c03f00008044000040400000803e64000000020000000100000040000080490100006040"
      "010000a04048e17a3f14000000010000003e0900000002000000"
      "52499d399a99593f52b87e3fbd378635cdcccc3d01006f12833acdcc4c3fa4707d3f95bfd6330ad7"
      "233c0001"
      "08114512";
  std::string bytes;
  for (std::size_t i = 0; i + 1 < v2.size(); i += 2) bytes.push_back(static_cast<char>(std::stoi(v2.substr(i, 2), nullptr, 16)));
  const SavedState back = decode_state(bytes);
  CHECK(back.state == sample_state());
  CHECK(back.config.compute_dtype == DType::f16);
  StepConfig old = distinct_config();
  old.state = StateFormat{};  // version 2 had no state formats either
  CHECK(encode_state(back.state, back.config) == encode_state(sample_state(), old));
  CHECK_NOTHROW(load_state(bytes, distinct_config()));
}

TEST_CASE("flags and formats out of range are refused, mismatches are named with their reason", "[checkpoint]") {
  const std::string bytes = encode_state(sample_state(), distinct_config());
  const auto with_byte = [&](std::size_t at, unsigned char value) {
    return with_field(bytes, at, static_cast<std::uint8_t>(value));
  };
  // Offsets in format 4: the configuration starts at 104, the state formats at 167, the groups at 183 and
  // 213.
  expect_corrupt(with_byte(104, 3), "halfstep state checkpoint: grad_dtype must be f16, bf16 or f32, got code 3");
  expect_corrupt(with_byte(105, 7), "model_dtype must be f16, bf16 or f32, got code 7");
  expect_corrupt(with_byte(105, 2), "StepConfig.model_dtype must be f16 or bf16");  // a format, not a copy's
  expect_corrupt(with_byte(106, 5), "compute_dtype must be f16, bf16 or f32, got code 5");
  expect_corrupt(with_byte(131, 2), "ScalerConfig.consecutive_hysteresis must be 0 or 1, got 2");
  expect_corrupt(with_byte(140, 3), "ScalerConfig.headroom_growth must be 0 or 1, got 3");
  expect_corrupt(with_byte(145, 255), "SpikeConfig.enabled must be 0 or 1, got 255");
  expect_corrupt(with_byte(158, 2), "SpikeConfig.action must be 0 or 1, got 2");
  expect_corrupt(with_byte(203, 2), "AdamWConfig.decoupled_weight_decay must be 0 or 1, got 2");
  expect_corrupt(with_byte(234, 2), "AdamWConfig.bias_correction must be 0 or 1, got 2");
  expect_corrupt(with_field(bytes, 205, std::int64_t{-1}), "AdamWConfig.step_offset must be in [0, kCounterLimit");

  const std::string prefix = "halfstep state checkpoint does not fit this StepConfig: ";
  StepConfig c = distinct_config();
  c.spike.action = SpikeConfig::Action::log;
  expect_mismatch(bytes, c, prefix + "SpikeConfig.action is skip is 1 in the checkpoint and 0 here "
                            "(the spike statistics follow its rules)");
  c = distinct_config();
  c.scaler.growth_factor = 2.0f;
  expect_mismatch(bytes, c, prefix + "ScalerConfig.growth_factor is 3 in the checkpoint and 2 here "
                            "(the scaler's state follows its rules)");
  c = distinct_config();
  c.model_dtype = DType::bf16;
  expect_mismatch(bytes, c, prefix + "model_dtype is f16 in the checkpoint and bf16 here "
                            "(the model copies are in it)");
  c = distinct_config();
  c.groups[1].decoupled_weight_decay = true;
  expect_mismatch(bytes, c, prefix + "groups[1].decoupled_weight_decay is 0 in the checkpoint and 1 here "
                            "(the moments and bias correction were built with it)");
  // Several mismatches: the number of groups first, then the fields in the order they are recorded.
  c = distinct_config();
  c.groups.resize(3);
  c.grad_dtype = DType::f16;
  expect_mismatch(bytes, c, prefix + "the number of groups is 2 in the checkpoint and 3 here "
                            "(each group has its own state)");
  c = distinct_config();
  c.groups[0].bias_correction = true;
  c.spike.min_std = 0.5f;
  c.scaler.headroom_margin_log2 = 1.0f;
  expect_mismatch(bytes, c, "ScalerConfig.headroom_margin_log2 is 3.5 in the checkpoint and 1 here");
  c.scaler.headroom_margin_log2 = 3.5f;
  expect_mismatch(bytes, c, "SpikeConfig.min_std is 0.125 in the checkpoint and 0.5 here");
  c.spike.min_std = 0.125f;
  expect_mismatch(bytes, c, "groups[0].bias_correction is 0 in the checkpoint and 1 here");
}

TEST_CASE("truncated checkpoints are rejected at every length", "[checkpoint]") {
  const std::string bytes = encode_state(sample_state(), sample_config());
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    CAPTURE(n);
    REQUIRE_THROWS_AS(decode_state(bytes.substr(0, n)), Error);
  }
  expect_corrupt(bytes.substr(0, 5), "truncated");
  expect_corrupt(bytes.substr(0, bytes.size() - 1), "size mismatch");
  expect_corrupt(bytes + "x", "size mismatch");
}

TEST_CASE("a flipped byte anywhere is rejected", "[checkpoint]") {
  const std::string bytes = encode_state(sample_state(), sample_config());
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    for (unsigned mask : {0x01u, 0x80u, 0xFFu}) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(static_cast<unsigned char>(bad[i]) ^ mask);
      CAPTURE(i, static_cast<int>(mask));
      REQUIRE_THROWS_AS(decode_state(bad), Error);
    }
  }
  std::string bad = bytes;
  bad[20] = static_cast<char>(bad[20] ^ 0x10);
  expect_corrupt(bad, "checksum mismatch");
}

TEST_CASE("a wrong magic or an unknown version is rejected", "[checkpoint]") {
  std::string bytes = encode_state(sample_state(), sample_config());
  std::string magic = bytes;
  magic[0] = 'X';
  expect_corrupt(magic, "wrong magic");
  expect_corrupt(std::string(200, '\0'), "wrong magic");
  std::string v5 = bytes;
  v5[4] = 5;
  expect_corrupt(v5, "unknown format version 5");
  std::string v1 = bytes;
  v1[4] = 1;
  expect_corrupt(v1, "version 1 recorded no configuration");
}

TEST_CASE("counters at INT64_MAX and impossible statistics are refused, naming the field", "[checkpoint]") {
  const std::string bytes = encode_state(sample_state(), sample_config());
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  // step = attempts = INT64_MAX: the next clean step would wrap the counter.
  expect_corrupt(with_field(with_field(bytes, kStep, huge), kAttempts, huge), "OptimizerState.attempts");
  expect_corrupt(with_field(bytes, kAttempts, kCounterLimit + 1), "OptimizerState.attempts");
  expect_corrupt(with_field(bytes, kOverflows, huge), "ScalerState.overflows");
  expect_corrupt(with_field(bytes, kSeen, huge), "SpikeState.seen");
  expect_corrupt(with_field(bytes, kSpikes, huge), "SpikeState.spikes");
  expect_corrupt(with_field(bytes, kGrowths, huge), "ScalerState.growths");
  expect_corrupt(with_field(bytes, kBackoffs, std::int64_t{-1}), "ScalerState.backoffs");
  expect_corrupt(with_field(bytes, kMean, 1e308), "SpikeState.mean");
  expect_corrupt(with_field(bytes, kMean, std::numeric_limits<double>::quiet_NaN()), "SpikeState.mean");
  expect_corrupt(with_field(bytes, kVar, 1e300), "SpikeState.var");
  expect_corrupt(with_field(bytes, kVar, -1.0), "SpikeState.var");
  expect_corrupt(with_field(bytes, kScale, 0.0f), "ScalerState.scale");
  expect_corrupt(with_field(bytes, kScale, std::numeric_limits<float>::infinity()), "ScalerState.scale");
}

TEST_CASE("relations between counters are checked", "[checkpoint]") {
  const std::string bytes = encode_state(sample_state(), sample_config());
  const OptimizerState s = sample_state();
  expect_corrupt(with_field(bytes, kStep, s.attempts + 1), "OptimizerState.step");
  expect_corrupt(with_field(bytes, kOverflows, s.attempts - s.step + 1), "ScalerState.overflows");
  expect_corrupt(with_field(bytes, kGrowths, s.step + 1), "ScalerState.growths");
  expect_corrupt(with_field(bytes, kBackoffs, s.scaler.overflows + 1), "ScalerState.backoffs");
  expect_corrupt(with_field(bytes, kGood, std::int32_t{100}), "ScalerState.good_steps");  // growth_interval
  expect_corrupt(with_field(bytes, kHyst, std::int32_t{3}), "ScalerState.hysteresis_left");  // hysteresis 2
  expect_corrupt(with_field(bytes, kHyst, std::int32_t{0}), "ScalerState.hysteresis_left");
  expect_corrupt(with_field(bytes, kConsecutive, std::int64_t{17}), "SpikeState.consecutive");  // max 16
  expect_corrupt(with_field(bytes, kConsecutive, s.spike.spikes + 1), "SpikeState.consecutive");
  expect_corrupt(with_field(bytes, kSeen, s.attempts + 1), "SpikeState.seen");
  // A group that joined after the steps taken so far (the last group's step_offset ends the
  // payload, before the CRC).
  expect_corrupt(with_field(bytes, bytes.size() - 12, s.step + 1), "step_offset");
  CHECK_NOTHROW(decode_state(with_field(bytes, bytes.size() - 12, s.step)));
  StepConfig late = sample_config();
  late.groups[1].step_offset = s.step + 1;
  CHECK_THROWS_WITH(encode_state(s, late), Catch::Contains("groups[1].step_offset must be at most OptimizerState.step"));
  // A spike state without the spike detector.
  StepConfig off = sample_config();
  off.spike.enabled = false;
  CHECK_THROWS_WITH(encode_state(sample_state(), off), Catch::Contains("SpikeState must be empty"));
}

TEST_CASE("every single-bit flip with a recomputed checksum is refused or resumes cleanly", "[checkpoint]") {
  // A flip that survives must leave a state some run of this configuration could have had: the
  // optimizer resumes from it and steps without throwing and without writing a non-finite value.
  // (A flip to another plausible counter value cannot be told from a real checkpoint; the
  // checksum is what catches accidental corruption, the checks below what it cannot.)
  const StepConfig c = sample_config();
  OptimizerState s = sample_state();
  s.step = 4000;
  s.attempts = 4100;
  s.scaler.growths = 12;
  const std::string bytes = encode_state(s, c);
  std::mt19937_64 rng(5);
  halfstep_test::HostModel m = halfstep_test::random_model(6, {40, 17}, 1.0f, DType::bf16, DType::f16);
  m.tensors[1].group = 1;
  const std::size_t state_end = 12 + 92;  // the state fields; the configuration follows
  std::size_t accepted_state = 0, accepted_config = 0, state_bits = 0, config_bits = 0;
  for (std::size_t i = 12; i + 4 < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = bytes;
      bad[i] = static_cast<char>(static_cast<unsigned char>(bad[i]) ^ (1u << bit));
      bad = with_crc(bad);
      (i < state_end ? state_bits : config_bits) += 1;
      SavedState saved;
      try {
        saved = load_state(bad, c);
      } catch (const Error& e) {
        REQUIRE(e.kind() == ErrorKind::corrupt_state);
        continue;
      }
      (i < state_end ? accepted_state : accepted_config) += 1;
      CAPTURE(i, bit);
      if (i >= state_end) {  // only fields that may differ: compute_dtype, max_grad_norm, init_scale,
                             // the state formats, their rounding and seed, and each group's lr, betas,
                             // eps, weight_decay and step_offset
        const std::size_t group_base = i >= 183 ? 183 + (i - 183) / 30 * 30 : 0;
        const std::size_t in_group = i - group_base;
        const bool allowed = (i >= 106 && i < 115) || (i >= 167 && i < 179) ||
                             (group_base != 0 && (in_group < 20 || in_group >= 22));
        REQUIRE(allowed);
      }
      halfstep_test::HostModel run = m;
      FusedAdamW opt(run.views(), c, Backend::reference);
      REQUIRE_NOTHROW(opt.load_state(bad));
      for (int k = 0; k < 3; ++k) {
        for (auto& t : run.tensors) halfstep_test::refill_grads(rng, t, DType::bf16, opt.loss_scale());
        REQUIRE_NOTHROW(opt.step());
        REQUIRE(opt.last_report().attempt == saved.state.attempts + k + 1);
        for (const auto& t : run.tensors) {
          for (float x : t.master) REQUIRE(std::isfinite(x));
          for (float x : t.exp_avg) REQUIRE(std::isfinite(x));
          for (float x : t.exp_avg_sq) REQUIRE(std::isfinite(x));
        }
      }
    }
  }
  INFO("state: " << accepted_state << " of " << state_bits << " flips accepted; configuration: "
                 << accepted_config << " of " << config_bits);
  CHECK(state_bits == 736);
  CHECK(config_bits == 1112);
  CHECK(accepted_state < state_bits / 2);  // version 1 accepted 601 of these 736
}

TEST_CASE("a checkpoint from another configuration is refused, naming the field", "[checkpoint]") {
  const StepConfig saved_with = sample_config();
  const std::string bytes = encode_state(sample_state(), saved_with);
  {
    StepConfig one = saved_with;
    one.groups.resize(1);
    expect_mismatch(bytes, one, "the number of groups is 2 in the checkpoint and 1 here");
    StepConfig five = saved_with;
    five.groups.resize(5);
    expect_mismatch(bytes, five, "the number of groups");
  }
  StepConfig c = saved_with;
  c.grad_dtype = DType::f16;
  expect_mismatch(bytes, c, "grad_dtype is bf16 in the checkpoint and f16 here");
  c = saved_with;
  c.model_dtype = DType::bf16;
  expect_mismatch(bytes, c, "model_dtype");
  c = saved_with;
  c.spike.enabled = false;
  expect_mismatch(bytes, c, "SpikeConfig.enabled");
  c = saved_with;
  c.spike.z_threshold = 4.0f;
  expect_mismatch(bytes, c, "SpikeConfig.z_threshold");
  c = saved_with;
  c.scaler.hysteresis = 4;
  expect_mismatch(bytes, c, "ScalerConfig.hysteresis is 2 in the checkpoint and 4 here");
  c = saved_with;
  c.scaler.growth_interval = 2000;
  expect_mismatch(bytes, c, "ScalerConfig.growth_interval");
  c = saved_with;
  c.groups[0].decoupled_weight_decay = false;
  expect_mismatch(bytes, c, "groups[0].decoupled_weight_decay");
  c = saved_with;
  c.groups[1].bias_correction = false;
  expect_mismatch(bytes, c, "groups[1].bias_correction");
}

TEST_CASE("what may differ loads, and the checkpoint's hyperparameters are restored", "[checkpoint]") {
  const StepConfig saved_with = sample_config();
  const std::string bytes = encode_state(sample_state(), saved_with);
  StepConfig c = saved_with;
  c.groups[0].lr = 5e-2f;           // the checkpoint's 3e-4 is restored
  c.groups[0].eps = 1e-6f;
  c.groups[1].weight_decay = 0.05f;
  c.groups[1].beta2 = 0.95f;        // set_group may have changed the betas: they are restored too
  c.groups[0].beta1 = 0.5f;
  c.max_grad_norm = 0.0f;
  c.scaler.init_scale = 1024.0f;
  c.compute_dtype = DType::bf16;
  c.host_driven = true;
  const SavedState loaded = load_state(bytes, c);
  CHECK(loaded.state == sample_state());
  for (std::size_t g = 0; g < 2; ++g) {
    CHECK(loaded.config.groups[g].lr == saved_with.groups[g].lr);
    CHECK(loaded.config.groups[g].beta1 == saved_with.groups[g].beta1);
    CHECK(loaded.config.groups[g].beta2 == saved_with.groups[g].beta2);
    CHECK(loaded.config.groups[g].eps == saved_with.groups[g].eps);
    CHECK(loaded.config.groups[g].weight_decay == saved_with.groups[g].weight_decay);
  }
  // A whole group is restored, so the restored lr meets the restored weight decay: a config
  // whose own weight decay would refuse the checkpoint's lr loads.
  c.groups[0].weight_decay = 4000.0f;  // 3e-4 · 4000 = 1.2 >= 1, but the checkpoint's decay is restored
  c.groups[0].lr = 1e-4f;
  CHECK_NOTHROW(load_state(bytes, c));
}

TEST_CASE("encode_state refuses what could not be loaded", "[checkpoint]") {
  StepConfig c = sample_config();
  OptimizerState s = sample_state();
  s.attempts = s.step - 1;
  CHECK_THROWS_WITH(encode_state(s, c), Catch::Contains("OptimizerState.step"));
  c.groups[0].lr = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(encode_state(sample_state(), c), Catch::Contains("lr must be finite"));
}
