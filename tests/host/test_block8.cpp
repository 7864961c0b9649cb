// The block-wise 8-bit moment codec (kernels/block8.hpp): the two dynamic maps, encoding one value
// to nearest and stochastically, a block's scale and codes, and where a tensor's blocks lie.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <random>
#include <thread>
#include <vector>

#include "block8.hpp"
#include "block8_geometry.hpp"
#include "halfstep/state.hpp"
#include "halfstep/step.hpp"
#include "state_codec.hpp"
#include "step_math.hpp"

namespace {

using namespace halfstep::detail;

// The codes of every value nearest x (one, or two at a tie), found by looking at all 256.
std::vector<int> nearest_codes(const Map8& map, float x) {
  double best = INFINITY;
  std::vector<int> codes;
  for (int c = 0; c < 256; ++c) {
    const double d = std::fabs(static_cast<double>(map.value[c]) - static_cast<double>(x));
    if (d < best) {
      best = d;
      codes = {c};
    } else if (d == best) {
      codes.push_back(c);
    }
  }
  return codes;
}

}  // namespace

TEST_CASE("8-bit maps: 256 ascending values, seven decades, 0 and 1 exact", "[block8]") {
  for (const Codec8* codec : {&kSignedCodec8, &kUnsignedCodec8}) {
    const Map8& map = codec->map;
    for (int c = 1; c < 256; ++c) REQUIRE(map.value[c - 1] < map.value[c]);
    REQUIRE(map.value[255] == 1.0f);
  }
  const Map8& s = kSignedCodec8.map;
  const Map8& u = kUnsignedCodec8.map;
  REQUIRE(s.value[kSignedZero8] == 0.0f);
  REQUIRE(u.value[kUnsignedZero8] == 0.0f);
  // The extremes: the top decade's last midpoint (64 cells signed, 128 unsigned) and the bottom
  // decade's first (1 cell signed, 2 unsigned), rounded once to fp32.
  REQUIRE(s.value[0] == static_cast<float>(-(0.1 + 0.9 * 63.5 / 64)));
  REQUIRE(s.value[254] == static_cast<float>(0.1 + 0.9 * 63.5 / 64));
  REQUIRE(s.value[128] == static_cast<float>((0.1 + 0.9 * 0.5) * 1e-6));
  REQUIRE(u.value[1] == static_cast<float>((0.1 + 0.9 * 0.5 / 2) * 1e-6));
  REQUIRE(u.value[254] == static_cast<float>(0.1 + 0.9 * 127.5 / 128));
  // The signed map is symmetric but for +1.
  for (int c = 0; c < 127; ++c) REQUIRE(s.value[c] == -s.value[254 - c]);
  // Within a decade the grid is linear: 64 signed cells between 0.1 and 1 have steps of 0.9/64.
  REQUIRE(std::fabs(s.value[200] - s.value[199] - 0.9 / 64) < 1e-7);
}

TEST_CASE("8-bit codec tables: magnitudes, thresholds, and guesses no more than one boundary short", "[block8]") {
  const auto lowest = [](int i) {
    return std::ldexp(1.0 + (i % (1 << kGuessBits8)) / static_cast<double>(1 << kGuessBits8), i / (1 << kGuessBits8) - 23);
  };
  for (const Codec8* codec : {&kSignedCodec8, &kUnsignedCodec8}) {
    const int zero = codec->is_signed ? kSignedZero8 : kUnsignedZero8;
    REQUIRE(codec->top == 255 - zero);
    for (int p = 0; p <= codec->top; ++p) REQUIRE(codec->magnitude[p] == codec->map.value[zero + p]);
    REQUIRE(std::isinf(codec->magnitude[codec->top + 1]));
    REQUIRE(std::isinf(codec->magnitude[257]));
    for (int p = 0; p <= codec->top; ++p) {
      REQUIRE(codec->step[p].lo == codec->magnitude[p]);
      REQUIRE(codec->step[p].gap == (p < codec->top ? codec->magnitude[p + 1] - codec->magnitude[p] : INFINITY));
    }
    // The thresholds: T_j is the smallest fp32 value the fp32 rule sends up from magnitude j - 1
    // to j, checked here with the rule and the fp32 neighbours as <cmath> gives them.
    std::vector<float> thresholds(static_cast<std::size_t>(codec->top) + 2, INFINITY);
    for (int j = 1; j <= codec->top; ++j) {
      const float lo = codec->magnitude[j - 1], hi = codec->magnitude[j];
      const auto up = [&](float y) { return y - lo > hi - y; };
      float t = lo + (hi - lo) / 2;
      while (up(t)) t = std::nextafter(t, 0.0f);
      while (!up(t)) t = std::nextafter(t, INFINITY);
      thresholds[static_cast<std::size_t>(j)] = t;
      REQUIRE(t > lo);
      REQUIRE(t <= hi);
    }
    // Entry e's range [lowest(e), lowest(e + 1)): each table's index is its answer for lowest(e)
    // and `next` the boundary past it, and the boundary after that lies at or past lowest(e + 1).
    // Below lowest(0) the answer is 0 in both (the first entry answers for those values too).
    REQUIRE(codec->floor[0].index == 0);
    REQUIRE(codec->nearest[0].index == 0);
    for (int e = 0; e < kGuessEntries8; ++e) {
      INFO("entry " << e);
      const Guess8 f = codec->floor[e], n = codec->nearest[e];
      REQUIRE(f.index >= 0);
      REQUIRE(f.index <= codec->top);
      REQUIRE(static_cast<double>(codec->magnitude[f.index]) <= lowest(e));
      REQUIRE(f.next == codec->magnitude[f.index + 1]);
      REQUIRE(static_cast<double>(f.next) > lowest(e));
      if (e + 1 < kGuessEntries8) REQUIRE(static_cast<double>(codec->magnitude[f.index + 2]) >= lowest(e + 1));
      REQUIRE(n.index >= 0);
      REQUIRE(n.index <= codec->top);
      REQUIRE((n.index == 0 || static_cast<double>(thresholds[static_cast<std::size_t>(n.index)]) <= lowest(e)));
      REQUIRE(n.next == thresholds[static_cast<std::size_t>(n.index) + 1]);
      REQUIRE(static_cast<double>(n.next) > lowest(e));
      if (e + 1 < kGuessEntries8 && n.index + 2 <= codec->top + 1) {
        REQUIRE(static_cast<double>(thresholds[static_cast<std::size_t>(n.index) + 2]) >= lowest(e + 1));
      }
    }
  }
}

