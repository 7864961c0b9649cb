// The host backend (Backend::host) on its own: the branch-free fp16 conversions its loops use
// against CUDA's host conversions on every pattern, its instruction-set variants against each
// other bit for bit, its results on any number of threads, and its thread API. Its results against
// the device's are in the GPU suite (tests/gpu/test_host_backend.cpp, on the emulated device in CI).
#include <catch2/catch.hpp>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "halfstep/fused_adamw.hpp"
#include "halfstep/portable_math.hpp"
#include "halfstep/state.hpp"
#include "host_passes.hpp"
#include "host_pool.hpp"
#include "state_codec.hpp"
#include "step_math.hpp"
#include "tensor_table.hpp"

using namespace halfstep;
using namespace halfstep::detail;

namespace {

// fp32 patterns [begin, end) whose f16_nearest differs from __float2half_rn (NaN aside).
std::uint64_t f16_mismatches(std::uint64_t begin, std::uint64_t end, std::uint64_t stride) {
  std::uint64_t wrong = 0;
  for (std::uint64_t b = begin; b < end; b += stride) {
    const float x = float_of(static_cast<std::uint32_t>(b));
    if (x != x) continue;
    wrong += f16_nearest(x) != __half_as_ushort(__float2half_rn(x)) ? 1 : 0;
  }
  return wrong;
}

}  // namespace

TEST_CASE("fp16 conversions: f16_nearest is __float2half_rn on every fp32 pattern, f16_value __half2float on every fp16 one",
          "[host][exhaustive]") {
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    const float want = __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
    const float got = f16_value(static_cast<std::uint16_t>(h));
    if (want != want) {
      REQUIRE(got != got);
    } else {
      REQUIRE(bits_of(got) == bits_of(want));
    }
  }
  // Every fp32 pattern (under the sanitizers every 251st), over the machine's threads.
  const std::uint64_t stride = std::getenv("HALFSTEP_TEST_REDUCED") != nullptr ? 251 : 1;
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::uint64_t> wrong(threads, 0);
  std::vector<std::thread> pool;
  const std::uint64_t total = std::uint64_t{1} << 32;
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      const std::uint64_t from = (total * t / threads + stride - 1) / stride * stride;
      wrong[t] = f16_mismatches(from, total * (t + 1) / threads, stride);
    });
  }
  for (std::thread& th : pool) th.join();
  std::uint64_t sum = 0;
  for (std::uint64_t w : wrong) sum += w;
  REQUIRE(sum == 0);
  // NaN gives the canonical NaN pattern.
  REQUIRE(f16_nearest(float_of(0x7FC00000u)) == 0x7FFFu);
  REQUIRE(f16_nearest(float_of(0xFFC00001u)) == 0x7FFFu);
}

namespace {

// A table of tensors in one state format, every buffer in host memory, filled at random (special
// values included), for running the passes directly.
struct Buffers {
  std::vector<ParamTensor> tensors;
  std::vector<std::vector<unsigned char>> bytes;  // every buffer, owned here

