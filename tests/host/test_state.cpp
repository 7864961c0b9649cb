// The state formats: the lossless split of fp32 masters into a bf16 model copy and an int16
// remainder (every finite fp32 pattern), the slots and bytes of each format, and runs with lean
// state on the reference backend: remainders bitwise the run with fp32 masters, bf16 moments
// reproducible across a resume.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "halfstep/checkpoint.hpp"
#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/safetensors.hpp"
#include "halfstep/state.hpp"
#include "sharded_run.hpp"
#include "state_codec.hpp"
#include "step_check.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

// The test's own statement of bf16 rounding to nearest, ties to even, on an fp32 pattern: the
// magnitude bits are ordered as the values are, so the two candidates are the pattern cut to its
// upper half and the next one (which may carry into the exponent, or reach infinity).
std::uint32_t nearest_even_bf16(std::uint32_t b) {
  const std::uint32_t low = b & 0xFFFFu, cut = b >> 16;
  if (low < 0x8000u) return cut;
  if (low > 0x8000u) return cut + 1;
  return (cut & 1u) == 0 ? cut : cut + 1;
}

struct SplitCounts {
  std::uint64_t split = 0, ties = 0, overflow = 0, nonfinite = 0, wrong = 0;
  std::uint32_t first_wrong = 0;
};

SplitCounts check_patterns(std::uint64_t begin, std::uint64_t end) {
  SplitCounts n;
  auto wrong = [&n](std::uint32_t b) {
    if (n.wrong++ == 0) n.first_wrong = b;
  };
  for (std::uint64_t i = begin; i < end; ++i) {
    const auto b = static_cast<std::uint32_t>(i);
    const bool finite = (b & 0x7F800000u) != 0x7F800000u;
    const std::uint32_t rne = nearest_even_bf16(b);
    const bool model_finite = (rne & 0x7F80u) != 0x7F80u;
    const bool tie = (b & 0x1FFFFu) == 0x8000u;  // the upper tie above an even pattern
    std::uint16_t model = 0;
    std::int16_t remainder = 0;
    const bool ok = split_master(b, model, remainder);
    // The kernels' codec, on the host: it canonicalises, so only the range can refuse.
    std::uint16_t k_model = 0, k_stored = 0;
    const float x = detail::float_of(b);
    const bool k_ok = finite && detail::MasterCodec<MasterFormat::bf16_remainder, DType::bf16>::encode(x, true, false, 0u, k_stored, k_model);
    float f_stored = 0.0f;
    std::uint16_t f_model = 0;
    const bool f_ok = finite && detail::MasterCodec<MasterFormat::f32, DType::bf16>::encode(x, true, false, 0u, f_stored, f_model);
    if (!finite) {
      ++n.nonfinite;
      if (ok) wrong(b);
      continue;
    }
    if (!model_finite) {  // would write an infinite model copy: never (invariant 11)
      ++n.overflow;
      if (ok || k_ok || f_ok) wrong(b);
      continue;
    }
    const std::uint32_t canonical = tie ? b - 1u : b;
    if (canonical_master(b) != canonical) wrong(b);
    if (tie) {
      ++n.ties;
      std::uint16_t m2 = 0;
      std::int16_t r2 = 0;
      if (ok || !split_master(b - 1u, m2, r2) || m2 != rne || join_master(m2, r2) != b - 1u) wrong(b);
    } else {
      ++n.split;
      if (!ok || model != rne || join_master(model, remainder) != b ||
          remainder != static_cast<std::int16_t>(static_cast<std::int32_t>(b - (rne << 16))))
        wrong(b);
    }
    // Both master formats store the canonical value with the model copy rounded to nearest even.
    if (!k_ok || k_model != rne ||
        detail::bits_of(detail::MasterCodec<MasterFormat::bf16_remainder, DType::bf16>::decode(k_stored, k_model)) != canonical)
      wrong(b);
    if (!f_ok || f_model != rne || detail::bits_of(f_stored) != canonical) wrong(b);
  }
  return n;
}

}  // namespace