namespace {
// The encoder as first written, the oracle of the tables: the floor guess, its magnitude and the
// two above it, one comparison for the floor, then to nearest "up when y - lo > hi - y" in fp32,
// or stochastically "up when y - lo > (hi - lo) · u", u = (r + 1/2) · 2^-16.
int magnitude_index_by_search(const Codec8& c, float y, bool stochastic, std::uint32_t random) {
  int p = c.floor[guess_entry8(y)].index;
  const float m0 = c.magnitude[p], m1 = c.magnitude[p + 1], m2 = c.magnitude[p + 2];
  const bool past = m1 <= y;
  p += past ? 1 : 0;
  const float lo = past ? m1 : m0, hi = past ? m2 : m1;
  const float below = y - lo;
  const bool up = stochastic ? below > (hi - lo) * ((static_cast<float>(random & 0xFFFFu) + 0.5f) * 0x1p-16f)
                             : below > hi - y;
  return p + (up ? 1 : 0);
}

// Patterns [begin, end) of magnitudes with `stride`: how many encode to other codes than the
// rules as first written give, to nearest and stochastically with bits that vary with the pattern.
std::uint64_t table_mismatches(const Codec8& codec, std::uint32_t begin, std::uint32_t end, std::uint32_t stride) {
  std::uint64_t mismatches = 0;
  for (std::uint32_t b = begin; b < end; b += stride) {
    const float y = float_of(b);
    const std::uint32_t r = fmix32(b);
    const int zero = codec.is_signed ? kSignedZero8 : 0;
    mismatches += encode8(codec, y, false, 0u, false) != zero + magnitude_index_by_search(codec, y, false, 0u) ? 1 : 0;
    mismatches += encode8(codec, y, true, r, false) != zero + magnitude_index_by_search(codec, y, true, r) ? 1 : 0;
  }
  return mismatches;
}
}  // namespace

TEST_CASE("8-bit encode: the tables give the fp32 rules' codes for every fp32 magnitude up to 2", "[block8][exhaustive]") {
  // Every fp32 pattern from 0 to 2 (the tables' range and past it on both sides; under the
  // sanitizers every 61st), each map, to nearest and stochastically, against the rules evaluated
  // as first written: the codes are bit for bit the same. Over the machine's threads.
  const std::uint32_t stride = std::getenv("HALFSTEP_TEST_REDUCED") != nullptr ? 61u : 1u;
  const std::uint32_t end = 0x40000001u;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  for (const Codec8* codec : {&kSignedCodec8, &kUnsignedCodec8}) {
    std::vector<std::uint64_t> parts(threads);
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      // Each thread's first pattern on the stride's grid from 0.
      const std::uint64_t from = (std::uint64_t{end} * t / threads + stride - 1) / stride * stride;
      const std::uint64_t to = std::uint64_t{end} * (t + 1) / threads;
      pool.emplace_back([&, t, from, to] {
        parts[t] = table_mismatches(*codec, static_cast<std::uint32_t>(from), static_cast<std::uint32_t>(to), stride);
      });
    }
    for (std::thread& th : pool) th.join();
    std::uint64_t mismatches = 0;
    for (std::uint64_t m : parts) mismatches += m;
    REQUIRE(mismatches == 0);
    // The extremes of the random bits, and negative values, on a stride of the patterns.
    for (std::uint32_t b = 0; b < end; b += 4099 * stride) {
      const float y = float_of(b);
      for (std::uint32_t r : {0u, 0xFFFFu}) {
        const int p = magnitude_index_by_search(*codec, y, true, r);
        REQUIRE(encode8(*codec, y, true, r, false) == (codec->is_signed ? kSignedZero8 + p : p));
        if (codec->is_signed) REQUIRE(encode8(*codec, -y, true, r, false) == kSignedZero8 - std::min(p, 127));
      }
    }
  }
}