  void* buffer(std::size_t n, std::mt19937_64& rng, bool random) {
    bytes.emplace_back(n + 16);
    if (random) {
      for (auto& b : bytes.back()) b = static_cast<unsigned char>(rng());
    }
    return bytes.back().data();
  }
};

// Finite random values of a storage format, as bytes, with zeros, subnormals and ±values; an inf
// where `inf_at` is a position.
void fill(void* p, Storage s, std::size_t n, std::mt19937_64& rng, float scale, std::int64_t inf_at = -1) {
  std::normal_distribution<float> g(0.0f, scale);
  for (std::size_t i = 0; i < n; ++i) {
    float x = g(rng);
    const auto kind = rng() % 16;
    if (kind == 0) x = 0.0f;
    if (kind == 1) x = 1e-6f * scale * static_cast<float>(rng() % 7);  // small, subnormal in fp16 for small scales
    if (static_cast<std::int64_t>(i) == inf_at) x = INFINITY;
    switch (s) {
      case Storage::f32:
        std::memcpy(static_cast<char*>(p) + 4 * i, &x, 4);
        break;
      case Storage::f16: {
        const std::uint16_t b = f16_nearest(x);
        std::memcpy(static_cast<char*>(p) + 2 * i, &b, 2);
        break;
      }
      case Storage::bf16: {
        const std::uint16_t b = bf16_nearest(x);
        std::memcpy(static_cast<char*>(p) + 2 * i, &b, 2);
        break;
      }
      case Storage::i16:
      case Storage::u8:
        break;  // remainders and codes stay as the random bytes they hold
    }
  }
}

Buffers make_buffers(const StepConfig& c, std::mt19937_64& rng, bool with_inf) {
  Buffers b;
  const std::vector<std::int64_t> sizes = {4096, 40000, 7, 300, 8448, 70000};
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    ParamTensor p;
    p.numel = sizes[t];
    p.row = t == 4 ? 264 : 0;
    p.group = static_cast<std::int32_t>(t % 2);
    for (const SlotLayout& s : slot_layouts(c, p)) {
      if (!s.present) continue;
      void* q = b.buffer(static_cast<std::size_t>(p.numel) * s.element_bytes, rng, true);
      if (s.slot == Slot::grad) {
        fill(q, s.storage, static_cast<std::size_t>(p.numel), rng, 100.0f, with_inf && t == 5 ? 12345 : -1);
        p.grad = q;
      } else {
        if (s.storage != Storage::u8 && s.storage != Storage::i16) {
          fill(q, s.storage, static_cast<std::size_t>(p.numel), rng, s.slot == Slot::exp_avg_sq ? 1e-3f : 0.3f);
        }
        if (s.slot == Slot::exp_avg_sq && s.storage == Storage::f32) {  // second moments are >= 0
          auto* v = static_cast<float*>(q);
          for (std::int64_t i = 0; i < p.numel; ++i) v[i] = std::fabs(v[i]);
        }
        set_slot_pointer(p, s.slot, q);
      }
    }
    const MomentBlocks blocks = moment_blocks(c, p);
    if (blocks.quantized) {
      p.exp_avg_scale = static_cast<float*>(b.buffer(static_cast<std::size_t>(blocks.blocks) * 4, rng, false));
      p.exp_avg_sq_scale = static_cast<float*>(b.buffer(static_cast<std::size_t>(blocks.blocks) * 4, rng, false));
      for (std::int64_t k = 0; k < blocks.blocks; ++k) {
        p.exp_avg_scale[k] = 0.01f * static_cast<float>(1 + rng() % 5);
        p.exp_avg_sq_scale[k] = 0.001f * static_cast<float>(1 + rng() % 5);
      }
    }
    b.tensors.push_back(p);
  }
  return b;
}

}  // namespace

