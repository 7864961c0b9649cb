// The dynamic loss scaler: transition rules, bounds, hysteresis, validation.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "halfstep/error.hpp"
#include "halfstep/scaler.hpp"

using namespace halfstep;

TEST_CASE("scaler defaults are the documented ones", "[scaler]") {
  const ScalerConfig c;
  CHECK(c.init_scale == 65536.0f);
  CHECK(c.growth_factor == 2.0f);
  CHECK(c.backoff_factor == 0.5f);
  CHECK(c.growth_interval == 2000);
  CHECK(c.hysteresis == 1);
  CHECK(c.min_scale == 1.0f);
  CHECK(c.max_scale == 16777216.0f);
  CHECK_NOTHROW(c.validate());
  const ScalerState s = ScalerState::initial(c);
  CHECK(s.scale == 65536.0f);
  CHECK(s.good_steps == 0);
  CHECK(s.hysteresis_left == 1);
  CHECK(s.overflows == 0);
}

TEST_CASE("scaler follows PyTorch's own GradScaler test sequence", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 4.0f;
  c.growth_factor = 2.0f;
  c.backoff_factor = 0.25f;
  c.growth_interval = 2;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, false);
  CHECK(s.good_steps == 1);
  CHECK(s.scale == 4.0f);
  s = next_state(s, c, false);
  CHECK(s.good_steps == 0);
  CHECK(s.scale == 8.0f);
  s = next_state(s, c, true);
  CHECK(s.good_steps == 0);
  CHECK(s.scale == 2.0f);
  CHECK(s.overflows == 1);
  CHECK(s.growths == 1);
  CHECK(s.backoffs == 1);
}

TEST_CASE("scale grows only after growth_interval consecutive clean steps", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 1024.0f;
  c.growth_interval = 3;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, false);
  s = next_state(s, c, false);
  CHECK(s.scale == 1024.0f);
  CHECK(s.good_steps == 2);
  s = next_state(s, c, true);  // the overflow resets the window
  CHECK(s.scale == 512.0f);
  CHECK(s.good_steps == 0);
  s = next_state(s, c, false);
  s = next_state(s, c, false);
  CHECK(s.scale == 512.0f);
  s = next_state(s, c, false);
  CHECK(s.scale == 1024.0f);
  CHECK(s.good_steps == 0);
}

TEST_CASE("hysteresis tolerates overflows before backing off and refills after", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 1024.0f;
  c.hysteresis = 3;
  c.growth_interval = 100;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, true);
  CHECK(s.scale == 1024.0f);
  CHECK(s.hysteresis_left == 2);
  s = next_state(s, c, true);
  CHECK(s.scale == 1024.0f);
  CHECK(s.hysteresis_left == 1);
  s = next_state(s, c, true);  // third overflow: back off and refill
  CHECK(s.scale == 512.0f);
  CHECK(s.hysteresis_left == 3);
  CHECK(s.overflows == 3);
  CHECK(s.backoffs == 1);
}

TEST_CASE("without consecutive_hysteresis clean steps do not refill the tolerance", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 1024.0f;
  c.hysteresis = 2;
  c.growth_interval = 100;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, true);
  s = next_state(s, c, false);
  s = next_state(s, c, false);
  CHECK(s.hysteresis_left == 1);
  s = next_state(s, c, true);  // the second overflow, separated by clean steps, still backs off
  CHECK(s.scale == 512.0f);
}

TEST_CASE("with consecutive_hysteresis every clean step refills the tolerance", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 1024.0f;
  c.hysteresis = 2;
  c.growth_interval = 100;
  c.consecutive_hysteresis = true;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, true);
  CHECK(s.hysteresis_left == 1);
  s = next_state(s, c, false);
  CHECK(s.hysteresis_left == 2);
  s = next_state(s, c, true);  // only consecutive overflows back off
  CHECK(s.scale == 1024.0f);
  s = next_state(s, c, true);
  CHECK(s.scale == 512.0f);
}

TEST_CASE("growth refills the hysteresis", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 8.0f;
  c.hysteresis = 2;
  c.growth_interval = 2;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, true);
  CHECK(s.hysteresis_left == 1);
  s = next_state(s, c, false);
  s = next_state(s, c, false);
  CHECK(s.scale == 16.0f);
  CHECK(s.hysteresis_left == 2);
}

TEST_CASE("the scale is clamped to min_scale and max_scale", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 4.0f;
  c.min_scale = 2.0f;
  c.max_scale = 8.0f;
  c.backoff_factor = 0.125f;
  c.growth_factor = 16.0f;
  c.growth_interval = 1;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, true);
  CHECK(s.scale == 2.0f);
  CHECK(s.backoffs == 1);
  s = next_state(s, c, true);  // already at the floor: no backoff counted
  CHECK(s.scale == 2.0f);
  CHECK(s.backoffs == 1);
  CHECK(s.overflows == 2);
  s = next_state(s, c, false);
  CHECK(s.scale == 8.0f);
  s = next_state(s, c, false);  // at the ceiling: no growth counted
  CHECK(s.scale == 8.0f);
  CHECK(s.growths == 1);
}

