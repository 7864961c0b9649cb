// The exact Σg²: the kernels' limb arithmetic (kernels/exact_sum.hpp, decoded by summarize) against
// the reference's own big integers, rounding ties, and the property the multi-rank step rests on —
// the record of a set of gradients does not depend on how the set was split or in which order the
// pieces were combined.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "exact_sum.hpp"
#include "halfstep/distributed.hpp"
#include "halfstep/error.hpp"
#include "host_buffers.hpp"
#include "reference_impl.hpp"
#include "step_check.hpp"
#include "step_math.hpp"

using namespace halfstep;
using halfstep_test::same_bits;

namespace {

// A record holding only the sum x · 2^-298 · 2^(32·limb) in its limbs.
StepTotals record_of_digits(const std::vector<std::uint64_t>& limbs) {
  StepTotals r{};
  for (std::size_t i = 0; i < limbs.size(); ++i) r.sum[i] = limbs[i];
  return r;
}

// Adds v · 2^shift (units of 2^-298) into 64-bit limbs, carrying.
void add_at(std::vector<std::uint64_t>& limbs, std::uint64_t v, int shift) {
  unsigned __int128 x = static_cast<unsigned __int128>(v) << (shift % 32);
  for (std::size_t i = static_cast<std::size_t>(shift / 32); x != 0 && i < limbs.size(); ++i) {
    const unsigned __int128 t = static_cast<unsigned __int128>(limbs[i]) + (x & 0xFFFFFFFFu);
    limbs[i] = static_cast<std::uint64_t>(t & 0xFFFFFFFFu);
    x = (x >> 32) + (t >> 32);
  }
}

// The flat concatenation of the gradients of `m`, cut at `cuts` (sorted offsets), as shards of
// tensors: every shard a list of pieces, each pointing into the original buffers.
std::vector<std::vector<ParamTensor>> cut(halfstep_test::HostModel& m, const std::vector<std::int64_t>& cuts) {
  std::vector<ParamTensor> whole = m.views();
  std::vector<std::vector<ParamTensor>> shards(cuts.size() + 1);
  std::int64_t at = 0;
  for (const ParamTensor& t : whole) {
    for (std::int64_t i = 0; i < t.numel;) {
      const std::int64_t flat = at + i;
      const std::size_t s = static_cast<std::size_t>(std::upper_bound(cuts.begin(), cuts.end(), flat) - cuts.begin());
      const std::int64_t end = s < cuts.size() ? std::min(t.numel, cuts[s] - at) : t.numel;
      ParamTensor p = t;
      p.grad = static_cast<const unsigned char*>(t.grad) + i * static_cast<std::int64_t>(element_size(m.tensors[0].grad_dtype));
      p.master = static_cast<float*>(p.master) + i;
      p.exp_avg = static_cast<float*>(p.exp_avg) + i;
      p.exp_avg_sq = static_cast<float*>(p.exp_avg_sq) + i;
      p.model = t.model != nullptr ? static_cast<std::uint16_t*>(t.model) + i : nullptr;
      p.numel = end - i;
      shards[s].push_back(p);
      i = end;
    }
    at += t.numel;
  }
  return shards;
}

// Gradients that make naive floating-point sums order-dependent: the extremes of the format,
// subnormals, zeros and everything between.
halfstep_test::HostModel adversarial(std::uint64_t seed, DType dtype, const std::vector<std::int64_t>& sizes) {
  std::mt19937_64 rng(seed);
  halfstep_test::HostModel m =
      halfstep_test::random_model(seed, sizes, 1.0f, dtype, dtype == DType::f32 ? DType::bf16 : dtype);
  const std::uint32_t max_bits = halfstep_test::special_bits(dtype).max_finite;
  const std::uint32_t sign = dtype == DType::f32 ? 0x80000000u : 0x8000u;
  std::uniform_int_distribution<int> kind(0, 5);
  std::uniform_int_distribution<std::uint32_t> any(0, max_bits);
  for (auto& t : m.tensors) {
    for (std::size_t i = 0; i < t.size(); ++i) {
      std::uint32_t mag = 0;
      switch (kind(rng)) {
        case 0: mag = max_bits; break;              // largest finite
        case 1: mag = 1; break;                     // smallest subnormal
        case 2: mag = any(rng) & 0x7F; break;       // subnormal (or zero)
        case 3: mag = 0; break;
        default: mag = any(rng); break;             // anything finite
      }
      t.set_grad_bits(i, mag | (rng() & 1 ? sign : 0u));
    }
  }
  return m;
}

}  // namespace