TEST_CASE("host passes: the baseline, AVX2 and AVX-512 variants compute the same bits", "[host]") {
  const std::vector<const HostPasses*> runnable = host_passes_runnable();
  REQUIRE(std::string(runnable.front()->isa) == "baseline");
  if (std::getenv("HALFSTEP_HOST_ISA") == nullptr) REQUIRE(&host_passes() == runnable.back());  // the widest
  if (runnable.size() == 1) {
    WARN("this CPU runs no vector variant: only the baseline is checked, against itself");
  } else if (runnable.size() == 2) {
    WARN("this CPU runs no AVX-512 variant: it is not checked here");
  }
  const HostPasses& base = *runnable.front();
  for (std::size_t variant = runnable.size() == 1 ? 0 : 1; variant < runnable.size(); ++variant) {
    const HostPasses& fast = *runnable[variant];
    CAPTURE(fast.isa);
    using MF = MasterFormat;
    using MoF = MomentFormat;
    struct F {
      DType grad, model;
      MF master;
      MoF m, v;
      Rounding rounding;
      bool model_everywhere = true;  // else every other tensor has no model copy (fp32 parameters)
    };
    // The formats the vector variants take with a tile loop of their own (host_apply_simd.inc:
    // fp32 or bf16 moments, an fp32 master or none) first, with every gradient format and model
    // copy, both roundings and moments of two formats; then the others.
    for (const F f : {F{DType::bf16, DType::bf16, MF::f32, MoF::f32, MoF::f32, Rounding::nearest},
                      F{DType::f32, DType::bf16, MF::f32, MoF::f32, MoF::f32, Rounding::nearest, false},
                      F{DType::f16, DType::f16, MF::f32, MoF::f32, MoF::f32, Rounding::nearest, false},
                      F{DType::f16, DType::f16, MF::f32, MoF::f32, MoF::f32, Rounding::stochastic},
                      F{DType::bf16, DType::bf16, MF::f32, MoF::bf16, MoF::bf16, Rounding::stochastic},
                      F{DType::f16, DType::f16, MF::f32, MoF::bf16, MoF::f32, Rounding::stochastic},
                      F{DType::f32, DType::bf16, MF::f32, MoF::f32, MoF::bf16, Rounding::nearest, false},
                      F{DType::f32, DType::bf16, MF::f32, MoF::bf16, MoF::bf16, Rounding::stochastic, false},
                      F{DType::f32, DType::bf16, MF::none, MoF::bf16, MoF::bf16, Rounding::nearest},
                      F{DType::f16, DType::bf16, MF::none, MoF::f32, MoF::bf16, Rounding::stochastic},
                      F{DType::f32, DType::bf16, MF::bf16_remainder, MoF::f32, MoF::bf16, Rounding::nearest},
                      F{DType::bf16, DType::bf16, MF::none, MoF::bf16, MoF::bf16, Rounding::stochastic},
                      F{DType::f16, DType::f16, MF::f32, MoF::block8, MoF::block8, Rounding::stochastic},
                      F{DType::bf16, DType::bf16, MF::none, MoF::block8, MoF::block8, Rounding::nearest}}) {
      for (const bool with_inf : {false, true}) {
        CAPTURE(dtype_name(f.grad), master_format_name(f.master), moment_format_name(f.m), with_inf);
        StepConfig c;
        c.grad_dtype = f.grad;
        c.model_dtype = f.model;
        c.state.master = f.master;
        c.state.exp_avg = f.m;
        c.state.exp_avg_sq = f.v;
        c.state.rounding = f.rounding;
        c.groups.resize(2);
        c.groups[1].decoupled_weight_decay = false;
        c.groups[1].weight_decay = 0.01f;
        std::mt19937_64 rng(7 + static_cast<std::uint64_t>(f.master) * 3 + static_cast<std::uint64_t>(f.m));
        Buffers a = make_buffers(c, rng, with_inf);
        if (!f.model_everywhere) {
          for (std::size_t t = 1; t < a.tensors.size(); t += 2) a.tensors[t].model = nullptr;
        }
        if (f.master == MF::f32) {  // masters at the model copy's edges: held, or rounded at a tie
          for (ParamTensor& t : a.tensors) {
            auto* w = static_cast<float*>(t.master);
            const std::int64_t n = t.numel;
            w[0] = 65519.99f;                // an f16 copy just below its overflow
            w[n / 2] = 65520.0f;             // ... and at it
            w[n - 1] = 3.40282347e38f;       // a bf16 copy of fp32's largest overflows
            if (n > 3) w[n - 2] = float_of(0x3F808000u);  // canonical_master's tie: a bf16 copy's low 17 bits
            if (n > 4) w[1] = -65504.0f;
          }
        }
        if (f.master == MF::none) {  // weights at bf16's largest: held where they round up to inf
          for (ParamTensor& t : a.tensors) {
            auto* w = static_cast<std::uint16_t*>(t.model);
            const std::int64_t n = t.numel;
            w[0] = w[n / 2] = w[n - 1] = 0x7F7Fu;
            if (n > 4) w[1] = 0xFF7Fu;
          }
        }
        if (f.m != MoF::block8) {
          // Pieces whose indices in the whole tensor cross 2^32 (a tile's draw there takes the
          // element loop) or lie past it: the random bits of stochastic rounding are theirs.
          a.tensors[1].offset = (std::int64_t{1} << 32) - 20003;
          a.tensors[1].whole_numel = a.tensors[1].offset + a.tensors[1].numel;
          a.tensors[5].offset = (std::int64_t{3} << 32) + 77;
          a.tensors[5].whole_numel = a.tensors[5].offset + a.tensors[5].numel;
        }
        Buffers b = a;  // the same bytes, in other buffers
        for (std::size_t t = 0; t < b.tensors.size(); ++t) {
          for (int k = 0; k < kSlotCount; ++k) {
            const auto s = static_cast<Slot>(k);
            const void* pa = slot_pointer(a.tensors[t], s);
            if (pa == nullptr) continue;
            for (std::size_t i = 0; i < a.bytes.size(); ++i) {
              if (pa == a.bytes[i].data()) {
                if (s == Slot::grad) {
                  b.tensors[t].grad = b.bytes[i].data();
                } else {
                  set_slot_pointer(b.tensors[t], s, b.bytes[i].data());
                }
              }
            }
          }
          for (std::size_t i = 0; i < a.bytes.size(); ++i) {
            if (a.tensors[t].exp_avg_scale == static_cast<void*>(a.bytes[i].data())) b.tensors[t].exp_avg_scale = reinterpret_cast<float*>(b.bytes[i].data());
            if (a.tensors[t].exp_avg_sq_scale == static_cast<void*>(a.bytes[i].data())) b.tensors[t].exp_avg_sq_scale = reinterpret_cast<float*>(b.bytes[i].data());
          }
        }
        const TensorTable ta = build_tensor_table(a.tensors, c), tb = build_tensor_table(b.tensors, c);
        // Pass 1 on every chunk: the same partials and spilled limbs.
        for (std::uint32_t hint : {0x3C00u, 0x0400u, 0x7000u}) {
          const HostPass1 args{c.grad_dtype, square_split(c.grad_dtype, hint), f32_pattern(format_info(measured_dtype(c)).min_normal)};
          std::uint64_t spill_a[kSumLimbs] = {}, spill_b[kSumLimbs] = {};
          bool any_a = false, any_b = false;
          for (std::size_t k = 0; k < ta.chunks.size(); ++k) {
            ChunkPartial pa{}, pb{};
            base.measure(args, ta.tensors[static_cast<std::size_t>(ta.chunks[k].tensor)], ta.chunks[k], pa, spill_a, any_a);
            fast.measure(args, tb.tensors[static_cast<std::size_t>(tb.chunks[k].tensor)], tb.chunks[k], pb, spill_b, any_b);
            REQUIRE(std::memcmp(&pa, &pb, sizeof pa) == 0);
          }
          REQUIRE(any_a == any_b);
          REQUIRE(std::equal(spill_a, spill_a + kSumLimbs, spill_b));
        }
        // Pass 2 on every chunk: the same bytes everywhere, and the same elements held.
        Decision d{};
        d.apply = 1;
        set_coefficient(d, 0.7 / 100.0);
        d.rounding_key = step_key(99, 3);
        std::vector<GroupConsts> consts;
        for (const AdamWConfig& h : c.groups) consts.push_back(group_consts(group_params(h), 1e-3f, 3));
        const HostPass2 args{c.grad_dtype, c.model_dtype, c.state, d, consts.data(), &kSignedCodec8, &kUnsignedCodec8};
        std::uint64_t held_a = 0, held_b = 0;
        for (std::size_t k = 0; k < ta.chunks.size(); ++k) {
          held_a += base.apply(args, ta.tensors[static_cast<std::size_t>(ta.chunks[k].tensor)], ta.chunks[k]);
          held_b += fast.apply(args, tb.tensors[static_cast<std::size_t>(tb.chunks[k].tensor)], tb.chunks[k]);
        }
        REQUIRE(held_a == held_b);
        for (std::size_t i = 0; i < a.bytes.size(); ++i) REQUIRE(a.bytes[i] == b.bytes[i]);
      }
    }
  }
}