TEST_CASE("every finite fp32 master splits into a bf16 model copy and an int16 remainder and joins back exactly",
          "[state][exhaustive]") {
  if (std::getenv("HALFSTEP_TEST_REDUCED") != nullptr) {
    // Under the sanitizers (minutes there): every low half under the upper halves where the
    // format changes character — zero, the subnormals' ends, around 1, the largest finite, the
    // infinities and NaNs, both signs — and every 251st one.
    SplitCounts n;
    for (std::uint32_t high = 0; high < 0x10000u; ++high) {
      const std::uint32_t m = high & 0x7FFFu;
      const bool special = m <= 1u || m == 0x7Fu || m == 0x80u || m == 0x3F7Fu || m == 0x3F80u || m == 0x3F81u ||
                           m >= 0x7F7Eu;
      if (!special && high % 251u != 0) continue;
      const SplitCounts part = check_patterns(std::uint64_t{high} << 16, (std::uint64_t{high} + 1) << 16);
      if (part.wrong != 0 && n.wrong == 0) n.first_wrong = part.first_wrong;
      n.wrong += part.wrong;
    }
    CAPTURE(n.first_wrong);
    CHECK(n.wrong == 0);
    return;
  }
  // All 2^32 patterns, over the machine's threads (a few seconds).
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<SplitCounts> parts(threads);
  std::vector<std::thread> pool;
  const std::uint64_t total = std::uint64_t{1} << 32;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] { parts[t] = check_patterns(total * t / threads, total * (t + 1) / threads); });
  }
  for (std::thread& th : pool) th.join();
  SplitCounts n;
  for (const SplitCounts& p : parts) {
    if (p.wrong != 0 && n.wrong == 0) n.first_wrong = p.first_wrong;
    n.split += p.split;
    n.ties += p.ties;
    n.overflow += p.overflow;
    n.nonfinite += p.nonfinite;
    n.wrong += p.wrong;
  }
  CAPTURE(n.first_wrong);
  CHECK(n.wrong == 0);
  CHECK(n.nonfinite == (std::uint64_t{1} << 24));  // exponent all ones: inf and NaN
  // Per sign, the patterns that round past 0x7F7F (the largest finite bf16): low half >= 0x8000.
  CHECK(n.overflow == 2u * 0x8000u);
  // Per sign, one upper tie per even finite bf16 pattern 0x0000 ... 0x7F7E.
  CHECK(n.ties == 2u * (0x7F80u / 2u));
  CHECK(n.split + n.ties + n.overflow + n.nonfinite == total);
}

TEST_CASE("split and join: signed zeros, subnormals, carries into the exponent and the largest finite master",
          "[state]") {
  struct Case {
    std::uint32_t bits;
    std::uint16_t model;
    std::int16_t remainder;
  };
  for (const Case c : {Case{0x00000000u, 0x0000u, 0}, Case{0x80000000u, 0x8000u, 0},
                       Case{0x00000001u, 0x0000u, 1}, Case{0x80007FFFu, 0x8000u, 0x7FFF},
                       Case{0x0000C000u, 0x0001u, -0x4000}, Case{0x007FFFFFu, 0x0080u, -1},  // subnormal -> normal
                       Case{0x3F7FFFFFu, 0x3F80u, -1},  // 1 - 2^-24: carries into the exponent, rounds to 1
                       Case{0x7F7F7FFFu, 0x7F7Fu, 0x7FFF}, Case{0x3F818000u, 0x3F82u, -0x8000}}) {
    CAPTURE(c.bits);
    std::uint16_t m = 0;
    std::int16_t r = 0;
    REQUIRE(split_master(c.bits, m, r));
    CHECK(m == c.model);
    CHECK(r == c.remainder);
    CHECK(join_master(m, r) == c.bits);
  }
  std::uint16_t m = 0;
  std::int16_t r = 0;
  CHECK_FALSE(split_master(0x7F7F8000u, m, r));   // rounds to infinity
  CHECK_FALSE(split_master(0x3F808000u, m, r));   // the upper tie above the even 0x3F80
  CHECK(canonical_master(0x3F808000u) == 0x3F807FFFu);
  CHECK(canonical_master(0x3F818000u) == 0x3F818000u);  // above an odd pattern: it rounds up, remainder -2^15
}