TEST_CASE("a limb deposit holds its value and converts back exactly", "[exact_sum]") {
  std::mt19937_64 rng(71);
  for (int trial = 0; trial < 20000; ++trial) {
    // A double that is a multiple of 2^-298 and fits the deposit: a 53-bit significand at a random
    // exponent.
    const std::uint64_t significand = (rng() >> 11) | (std::uint64_t{1} << 52);
    const int exponent = static_cast<int>(rng() % 520) - 298;  // lowest bit at 2^exponent
    const double x = std::ldexp(static_cast<double>(significand), exponent);
    const detail::LimbDeposit d = detail::limb_deposit(x);
    std::uint64_t limbs[detail::kSumLimbs] = {};
    REQUIRE(d.index >= 0);
    REQUIRE(d.index + 2 < detail::kSumLimbs);
    for (int i = 0; i < 3; ++i) limbs[d.index + i] += d.digit[i];
    CAPTURE(trial, x);
    REQUIRE(same_bits(detail::limbs_to_double(limbs), x));
  }
  CHECK(detail::limb_deposit(0.0).index == -1);
}

TEST_CASE("the kernels' rounding of the exact sum is the reference's, ties included", "[exact_sum]") {
  std::mt19937_64 rng(72);
  int ties = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::vector<std::uint64_t> limbs(StepTotals::kSumLimbs, 0);
    switch (trial % 4) {
      case 0: {  // random digits over a random span, some words past 2^32 (an all-reduced record)
        const int top = static_cast<int>(rng() % StepTotals::kSumLimbs);
        const int bottom = static_cast<int>(rng() % static_cast<std::uint64_t>(top + 1));
        for (int i = bottom; i <= top && i < StepTotals::kSumLimbs - 1; ++i) limbs[static_cast<std::size_t>(i)] = rng() >> (trial % 3 == 0 ? 1 : 32);
        break;
      }
      case 1:    // exactly halfway between two doubles: 54 significant bits ending in 1
      case 2: {  // and one unit of 2^-298 either side of halfway
        const std::uint64_t m54 = (rng() >> 10) | (std::uint64_t{1} << 53) | 1u;
        const int shift = static_cast<int>(rng() % 480);
        add_at(limbs, m54, shift);
        if (trial % 4 == 2) {
          if (rng() & 1) {
            add_at(limbs, 1, 0);
          } else {  // subtract one unit: borrow through the limbs
            for (std::size_t i = 0; i < limbs.size(); ++i) {
              if (limbs[i] != 0) {
                --limbs[i];
                break;
              }
              limbs[i] = 0xFFFFFFFFu;
            }
          }
        }
        ++ties;
        break;
      }
      default: {  // a few large words from many ranks
        for (int i = 0; i < 4; ++i) {
          limbs[static_cast<std::size_t>(rng() % (StepTotals::kSumLimbs - 1))] += rng() >> 3;
        }
        break;
      }
    }
    const StepTotals r = record_of_digits(limbs);
    const double kernels = detail::decode_totals(r, DType::bf16).sum_sq;  // (digits alone: not a whole record)
    const double reference = detail::reference_sum_of_squares(r);
    CAPTURE(trial);
    REQUIRE(same_bits(kernels, reference));
  }
  CHECK(ties > 5000);
  // Ties to even, by hand: 2^53 + 1 and 2^53 + 3 units lie halfway; they round to 2^53 and 2^53 + 4.
  std::vector<std::uint64_t> limbs(StepTotals::kSumLimbs, 0);
  add_at(limbs, (std::uint64_t{1} << 53) + 1, 0);
  CHECK(detail::decode_totals(record_of_digits(limbs), DType::f16).sum_sq == std::ldexp(1.0, 53 - 298));
  std::fill(limbs.begin(), limbs.end(), 0);
  add_at(limbs, (std::uint64_t{1} << 53) + 3, 0);
  CHECK(detail::decode_totals(record_of_digits(limbs), DType::f16).sum_sq ==
        std::ldexp(static_cast<double>((std::uint64_t{1} << 53) + 4), -298));
}

