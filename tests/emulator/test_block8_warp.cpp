// The 8-bit moments' block encoding by a warp (kernels/block8.hpp, warp_encode_block8) on the
// emulated device, against the host's encode_block8, bit for bit: scales, codes and refusals, on
// fresh random blocks of every size kind, zero blocks, flushed blocks, and blocks with inf or NaN
// at their first, middle and last elements — and garbage past a short block's end, which must not
// count — under every thread order the emulator has.
#include <catch2/catch.hpp>

#include "block8.hpp"
#include "state_codec.hpp"
#include "step_math.hpp"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "halfstep_emu/control.hpp"

namespace {

using namespace halfstep::detail;

// One warp per block of 256: lane l encodes elements 8l .. 8l + 7. A refused block writes 0xAB
// codes, scale -1 and ok 0.
__global__ void encode_blocks(const Codec8* codec, const float* x, const int* sizes, const std::uint32_t* random,
                              int stochastic, int shift, int never_zero, std::uint8_t* codes, float* scales, int* ok) {
  const int b = static_cast<int>(blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u);
  const int first = b * kBlock8 + static_cast<int>(threadIdx.x % 32u) * kBlock8PerLane;
  float v[kBlock8PerLane];
  std::uint32_t r[kBlock8PerLane];
  std::uint8_t c[kBlock8PerLane];
  for (int j = 0; j < kBlock8PerLane; ++j) {
    v[j] = x[first + j];
    r[j] = random[first + j];
    c[j] = 0xAB;
  }
  float scale = -1.0f;
  const bool good = warp_encode_block8(*codec, v, sizes[b], stochastic != 0, r, shift, never_zero != 0, c, scale);
  for (int j = 0; j < kBlock8PerLane; ++j) codes[first + j] = good ? c[j] : std::uint8_t{0xAB};
  if (threadIdx.x % 32u == 0) {
    scales[b] = good ? scale : -1.0f;
    ok[b] = good ? 1 : 0;
  }
}

template <class T>
T* device_copy(const std::vector<T>& h) {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, h.size() * sizeof(T)) == cudaSuccess);
  REQUIRE(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  return static_cast<T*>(p);
}
template <class T>
std::vector<T> host_copy(const T* p, std::size_t n) {
  std::vector<T> h(n);
  REQUIRE(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
  return h;
}

// 64 blocks: random sizes and magnitudes (one to eight decades inside a block), a block of zeros,
// a block whose absmax is below fp32's smallest normal, a block whose small positive values the
// division by the absmax flushes, and blocks with +inf, -inf or NaN at the first, middle or last
// of their elements; every element past a block's size is NaN.
struct Blocks {
  std::vector<float> x;
  std::vector<int> sizes;
  std::vector<std::uint32_t> random;
};
Blocks make_blocks(bool non_negative, std::uint32_t seed) {
  constexpr int kBlocks = 64;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> decades(0.0f, 8.0f);
  std::uniform_int_distribution<int> size(1, kBlock8);
  Blocks b{std::vector<float>(kBlocks * kBlock8), std::vector<int>(kBlocks), std::vector<std::uint32_t>(kBlocks * kBlock8)};
  for (auto& r : b.random) r = static_cast<std::uint32_t>(gen());
  const float bad[3] = {INFINITY, -INFINITY, NAN};
  for (int k = 0; k < kBlocks; ++k) {
    const int n = k % 4 == 0 ? kBlock8 : k % 4 == 1 ? size(gen) : k % 4 == 2 ? 1 : 255;
    b.sizes[static_cast<std::size_t>(k)] = n;
    const float span = decades(gen);
    for (int i = 0; i < kBlock8; ++i) {
      float v = normal(gen) * std::pow(10.0f, -span * std::fabs(normal(gen)) / 3.0f);
      if (non_negative) v = std::fabs(v);
      if (i >= n) v = NAN;  // past the block: never read as the block's
      b.x[static_cast<std::size_t>(k * kBlock8 + i)] = v;
    }
    float* block = &b.x[static_cast<std::size_t>(k * kBlock8)];
    if (k == 4) {
      for (int i = 0; i < n; ++i) block[i] = 0.0f;
    } else if (k == 8) {
      for (int i = 0; i < n; ++i) block[i] = (i % 2 == 0 ? 1e-39f : 3e-40f);
    } else if (k == 12) {
      for (int i = 0; i < n; ++i) block[i] = i == 0 ? 1e3f : 1e-44f;
    } else if (k >= 16 && k < 25) {  // 9 blocks: each bad value at the first, middle, last element
      const int at = (k - 16) % 3 == 0 ? 0 : (k - 16) % 3 == 1 ? n / 2 : n - 1;
      block[at] = bad[(k - 16) / 3];
    }
  }
  return b;
}

}  // namespace