TEST_CASE("slot layouts and bytes per element of each state format", "[state]") {
  StepConfig c;  // fp16 gradients and model copy, fp32 state
  auto bytes = [](const StepConfig& config, bool model) {
    const StateBytes b = state_bytes(config, model);
    return std::vector<std::size_t>{b.state, b.gradient, b.model, b.moved};
  };
  // pass 1 reads the gradient (2), pass 2 reads it (2), reads and writes master and moments
  // (3 x 8), writes the model copy (2).
  CHECK(bytes(c, true) == std::vector<std::size_t>{12, 2, 2, 30});
  CHECK(bytes(c, false) == std::vector<std::size_t>{12, 2, 0, 28});
  c.grad_dtype = c.model_dtype = DType::bf16;
  c.state.exp_avg = c.state.exp_avg_sq = MomentFormat::bf16;
  CHECK(bytes(c, true) == std::vector<std::size_t>{8, 2, 2, 22});
  c.state.master = MasterFormat::bf16_remainder;  // the model copy is read too
  CHECK(bytes(c, true) == std::vector<std::size_t>{6, 2, 2, 20});
  const auto slots = slot_layouts(c);
  CHECK(slots[0].storage == Storage::i16);
  CHECK(std::string(slots[0].name) == "master");
  CHECK(slots[2].storage == Storage::bf16);
  CHECK_FALSE(slots[4].nullable);  // the model copy is half of the master
  CHECK(slots[4].read);
  c.state = StateFormat{};
  CHECK(slot_layouts(c)[4].nullable);
  CHECK_FALSE(slot_layouts(c)[4].read);
  c.grad_dtype = DType::f32;  // fp32 gradients, fp32 parameters that are the masters
  CHECK(bytes(c, false) == std::vector<std::size_t>{12, 4, 0, 32});
}

TEST_CASE("state formats a step cannot serve are refused by name", "[state][validate]") {
  StepConfig c;
  c.state.master = MasterFormat::bf16_remainder;  // with an fp16 model copy
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("bf16_remainder needs a bf16 model copy") &&
                                      Catch::Contains("model_dtype is f16"));
  c.model_dtype = c.grad_dtype = DType::bf16;
  CHECK_NOTHROW(c.validate());
  c.state.exp_avg = static_cast<MomentFormat>(7);
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("StepConfig.state.exp_avg must be f32, bf16 or block8"));
  c.state.exp_avg = MomentFormat::bf16;
  c.state.rounding = static_cast<Rounding>(3);
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("StepConfig.state.rounding"));
  c.state.rounding = Rounding::nearest;
  // A remainder needs its model copy: a tensor without one is refused before anything runs.
  FlatBuffers flat = ShardedCase::make(5, DType::bf16, 0, 40, c.state).initial;
  ParamTensor p = flat.view();
  p.model = nullptr;
  CHECK_THROWS_WITH(FusedAdamW({p}, c, Backend::reference), Catch::Contains("model"));
  // bf16 moments are 2-byte buffers: an odd address is refused.
  p = flat.view();
  p.exp_avg = static_cast<unsigned char*>(p.exp_avg) + 1;
  p.numel -= 1;
  CHECK_THROWS_WITH(FusedAdamW({p}, c, Backend::reference), Catch::Contains("exp_avg"));
}