TEST_CASE("clamp_scale maps NaN to the floor and keeps infinities out", "[scaler]") {
  CHECK(clamp_scale(std::nanf(""), 1.0f, 4.0f) == 1.0f);
  CHECK(clamp_scale(INFINITY, 1.0f, 4.0f) == 4.0f);
  CHECK(clamp_scale(-INFINITY, 1.0f, 4.0f) == 1.0f);
  CHECK(clamp_scale(0.0f, 1.0f, 4.0f) == 1.0f);
  CHECK(clamp_scale(3.0f, 1.0f, 4.0f) == 3.0f);
}

TEST_CASE("a million random overflow sequences under extreme configs stay in bounds", "[scaler]") {
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> log_factor(0.0f, 40.0f);
  std::uniform_int_distribution<int> small(1, 5);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  long transitions = 0;
  for (int run = 0; run < 1000; ++run) {
    ScalerConfig c;
    c.growth_factor = std::exp2(0.01f + log_factor(rng));            // up to 2^40
    c.backoff_factor = std::exp2(-(0.01f + log_factor(rng)));        // down to 2^-40
    c.min_scale = std::exp2(-120.0f * static_cast<float>(unit(rng)));
    c.max_scale = c.min_scale * std::exp2(250.0f * static_cast<float>(unit(rng)));
    if (!std::isfinite(c.max_scale)) c.max_scale = 3e38f;
    c.init_scale = c.min_scale;
    c.growth_interval = small(rng);
    c.hysteresis = small(rng);
    c.consecutive_hysteresis = run % 2 == 0;
    REQUIRE_NOTHROW(c.validate());
    const double p_overflow = unit(rng);
    ScalerState s = ScalerState::initial(c);
    for (int i = 0; i < 1000; ++i, ++transitions) {
      s = next_state(s, c, unit(rng) < p_overflow);
      REQUIRE(std::isfinite(s.scale));
      REQUIRE(s.scale > 0.0f);
      REQUIRE(s.scale >= c.min_scale);
      REQUIRE(s.scale <= c.max_scale);
      REQUIRE(s.good_steps >= 0);
      REQUIRE(s.good_steps < c.growth_interval);
      REQUIRE(s.hysteresis_left >= 1);
      REQUIRE(s.hysteresis_left <= c.hysteresis);
    }
  }
  CHECK(transitions == 1000000);
}

TEST_CASE("every invalid scaler config is rejected with the field named", "[scaler]") {
  struct Case {
    const char* field;
    std::function<void(ScalerConfig&)> breaks;
  };
  const std::vector<Case> cases = {
      {"growth_factor", [](ScalerConfig& c) { c.growth_factor = 1.0f; }},
      {"growth_factor", [](ScalerConfig& c) { c.growth_factor = INFINITY; }},
      {"growth_factor", [](ScalerConfig& c) { c.growth_factor = std::nanf(""); }},
      {"backoff_factor", [](ScalerConfig& c) { c.backoff_factor = 1.5f; }},
      {"backoff_factor", [](ScalerConfig& c) { c.backoff_factor = 1.0f; }},
      {"backoff_factor", [](ScalerConfig& c) { c.backoff_factor = 0.0f; }},
      {"backoff_factor", [](ScalerConfig& c) { c.backoff_factor = std::nanf(""); }},
      {"growth_interval", [](ScalerConfig& c) { c.growth_interval = 0; }},
      {"hysteresis", [](ScalerConfig& c) { c.hysteresis = 0; }},
      {"min_scale", [](ScalerConfig& c) { c.min_scale = 0.0f; }},
      {"min_scale", [](ScalerConfig& c) { c.min_scale = -1.0f; }},
      {"min_scale", [](ScalerConfig& c) { c.min_scale = INFINITY; }},
      {"max_scale", [](ScalerConfig& c) { c.max_scale = 0.5f; }},
      {"max_scale", [](ScalerConfig& c) { c.max_scale = INFINITY; }},
      {"init_scale", [](ScalerConfig& c) { c.init_scale = 0.5f; }},
      {"init_scale", [](ScalerConfig& c) { c.init_scale = 1e9f; }},
      {"init_scale", [](ScalerConfig& c) { c.init_scale = std::nanf(""); }},
  };
  for (const Case& k : cases) {
    ScalerConfig c;
    k.breaks(c);
    CAPTURE(k.field);
    REQUIRE_THROWS_AS(c.validate(), Error);
    REQUIRE_THROWS_WITH(c.validate(), Catch::Contains(std::string("ScalerConfig.") + k.field));
  }
}