TEST_CASE("the record of a set of gradients is the same however it is split and combined", "[exact_sum][distributed]") {
  for (const DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    std::mt19937_64 rng(73 + static_cast<int>(dtype));
    for (int trial = 0; trial < 40; ++trial) {
      halfstep_test::HostModel m = adversarial(rng(), dtype, {1, 777, 0, 4096, 31, 2500});
      StepConfig c;
      c.grad_dtype = dtype;
      c.model_dtype = dtype == DType::f32 ? DType::bf16 : dtype;
      const StepTotals whole = detail::reference_measure(m.views(), c, 0, nullptr);
      const TotalsSummary want = summarize(whole, dtype);
      // Random cut points anywhere in the flat space, 1 to 7 shards, combined in a random order
      // and grouping.
      const std::int64_t total = 1 + 777 + 4096 + 31 + 2500;
      std::vector<std::int64_t> cuts(static_cast<std::size_t>(rng() % 7));
      for (auto& x : cuts) x = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(total + 1));
      std::sort(cuts.begin(), cuts.end());
      auto shards = cut(m, cuts);
      std::vector<StepTotals> parts;
      for (std::size_t s = 0; s < shards.size(); ++s) {
        parts.push_back(detail::reference_measure(shards[s], c, static_cast<std::int32_t>(s), nullptr));
      }
      std::shuffle(parts.begin(), parts.end(), rng);
      while (parts.size() > 1) {  // pairwise, in random pairs: a tree like NCCL's
        const std::size_t i = static_cast<std::size_t>(rng() % (parts.size() - 1));
        combine(parts[i], parts[i + 1]);
        parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      }
      const TotalsSummary got = summarize(parts[0], dtype);
      CAPTURE(trial, cuts.size());
      REQUIRE(same_bits(got.sum_sq, want.sum_sq));
      REQUIRE(got.max_abs == want.max_abs);
      REQUIRE(got.subnormal == want.subnormal);
      REQUIRE(got.zero == want.zero);
      REQUIRE(got.numel == want.numel);
      REQUIRE(got.nonfinite == 0);
    }
  }
}

TEST_CASE("naive sums of the adversarial gradients depend on the order, the exact sum does not", "[exact_sum]") {
  // The test data is hard: summing its squares in fp64 forwards and backwards gives different
  // bits, where the record gives one answer.
  halfstep_test::HostModel m = adversarial(75, DType::bf16, {10000});
  double forward = 0.0, backward = 0.0;
  const auto& g = m.tensors[0].grad;
  for (std::size_t i = 0; i < g.size(); ++i) forward += std::pow(from_bits16(DType::bf16, g[i]), 2);
  for (std::size_t i = g.size(); i-- > 0;) backward += std::pow(from_bits16(DType::bf16, g[i]), 2);
  CHECK_FALSE(same_bits(forward, backward));
  StepConfig c;
  c.grad_dtype = DType::bf16;
  std::reverse(m.tensors[0].grad.begin(), m.tensors[0].grad.end());
  const double reversed = summarize(detail::reference_measure(m.views(), c, 0, nullptr), DType::bf16).sum_sq;
  std::reverse(m.tensors[0].grad.begin(), m.tensors[0].grad.end());
  const double original = summarize(detail::reference_measure(m.views(), c, 0, nullptr), DType::bf16).sum_sq;
  CHECK(same_bits(reversed, original));
}