namespace {

// `c` stepped unsharded on the reference backend: the reports and the buffers.
std::pair<std::vector<StepReport>, FlatBuffers> run_reference(const ShardedCase& c, std::size_t steps = SIZE_MAX) {
  FlatBuffers flat = c.initial;
  FusedAdamW opt(c.whole(flat), c.config, Backend::reference);
  std::vector<StepReport> reports;
  for (std::size_t s = 0; s < std::min(steps, c.grads.size()); ++s) {
    flat.grad = c.grads[s];
    opt.step();
    reports.push_back(opt.last_report());
  }
  return {reports, flat};
}

// The layout entry flat element `i` of `c` belongs to, and where that tensor starts.
std::size_t tensor_of(const ShardedCase& c, std::size_t i) {
  std::int64_t at = 0;
  for (std::size_t t = 0; t < c.layout.size(); ++t) {
    at += c.layout[t].numel;
    if (static_cast<std::int64_t>(i) < at) return t;
  }
  return c.layout.size();
}
std::int64_t start_of(const ShardedCase& c, std::size_t t) {
  std::int64_t at = 0;
  for (std::size_t k = 0; k < t; ++k) at += c.layout[k].numel;
  return at;
}

// Step s of `c` on `opt` (over `flat`, its state in a narrow format) beside the fp32-state step
// from the same values and optimizer state; both reports must agree. Returns the fp32 step's
// buffers.
FlatBuffers step_beside_fp32(const ShardedCase& c, std::size_t s, FlatBuffers& flat, FusedAdamW& opt) {
  ShardedCase wide_case = c;
  wide_case.config.state = StateFormat{};
  FlatBuffers wide = flat.as_f32();
  wide.grad = c.grads[s];
  FusedAdamW one(wide_case.whole(wide), wide_case.config, Backend::reference);
  one.set_state(opt.state());
  one.step();
  flat.grad = c.grads[s];
  opt.step();
  REQUIRE(same_report(opt.last_report(), one.last_report(), [](std::int32_t, std::int32_t t) { return t; }));
  return wide;
}

// How often stochastic rounding went each way.
struct RoundingCounts {
  std::size_t up = 0, down = 0, exact = 0;
};

// `got` must be the fp32 value `x` rounded to bf16 once: to nearest even, or (stochastic) to one
// of the two bf16 values around it, never anything else.
void check_rounded(std::uint16_t got, float x, Rounding rounding, RoundingCounts& n) {
  const std::uint32_t b = detail::bits_of(x);
  const auto down = static_cast<std::uint16_t>(b >> 16);  // towards zero
  if (rounding == Rounding::nearest) {
    REQUIRE(got == static_cast<std::uint16_t>(nearest_even_bf16(b)));
  } else if ((b & 0xFFFFu) == 0) {
    REQUIRE(got == down);
    ++n.exact;
  } else {
    REQUIRE((got == down || got == down + 1));
    (got == down ? n.down : n.up) += 1;
  }
}

bool same_reports(const std::vector<StepReport>& a, const std::vector<StepReport>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t s = 0; s < a.size(); ++s) {
    if (!same_report(a[s], b[s], [](std::int32_t, std::int32_t t) { return t; })) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("remainders step bitwise like fp32 masters with a bf16 model copy", "[state][reference]") {
  for (const MomentFormat moments : {MomentFormat::f32, MomentFormat::bf16}) {
    StateFormat f32;
    f32.exp_avg = f32.exp_avg_sq = moments;
    f32.seed = 77;
    StateFormat lean = f32;
    lean.master = MasterFormat::bf16_remainder;
    const ShardedCase a = ShardedCase::make(2100, DType::bf16, 200, 900, f32);
    const ShardedCase b = ShardedCase::make(2100, DType::bf16, 200, 900, lean);
    const auto ra = run_reference(a), rb = run_reference(b);
    CAPTURE(moment_format_name(moments));
    CHECK(same_reports(ra.first, rb.first));
    CHECK(rb.second.as_f32() == ra.second.as_f32());  // masters, moments, model copies
    int applied = 0;
    for (const StepReport& r : ra.first) applied += r.outcome == Outcome::applied;
    CHECK(applied >= 100);
  }
}

TEST_CASE("each step with bf16 moments is the fp32 step from the same state, its moments rounded once",
          "[state][reference]") {
  // From the state a bf16-moment run holds before each step (decoded exactly to fp32), one step
  // with fp32 moments gives the fp32 results; the lean step must give the same report and master
  // and store each moment as that result rounded: to nearest even, or (stochastic) to one of the
  // two bf16 values around it, never anything else.
  for (const Rounding rounding : {Rounding::nearest, Rounding::stochastic}) {
    StateFormat lean;
    lean.exp_avg = lean.exp_avg_sq = MomentFormat::bf16;
    lean.rounding = rounding;
    const ShardedCase c = ShardedCase::make(2200, DType::bf16, 40, 900, lean);
    FlatBuffers flat = c.initial;
    FusedAdamW opt(c.whole(flat), c.config, Backend::reference);
    RoundingCounts n;
    for (std::size_t s = 0; s < c.grads.size(); ++s) {
      CAPTURE(rounding_name(rounding), s);
      const FlatBuffers wide = step_beside_fp32(c, s, flat, opt);
      const FlatBuffers got = flat.as_f32();
      REQUIRE(std::memcmp(got.master.data(), wide.master.data(), got.master.size() * sizeof(float)) == 0);
      for (const auto& [stored, want] : {std::pair{&flat.exp_avg16, &wide.exp_avg},
                                         std::pair{&flat.exp_avg_sq16, &wide.exp_avg_sq}}) {
        for (std::size_t i = 0; i < stored->size(); ++i) check_rounded((*stored)[i], (*want)[i], rounding, n);
      }
    }
    if (rounding == Rounding::stochastic) {  // both ways, many times
      CHECK(n.up > 1000);
      CHECK(n.down > 1000);
    }
  }
}

TEST_CASE("stochastic rounding resumes bit for bit: the checkpoint carries the seed", "[state][checkpoint]") {
  for (const MasterFormat master : {MasterFormat::bf16_remainder, MasterFormat::none}) {
    StateFormat lean;
    lean.master = master;
    lean.exp_avg = lean.exp_avg_sq = MomentFormat::bf16;
    lean.seed = 0x5EEDu;
    CAPTURE(master_format_name(master));
    const ShardedCase c = ShardedCase::make(2300, DType::bf16, 80, 900, lean);
    const auto straight = run_reference(c);
    // 40 steps, the checkpoint and the buffers, then an optimizer built with another seed resumes.
    FlatBuffers flat = c.initial;
    std::string saved;
    {
      FusedAdamW opt(c.whole(flat), c.config, Backend::reference);
      for (std::size_t s = 0; s < 40; ++s) {
        flat.grad = c.grads[s];
        opt.step();
      }
      saved = opt.save_state();
    }
    for (const bool restore : {true, false}) {
      FlatBuffers resumed = flat;
      StepConfig other = c.config;
      other.state.seed = 1;
      FusedAdamW opt(c.whole(resumed), other, Backend::reference);
      if (restore) opt.load_state(saved);
      std::vector<StepReport> reports;
      for (std::size_t s = 40; s < c.grads.size(); ++s) {
        resumed.grad = c.grads[s];
        opt.step();
        reports.push_back(opt.last_report());
      }
      CAPTURE(restore);
      if (restore) {
        CHECK(opt.config().state.seed == 0x5EEDu);  // the run's seed, not the one this optimizer was built with
        CHECK(same_reports(reports, std::vector<StepReport>(straight.first.begin() + 40, straight.first.end())));
        CHECK(resumed == straight.second);
      } else {
        CHECK_FALSE(resumed == straight.second);  // another seed rounds otherwise
      }
    }
  }
}

TEST_CASE("a model copy written outside the step over its remainder is read as a number", "[state][reference]") {
  // ±0 written over a negative remainder (a weight zeroed in place) joins to a bit pattern past
  // the sign: not a number. The kernels' codec and the reference both read the model copy's own
  // value there; a step then holds nothing, and writes finite masters.
  using Codec = detail::MasterCodec<MasterFormat::bf16_remainder, DType::bf16>;
  const auto minus = static_cast<std::uint16_t>(static_cast<std::int16_t>(-5));
  CHECK(detail::bits_of(Codec::decode(minus, 0x0000u)) == 0x00000000u);
  CHECK(detail::bits_of(Codec::decode(minus, 0x8000u)) == 0x80000000u);
  CHECK(detail::bits_of(Codec::decode(5, 0x0000u)) == 5u);                 // a valid pair: the join
  CHECK(detail::bits_of(Codec::decode(minus, 0x3F80u)) == 0x3F7FFFFBu);    // the join, below 1
  CHECK(std::isnan(Codec::decode(0, 0x7FC0u)));                            // a NaN written stays NaN
  StateFormat lean;
  lean.master = MasterFormat::bf16_remainder;
  const ShardedCase c = ShardedCase::make(2400, DType::bf16, 12, 300, lean);
  FlatBuffers flat = c.initial;
  FusedAdamW opt(c.whole(flat), c.config, Backend::reference);
  for (std::size_t s = 0; s < 6; ++s) {
    flat.grad = c.grads[s];
    opt.step();
  }
  std::size_t zeroed = 0;
  for (std::size_t i = 0; i < flat.model.size(); ++i) {
    if (static_cast<std::int16_t>(flat.remainder[i]) < 0 && i % 2 == 0) {
      flat.model[i] = i % 4 == 0 ? 0x0000u : 0x8000u;
      ++zeroed;
    }
  }
  REQUIRE(zeroed > 20);
  for (std::size_t s = 6; s < c.grads.size(); ++s) {
    flat.grad = c.grads[s];
    opt.step();
    CHECK(opt.last_report().held_elements == 0);
  }
  const FlatBuffers wide = flat.as_f32();
  for (float m : wide.master) REQUIRE(std::isfinite(m));
}

TEST_CASE("without a master the bf16 model copy is the weight: slots, bytes and the rules", "[state][validate]") {
  StepConfig c;
  c.grad_dtype = c.model_dtype = DType::bf16;
  c.state.master = MasterFormat::none;
  const auto slots = slot_layouts(c);
  CHECK_FALSE(slots[0].present);  // no master buffer
  CHECK(slots[0].element_bytes == 0);
  CHECK_FALSE((slots[0].state || slots[0].read || slots[0].written));
  CHECK(slots[4].present);
  CHECK(slots[4].read);  // the weight is read and written
  CHECK(slots[4].written);
  CHECK_FALSE(slots[4].nullable);
  auto bytes = [](const StepConfig& config) {
    const StateBytes b = state_bytes(config, true);
    return std::vector<std::size_t>{b.state, b.gradient, b.model, b.moved};
  };
  // pass 1 reads the gradient (2), pass 2 reads it (2), reads and writes the moments (2 x 8) and
  // the weight (2 x 2).
  CHECK(bytes(c) == std::vector<std::size_t>{8, 2, 2, 24});
  c.state.exp_avg = c.state.exp_avg_sq = MomentFormat::bf16;
  CHECK(bytes(c) == std::vector<std::size_t>{4, 2, 2, 16});
  CHECK_THROWS_WITH(state_bytes(c, false), Catch::Contains("master = none") && Catch::Contains("model_copy must be true"));
  CHECK(std::string(master_format_name(MasterFormat::none)) == "none");
  // The kernels' codec: the weight is the model copy; a result is rounded to it, up with
  // probability (discarded bits) / 2^16, and one that would not be finite is refused.
  using Codec = detail::MasterCodec<MasterFormat::none, DType::bf16>;
  std::uint16_t unused = 0, w = 0;
  CHECK(Codec::decode(0, 0x3FC0u) == 1.5f);
  const float x = 1.5f + 0x1p-9f;  // a quarter of an ulp above 1.5: discarded bits 0x4000
  CHECK((Codec::encode(x, true, false, 0u, unused, w) && w == 0x3FC0u));         // to nearest
  CHECK((Codec::encode(x, true, true, 0xBFFFu, unused, w) && w == 0x3FC0u));     // 0x4000 + 0xBFFF < 2^16
  CHECK((Codec::encode(x, true, true, 0xC000u, unused, w) && w == 0x3FC1u));     // reaches 2^16: up
  CHECK((Codec::encode(x, true, true, 0xFFFF0000u, unused, w) && w == 0x3FC0u)); // only the low 16 bits count
  CHECK_FALSE(Codec::encode(0x1.fffffep127f, true, true, 0xFFFFu, unused, w));   // rounds past bf16's range
  CHECK_FALSE(Codec::encode(std::numeric_limits<float>::infinity(), true, false, 0u, unused, w));

  StepConfig f16 = c;
  f16.model_dtype = f16.grad_dtype = DType::f16;
  CHECK_THROWS_WITH(f16.validate(), Catch::Contains("master = none needs a bf16 model copy") &&
                                        Catch::Contains("model_dtype is f16"));
  // A master buffer where there is none, or no model copy, is refused before anything runs.
  FlatBuffers flat = ShardedCase::make(6, DType::bf16, 0, 40, c.state).initial;
  CHECK(flat.master.empty());
  ParamTensor p = flat.view();
  CHECK(p.master == nullptr);
  CHECK_NOTHROW(FusedAdamW({p}, c, Backend::reference));
  std::vector<float> stray(static_cast<std::size_t>(p.numel));
  p.master = stray.data();
  CHECK_THROWS_WITH(FusedAdamW({p}, c, Backend::reference),
                    Catch::Contains("tensors[0].master must be null") && Catch::Contains("master = none"));
  p = flat.view();
  p.model = nullptr;
  CHECK_THROWS_WITH(FusedAdamW({p}, c, Backend::reference),
                    Catch::Contains("tensors[0].model is null") && Catch::Contains("the bf16 model copy is the weight"));
  // An empty tensor's master must be null too.
  p = flat.view();
  p.numel = 0;
  p.master = stray.data();
  CHECK_THROWS_WITH(FusedAdamW({p}, c, Backend::reference), Catch::Contains("tensors[0].master must be null"));
}

TEST_CASE("without a master each step is the fp32-master step from the same weights, the weight rounded once",
          "[state][reference]") {
  // From the weights a master-free run holds before each step (bf16, exactly fp32 values), one
  // step with an fp32 master gives the fp32 result; the master-free step must give the same
  // report and moments and store the weight as that result rounded: to nearest even, or
  // (stochastic) to one of the two bf16 values around it, never anything else.
  for (const Rounding rounding : {Rounding::nearest, Rounding::stochastic}) {
    StateFormat lean;
    lean.master = MasterFormat::none;
    lean.rounding = rounding;
    lean.seed = 31;
    const ShardedCase c = ShardedCase::make(2500, DType::bf16, 40, 900, lean);
    FlatBuffers flat = c.initial;
    FusedAdamW opt(c.whole(flat), c.config, Backend::reference);
    RoundingCounts n;
    std::size_t applied = 0;
    for (std::size_t s = 0; s < c.grads.size(); ++s) {
      CAPTURE(rounding_name(rounding), s);
      const FlatBuffers wide = step_beside_fp32(c, s, flat, opt);
      applied += opt.last_report().outcome == Outcome::applied;
      REQUIRE(flat.exp_avg == wide.exp_avg);  // fp32 moments: the same arithmetic, bit for bit
      REQUIRE(flat.exp_avg_sq == wide.exp_avg_sq);
      for (std::size_t i = 0; i < flat.model.size(); ++i) {
        check_rounded(flat.model[i], wide.master[i], rounding, n);
        if (rounding == Rounding::stochastic && opt.last_report().outcome == Outcome::applied) {
          // The reference draws the weight's bits as the kernels' codec does (state_codec.hpp).
          const std::size_t t = tensor_of(c, i);
          const std::uint64_t key =
              detail::tensor_key(detail::step_key(lean.seed, opt.last_report().step), static_cast<std::uint32_t>(t + 1));
          const std::uint32_t r = detail::weight_bits(detail::element_bits(key, static_cast<std::int64_t>(i) - start_of(c, t)));
          // (The fp32 master stores an upper tie one ulp lower, canonical_master; the weight
          // rounds the result itself: either may have been the fp32 result.)
          const std::uint32_t b = detail::bits_of(wide.master[i]);
          const auto rounded = [&](std::uint32_t x) { return static_cast<std::uint16_t>((x + (r & 0xFFFFu)) >> 16); };
          REQUIRE((flat.model[i] == rounded(b) || ((b & 0x1FFFFu) == 0x7FFFu && flat.model[i] == rounded(b + 1))));
        }
      }
    }
    CHECK(applied >= 20);
    if (rounding == Rounding::stochastic) {
      CHECK(n.up > 1000);
      CHECK(n.down > 1000);
    }
  }
}

TEST_CASE("without a master, stochastic rounding keeps updates below half a bf16 ulp, to nearest loses them",
          "[state][reference]") {
  // 4096 weights at 1.5 (bf16 ulp 2^-7) under a constant gradient: Adam's update is lr = 2^-11,
  // a sixteenth of an ulp, for 64 steps. An fp32 master moves by 64 · 2^-11 = 2^-5; a master-free
  // weight rounded to nearest never moves; rounded stochastically each weight moves by the fp32
  // step in expectation: the mean over 4096 weights has a standard error below
  // sqrt(64) · 2^-8 / sqrt(4096) = 2^-11, and must lie within 6 of them of the fp32 master's move.
  const std::size_t n = 4096;
  const int steps = 64;
  auto run = [&](MasterFormat master, Rounding rounding) {
    StepConfig c;
    c.grad_dtype = c.model_dtype = DType::bf16;
    c.groups.resize(1);
    c.groups[0].lr = 0x1p-11f;
    c.groups[0].weight_decay = 0.0f;
    c.max_grad_norm = 0.0f;
    c.scaler.init_scale = 1.0f;
    c.spike.enabled = false;
    c.state.master = master;
    c.state.rounding = rounding;
    c.state.seed = 5;
    std::vector<float> w32(n, 1.5f), m(n, 0.0f), v(n, 0.0f);
    std::vector<std::uint16_t> g(n, to_bits16(DType::bf16, 0.25)), model(n, to_bits16(DType::bf16, 1.5));
    ParamTensor p;
    p.master = master == MasterFormat::f32 ? w32.data() : nullptr;
    p.grad = g.data();
    p.exp_avg = m.data();
    p.exp_avg_sq = v.data();
    p.model = model.data();
    p.numel = static_cast<std::int64_t>(n);
    FusedAdamW opt({p}, c, Backend::reference);
    for (int s = 0; s < steps; ++s) {
      opt.step();
      REQUIRE(opt.last_report().outcome == Outcome::applied);
    }
    double mean = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      mean += master == MasterFormat::f32 ? static_cast<double>(w32[i]) : from_bits16(DType::bf16, model[i]);
    }
    return 1.5 - mean / static_cast<double>(n);  // the mean move
  };
  const double fp32 = run(MasterFormat::f32, Rounding::stochastic);
  CHECK(std::fabs(fp32 - 0x1p-5) < 0x1p-5 * 1e-3);
  CHECK(run(MasterFormat::none, Rounding::nearest) == 0.0);
  const double sr = run(MasterFormat::none, Rounding::stochastic);
  CAPTURE(fp32, sr);
  CHECK(std::fabs(sr - fp32) < 6 * 0x1p-11);
}

TEST_CASE("safetensors checkpoints move between fp32 masters and no master, and resume without one bit for bit",
          "[state][safetensors]") {
  // The file holds a master as fp32 values: without a master, the weight's (exact). Loaded where
  // there is no master, an fp32 master becomes the weight rounded to nearest even (what its model
  // copy already is); loaded where there is one, the weight becomes the fp32 master exactly.
  StateFormat none;
  none.master = MasterFormat::none;
  none.seed = 404;
  const ShardedCase c = ShardedCase::make(2600, DType::bf16, 60, 500, none);
  ShardedCase c32 = c;
  c32.config.state = StateFormat{};
  c32.config.state.seed = 404;
  c32.initial = ShardedCase::make(2600, DType::bf16, 0, 500, StateFormat{}).initial;
  std::vector<std::string> names;
  for (std::size_t t = 0; t < c.layout.size(); ++t) names.push_back("w" + std::to_string(t));
  const std::string path = "halfstep_test_no_master.safetensors";
  auto steps = [](FusedAdamW& opt, FlatBuffers& flat, const ShardedCase& k, std::size_t from, std::size_t to) {
    for (std::size_t s = from; s < to; ++s) {
      flat.grad = k.grads[s];
      opt.step();
    }
  };
  // fp32 masters -> no master.
  FlatBuffers a = c32.initial;
  FusedAdamW opt_a(c32.whole(a), c32.config, Backend::reference);
  steps(opt_a, a, c32, 0, 20);
  save_checkpoint(opt_a, names, path);
  FlatBuffers b = c.initial;
  FusedAdamW opt_b(c.whole(b), c.config, Backend::reference);
  load_checkpoint(opt_b, names, path);
  for (std::size_t i = 0; i < a.master.size(); ++i) REQUIRE(b.model[i] == to_bits16(DType::bf16, a.master[i]));
  CHECK(b.exp_avg == a.exp_avg);
  CHECK(b.exp_avg_sq == a.exp_avg_sq);
  CHECK(opt_b.state() == opt_a.state());
  // No master -> no master: the rest of the run, bit for bit, as if never interrupted.
  steps(opt_b, b, c, 20, 40);
  save_checkpoint(opt_b, names, path);
  FlatBuffers d = c.initial;
  {
    FusedAdamW opt_d(c.whole(d), c.config, Backend::reference);
    load_checkpoint(opt_d, names, path);
    d.grad = b.grad;  // the buffers compared besides the gradients
    CHECK(d == b);
    steps(opt_d, d, c, 40, 60);
  }
  steps(opt_b, b, c, 40, 60);
  CHECK(d == b);
  // No master -> fp32 masters: the master is the weight's value.
  save_checkpoint(opt_b, names, path);
  FlatBuffers e = c32.initial;
  FusedAdamW opt_e(c32.whole(e), c32.config, Backend::reference);
  load_checkpoint(opt_e, names, path);
  const FlatBuffers wide = b.as_f32();
  CHECK(e.master == wide.master);
  CHECK(e.model == b.model);
  std::remove(path.c_str());
}