TEST_CASE("8-bit encode to nearest: every code round-trips, every value goes to a nearest code", "[block8]") {
  for (const Codec8* codec : {&kSignedCodec8, &kUnsignedCodec8}) {
    const Map8& map = codec->map;
    // A tie goes to the smaller magnitude.
    const auto nearest = [&](float x) {
      const std::vector<int> best = nearest_codes(map, x);
      if (best.size() == 1) return best[0];
      return std::fabs(map.value[best[0]]) < std::fabs(map.value[best[1]]) ? best[0] : best[1];
    };
    for (int c = 0; c < 256; ++c) REQUIRE(encode8(*codec, map.value[c], false, 0u, false) == c);
    std::mt19937 gen(31);
    std::uniform_real_distribution<float> unit(codec->is_signed ? -1.0f : 0.0f, 1.0f);
    std::uniform_real_distribution<float> decades(-8.0f, 0.0f);
    for (int i = 0; i < 20000; ++i) {
      // Half uniform, half log-uniform over eight decades (and its sign for the signed map).
      float x = unit(gen);
      if (i % 2 == 1) x = std::copysign(std::pow(10.0f, decades(gen)), codec->is_signed ? x : 1.0f);
      INFO("x = " << x);
      REQUIRE(encode8(*codec, x, false, 0u, false) == nearest(x));
    }
    // Where the guess and its one comparison decide: each map value, each guess entry's lowest
    // value, and their neighbours four fp32 ulps either way, both signs.
    std::vector<float> edges;
    for (int c = 0; c < 256; ++c) edges.push_back(map.value[c]);
    for (int e = 0; e < kGuessEntries8; ++e) {
      edges.push_back(static_cast<float>(std::ldexp(1.0 + (e % 128) / 128.0, e / 128 - 23)));
    }
    for (float edge : edges) {
      float x = edge;
      for (int k = 0; k < 4; ++k) x = std::nextafter(x, -INFINITY);
      for (int k = 0; k < 9; ++k, x = std::nextafter(x, INFINITY)) {
        for (float v : {x, -x}) {
          if (!codec->is_signed && v < 0.0f) continue;
          INFO("x = " << v);
          REQUIRE(encode8(*codec, v, false, 0u, false) == nearest(v));
        }
      }
    }
    // Midpoints between neighbours are ties: the smaller magnitude.
    int ties = 0;
    for (int c = 0; c < 255; ++c) {
      const float lo = map.value[c], hi = map.value[c + 1];
      const float mid = lo + (hi - lo) / 2;
      if (mid - lo != hi - mid) continue;  // not exactly halfway in fp32
      ++ties;
      REQUIRE(encode8(*codec, mid, false, 0u, false) == (std::fabs(lo) < std::fabs(hi) ? c : c + 1));
    }
    REQUIRE(ties > 100);
  }
  // Beyond the ends: the end codes (the signed map's -1 goes to its lowest value).
  REQUIRE(encode8(kSignedCodec8, -1.0f, false, 0u, false) == 0);
  REQUIRE(encode8(kSignedCodec8, -1.5f, true, 0xFFFFu, false) == 0);
  REQUIRE(encode8(kSignedCodec8, 1.0000001f, false, 0u, false) == 255);
  REQUIRE(encode8(kUnsignedCodec8, 1.0000001f, false, 0u, false) == 255);
  REQUIRE(encode8(kUnsignedCodec8, 3.0f, true, 0xFFFFu, false) == 255);
  REQUIRE(encode8(kSignedCodec8, -0.0f, false, 0u, false) == kSignedZero8);
}

TEST_CASE("8-bit stochastic encode: one of the two neighbours, up as often as x lies past the lower", "[block8]") {
  std::mt19937 gen(32);
  for (const Codec8* codec : {&kSignedCodec8, &kUnsignedCodec8}) {
    const Map8& map = codec->map;
    std::uniform_int_distribution<int> code(0, 254);
    std::uniform_real_distribution<float> frac(0.0f, 1.0f);
    for (int trial = 0; trial < 200; ++trial) {
      const int c = code(gen);
      const float lo = map.value[c], hi = map.value[c + 1];
      const float x = lo + (hi - lo) * frac(gen);
      if (!(x > lo && x < hi)) continue;
      // Every one of the 2^16 random values, counted: the share that rounds up is the share of
      // the gap x lies past lo, to within one random value (2^-16) and fp32's rounding of it.
      std::int64_t ups = 0, others = 0;
      for (std::uint32_t r = 0; r < 65536u; ++r) {
        const int got = encode8(*codec, x, true, r, false);
        ups += got == c + 1 ? 1 : 0;
        others += got != c && got != c + 1 ? 1 : 0;
      }
      REQUIRE(others == 0);
      const double want = (static_cast<double>(x) - lo) / (static_cast<double>(hi) - lo);
      INFO("code " << c << ", x = " << x);
      REQUIRE(std::fabs(static_cast<double>(ups) / 65536.0 - want) <= 2.0 / 65536.0 + want * 0x1p-22);
      // The bits used are the low 16: the high half changes nothing.
      REQUIRE(encode8(*codec, x, true, 0x1234u, false) == encode8(*codec, x, true, 0xABCD1234u, false));
    }
    // A value on the map stays put whatever the bits.
    for (std::uint32_t r : {0u, 0x7FFFu, 0xFFFFu}) REQUIRE(encode8(*codec, map.value[77], true, r, false) == 77);
  }
}