TEST_CASE("8-bit block encoding by a warp is the host's, bit for bit", "[block8][emulated]") {
  const std::string saved = halfstep_emu::settings();
  for (const char* order : {"forward", "reverse", "random", "warps", "starve"}) {
    halfstep_emu::configure(std::string("threads=") + order + ",seed=7");
    struct Mode {
      const Codec8* codec;
      bool stochastic;
      int shift;
      bool never_zero;
    };
    for (const Mode& mode : {Mode{&kSignedCodec8, false, 0, false}, Mode{&kSignedCodec8, true, 0, false},
                             Mode{&kUnsignedCodec8, true, 16, true}, Mode{&kUnsignedCodec8, false, 16, true}}) {
      INFO("threads=" << order << ", " << (mode.codec->is_signed ? "signed" : "unsigned")
                      << (mode.stochastic ? ", stochastic" : ", nearest"));
      const Blocks in = make_blocks(!mode.codec->is_signed, mode.stochastic ? 71u : 72u);
      const std::size_t blocks = in.sizes.size();
      Codec8* codec = device_copy(std::vector<Codec8>{*mode.codec});
      float* x = device_copy(in.x);
      int* sizes = device_copy(in.sizes);
      std::uint32_t* random = device_copy(in.random);
      std::uint8_t* codes = device_copy(std::vector<std::uint8_t>(in.x.size(), 0));
      float* scales = device_copy(std::vector<float>(blocks, 0.0f));
      int* ok = device_copy(std::vector<int>(blocks, 0));
      HALFSTEP_LAUNCH(static_cast<unsigned>(blocks / 4), 128, 0, nullptr, encode_blocks)(
          codec, x, sizes, random, mode.stochastic ? 1 : 0, mode.shift, mode.never_zero ? 1 : 0, codes, scales, ok);
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      const auto got_codes = host_copy(codes, in.x.size());
      const auto got_scales = host_copy(scales, blocks);
      const auto got_ok = host_copy(ok, blocks);
      int refused = 0;
      for (std::size_t k = 0; k < blocks; ++k) {
        std::uint8_t want[kBlock8];
        float want_scale = -1.0f;
        const bool good = encode_block8(*mode.codec, &in.x[k * kBlock8], in.sizes[k], mode.stochastic,
                                        &in.random[k * kBlock8], mode.shift, mode.never_zero, want, want_scale);
        INFO("block " << k << " of " << in.sizes[k] << " elements");
        REQUIRE(got_ok[k] == (good ? 1 : 0));
        refused += good ? 0 : 1;
        if (!good) continue;
        REQUIRE(std::memcmp(&got_scales[k], &want_scale, sizeof want_scale) == 0);
        for (int i = 0; i < in.sizes[k]; ++i) REQUIRE(got_codes[k * kBlock8 + static_cast<std::size_t>(i)] == want[i]);
        for (int i = in.sizes[k]; i < kBlock8; ++i) REQUIRE(got_codes[k * kBlock8 + static_cast<std::size_t>(i)] == 0);
      }
      REQUIRE(refused == 9);  // the nine blocks with inf or NaN, and no other
      REQUIRE(got_scales[4] == 0.0f);  // zeros
      REQUIRE(got_scales[8] == 0.0f);  // flushed
      if (mode.never_zero) REQUIRE(got_codes[12 * kBlock8 + 1] == 1);
      for (void* p : {static_cast<void*>(codec), static_cast<void*>(x), static_cast<void*>(sizes),
                      static_cast<void*>(random), static_cast<void*>(codes), static_cast<void*>(scales),
                      static_cast<void*>(ok)}) {
        cudaFree(p);
      }
    }
  }
  halfstep_emu::configure(saved);
}

