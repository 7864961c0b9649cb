// The 8-bit moments' block encoding by a warp (kernels/block8.hpp, warp_encode_block8) on the
// emulated device, against the host's encode_block8, bit for bit: scales, codes and refusals, on
// fresh random blocks of every size kind, zero blocks, flushed blocks, and blocks with inf or NaN
// at their first, middle and last elements — and garbage past a short block's end, which must not
// count — under every thread order the emulator has.
#include <catch2/catch.hpp>

#include "block8.hpp"

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