TEST_CASE("8-bit never_zero: a positive square root never decodes to 0", "[block8]") {
  const Codec8& codec = kUnsignedCodec8;
  for (float x : {1e-30f, 1e-12f, 1e-8f, 1.6e-7f}) {
    REQUIRE(encode8(codec, x, false, 0u, false) == 0);  // below half the smallest positive value
    REQUIRE(encode8(codec, x, false, 0u, true) == 1);
    for (std::uint32_t r : {0u, 0xFFFFu}) REQUIRE(encode8(codec, x, true, r, true) == 1);
  }
  // In a block: positive values the division by the absmax flushes to 0 too; zeros stay 0.
  std::uint32_t random[4] = {0u, 0xFFFFFFFFu, 0u, 0u};
  float x[4] = {1e-45f, 1e-40f, 1e3f, 0.0f};
  for (bool stochastic : {false, true}) {
    std::uint8_t codes[4];
    float scale;
    REQUIRE(encode_block8(codec, x, 4, stochastic, random, 0, true, codes, scale));
    REQUIRE(codes[0] == 1);
    REQUIRE(codes[1] == 1);
    REQUIRE(codes[2] == 255);
    REQUIRE(codes[3] == 0);
    REQUIRE(encode_block8(codec, x, 4, stochastic, random, 0, false, codes, scale));
    REQUIRE(codes[0] == 0);  // without the rule
  }
}

TEST_CASE("8-bit block: absmax scale, the largest value exact to nearest, zeros, flushes and non-finite refusal", "[block8]") {
  std::mt19937 gen(33);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(256);
  std::vector<std::uint32_t> random(256);
  for (int n : {1, 37, 255, 256}) {
    for (int i = 0; i < n; ++i) {
      x[static_cast<std::size_t>(i)] = normal(gen) * 1e-3f;
      random[static_cast<std::size_t>(i)] = static_cast<std::uint32_t>(gen());
    }
    x[static_cast<std::size_t>(n / 2)] = 5e-3f;  // the absmax, positive
    for (bool stochastic : {false, true}) {
      std::uint8_t codes[256];
      float scale = -1.0f;
      REQUIRE(encode_block8(kSignedCodec8, x.data(), n, stochastic, random.data(), 0, false, codes, scale));
      REQUIRE(scale == 5e-3f);
      // To nearest the absmax is exact (1 · absmax); stochastically a·fl(1/a) may fall one ulp
      // below 1, and the absmax rounds down with a tiny probability (not for this a).
      if (!stochastic) REQUIRE(decode8(kSignedCodec8, codes[n / 2], scale) == 5e-3f);
      const float inverse = 1.0f / scale;
      for (int i = 0; i < n; ++i) {
        const std::size_t u = static_cast<std::size_t>(i);
        REQUIRE(codes[i] == encode8(kSignedCodec8, x[u] * inverse, stochastic, random[u], false));
        if (!stochastic) {  // a code of the value nearest x · (1 / absmax)
          const std::vector<int> best = nearest_codes(kSignedCodec8.map, x[u] * inverse);
          REQUIRE(std::find(best.begin(), best.end(), static_cast<int>(codes[i])) != best.end());
        }
      }
    }
  }
  // The exp_avg_sq side: shift 16 takes the high half of the bits.
  {
    for (int i = 0; i < 256; ++i) x[static_cast<std::size_t>(i)] = std::fabs(normal(gen));
    std::uint8_t a[256], b[256];
    float sa, sb;
    std::vector<std::uint32_t> shifted(256);
    for (int i = 0; i < 256; ++i) shifted[static_cast<std::size_t>(i)] = random[static_cast<std::size_t>(i)] >> 16;
    REQUIRE(encode_block8(kUnsignedCodec8, x.data(), 256, true, random.data(), 16, true, a, sa));
    REQUIRE(encode_block8(kUnsignedCodec8, x.data(), 256, true, shifted.data(), 0, true, b, sb));
    REQUIRE(sa == sb);
    for (int i = 0; i < 256; ++i) REQUIRE(a[i] == b[i]);
  }
  // A block of zeros: scale 0, every code the map's 0, decoded as 0 (no 0 · inf).
  {
    std::vector<float> zeros(256, 0.0f);
    zeros[3] = -0.0f;
    std::uint8_t codes[256];
    float scale = -1.0f;
    REQUIRE(encode_block8(kSignedCodec8, zeros.data(), 256, true, random.data(), 0, false, codes, scale));
    REQUIRE(scale == 0.0f);
    for (int i = 0; i < 256; ++i) {
      REQUIRE(codes[i] == kSignedZero8);
      REQUIRE(decode8(kSignedCodec8, codes[i], scale) == 0.0f);
    }
    REQUIRE(encode_block8(kUnsignedCodec8, zeros.data(), 256, false, random.data(), 0, true, codes, scale));
    REQUIRE(scale == 0.0f);
    for (int i = 0; i < 256; ++i) REQUIRE(codes[i] == kUnsignedZero8);
  }
  // An absmax below fp32's smallest normal: the block stores zeros (its reciprocal would overflow).
  {
    float tiny[3] = {1e-39f, -5e-40f, 0.0f};
    std::uint8_t codes[3];
    float scale = -1.0f;
    REQUIRE(encode_block8(kSignedCodec8, tiny, 3, false, random.data(), 0, false, codes, scale));
    REQUIRE(scale == 0.0f);
    for (std::uint8_t c : codes) REQUIRE(c == kSignedZero8);
    float smallest_normal[2] = {0x1p-126f, -0x1p-127f};
    REQUIRE(encode_block8(kSignedCodec8, smallest_normal, 2, false, random.data(), 0, false, codes, scale));
    REQUIRE(scale == 0x1p-126f);
    REQUIRE(std::isfinite(inverse8(scale)));
    REQUIRE(codes[0] == 255);
  }
  // Any inf or NaN, first, middle or last: refused, and nothing written.
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    for (int at : {0, 128, 255}) {
      for (int i = 0; i < 256; ++i) x[static_cast<std::size_t>(i)] = 0.5f;
      x[static_cast<std::size_t>(at)] = bad;
      std::uint8_t codes[256];
      for (std::uint8_t& c : codes) c = 0xAB;
      float scale = 7.0f;
      REQUIRE_FALSE(encode_block8(kSignedCodec8, x.data(), 256, false, random.data(), 0, false, codes, scale));
      REQUIRE(scale == 7.0f);
      for (std::uint8_t c : codes) REQUIRE(c == 0xAB);
    }
  }
}