namespace {

// Σx² of the finite words of a bf16 or f32 chunk, exactly, as normalised limbs: the oracle pass 1's
// digits and spilled limbs are checked against.
void exact_limbs(DType grad, const std::vector<std::uint32_t>& words, std::uint64_t (&limbs)[kSumLimbs]) {
  for (const std::uint32_t w : words) {
    const std::uint32_t bits = grad == DType::f32 ? w : w << 16;
    const double x = static_cast<double>(float_of(bits));
    if (!std::isfinite(x) || x == 0.0) continue;
    const LimbDeposit d = limb_deposit(x * x);  // exact: at most 48 significant bits
    for (int k = 0; k < 3 && d.index + k < kSumLimbs; ++k) limbs[d.index + k] += d.digit[k];
  }
  limbs_normalize(limbs);
}

}  // namespace

// Pass 1's vector loops take a quicker way (two parts in biased fp64 sums) on a chunk whose
// nonzero magnitudes all lie in the window, are normal and span at most 25 binades (f32) or 41
// (bf16). Chunks at those limits and just past them, at the ends of the formats' ranges, of zeros
// only, with the largest squares everywhere, with tails shorter than a vector: every variant gives
// the baseline's bits, and the digits and spilled limbs add up to the exact sum.
TEST_CASE("host passes: pass 1 on chunks of nearby magnitudes, at and past the limits, is exact in every variant",
          "[host]") {
  const std::vector<const HostPasses*> runnable = host_passes_runnable();
  const HostPasses& base = *runnable.front();
  std::mt19937_64 rng(2026);
  struct Case {
    DType grad;
    float hint;  // the largest gradient the window is placed for
  };
  int cases = 0;
  for (const Case c : {Case{DType::f32, 400.0f}, Case{DType::f32, 1e-38f}, Case{DType::f32, 3e38f},
                       Case{DType::bf16, 1.0f}, Case{DType::bf16, 1e-38f}, Case{DType::bf16, 3e38f}}) {
    const bool f32 = c.grad == DType::f32;
    const int fraction = f32 ? 23 : 7;
    const std::uint32_t hint = f32 ? f32_pattern(c.hint) & 0x7FFFFFFFu : (f32_pattern(c.hint) >> 16) & 0x7FFFu;
    const SquareSplit split = square_split(c.grad, hint);
    const int e0 = f32 ? split.unit_log2[1] / 2 : (split.unit_log2[1] + 14) / 2;  // the window's lowest binade
    const int window = f32 ? 46 : 39;
    const int near_span = 47 - fraction;  // the quicker way's limit: largest binade less smallest
    // A pattern of binade e (e >= -126) with the given fraction bits and sign.
    const auto pattern = [&](int e, std::uint32_t frac, bool negative) {
      const std::uint32_t p = static_cast<std::uint32_t>(e + 127) << fraction | frac;
      return p | (negative ? (f32 ? 0x80000000u : 0x8000u) : 0u);
    };
    const std::uint32_t all_frac = (1u << fraction) - 1u;
    for (const std::uint32_t normal : {f32_pattern(0x1p-126f), f32_pattern(0x1p-14f)}) {
      if (!f32 && normal != f32_pattern(0x1p-126f)) continue;  // bf16's threshold is its format's
      const HostPass1 args{c.grad, split, normal};
      // The binade range [low, low + span] of each chunk, within the window and the format.
      const int lowest = e0 < -126 ? -126 : e0, highest = e0 + window - 1 > 127 ? 127 : e0 + window - 1;
      for (const int span : {0, 1, near_span - 1, near_span, near_span + 1, near_span + 2, window - 1}) {
        for (const int len : {32768, 32768 - 5, 1, 15, 17, 1000}) {
          // 0 random, 1 largest squares, 2 zeros only, 3 the window's edges (at the top of the
          // window), 4 random from the window's lowest normal binade up
          for (const int shape : {0, 1, 2, 3, 4}) {
            int top = highest, bottom = highest - span;
            if (bottom < lowest || shape == 4) {
              bottom = lowest;
              top = lowest + span > 127 ? 127 : lowest + span;
            }
            std::vector<std::uint32_t> words(static_cast<std::size_t>(len));
            for (auto& w : words) {
              const bool negative = (rng() & 1u) != 0;
              if (shape == 2) {
                w = negative ? (f32 ? 0x80000000u : 0x8000u) : 0u;
              } else if (rng() % 10 == 0) {
                w = 0;
              } else if (shape == 1) {
                w = pattern(top, all_frac, negative);
              } else {
                const int e = bottom + static_cast<int>(rng() % static_cast<std::uint64_t>(top - bottom + 1));
                w = pattern(e, static_cast<std::uint32_t>(rng()) & all_frac, negative);
              }
            }
            if (shape != 2) {  // the range's ends, at the first, middle and last words
              words.front() = pattern(bottom, 0, false);
              words[words.size() / 2] = pattern(top, all_frac, true);
              if (shape == 3) {
                words.back() = split.low;          // the window's smallest
                words[words.size() / 3] = split.high - 1u;  // its largest (or the format's)
              }
            }
            std::vector<std::uint32_t> stored = words;
            std::vector<std::uint16_t> stored16(words.size());
            for (std::size_t i = 0; i < words.size(); ++i) stored16[i] = static_cast<std::uint16_t>(words[i]);
            TensorDesc t{};
            t.grad = f32 ? static_cast<const void*>(stored.data()) : static_cast<const void*>(stored16.data());
            t.numel = len;
            t.in_norm = 1;
            t.grad_vec = 1;
            const ChunkDesc chunk{0, 0, len};
            std::uint64_t exact[kSumLimbs] = {};
            exact_limbs(c.grad, words, exact);
            std::uint32_t zeros = 0, below = 0, largest = 0;
            for (const std::uint32_t w : words) {
              const std::uint32_t mag = w & (f32 ? 0x7FFFFFFFu : 0x7FFFu);
              zeros += mag == 0 ? 1u : 0u;
              below += mag != 0 && mag < (f32 ? normal : 0x80u) ? 1u : 0u;
              largest = mag > largest ? mag : largest;
            }
            CAPTURE(dtype_name(c.grad), c.hint, normal, span, len, shape);
            ChunkPartial want{};
            std::uint64_t want_spill[kSumLimbs] = {};
            bool want_spilled = false;
            base.measure(args, t, chunk, want, want_spill, want_spilled);
            for (const HostPasses* v : runnable) {
              CAPTURE(v->isa);
              ChunkPartial got{};
              std::uint64_t spill[kSumLimbs] = {};
              bool spilled = false;
              v->measure(args, t, chunk, got, spill, spilled);
              REQUIRE(std::memcmp(&got, &want, sizeof got) == 0);
              REQUIRE(spilled == want_spilled);
              REQUIRE(std::equal(spill, spill + kSumLimbs, want_spill));
              // The digits, at their limb, and the spilled limbs add up to the exact sum.
              std::uint64_t total[kSumLimbs] = {};
              for (int k = 0; k < kSumLimbs; ++k) total[k] = spill[k];
              const int at = split_grid_offset(split) / 32;
              for (int k = 0; k < kPartialDigits && at + k < kSumLimbs; ++k) total[at + k] += got.digit[k];
              limbs_normalize(total);
              REQUIRE(std::equal(total, total + kSumLimbs, exact));
              REQUIRE(got.zero == zeros);
              REQUIRE(got.subnormal == below);
              REQUIRE(got.max_bits == largest);
              REQUIRE(got.nonfinite == 0u);
            }
            ++cases;
          }
        }
      }
    }
  }
  REQUIRE(cases == (3 * 2 + 3) * 7 * 6 * 5);
}

