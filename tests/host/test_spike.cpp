// The spike detector on synthetic norm streams.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "halfstep/error.hpp"
#include "halfstep/spike.hpp"

using namespace halfstep;

namespace {

SpikeConfig enabled() {
  SpikeConfig c;
  c.enabled = true;
  return c;
}

// Feeds `steps` norms of base·drift^i·(lognormal noise with deviation `noise`); returns the number
// of spikes flagged.
int feed(SpikeState& s, const SpikeConfig& c, int steps, double base, double drift, double noise,
         std::mt19937_64& rng) {
  std::normal_distribution<double> n(0.0, noise);
  int flagged = 0;
  double level = base;
  for (int i = 0; i < steps; ++i) {
    const SpikeVerdict v = observe_norm(s, c, level * std::exp(n(rng)));
    flagged += v.spike ? 1 : 0;
    s = v.next;
    level *= drift;
  }
  return flagged;
}

}  // namespace

TEST_CASE("a lone 100x spike after warm-up is flagged and the next norm is not", "[spike]") {
  std::mt19937_64 rng(7);
  const SpikeConfig c = enabled();
  SpikeState s;
  REQUIRE(feed(s, c, 300, 2.0, 1.0, 0.1, rng) == 0);
  const SpikeVerdict v = observe_norm(s, c, 200.0);
  CHECK(v.spike);
  CHECK(v.next.spikes == 1);
  s = v.next;
  CHECK_FALSE(observe_norm(s, c, 2.0).spike);
}

TEST_CASE("slow drift of x0.999 per step for 10k steps is never flagged", "[spike]") {
  std::mt19937_64 rng(8);
  SpikeState s;
  CHECK(feed(s, enabled(), 10000, 5.0, 0.999, 0.05, rng) == 0);
  CHECK(s.spikes == 0);
}

TEST_CASE("slow upward drift of x1.001 per step for 10k steps is never flagged", "[spike]") {
  std::mt19937_64 rng(9);
  SpikeState s;
  CHECK(feed(s, enabled(), 10000, 1e-3, 1.001, 0.05, rng) == 0);
}

TEST_CASE("noiseless constant norms with a 30% wobble are not spikes", "[spike]") {
  // The floor on the deviation keeps a zero-variance history from flagging any increase.
  SpikeConfig c = enabled();
  SpikeState s;
  for (int i = 0; i < 200; ++i) s = observe_norm(s, c, 1.0).next;
  CHECK(s.var == 0.0);
  CHECK_FALSE(observe_norm(s, c, 1.3).spike);
  CHECK(observe_norm(s, c, 1.4).spike);  // log(1.4) = 0.336 > 6 · 0.05
}

TEST_CASE("no step is flagged during warm-up however large", "[spike]") {
  SpikeConfig c = enabled();
  c.warmup_steps = 50;
  SpikeState s;
  for (int i = 0; i < 49; ++i) {
    const double norm = i % 10 == 9 ? 1e6 : 1.0;
    const SpikeVerdict v = observe_norm(s, c, norm);
    CHECK_FALSE(v.spike);
    s = v.next;
  }
  CHECK(s.seen == 49);
  CHECK(s.spikes == 0);
}

TEST_CASE("a flagged spike leaves the statistics unchanged", "[spike]") {
  std::mt19937_64 rng(10);
  const SpikeConfig c = enabled();
  SpikeState s;
  feed(s, c, 200, 1.0, 1.0, 0.1, rng);
  const SpikeVerdict v = observe_norm(s, c, 1e4);
  REQUIRE(v.spike);
  CHECK(v.next.mean == s.mean);
  CHECK(v.next.var == s.var);
  CHECK(v.next.seen == s.seen);
  CHECK(v.next.consecutive == 1);
}

TEST_CASE("zero and non-finite norms leave the statistics alone", "[spike]") {
  std::mt19937_64 rng(11);
  const SpikeConfig c = enabled();
  SpikeState s;
  feed(s, c, 150, 1.0, 1.0, 0.1, rng);
  for (double norm : {0.0, -1.0, static_cast<double>(INFINITY), std::nan("")}) {
    const SpikeVerdict v = observe_norm(s, c, norm);
    CHECK_FALSE(v.spike);
    CHECK(v.next == s);
  }
}

TEST_CASE("the statistics follow the EMA mean and variance of log norm", "[spike]") {
  SpikeConfig c = enabled();
  c.ema_beta = 0.5f;
  SpikeState s;
  s = observe_norm(s, c, std::exp(1.0)).next;
  CHECK(s.mean == Approx(1.0).epsilon(1e-15));
  CHECK(s.var == 0.0);
  s = observe_norm(s, c, std::exp(3.0)).next;
  // deviation 2: mean = 1 + 0.5·2 = 2, var = 0.5·(0 + 0.5·4) = 1
  CHECK(s.mean == Approx(2.0).epsilon(1e-14));
  CHECK(s.var == Approx(1.0).epsilon(1e-14));
  CHECK(s.seen == 2);
}

TEST_CASE("a level that persists past max_consecutive spikes becomes the new normal", "[spike]") {
  std::mt19937_64 rng(12);
  SpikeConfig c = enabled();
  c.max_consecutive = 3;
  SpikeState s;
  feed(s, c, 200, 1.0, 1.0, 0.05, rng);
  for (int i = 0; i < 3; ++i) {
    const SpikeVerdict v = observe_norm(s, c, 100.0);
    CHECK(v.spike);
    s = v.next;
  }
  const SpikeVerdict accepted = observe_norm(s, c, 100.0);
  CHECK_FALSE(accepted.spike);
  CHECK(accepted.next.seen == 1);
  CHECK(accepted.next.mean == Approx(std::log(100.0)));
  CHECK(accepted.next.spikes == 3);
  CHECK(accepted.next.consecutive == 0);
}

TEST_CASE("a disabled detector flags nothing and keeps no statistics", "[spike]") {
  const SpikeConfig c;  // disabled by default
  SpikeState s;
  for (int i = 0; i < 500; ++i) {
    const SpikeVerdict v = observe_norm(s, c, i == 400 ? 1e9 : 1.0);
    CHECK_FALSE(v.spike);
    s = v.next;
  }
  CHECK(s == SpikeState{});
}

TEST_CASE("every invalid spike config is rejected with the field named", "[spike]") {
  SpikeConfig c;
  c.z_threshold = 0.0f;
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("SpikeConfig.z_threshold"));
  c = SpikeConfig{};
  c.ema_beta = 1.0f;
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("SpikeConfig.ema_beta"));
  c = SpikeConfig{};
  c.warmup_steps = 0;
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("SpikeConfig.warmup_steps"));
  c = SpikeConfig{};
  c.min_std = -1.0f;
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("SpikeConfig.min_std"));
  c = SpikeConfig{};
  c.max_consecutive = 0;
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("SpikeConfig.max_consecutive"));
  c = SpikeConfig{};
  c.action = static_cast<SpikeConfig::Action>(7);
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("SpikeConfig.action"));
  CHECK_NOTHROW(SpikeConfig{}.validate());
}