TEST_CASE("8-bit block loop helpers: division by an invariant divisor, eight elements' random bits at once", "[block8]") {
  // Divisor32: floor(n / d) for every n below 2^32, checked on the divisors a tensor's rows take
  // (1 to a few thousand blocks a row), powers of two and their neighbours, and the largest, at
  // random and extreme dividends.
  std::mt19937_64 gen(35);
  std::vector<std::uint32_t> divisors;
  for (std::uint32_t d = 1; d <= 4100; ++d) divisors.push_back(d);
  for (int k = 12; k < 32; ++k) {
    for (std::int64_t delta : {-1, 0, 1}) divisors.push_back(static_cast<std::uint32_t>((std::int64_t{1} << k) + delta));
  }
  for (std::uint32_t d : {0x7FFFFFFFu, 0x80000001u, 0xFFFFFFFEu, 0xFFFFFFFFu, 3000000007u}) divisors.push_back(d);
  for (int i = 0; i < 200; ++i) divisors.push_back(static_cast<std::uint32_t>(gen() | 1u));
  for (std::uint32_t d : divisors) {
    const Divisor32 v = divisor32(d);
    std::vector<std::uint32_t> ns = {0u, 1u, d - 1u, d, d + 1u, 2u * d - 1u, 0xFFFFFFFFu, 0xFFFFFFFEu, 0x80000000u};
    for (int i = 0; i < 64; ++i) ns.push_back(static_cast<std::uint32_t>(gen()));
    for (std::uint32_t q = 1; q < 4; ++q) {
      const std::uint64_t m = std::uint64_t{d} * q;
      if (m <= 0xFFFFFFFFu) ns.push_back(static_cast<std::uint32_t>(m - 1));
    }
    for (std::uint32_t n : ns) {
      INFO("n = " << n << ", d = " << d);
      REQUIRE(v.divide(n) == n / d);
    }
  }
  // element_bits8: element_bits of eight consecutive indices from a multiple of 8, also where the
  // low half of the index is near 2^32 and the high half is not 0.
  for (std::int64_t index : {std::int64_t{0}, std::int64_t{8}, std::int64_t{4096}, (std::int64_t{1} << 32) - 8,
                             std::int64_t{1} << 32, (std::int64_t{5} << 32) + 0xFFFFFFF8, (std::int64_t{1} << 46) - 8}) {
    for (std::uint64_t key : {std::uint64_t{0}, std::uint64_t{0x0123456789ABCDEFull}, ~std::uint64_t{0}}) {
      std::uint32_t r[8];
      element_bits8(key, index, r);
      for (int j = 0; j < 8; ++j) REQUIRE(r[j] == element_bits(key, index + j));
    }
  }
}