TEST_CASE("a tensor outside the norm adds its inf/NaN and its maximum only", "[exact_sum][distributed]") {
  halfstep_test::HostModel m = halfstep_test::random_model(76, {100, 50}, 1.0f);
  StepConfig c;
  std::vector<ParamTensor> v = m.views();
  const TotalsSummary first_only = summarize(detail::reference_measure({v[0]}, c, 0, nullptr), DType::f16);
  m.tensors[1].grad[7] = 0x7BFF;  // the largest value is in the excluded tensor
  v = m.views();
  v[1].duplicate = true;
  TotalsSummary s = summarize(detail::reference_measure(v, c, 3, nullptr), DType::f16);
  CHECK(same_bits(s.sum_sq, first_only.sum_sq));
  CHECK(s.numel == 100);
  CHECK(s.max_abs == 65504.0f);
  m.tensors[1].grad[9] = 0xFC00;  // -inf in the excluded tensor still counts
  v = m.views();
  v[1].duplicate = true;
  s = summarize(detail::reference_measure(v, c, 3, nullptr), DType::f16);
  CHECK(s.nonfinite == 1);
  CHECK(s.first_nonfinite_rank == 3);
  CHECK(s.first_nonfinite_tensor == 1);
}

TEST_CASE("combine keeps the lowest rank's first inf/NaN and the largest maximum", "[exact_sum][distributed]") {
  StepTotals a{}, b{};
  a.sum[StepTotals::kSumLimbs] = 2;
  a.max[0] = 0x3C00;
  a.max[1] = (std::uint64_t{0xFFFFFFFFu - 5} << 32) | (0xFFFFFFFFu - 9);  // rank 5, tensor 9
  b.sum[StepTotals::kSumLimbs] = 1;
  b.max[0] = 0x4000;
  b.max[1] = (std::uint64_t{0xFFFFFFFFu - 2} << 32) | (0xFFFFFFFFu - 40);  // rank 2, tensor 40
  combine(a, b);
  const TotalsSummary s = summarize(a, DType::f16);
  CHECK(s.nonfinite == 3);
  CHECK(s.max_abs == 2.0f);
  CHECK(s.first_nonfinite_rank == 2);
  CHECK(s.first_nonfinite_tensor == 40);
}

TEST_CASE("summarize refuses words no reduction of records could give", "[exact_sum][distributed][validate]") {
  StepTotals r{};
  r.max[0] = 0x7C00;  // +inf is not a finite maximum
  CHECK_THROWS_WITH(summarize(r, DType::f16), Catch::Contains("max[0]"));
  r.max[0] = 0;
  r.max[1] = 1;  // a key without a count
  CHECK_THROWS_WITH(summarize(r, DType::f16), Catch::Contains("max[1]"));
  r.max[1] = 0;
  r.sum[StepTotals::kSumLimbs + 1] = 5;  // subnormals without elements
  CHECK_THROWS_WITH(summarize(r, DType::f16), Catch::Contains("outnumber"));
  r.sum[StepTotals::kSumLimbs + 1] = 0;
  r.sum[StepTotals::kSumLimbs] = std::uint64_t{1} << 63;  // a negative count
  CHECK_THROWS_WITH(summarize(r, DType::f16), Catch::Contains("past any count of elements"));
  r.sum[StepTotals::kSumLimbs] = 0;
  r.sum[0] = 1;  // a square without elements
  CHECK_THROWS_WITH(summarize(r, DType::f16), Catch::Contains("exceeds the element count"));
  r.sum[0] = 0;
  CHECK_THROWS_WITH(summarize(r, static_cast<DType>(7)), Catch::Contains("grad_dtype"));
  r.max[0] = 0x7F800000;  // fp32's +inf
  CHECK_THROWS_WITH(summarize(r, DType::f32), Catch::Contains("max[0]"));
  r.max[0] = 0x7F7FFFFF;  // fp32's largest: a finite f32 maximum, no f16 one
  CHECK_NOTHROW(summarize(r, DType::f32));
  CHECK_THROWS_WITH(summarize(r, DType::f16), Catch::Contains("max[0]"));
  r.max[0] = 0;
  CHECK_NOTHROW(summarize(r, DType::bf16));
  CHECK(!summarize(r, DType::bf16).hyperparameters_agree);  // no rank's fingerprint
  r.max[3] = ~r.max[2];
  CHECK(summarize(r, DType::bf16).hyperparameters_agree);
}