TEST_CASE("host backend: the same bits on 1 to 4 threads, and set_threads refuses by name", "[host][fused]") {
  StepConfig c;
  c.grad_dtype = DType::bf16;
  c.model_dtype = DType::bf16;
  c.state.master = MasterFormat::none;
  c.state.exp_avg = c.state.exp_avg_sq = MomentFormat::block8;
  c.max_grad_norm = 1.0f;
  c.scaler = ScalerConfig::constant(1.0f);
  c.groups.resize(2);
  std::vector<std::vector<unsigned char>> results;
  for (int threads = 1; threads <= 4; ++threads) {
    std::mt19937_64 rng(5);
    Buffers b = make_buffers(c, rng, false);
    FusedAdamW opt(b.tensors, c, Backend::host);
    opt.set_threads(threads);
    REQUIRE(opt.threads() == threads);
    for (int step = 0; step < 3; ++step) {
      opt.step();
      REQUIRE(opt.last_report().outcome == Outcome::applied);
      for (const ParamTensor& p : b.tensors) {
        fill(const_cast<void*>(p.grad), Storage::bf16, static_cast<std::size_t>(p.numel), rng, 1.0f);
      }
    }
    std::vector<unsigned char> all;
    for (const auto& x : b.bytes) all.insert(all.end(), x.begin(), x.end());
    results.push_back(all);
  }
  for (std::size_t k = 1; k < results.size(); ++k) REQUIRE(results[k] == results[0]);

  std::mt19937_64 rng(6);
  Buffers b = make_buffers(c, rng, false);
  FusedAdamW opt(b.tensors, c, Backend::host);
  CHECK(opt.threads() == 1);
  CHECK_THROWS_WITH(opt.set_threads(0), Catch::Contains("threads must be in [1, 1024], got 0"));
  CHECK_THROWS_WITH(opt.set_threads(1025), Catch::Contains("threads must be in [1, 1024]"));
  CHECK(opt.threads() == 1);
  FusedAdamW ref(b.tensors, c, Backend::reference);
  CHECK_THROWS_WITH(ref.set_threads(2), Catch::Contains("only Backend::host runs its step on host threads"));
  CHECK(ref.threads() == 1);
}