TEST_CASE("8-bit block geometry: the small-tensor rule by global shape, blocks within rows", "[block8]") {
  // The rule reads the whole tensor's shape, never a shard's.
  REQUIRE_FALSE(block8_geometry(4095, 0).quantized);
  REQUIRE(block8_geometry(4096, 0).quantized);
  REQUIRE_FALSE(block8_geometry(1 << 20, 1).quantized);   // a 1-D tensor cut anywhere: rows of 1
  REQUIRE_FALSE(block8_geometry(31 * 1000, 31).quantized);
  REQUIRE(block8_geometry(32 * 1000, 32).quantized);
  REQUIRE_FALSE(block8_geometry(0, 0).quantized);
  REQUIRE_FALSE(block8_geometry(5000, 300).quantized);  // rows that do not divide the tensor

  {  // One row of 5000: 19 blocks of 256 and one of 136.
    const Block8Geometry g = block8_geometry(5000, 0);
    REQUIRE(g.blocks == 20);
    REQUIRE(g.block_of(0) == 0);
    REQUIRE(g.block_of(255) == 0);
    REQUIRE(g.block_of(256) == 1);
    REQUIRE(g.block_of(4999) == 19);
    REQUIRE(g.block_size(0) == 256);
    REQUIRE(g.block_size(19) == 136);
    REQUIRE(g.starts_block(4864));
    REQUIRE_FALSE(g.starts_block(4865));
    REQUIRE(g.starts_block(5000));
  }
  {  // Rows of 300 (a [40, 300] tensor): two blocks a row, 256 and 44; every row starts a block.
    const Block8Geometry g = block8_geometry(40 * 300, 300);
    REQUIRE(g.blocks_per_row == 2);
    REQUIRE(g.blocks == 80);
    REQUIRE(g.block_of(299) == 1);
    REQUIRE(g.block_of(300) == 2);
    REQUIRE(g.block_of(300 + 256) == 3);
    REQUIRE(g.block_size(2) == 256);
    REQUIRE(g.block_size(3) == 44);
    for (std::int64_t r = 0; r <= 40; ++r) REQUIRE(g.starts_block(r * 300));
    REQUIRE(g.starts_block(256));
    REQUIRE_FALSE(g.starts_block(512));  // 212 into the second row
  }
  {  // Rows of 64 (an embedding of width 64): one block a row.
    const Block8Geometry g = block8_geometry(100 * 64, 64);
    REQUIRE(g.blocks == 100);
    REQUIRE(g.block_size(7) == 64);
    REQUIRE(g.block_of(64 * 7 + 63) == 7);
  }
  // Sum of the block sizes is the tensor; pieces cut at block starts hold disjoint, consecutive
  // blocks: the scale a piece's local block i holds is the whole tensor's block_of(begin) + i.
  for (std::int64_t row : {std::int64_t{0}, std::int64_t{300}, std::int64_t{64}, std::int64_t{1024}}) {
    const std::int64_t numel = row == 0 ? 9000 : row * 100;
    const Block8Geometry g = block8_geometry(numel, row);
    REQUIRE(g.quantized);
    std::int64_t total = 0;
    for (std::int64_t b = 0; b < g.blocks; ++b) total += g.block_size(b);
    REQUIRE(total == numel);
    std::vector<std::int64_t> starts;
    for (std::int64_t i = 0; i <= numel; ++i) {
      if (g.starts_block(i)) starts.push_back(i);
    }
    REQUIRE(static_cast<std::int64_t>(starts.size()) == g.blocks + 1);
    // Cut into three pieces at block starts: their block counts add up, and each element's local
    // block is its global block less the piece's first.
    const std::int64_t cut1 = starts[starts.size() / 3], cut2 = starts[2 * starts.size() / 3];
    REQUIRE(g.blocks_in(0, cut1) + g.blocks_in(cut1, cut2) + g.blocks_in(cut2, numel) == g.blocks);
    for (std::int64_t i = cut1; i < cut2; ++i) {
      const std::int64_t local = g.block_of(i) - g.block_of(cut1);
      REQUIRE(local >= 0);
      REQUIRE(local < g.blocks_in(cut1, cut2));
    }
  }
}