namespace {

// One warp per block: lane l steps elements 8l .. 8l + 7 of its block, in place; held[b] says
// whether the block kept everything.
template <class Master, bool kDraw>
__global__ void step_blocks(const Codec8* codecs, typename Master::Stored* ps, std::uint16_t* model, std::uint8_t* m_codes,
                            std::uint8_t* v_codes, float* m_scales, float* v_scales, const float* g, const int* sizes,
                            const std::uint32_t* random, int with_model, GroupConsts k, int* held) {
  const int b = static_cast<int>(blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u);
  const int first = b * kBlock8 + static_cast<int>(threadIdx.x % 32u) * kBlock8PerLane;
  typename Master::Stored p[kBlock8PerLane];
  std::uint16_t w[kBlock8PerLane];
  std::uint8_t mc[kBlock8PerLane], vc[kBlock8PerLane];
  float gv[kBlock8PerLane];
  std::uint32_t r[kBlock8PerLane];
  for (int j = 0; j < kBlock8PerLane; ++j) {
    p[j] = ps[first + j];
    w[j] = model[first + j];
    mc[j] = m_codes[first + j];
    vc[j] = v_codes[first + j];
    gv[j] = g[first + j];
    r[j] = random[first + j];
  }
  float ms = m_scales[b], vs = v_scales[b];
  const bool kept = warp_update_block8<Master, kDraw>(codecs[0], codecs[1], p, w, mc, vc, ms, vs, gv, sizes[b],
                                                      with_model != 0, r, k);
  for (int j = 0; j < kBlock8PerLane; ++j) {
    ps[first + j] = p[j];
    model[first + j] = w[j];
    m_codes[first + j] = mc[j];
    v_codes[first + j] = vc[j];
  }
  if (threadIdx.x % 32u == 0) {
    m_scales[b] = ms;
    v_scales[b] = vs;
    held[b] = kept ? 1 : 0;
  }
}

// The state of 32 blocks of every size kind: bf16 weights near 1 (masters: fp32 values that
// round to them, or their remainders), moments from random codes and scales across decades
// (a block of zero scales among them), gradients of 1e-3; a gradient of 1e30 at the first,
// middle or last element of three blocks makes exp_avg_sq overflow there.
template <class Master>
struct StepCase {
  std::vector<typename Master::Stored> ps;
  std::vector<std::uint16_t> model;
  std::vector<std::uint8_t> m_codes, v_codes;
  std::vector<float> m_scales, v_scales, g;
  std::vector<int> sizes;
  std::vector<std::uint32_t> random;
};
template <class Master>
StepCase<Master> make_step_case(std::uint32_t seed) {
  constexpr int kBlocks = 32;
  constexpr std::size_t n = kBlocks * kBlock8;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> size(1, kBlock8);
  StepCase<Master> c{std::vector<typename Master::Stored>(n), std::vector<std::uint16_t>(n), std::vector<std::uint8_t>(n),
                     std::vector<std::uint8_t>(n), std::vector<float>(kBlocks), std::vector<float>(kBlocks),
                     std::vector<float>(n), std::vector<int>(kBlocks), std::vector<std::uint32_t>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    const float master = 1.0f + 0.1f * normal(gen);
    std::uint16_t bf16 = 0;
    typename Master::Stored stored{};
    Master::encode(master, true, false, 0u, stored, bf16);
    c.ps[i] = stored;
    c.model[i] = bf16;
    c.m_codes[i] = static_cast<std::uint8_t>(gen());
    c.v_codes[i] = static_cast<std::uint8_t>(gen());
    c.g[i] = 1e-3f * normal(gen);
    c.random[i] = static_cast<std::uint32_t>(gen());
  }
  for (int b = 0; b < kBlocks; ++b) {
    const std::size_t u = static_cast<std::size_t>(b);
    c.sizes[u] = b % 4 == 0 ? kBlock8 : b % 4 == 1 ? size(gen) : b % 4 == 2 ? 1 : 255;
    c.m_scales[u] = b == 5 ? 0.0f : std::pow(10.0f, -3.0f - 3.0f * std::fabs(normal(gen)));
    c.v_scales[u] = b == 5 ? 0.0f : std::pow(10.0f, -3.0f - 3.0f * std::fabs(normal(gen)));
  }
  // Past a block's size nothing is the block's: NaN gradients there would hold it if read.
  for (int b = 0; b < kBlocks; ++b) {
    for (int i = c.sizes[static_cast<std::size_t>(b)]; i < kBlock8; ++i) c.g[static_cast<std::size_t>(b * kBlock8 + i)] = NAN;
  }
  for (int b : {8, 9, 10}) {
    const int sz = c.sizes[static_cast<std::size_t>(b)];
    const int at = b == 8 ? 0 : b == 9 ? sz / 2 : sz - 1;
    c.g[static_cast<std::size_t>(b * kBlock8 + at)] = 1e30f;
  }
  return c;
}

template <class Master, bool kDraw>
void check_block_steps(bool with_model) {
  StepCase<Master> in = make_step_case<Master>(kDraw ? 81u : 82u);
  GroupParams params{0.9f, 0.999f, 1e-8f, 0.01f, 1, 1, {0, 0}, 0};
  const GroupConsts k = group_consts(params, 1e-3f, 7);
  // The device's run.
  Codec8* codecs = device_copy(std::vector<Codec8>{kSignedCodec8, kUnsignedCodec8});
  auto* ps = device_copy(in.ps);
  auto* model = device_copy(in.model);
  auto* m_codes = device_copy(in.m_codes);
  auto* v_codes = device_copy(in.v_codes);
  auto* m_scales = device_copy(in.m_scales);
  auto* v_scales = device_copy(in.v_scales);
  auto* g = device_copy(in.g);
  auto* sizes = device_copy(in.sizes);
  auto* random = device_copy(in.random);
  int* held = device_copy(std::vector<int>(in.sizes.size(), -1));
  HALFSTEP_LAUNCH(static_cast<unsigned>(in.sizes.size() / 4), 128, 0, nullptr, step_blocks<Master, kDraw>)(
      codecs, ps, model, m_codes, v_codes, m_scales, v_scales, g, sizes, random, with_model ? 1 : 0, k, held);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::size_t n = in.ps.size(), blocks = in.sizes.size();
  const auto got_ps = host_copy(ps, n);
  const auto got_model = host_copy(model, n);
  const auto got_m = host_copy(m_codes, n);
  const auto got_v = host_copy(v_codes, n);
  const auto got_ms = host_copy(m_scales, blocks);
  const auto got_vs = host_copy(v_scales, blocks);
  const auto got_held = host_copy(held, blocks);
  // The host's, block by block, and the two compared bit for bit.
  int held_blocks = 0, moved = 0;
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t at = b * kBlock8;
    const int sz = in.sizes[b];
    const bool want_held = update_block8<Master, kDraw>(kSignedCodec8, kUnsignedCodec8, &in.ps[at], &in.model[at],
                                                        &in.m_codes[at], &in.v_codes[at], in.m_scales[b], in.v_scales[b],
                                                        &in.g[at], sz, with_model, &in.random[at], k);
    INFO("block " << b << " of " << sz);
    REQUIRE(got_held[b] == (want_held ? 1 : 0));
    held_blocks += want_held ? 1 : 0;
    REQUIRE(std::memcmp(&got_ms[b], &in.m_scales[b], sizeof(float)) == 0);
    REQUIRE(std::memcmp(&got_vs[b], &in.v_scales[b], sizeof(float)) == 0);
    for (int i = 0; i < sz; ++i) {
      const std::size_t u = at + static_cast<std::size_t>(i);
      REQUIRE(std::memcmp(&got_ps[u], &in.ps[u], sizeof(in.ps[u])) == 0);
      REQUIRE(got_model[u] == in.model[u]);
      REQUIRE(got_m[u] == in.m_codes[u]);
      REQUIRE(got_v[u] == in.v_codes[u]);
    }
  }
  // The three blocks with an overflowing exp_avg_sq, and only they, kept their state; the rest moved.
  REQUIRE(held_blocks == 3);
  REQUIRE(got_held[8] == 1);
  REQUIRE(got_held[9] == 1);
  REQUIRE(got_held[10] == 1);
  const StepCase<Master> before = make_step_case<Master>(kDraw ? 81u : 82u);
  for (std::size_t b : {std::size_t{8}, std::size_t{9}, std::size_t{10}}) {
    for (int i = 0; i < in.sizes[b]; ++i) {
      const std::size_t u = b * kBlock8 + static_cast<std::size_t>(i);
      REQUIRE(got_m[u] == before.m_codes[u]);
      REQUIRE(got_v[u] == before.v_codes[u]);
      REQUIRE(got_model[u] == before.model[u]);
    }
  }
  for (std::size_t u = 0; u < 4 * kBlock8; ++u) moved += got_model[u] != before.model[u] || got_m[u] != before.m_codes[u] ? 1 : 0;
  REQUIRE(moved > 0);
  REQUIRE(got_vs[5] > 0.0f);  // a block of zero moments takes the gradients' square roots
  for (void* p : {static_cast<void*>(codecs), static_cast<void*>(ps), static_cast<void*>(model),
                  static_cast<void*>(m_codes), static_cast<void*>(v_codes), static_cast<void*>(m_scales),
                  static_cast<void*>(v_scales), static_cast<void*>(g), static_cast<void*>(sizes),
                  static_cast<void*>(random), static_cast<void*>(held)}) {
    cudaFree(p);
  }
}

}  // namespace