TEST_CASE("pass 1's split part sums are exact at their bounds, in every window", "[exact_sum]") {
  // A thread adds at most kMaxPerThread squares. For random windows (hints) of every format, the
  // most extreme thread: every value at the window's top, at its bottom, or anywhere in it; its
  // part sums, turned into integers and placed as digits, must equal the reference's own integer
  // sum of the same squares.
  std::mt19937_64 rng(77);
  for (const DType dtype : {DType::f16, DType::bf16, DType::f32}) {
    const std::uint32_t max_finite = halfstep_test::special_bits(dtype).max_finite;
    for (int trial = 0; trial < 300; ++trial) {
      const std::uint32_t hint = static_cast<std::uint32_t>(rng() % (max_finite + 1ull));
      const detail::SquareSplit split = detail::square_split(dtype, hint);
      const std::uint32_t top = std::min(split.high, max_finite + 1) - 1;  // the largest pattern in it
      std::vector<std::uint32_t> mags(detail::kMaxPerThread);
      for (auto& m : mags) {
        const int kind = trial % 3;
        m = kind == 0 ? top : kind == 1 ? split.low
                                        : split.low + static_cast<std::uint32_t>(rng() % (top - split.low + 1ull));
      }
      double sums[3] = {};
      halfstep_test::HostModel model = halfstep_test::random_model(
          1, {detail::kMaxPerThread}, 1.0f, dtype, dtype == DType::f32 ? DType::bf16 : dtype);
      for (std::size_t i = 0; i < mags.size(); ++i) {
        model.tensors[0].set_grad_bits(i, mags[i]);
        const double x = model.tensors[0].grad_value(i);
        if (split.parts == 2) {
          double two[2] = {sums[0], sums[1]};
          detail::add_square<2>(split, x, two);
          sums[0] = two[0];
          sums[1] = two[1];
        } else {
          detail::add_square<3>(split, x, sums);
        }
      }
      std::int64_t parts[3] = {0, 0, 0};
      for (int k = 0; k < split.parts; ++k) {
        const double units = sums[k] * std::ldexp(1.0, -split.unit_log2[k]);
        REQUIRE(units == std::trunc(units));               // an integer in its unit
        REQUIRE(std::fabs(units) <= std::ldexp(1.0, 53));  // that fp64 held exactly
        parts[k] = static_cast<std::int64_t>(units);
      }
      std::uint32_t digits[detail::kPartialDigits];
      detail::place_parts(split, parts, digits);
      std::uint64_t got[detail::kSumLimbs] = {};
      const int base = detail::split_grid_offset(split) / 32;
      for (int k = 0; k < detail::kPartialDigits && base + k < detail::kSumLimbs; ++k) got[base + k] = digits[k];
      detail::limbs_normalize(got);
      StepConfig c;
      c.grad_dtype = dtype;
      c.model_dtype = dtype == DType::f32 ? DType::bf16 : dtype;
      const StepTotals want = detail::reference_measure(model.views(), c, 0, nullptr);
      CAPTURE(dtype_name(dtype), trial, hint, split.low, top);
      for (int i = 0; i < detail::kSumLimbs; ++i) REQUIRE(got[i] == want.sum[i]);
    }
  }
}