// The pool's threads take pieces in turn; whatever the thread count, the piece size, or which
// thread is slow, every item is run exactly once, by a thread the pool has, and all of it is done
// (and visible to the caller) when run returns.
TEST_CASE("host pool: every item exactly once on 1 to 4 threads, run after run, and a slow thread takes less", "[host]") {
  HostPool pool(1);
  for (const int threads : {1, 3, 2, 4, 1, 2}) {  // set_threads up and down on one pool
    pool.set_threads(threads);
    REQUIRE(pool.threads() == threads);
    for (const std::int64_t n : {0, 1, 2, 3, 7, 8, 31, 64, 100, 1000, 3053}) {
      for (int rep = 0; rep < 40; ++rep) {
        std::vector<std::atomic<int>> runs(static_cast<std::size_t>(n));
        std::vector<int> written(static_cast<std::size_t>(n), 0);  // plain writes: run returns after them
        std::atomic<int> bad_worker{0}, bad_range{0};
        pool.run(n, [&](std::int64_t begin, std::int64_t end, int w) {
          if (w < 0 || w >= threads) bad_worker.fetch_add(1);
          if (begin < 0 || begin >= end || end > n) bad_range.fetch_add(1);
          for (std::int64_t i = begin; i < end; ++i) {
            runs[static_cast<std::size_t>(i)].fetch_add(1);
            written[static_cast<std::size_t>(i)] = rep + 1;
          }
        });
        REQUIRE(bad_worker.load() == 0);
        REQUIRE(bad_range.load() == 0);
        for (std::int64_t i = 0; i < n; ++i) {
          REQUIRE(runs[static_cast<std::size_t>(i)].load() == 1);
          REQUIRE(written[static_cast<std::size_t>(i)] == rep + 1);
        }
      }
    }
  }
  // A worker held up in its first piece (as one sharing a core with another process's spinning
  // thread would be) leaves the other pieces to the caller's thread, and the run still ends with
  // every item done once. Pieces of 1000 / 16 = 62 items: the held-up worker does at most one.
  pool.set_threads(2);
  for (int rep = 0; rep < 3; ++rep) {
    std::vector<std::atomic<int>> runs(1000);
    std::atomic<std::int64_t> by_worker{0};
    pool.run(1000, [&](std::int64_t begin, std::int64_t end, int w) {
      if (w != 0) {
        by_worker.fetch_add(end - begin);
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      for (std::int64_t i = begin; i < end; ++i) runs[static_cast<std::size_t>(i)].fetch_add(1);
    });
    for (const auto& r : runs) REQUIRE(r.load() == 1);
    REQUIRE(by_worker.load() <= 62);
  }
}

// A forked process has none of its parent's threads: its pool leaves the parent's state alone
// and starts workers of its own, and so does a child of the child.
TEST_CASE("host pool: a forked child, and its child, run jobs on workers of their own", "[host]") {
  HostPool pool(2);
  const auto runs_each_once = [&pool](std::int64_t n) {
    std::vector<std::atomic<int>> runs(static_cast<std::size_t>(n));
    pool.run(n, [&](std::int64_t begin, std::int64_t end, int) {
      for (std::int64_t i = begin; i < end; ++i) runs[static_cast<std::size_t>(i)].fetch_add(1);
    });
    return std::all_of(runs.begin(), runs.end(), [](const std::atomic<int>& r) { return r.load() == 1; });
  };
  // A job of two pieces whose first, on the caller's thread, waits (up to 10 s) for a worker to
  // take the second: true when the pool has a worker of its own that runs.
  const auto a_worker_runs = [&pool] {
    std::atomic<bool> worker{false};
    pool.run(2, [&](std::int64_t, std::int64_t, int w) {
      if (w != 0) {
        worker.store(true);
        return;
      }
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!worker.load() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    });
    return worker.load();
  };
  const auto exited_well = [](pid_t pid) {
    int status = 0;
    return ::waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  };
  // Each fork waits until the workers, which watch for the next job for up to 100 µs after one,
  // are asleep: under AddressSanitizer a thread inside its allocator at the fork leaves that lock
  // held in the child, which then hangs at its first allocation (1 run in about 40 did before).
  const auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };
  REQUIRE(runs_each_once(1000));
  REQUIRE(a_worker_runs());
  settle();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::alarm(60);  // a child that hangs dies, and the parent sees it fail
    bool ok = runs_each_once(1000) && a_worker_runs();
    pool.set_threads(3);  // stops this process's workers, never the parent's (which are not here)
    ok = ok && runs_each_once(1000);
    settle();
    const pid_t grandchild = ::fork();
    if (grandchild == 0) {
      ::alarm(60);
      const bool first = runs_each_once(1000) && a_worker_runs();
      pool.set_threads(2);
      ::_exit(first && runs_each_once(1000) && runs_each_once(7) ? 0 : 1);
    }
    ok = ok && grandchild > 0 && exited_well(grandchild) && runs_each_once(3053);
    ::_exit(ok ? 0 : 1);
  }
  REQUIRE(exited_well(child));
  REQUIRE(runs_each_once(1000));  // and the parent's pool runs on
  REQUIRE(a_worker_runs());
}