TEST_CASE("the error message states the rule and the value", "[scaler]") {
  ScalerConfig c;
  c.backoff_factor = 1.5f;
  REQUIRE_THROWS_WITH(c.validate(), "ScalerConfig.backoff_factor must be in (0, 1), got 1.5");
}

TEST_CASE("DynamicLossScaler reports whether the step may be applied", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 256.0f;
  c.growth_interval = 2;
  DynamicLossScaler scaler(c);
  CHECK(scaler.scale() == 256.0f);
  CHECK(scaler.update(false));
  CHECK(scaler.update(false));
  CHECK(scaler.scale() == 512.0f);
  CHECK_FALSE(scaler.update(true));
  CHECK(scaler.scale() == 256.0f);
  CHECK(scaler.state().overflows == 1);
  CHECK(scaler.config().growth_interval == 2);
}

TEST_CASE("DynamicLossScaler rejects an invalid config at construction", "[scaler]") {
  ScalerConfig c;
  c.hysteresis = -2;
  REQUIRE_THROWS_WITH(DynamicLossScaler(c), Catch::Contains("ScalerConfig.hysteresis"));
}

TEST_CASE("DynamicLossScaler::set_state rejects states the config cannot produce", "[scaler]") {
  DynamicLossScaler scaler;
  ScalerState s = scaler.state();
  s.scale = 0.25f;
  REQUIRE_THROWS_WITH(scaler.set_state(s), Catch::Contains("ScalerState.scale"));
  s = scaler.state();
  s.hysteresis_left = 0;
  REQUIRE_THROWS_WITH(scaler.set_state(s), Catch::Contains("hysteresis_left"));
  CHECK(scaler.state() == ScalerState::initial(ScalerConfig{}));
  s = scaler.state();
  s.scale = 1024.0f;
  scaler.set_state(s);
  CHECK(scaler.scale() == 1024.0f);
}

TEST_CASE("a constant scaler never changes the scale but still counts overflows", "[scaler]") {
  const ScalerConfig c = ScalerConfig::constant(1.0f);
  REQUIRE_NOTHROW(c.validate());
  ScalerState s = ScalerState::initial(c);
  for (int i = 0; i < 5000; ++i) s = next_state(s, c, i % 7 == 0);
  CHECK(s.scale == 1.0f);
  CHECK(s.overflows == 715);
  CHECK(s.growths == 0);
  CHECK(s.backoffs == 0);
}

TEST_CASE("headroom growth grows early only with room for the factor and the margin", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 1024.0f;
  c.growth_interval = 1000;
  c.headroom_growth = true;
  c.headroom_margin_log2 = 4.0f;  // grow by 2 only when headroom >= 1 + 4 = 5
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, false, 4.99f);
  CHECK(s.scale == 1024.0f);
  CHECK(s.good_steps == 1);
  s = next_state(s, c, false, 5.0f);
  CHECK(s.scale == 2048.0f);
  CHECK(s.good_steps == 0);
  CHECK(s.growths == 1);
  s = next_state(s, c, false, INFINITY);  // all-zero gradients say nothing about the scale
  CHECK(s.scale == 2048.0f);
  s = next_state(s, c, false, std::nanf(""));
  CHECK(s.scale == 2048.0f);
  s = next_state(s, c, true, 30.0f);  // an overflow still backs off, whatever the headroom
  CHECK(s.scale == 1024.0f);
}

TEST_CASE("without the opt-in the headroom is ignored", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 1024.0f;
  c.growth_interval = 3;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, false, 20.0f);
  s = next_state(s, c, false, 20.0f);
  CHECK(s.scale == 1024.0f);
  s = next_state(s, c, false, 20.0f);
  CHECK(s.scale == 2048.0f);
  CHECK(next_state(s, c, false) == next_state(s, c, false, 20.0f));
}

TEST_CASE("headroom growth keeps the scale clamped and the margin validated", "[scaler]") {
  ScalerConfig c;
  c.init_scale = c.max_scale;
  c.headroom_growth = true;
  ScalerState s = ScalerState::initial(c);
  s = next_state(s, c, false, 40.0f);
  CHECK(s.scale == c.max_scale);
  CHECK(s.growths == 0);
  c.headroom_margin_log2 = -1.0f;
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("ScalerConfig.headroom_margin_log2"));
  c.headroom_margin_log2 = INFINITY;
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("ScalerConfig.headroom_margin_log2"));
}

TEST_CASE("DynamicLossScaler passes the headroom to the transition", "[scaler]") {
  ScalerConfig c;
  c.init_scale = 8.0f;
  c.headroom_growth = true;
  DynamicLossScaler scaler(c);
  CHECK(scaler.update(false, 12.0f));
  CHECK(scaler.scale() == 16.0f);
  CHECK(scaler.update(false));
  CHECK(scaler.scale() == 16.0f);
}