TEST_CASE("8-bit block step by a warp is the host's, bit for bit, and holds a block whole", "[block8][emulated]") {
  using halfstep::DType;
  using halfstep::MasterFormat;
  const std::string saved = halfstep_emu::settings();
  for (const char* order : {"forward", "random", "warps"}) {
    halfstep_emu::configure(std::string("threads=") + order + ",seed=9");
    INFO("threads=" << order);
    SECTION(std::string("fp32 masters, bf16 model, nearest, ") + order) {
      check_block_steps<MasterCodec<MasterFormat::f32, DType::bf16>, false>(true);
    }
    SECTION(std::string("fp32 masters, fp16 model, nearest, ") + order) {
      check_block_steps<MasterCodec<MasterFormat::f32, DType::f16>, false>(true);
    }
    SECTION(std::string("fp32 masters, no model copy, stochastic, ") + order) {
      check_block_steps<MasterCodec<MasterFormat::f32, DType::bf16>, true>(false);
    }
    SECTION(std::string("remainders, stochastic, ") + order) {
      check_block_steps<MasterCodec<MasterFormat::bf16_remainder, DType::bf16>, true>(true);
    }
    SECTION(std::string("no master, stochastic, ") + order) {
      check_block_steps<MasterCodec<MasterFormat::none, DType::bf16>, true>(true);
    }
    SECTION(std::string("no master, nearest, ") + order) {
      check_block_steps<MasterCodec<MasterFormat::none, DType::bf16>, false>(true);
    }
  }
  halfstep_emu::configure(saved);
}