namespace {

// One block's step composed from its parts, each chosen independently of update_block8: the
// decoded state (map value times scale; exp_avg_sq the square of its root), AdamW, the master
// codec with the weight's own bits (weight_bits of the element's draw), exp_avg encoded to
// nearest and sqrt(exp_avg_sq) with the state's rounding from bits 16-31.
template <class Master, bool kDraw>
void composed_step(std::vector<typename Master::Stored>& ps, std::vector<std::uint16_t>& model, std::vector<std::uint8_t>& mc,
                   std::vector<std::uint8_t>& vc, float& ms, float& vs, const std::vector<float>& g, bool with_model,
                   const std::vector<std::uint32_t>& random, const GroupConsts& k) {
  const std::size_t n = g.size();
  std::vector<float> m(n), root(n);
  for (std::size_t i = 0; i < n; ++i) {
    float p = Master::decode(ps[i], model[i]);
    m[i] = kSignedCodec8.map.value[mc[i]] * ms;
    const float r = kUnsignedCodec8.map.value[vc[i]] * vs;
    float v = r * r;
    adamw_update(p, m[i], v, g[i], k);
    root[i] = std::sqrt(v);
    std::uint16_t w = 0;
    typename Master::Stored stored{};
    REQUIRE(Master::encode(p, with_model, kDraw, weight_bits(random[i]), stored, w));
    ps[i] = stored;
    if (with_model) model[i] = w;
  }
  std::vector<std::uint32_t> high(n);
  for (std::size_t i = 0; i < n; ++i) high[i] = random[i] >> 16;
  const int count = static_cast<int>(n);
  REQUIRE(encode_block8(kSignedCodec8, m.data(), count, false, nullptr, 0, false, mc.data(), ms));
  REQUIRE(encode_block8(kUnsignedCodec8, root.data(), count, kDraw, high.data(), 0, true, vc.data(), vs));
}

template <class Master, bool kDraw>
void check_composed(bool with_model, int n) {
  std::mt19937 gen(kDraw ? 41u : 42u);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::size_t u = static_cast<std::size_t>(n);
  std::vector<typename Master::Stored> ps(u);
  std::vector<std::uint16_t> model(u);
  std::vector<std::uint8_t> mc(u), vc(u);
  std::vector<float> g(u);
  std::vector<std::uint32_t> random(u);
  for (std::size_t i = 0; i < u; ++i) {
    typename Master::Stored stored{};
    std::uint16_t w = 0;
    REQUIRE(Master::encode(1.0f + 0.1f * normal(gen), true, false, 0u, stored, w));
    ps[i] = stored;
    model[i] = with_model ? w : std::uint16_t{0};
    mc[i] = static_cast<std::uint8_t>(gen());
    vc[i] = static_cast<std::uint8_t>(gen());
    g[i] = 1e-3f * normal(gen);
    random[i] = static_cast<std::uint32_t>(gen());
  }
  float ms = 3e-4f, vs = 2e-3f;
  GroupParams params{0.9f, 0.999f, 1e-8f, 0.01f, 1, 1, {0, 0}, 0};
  const GroupConsts k = group_consts(params, 1e-3f, 5);
  auto want_ps = ps;
  auto want_model = model;
  auto want_mc = mc, want_vc = vc;
  float want_ms = ms, want_vs = vs;
  composed_step<Master, kDraw>(want_ps, want_model, want_mc, want_vc, want_ms, want_vs, g, with_model, random, k);
  // The block step reads only the buffers the format has: null where there is none.
  typename Master::Stored* p_ps = Master::kStored ? ps.data() : nullptr;
  std::uint16_t* p_model = with_model ? model.data() : nullptr;
  const std::uint32_t* p_random = kDraw ? random.data() : nullptr;
  REQUIRE_FALSE(update_block8<Master, kDraw>(kSignedCodec8, kUnsignedCodec8, p_ps, p_model, mc.data(), vc.data(), ms, vs,
                                              g.data(), n, with_model, p_random, k));
  REQUIRE(ms == want_ms);
  REQUIRE(vs == want_vs);
  for (std::size_t i = 0; i < u; ++i) {
    INFO("element " << i);
    if (Master::kStored) REQUIRE(std::memcmp(&ps[i], &want_ps[i], sizeof ps[i]) == 0);
    if (with_model) REQUIRE(model[i] == want_model[i]);
    REQUIRE(mc[i] == want_mc[i]);
    REQUIRE(vc[i] == want_vc[i]);
  }
}

}  // namespace

TEST_CASE("8-bit block step: AdamW on the decoded state, exp_avg to nearest, sqrt(exp_avg_sq) with bits 16-31, the weight with its own bits", "[block8]") {
  using halfstep::DType;
  using halfstep::MasterFormat;
  for (int n : {256, 97}) {
    check_composed<MasterCodec<MasterFormat::none, DType::bf16>, true>(true, n);
    check_composed<MasterCodec<MasterFormat::none, DType::bf16>, false>(true, n);
    check_composed<MasterCodec<MasterFormat::f32, DType::bf16>, true>(false, n);
    check_composed<MasterCodec<MasterFormat::f32, DType::f16>, false>(true, n);
    check_composed<MasterCodec<MasterFormat::bf16_remainder, DType::bf16>, true>(true, n);
  }
}