TEST_CASE("portable logarithms: within 2 ulps of the C library's, exact at powers of two", "[host]") {
  std::mt19937_64 rng(12);
  std::uniform_real_distribution<double> exponent(-300.0, 300.0);
  const auto ulps = [](double a, double b) {
    std::int64_t x, y;
    std::memcpy(&x, &a, 8);
    std::memcpy(&y, &b, 8);
    return x > y ? x - y : y - x;
  };
  for (int i = 0; i < 200000; ++i) {
    const double x = std::pow(10.0, exponent(rng));
    INFO("x = " << x);
    const double l = std::log(x), l2 = std::log2(x);
    if (std::fabs(l) > 1e-3) REQUIRE(ulps(portable_log(x), l) <= 2);
    if (std::fabs(l2) > 1e-3) REQUIRE(ulps(portable_log2(x), l2) <= 2);
  }
  for (double x : {0.999, 1.0001, 1.5, 0.75, 1e-310, 5e-324, 1.7976931348623157e308}) {
    REQUIRE(std::fabs(portable_log(x) - std::log(x)) <= 4e-16 * std::max(1.0, std::fabs(std::log(x))));
    REQUIRE(std::fabs(portable_log2(x) - std::log2(x)) <= 4e-16 * std::max(1.0, std::fabs(std::log2(x))));
  }
  for (int e = -1074; e <= 1023; ++e) REQUIRE(portable_log2(std::ldexp(1.0, e)) == static_cast<double>(e));
  REQUIRE(portable_log(1.0) == 0.0);
}
