// The checkpoint format: exact round trips, and every kind of corruption rejected.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>

#include "halfstep/checkpoint.hpp"
#include "halfstep/error.hpp"

using namespace halfstep;

namespace {

OptimizerState sample_state() {
  OptimizerState s;
  s.scaler = ScalerState{0x1.234568p+13f, 17, 1, 5, 3, 4};
  s.spike = SpikeState{-0.3333333333333333, 4.9406564584124654e-324, 1234, 7, 2};
  s.step = 987654321012LL;
  s.attempts = 987654321999LL;
  return s;
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

}  // namespace

TEST_CASE("a state round-trips bit-exactly", "[checkpoint]") {
  const OptimizerState s = sample_state();
  const std::string bytes = encode_state(s);
  const OptimizerState back = decode_state(bytes);
  CHECK(back == s);
  CHECK(std::memcmp(&back.spike.var, &s.spike.var, sizeof(double)) == 0);  // a subnormal
  CHECK(encode_state(back) == bytes);
}

TEST_CASE("negative zero NaN payloads and extremes survive a round trip", "[checkpoint]") {
  OptimizerState s = sample_state();
  s.spike.mean = -0.0;
  const std::uint64_t nan_bits = 0x7FF0000000000123ull;  // a signalling NaN with a payload
  std::memcpy(&s.spike.var, &nan_bits, sizeof(double));
  s.scaler.scale = std::numeric_limits<float>::denorm_min();
  s.step = std::numeric_limits<std::int64_t>::max();
  const OptimizerState back = decode_state(encode_state(s));
  CHECK(back == s);
  CHECK(std::signbit(back.spike.mean));
  std::uint64_t back_bits;
  std::memcpy(&back_bits, &back.spike.var, sizeof(double));
  CHECK(back_bits == nan_bits);
}

TEST_CASE("truncated checkpoints are rejected at every length", "[checkpoint]") {
  const std::string bytes = encode_state(sample_state());
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    CAPTURE(n);
    REQUIRE_THROWS_AS(decode_state(bytes.substr(0, n)), Error);
  }
  expect_corrupt(bytes.substr(0, 5), "truncated");
  expect_corrupt(bytes.substr(0, bytes.size() - 1), "size mismatch");
}

TEST_CASE("a checkpoint with bytes appended is rejected", "[checkpoint]") {
  expect_corrupt(encode_state(sample_state()) + "x", "size mismatch");
}

TEST_CASE("a flipped byte anywhere is rejected", "[checkpoint]") {
  const std::string bytes = encode_state(sample_state());
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

TEST_CASE("a wrong magic is rejected as not a halfstep state", "[checkpoint]") {
  std::string bytes = encode_state(sample_state());
  bytes[0] = 'X';
  expect_corrupt(bytes, "wrong magic");
  expect_corrupt(std::string(200, '\0'), "wrong magic");
}

TEST_CASE("an unknown version is rejected with the version named", "[checkpoint]") {
  std::string bytes = encode_state(sample_state());
  bytes[4] = 2;
  expect_corrupt(bytes, "unknown format version 2");
}

TEST_CASE("load_state replaces the target only when the state fits the config", "[checkpoint]") {
  StepConfig config;
  OptimizerState target = OptimizerState::initial(config);
  const OptimizerState original = target;

  std::string bytes = encode_state(sample_state());  // scale 9318.9 is within [1, 2^24]
  bytes[30] = static_cast<char>(bytes[30] ^ 0x04);
  CHECK_THROWS_AS(load_state(target, bytes, config), Error);
  CHECK(target == original);

  OptimizerState too_big = sample_state();
  too_big.scaler.scale = 1e30f;  // outside [min_scale, max_scale]
  CHECK_THROWS_WITH(load_state(target, encode_state(too_big), config),
                    Catch::Contains("ScalerState.scale"));
  CHECK(target == original);

  load_state(target, encode_state(sample_state()), config);
  CHECK(target == sample_state());
}