TEST_CASE("8-bit moment conversion: encode_moment is the codec's encoding block by block, decode its inverse, refusals", "[block8]") {
  std::mt19937 gen(77);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // A tensor of 20 rows of 300: two blocks a row (256 + 44).
  const std::int64_t rows = 20, row = 300, n = rows * row;
  std::vector<float> m(n), v(n);
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = normal(gen) * std::exp(normal(gen) * 3.0f) * 1e-3f;
    v[i] = m[i] * m[i] * std::exp(normal(gen));
  }
  for (std::int64_t i = 256; i < 300; ++i) m[i] = v[i] = 0.0f;  // a block of zeros
  halfstep::ParamTensor t;
  t.numel = n;
  t.row = row;
  std::vector<std::uint8_t> mc(n), vc(n);
  std::vector<float> ms(rows * 2), vs(rows * 2);
  halfstep::encode_moment(t, halfstep::Slot::exp_avg, m.data(), mc.data(), ms.data());
  halfstep::encode_moment(t, halfstep::Slot::exp_avg_sq, v.data(), vc.data(), vs.data());
  const Block8Geometry g = block8_geometry(n, row);
  for (std::int64_t b = 0; b < g.blocks; ++b) {
    const std::int64_t at = g.block_start(b), size = g.block_size(b);
    std::vector<float> root(static_cast<std::size_t>(size));
    for (std::int64_t j = 0; j < size; ++j) root[j] = static_cast<float>(std::sqrt(static_cast<double>(v[at + j])));
    std::uint8_t want_m[kBlock8], want_v[kBlock8];
    float scale_m = -1.0f, scale_v = -1.0f;
    REQUIRE(encode_block8(kSignedCodec8, m.data() + at, static_cast<int>(size), false, nullptr, 0, false, want_m, scale_m));
    REQUIRE(encode_block8(kUnsignedCodec8, root.data(), static_cast<int>(size), false, nullptr, 0, true, want_v, scale_v));
    CHECK(ms[b] == scale_m);
    CHECK(vs[b] == scale_v);
    CHECK(std::equal(want_m, want_m + size, mc.begin() + at));
    CHECK(std::equal(want_v, want_v + size, vc.begin() + at));
  }
  CHECK(ms[1] == 0.0f);  // the block of zeros: scale 0, the maps' zeros
  CHECK(std::all_of(mc.begin() + 256, mc.begin() + 300, [](std::uint8_t c) { return c == kSignedZero8; }));

  // Decoding is map[code] · scale (exp_avg_sq's squared in double, rounded once): checked exactly
  // against the map, element by element; that encoding picks the nearest code is the codec's own
  // test above.
  std::vector<float> md(n), vd(n);
  halfstep::decode_moment(t, halfstep::Slot::exp_avg, mc.data(), ms.data(), md.data());
  halfstep::decode_moment(t, halfstep::Slot::exp_avg_sq, vc.data(), vs.data(), vd.data());
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t b = g.block_of(i);
    CHECK(md[i] == kSignedCodec8.map.value[mc[i]] * ms[b]);
    const double r = static_cast<double>(kUnsignedCodec8.map.value[vc[i]] * vs[b]);
    CHECK(vd[i] == static_cast<float>(r * r));
  }
  // A block's largest magnitude is exact (it encodes to ±1, or -0.99296875 · absmax when negative).
  for (std::int64_t b = 0; b < g.blocks; ++b) {
    const std::int64_t at = g.block_start(b), size = g.block_size(b);
    const auto top = std::max_element(m.begin() + at, m.begin() + at + size,
                                      [](float x, float y) { return std::fabs(x) < std::fabs(y); });
    const float got = md[top - m.begin()];
    CHECK((*top >= 0.0f ? got == *top : got == -0.99296875f * -*top));
  }

  // A piece cut anywhere decodes as the whole does (its scales from its first element's block).
  halfstep::ParamTensor piece = t;
  piece.offset = 1000;
  piece.numel = 777;
  piece.whole_numel = n;
  const std::int64_t first = g.block_of(piece.offset);
  std::vector<float> pd(777);
  halfstep::decode_moment(piece, halfstep::Slot::exp_avg_sq, vc.data() + 1000, vs.data() + first, pd.data());
  CHECK(std::equal(pd.begin(), pd.end(), vd.begin() + 1000));

  // Refusals, by name, with nothing written.
  std::vector<std::uint8_t> untouched(n, 9);
  auto refused = [&](const halfstep::ParamTensor& bad, halfstep::Slot slot, const std::vector<float>& x, const char* rule) {
    std::vector<std::uint8_t> codes = untouched;
    std::vector<float> scales(rows * 2, 5.0f);
    CHECK_THROWS_WITH(halfstep::encode_moment(bad, slot, x.data(), codes.data(), scales.data()), Catch::Contains(rule));
    CHECK(codes == untouched);
    CHECK(std::all_of(scales.begin(), scales.end(), [](float s) { return s == 5.0f; }));
  };
  std::vector<float> bad_m = m, bad_v = v;
  bad_m[n - 1] = NAN;
  bad_v[0] = -1.0f;
  refused(t, halfstep::Slot::exp_avg, bad_m, "values[5999] is not finite");
  refused(t, halfstep::Slot::exp_avg_sq, bad_v, "values[0] is negative");
  refused(t, halfstep::Slot::master, m, "slot must be exp_avg or exp_avg_sq");
  halfstep::ParamTensor small;
  small.numel = 4095;
  refused(small, halfstep::Slot::exp_avg, m, "has no blocks");
  halfstep::ParamTensor short_rows = t;
  short_rows.row = 30;
  refused(short_rows, halfstep::Slot::exp_avg, m, "has no blocks");
  halfstep::ParamTensor inside = piece;  // encoding cuts where blocks start
  refused(inside, halfstep::Slot::exp_avg, m, "inside block");
  std::vector<float> out(n, 3.0f);
  std::vector<float> bad_scales = vs;
  bad_scales[3] = INFINITY;
  CHECK_THROWS_WITH(halfstep::decode_moment(t, halfstep::Slot::exp_avg_sq, vc.data(), bad_scales.data(), out.data()),
                    Catch::Contains("scales[3] must be finite and >= 0"));
  halfstep::ParamTensor past = piece;
  past.offset = n - 10;
  CHECK_THROWS_WITH(halfstep::decode_moment(past, halfstep::Slot::exp_avg, mc.data(), ms.data(), out.data()),
                    Catch::Contains("past"));
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 3.0f; }));
}
