// The emulated device's own tests: it faults (with a message, never a hang or a guess) on divergent
// barriers, partial-mask and divergent shuffles, misaligned vector accesses and accesses outside
// device memory; warp operations follow CUDA's documented semantics; the schedules really change
// the order threads run in; the lazy stream model runs work only when CUDA orders it; the runtime
// registry checks every copy. Test kernels are written here, in the same dialect as kernels/.
#include <catch2/catch.hpp>

#include "device.cuh"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "halfstep_emu/control.hpp"

namespace {

using halfstep::detail::load16;
using halfstep::detail::store16;

/// Runs the test body under other emulator settings and restores them (and clears any fault) after.
struct Settings {
  std::string saved;
  explicit Settings(const std::string& spec) : saved(halfstep_emu::settings()) {
    halfstep_emu::configure(spec);
  }
  ~Settings() {
    halfstep_emu::clear_fault();
    halfstep_emu::configure(saved);
  }
};

/// A device buffer of n Ts.
template <class T>
struct Buffer {
  T* ptr = nullptr;
  std::size_t n;
  explicit Buffer(std::size_t count) : n(count) {
    void* raw = nullptr;
    REQUIRE(cudaMalloc(&raw, n * sizeof(T)) == cudaSuccess);
    ptr = static_cast<T*>(raw);
  }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::vector<T> get() const {
    std::vector<T> h(n);
    REQUIRE(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }
  void set(const std::vector<T>& h) {
    REQUIRE(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
};

/// The launch's error (cudaGetLastError after it) and the fault message, then a clean device.
struct Outcome {
  cudaError_t code;
  std::string message;
};
Outcome outcome_and_clear() {
  Outcome o{cudaGetLastError(), halfstep_emu::fault_message()};
  halfstep_emu::clear_fault();
  return o;
}

const char* const kThreadOrders[] = {"forward", "reverse", "random", "warps", "starve"};

// --- kernels that break the rules -----------------------------------------------------------------

__global__ void barrier_in_half_the_block(int* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void barriers_at_two_sites(int* out) {
  if (threadIdx.x % 2 == 0) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

__global__ void early_exit_then_barrier(int* out) {
  if (threadIdx.x >= 32) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

__global__ void partial_mask_shuffle(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x < 16) v = __shfl_down_sync(0x0000FFFFu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void divergent_shuffles(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x % 32 < 16) {
    v = __shfl_down_sync(0xFFFFFFFFu, v, 1);
  } else {
    v = __shfl_xor_sync(0xFFFFFFFFu, v, 1);
  }
  out[threadIdx.x] = v;
}

__global__ void shuffle_against_barrier(int* out) {
  int v = static_cast<int>(threadIdx.x);
  if (threadIdx.x == 5) {
    __syncthreads();
  } else {
    v = __shfl_down_sync(0xFFFFFFFFu, v, 1);
    __syncthreads();
  }
  out[threadIdx.x] = v;
}

__global__ void vector_load_at(const unsigned char* base, int offset, uint4* out) {
  out[threadIdx.x] = load16<uint4>(base + offset);
}

__global__ void vector_store_at(unsigned char* base, int offset) {
  store16(base + offset, make_uint4(1, 2, 3, 4));
}

__global__ void ldg_vector_at(const unsigned char* base, int offset, uint4* out) {
  out[threadIdx.x] = __ldg(reinterpret_cast<const uint4*>(base + offset));
}

__global__ void ldg_one_past(const float* p, int n, float* out) { out[0] = __ldg(p + n); }

}  // namespace

TEST_CASE("a __syncthreads that not every thread reaches faults under every schedule", "[emulator]") {
  for (const char* order : kThreadOrders) {
    Settings s(std::string("threads=") + order);
    Buffer<int> out(64);
    HALFSTEP_LAUNCH(1, 64, 0, nullptr, barrier_in_half_the_block)(out.ptr);
    const Outcome o = outcome_and_clear();
    CAPTURE(order, o.message);
    CHECK(o.code == cudaErrorLaunchFailure);
    CHECK_THAT(o.message, Catch::Contains("barrier_in_half_the_block") &&
                              Catch::Contains("every thread must reach every __syncthreads"));
  }
}

TEST_CASE("threads of a block at different __syncthreads fault", "[emulator]") {
  for (const char* order : kThreadOrders) {
    Settings s(std::string("threads=") + order);
    Buffer<int> out(64);
    HALFSTEP_LAUNCH(1, 64, 0, nullptr, barriers_at_two_sites)(out.ptr);
    const Outcome o = outcome_and_clear();
    CAPTURE(order, o.message);
    CHECK(o.code == cudaErrorLaunchFailure);
    CHECK_THAT(o.message, Catch::Contains("reached different __syncthreads"));
  }
}

TEST_CASE("a __syncthreads after some threads returned early faults", "[emulator]") {
  for (const char* order : kThreadOrders) {
    Settings s(std::string("threads=") + order);
    Buffer<int> out(64);
    HALFSTEP_LAUNCH(1, 64, 0, nullptr, early_exit_then_barrier)(out.ptr);
    const Outcome o = outcome_and_clear();
    CAPTURE(order, o.message);
    CHECK(o.code == cudaErrorLaunchFailure);
    CHECK_THAT(o.message, Catch::Contains("__syncthreads"));
  }
}

TEST_CASE("a partial-mask shuffle faults", "[emulator]") {
  Settings s("threads=forward");
  Buffer<int> out(32);
  HALFSTEP_LAUNCH(1, 32, 0, nullptr, partial_mask_shuffle)(out.ptr);
  const Outcome o = outcome_and_clear();
  CHECK(o.code == cudaErrorLaunchFailure);
  CHECK_THAT(o.message, Catch::Contains("partial-mask __shfl_down_sync (mask 0x0000ffff)"));
}

TEST_CASE("lanes of a warp at different shuffles fault as a divergent warp", "[emulator]") {
  for (const char* order : kThreadOrders) {
    Settings s(std::string("threads=") + order);
    Buffer<int> out(32);
    HALFSTEP_LAUNCH(1, 32, 0, nullptr, divergent_shuffles)(out.ptr);
    const Outcome o = outcome_and_clear();
    CAPTURE(order, o.message);
    CHECK(o.code == cudaErrorLaunchFailure);
    CHECK_THAT(o.message, Catch::Contains("divergent warp"));
  }
}

TEST_CASE("a lane at a barrier while its warp shuffles faults", "[emulator]") {
  for (const char* order : kThreadOrders) {
    Settings s(std::string("threads=") + order);
    Buffer<int> out(64);
    HALFSTEP_LAUNCH(1, 64, 0, nullptr, shuffle_against_barrier)(out.ptr);
    const Outcome o = outcome_and_clear();
    CAPTURE(order, o.message);
    CHECK(o.code == cudaErrorLaunchFailure);
    CHECK_THAT(o.message, Catch::Contains("__syncthreads") && Catch::Contains("__shfl_down_sync"));
  }
}

TEST_CASE("misaligned 16-byte vector loads and stores fault, aligned ones do not", "[emulator]") {
  Settings s("threads=forward");
  Buffer<unsigned char> bytes(64);
  Buffer<uint4> out(1);
  for (int offset : {4, 8, 2, 1}) {
    CAPTURE(offset);
    HALFSTEP_LAUNCH(1, 1, 0, nullptr, vector_load_at)(bytes.ptr, offset, out.ptr);
    Outcome o = outcome_and_clear();
    CHECK(o.code == cudaErrorMisalignedAddress);
    CHECK_THAT(o.message, Catch::Contains("misaligned 16-byte vector load") && Catch::Contains("vector_load_at"));
    HALFSTEP_LAUNCH(1, 1, 0, nullptr, vector_store_at)(bytes.ptr, offset);
    o = outcome_and_clear();
    CHECK(o.code == cudaErrorMisalignedAddress);
    CHECK_THAT(o.message, Catch::Contains("misaligned 16-byte vector store"));
    HALFSTEP_LAUNCH(1, 1, 0, nullptr, ldg_vector_at)(bytes.ptr, offset, out.ptr);
    o = outcome_and_clear();
    CHECK(o.code == cudaErrorMisalignedAddress);
    CHECK_THAT(o.message, Catch::Contains("misaligned 16-byte __ldg"));
  }
  HALFSTEP_LAUNCH(1, 1, 0, nullptr, vector_load_at)(bytes.ptr, 16, out.ptr);
  HALFSTEP_LAUNCH(1, 1, 0, nullptr, vector_store_at)(bytes.ptr, 32);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("a kernel read past the end of its allocation or of host memory faults", "[emulator]") {
  Settings s("threads=forward");
  Buffer<float> in(10), out(1);
  HALFSTEP_LAUNCH(1, 1, 0, nullptr, ldg_one_past)(in.ptr, 10, out.ptr);
  Outcome o = outcome_and_clear();
  CHECK(o.code == cudaErrorIllegalAddress);
  CHECK_THAT(o.message, Catch::Contains("outside every device allocation"));
  std::vector<float> host(4);
  HALFSTEP_LAUNCH(1, 1, 0, nullptr, ldg_one_past)(host.data(), 0, out.ptr);
  o = outcome_and_clear();
  CHECK(o.code == cudaErrorIllegalAddress);
  HALFSTEP_LAUNCH(1, 1, 0, nullptr, ldg_one_past)(in.ptr, 9, out.ptr);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("a fault is sticky until cleared, as a CUDA context error is", "[emulator]") {
  Settings s("threads=forward");
  Buffer<int> out(64);
  HALFSTEP_LAUNCH(1, 64, 0, nullptr, early_exit_then_barrier)(out.ptr);
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
  CHECK(cudaGetLastError() == cudaErrorLaunchFailure);  // not reset
  int n = 0;
  CHECK(cudaGetDeviceCount(&n) == cudaErrorLaunchFailure);
  CHECK_THAT(std::string(cudaGetErrorString(cudaErrorLaunchFailure)),
             Catch::Contains("early_exit_then_barrier"));
  halfstep_emu::clear_fault();
  CHECK(cudaGetDeviceCount(&n) == cudaSuccess);
}

// --- warp operations ------------------------------------------------------------------------------

namespace {

// What CUDA documents each shuffle returns to `lane`: the value of the source lane, or the lane's
// own value when the source falls outside its width-sized segment.
int expected_source(int op, int lane, int arg, int width) {
  const int base = lane / width * width;
  switch (op) {
    case 0: return base + ((arg % width) + width) % width;            // __shfl_sync: srcLane mod width
    case 1: return lane - base >= arg ? lane - arg : lane;            // __shfl_up_sync
    case 2: return lane - base + arg < width ? lane + arg : lane;     // __shfl_down_sync
    default: {                                                         // __shfl_xor_sync
      const int s = lane ^ arg;
      return s < base + width ? s : lane;
    }
  }
}

template <class T>
__global__ void shuffles(const T* in, int op, int arg, int width, T* out) {
  const T v = in[threadIdx.x];
  T r = v;
  switch (op) {
    case 0: r = __shfl_sync(0xFFFFFFFFu, v, arg + static_cast<int>(threadIdx.x % 3), width); break;
    case 1: r = __shfl_up_sync(0xFFFFFFFFu, v, static_cast<unsigned>(arg), width); break;
    case 2: r = __shfl_down_sync(0xFFFFFFFFu, v, static_cast<unsigned>(arg), width); break;
    default: r = __shfl_xor_sync(0xFFFFFFFFu, v, arg, width); break;
  }
  out[threadIdx.x] = r;
}

template <class T>
void check_shuffles(const char* type) {
  const int n = 64;  // two warps
  std::vector<T> in(n);
  for (int i = 0; i < n; ++i) {
    unsigned char bytes[sizeof(T)];
    for (std::size_t k = 0; k < sizeof(T); ++k) bytes[k] = static_cast<unsigned char>(i * 7 + static_cast<int>(k) * 31);
    bytes[0] = static_cast<unsigned char>(i);  // every lane's bytes differ
    std::memcpy(static_cast<void*>(&in[static_cast<std::size_t>(i)]), bytes, sizeof(T));
  }
  Buffer<T> din(n), dout(n);
  din.set(in);
  for (int op = 0; op < 4; ++op) {
    for (int width : {32, 16, 8, 4, 2, 1}) {
      for (int arg : {0, 1, 3, 7, 16, 31}) {
        HALFSTEP_LAUNCH(1, n, 0, nullptr, shuffles<T>)(din.ptr, op, arg, width, dout.ptr);
        REQUIRE(cudaGetLastError() == cudaSuccess);
        const std::vector<T> got = dout.get();
        for (int i = 0; i < n; ++i) {
          const int lane = i % 32, warp_base = i - lane;
          const int lane_arg = op == 0 ? arg + i % 3 : arg;
          const int src = warp_base + expected_source(op, lane, lane_arg, width);
          CAPTURE(type, op, width, arg, i, src);
          REQUIRE(std::memcmp(static_cast<const void*>(&got[static_cast<std::size_t>(i)]),
                              static_cast<const void*>(&in[static_cast<std::size_t>(src)]), sizeof(T)) == 0);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("shuffles exchange values in lockstep for every type CUDA overloads", "[emulator]") {
  Settings s("threads=random,seed=9");
  check_shuffles<int>("int");
  check_shuffles<unsigned>("unsigned");
  check_shuffles<long>("long");
  check_shuffles<unsigned long>("unsigned long");
  check_shuffles<long long>("long long");
  check_shuffles<unsigned long long>("unsigned long long");
  check_shuffles<float>("float");
  check_shuffles<double>("double");
  check_shuffles<__half>("__half");
  check_shuffles<__half2>("__half2");
  check_shuffles<__nv_bfloat16>("__nv_bfloat16");
  check_shuffles<__nv_bfloat162>("__nv_bfloat162");
}

namespace {
__global__ void votes(unsigned* out) {
  const unsigned lane = threadIdx.x % 32;
  // Lanes 0..15 vote among themselves, lanes 16..31 among themselves.
  const unsigned mask = lane < 16 ? 0x0000FFFFu : 0xFFFF0000u;
  const int pred = lane % 3 == 0;
  out[threadIdx.x * 3 + 0] = __ballot_sync(mask, pred);
  out[threadIdx.x * 3 + 1] = static_cast<unsigned>(__any_sync(mask, lane == 20));
  out[threadIdx.x * 3 + 2] = static_cast<unsigned>(__all_sync(mask, lane < 16));
  __syncwarp(mask);
}
}  // namespace

TEST_CASE("votes and __syncwarp work on partial masks", "[emulator]") {
  for (const char* order : kThreadOrders) {
    Settings s(std::string("threads=") + order);
    Buffer<unsigned> out(32 * 3);
    HALFSTEP_LAUNCH(1, 32, 0, nullptr, votes)(out.ptr);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    const std::vector<unsigned> got = out.get();
    unsigned low = 0, high = 0;
    for (unsigned l = 0; l < 32; ++l) {
      if (l % 3 == 0) (l < 16 ? low : high) |= 1u << l;
    }
    for (unsigned l = 0; l < 32; ++l) {
      CAPTURE(order, l);
      CHECK(got[l * 3 + 0] == (l < 16 ? low : high));
      CHECK(got[l * 3 + 1] == (l < 16 ? 0u : 1u));
      CHECK(got[l * 3 + 2] == (l < 16 ? 1u : 0u));
    }
  }
}

// --- schedules and shared memory ------------------------------------------------------------------

namespace {

// Each thread takes a ticket after a barrier: the order in which the schedule ran them.
__global__ void tickets(int* counter, int* order) {
  __syncthreads();
  const int t = atomicAdd(counter, 1);
  order[blockIdx.x * blockDim.x + threadIdx.x] = t;
}

std::vector<int> ticket_order(const std::string& spec, int blocks, int threads) {
  Settings s(spec);
  Buffer<int> counter(1), order(static_cast<std::size_t>(blocks * threads));
  counter.set({0});
  HALFSTEP_LAUNCH(blocks, threads, 0, nullptr, tickets)(counter.ptr, order.ptr);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  return order.get();
}

}  // namespace

TEST_CASE("thread and block orders follow the schedule, reproducibly per seed", "[emulator]") {
  const int threads = 128;
  std::vector<int> forward(threads), reverse(threads);
  std::iota(forward.begin(), forward.end(), 0);
  std::iota(reverse.rbegin(), reverse.rend(), 0);
  CHECK(ticket_order("threads=forward", 1, threads) == forward);
  CHECK(ticket_order("threads=reverse", 1, threads) == reverse);
  const auto r1 = ticket_order("threads=random,seed=3", 1, threads);
  CHECK(r1 != forward);
  CHECK(r1 != reverse);
  CHECK(r1 == ticket_order("threads=random,seed=3", 1, threads));
  CHECK(r1 != ticket_order("threads=random,seed=4", 1, threads));
  // One warp at a time: every warp's 32 tickets are consecutive, and the warp order is not always 0..3.
  bool some_warp_out_of_order = false;
  for (int seed = 1; seed <= 4; ++seed) {
    const auto w = ticket_order("threads=warps,seed=" + std::to_string(seed), 1, threads);
    for (int warp = 0; warp < threads / 32; ++warp) {
      const int first = w[static_cast<std::size_t>(warp * 32)];
      CHECK(first % 32 == 0);
      for (int l = 0; l < 32; ++l) CHECK(w[static_cast<std::size_t>(warp * 32 + l)] == first + l);
      some_warp_out_of_order |= first != warp * 32;
    }
  }
  CHECK(some_warp_out_of_order);
  // Starvation: the starved warps take their tickets after all the others.
  const auto st = ticket_order("threads=starve,seed=5", 1, threads);
  CHECK(st != forward);
  // Blocks: reverse order runs the last block first.
  const auto b = ticket_order("blocks=reverse", 3, 32);
  CHECK(b[64] == 0);
  CHECK(b[0] == 64);
}

namespace {

// A block sum that forgets the barrier between reusing its scratch: correct only when the schedule
// happens to let warp 0 read before the other warps overwrite.
__global__ void racy_block_sums(const int* in, int* out) {
  HALFSTEP_SHARED(int[4], scratch);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  for (int round = 0; round < 2; ++round) {
    int v = in[round * 128 + static_cast<int>(threadIdx.x)];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, static_cast<unsigned>(o));
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) out[round] = scratch[0] + scratch[1] + scratch[2] + scratch[3];
    // (missing __syncthreads here)
  }
}

__global__ void shared_garbage(unsigned* out) {
  HALFSTEP_SHARED(unsigned, first_touch);
  HALFSTEP_SHARED(unsigned[2], per_block);
  if (threadIdx.x == 0) {
    out[blockIdx.x * 2] = first_touch;  // read before anything wrote it
    per_block[0] = blockIdx.x + 100;
  }
  __syncthreads();
  if (threadIdx.x == 1) out[blockIdx.x * 2 + 1] = per_block[0];
}

}  // namespace

TEST_CASE("a missing barrier is invisible in one schedule and caught by another", "[emulator]") {
  std::vector<int> in(256);
  std::iota(in.begin(), in.end(), 1);
  const int want0 = std::accumulate(in.begin(), in.begin() + 128, 0);
  const int want1 = std::accumulate(in.begin() + 128, in.end(), 0);
  auto run = [&](const std::string& spec) {
    Settings s(spec);
    Buffer<int> din(256), out(2);
    din.set(in);
    HALFSTEP_LAUNCH(1, 128, 0, nullptr, racy_block_sums)(din.ptr, out.ptr);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    return out.get();
  };
  CHECK(run("threads=forward") == std::vector<int>{want0, want1});
  CHECK(run("threads=reverse") != std::vector<int>{want0, want1});
}

TEST_CASE("shared memory is fresh garbage in every block", "[emulator]") {
  {
    Settings s("shared=nan");
    Buffer<unsigned> out(6);
    HALFSTEP_LAUNCH(3, 32, 0, nullptr, shared_garbage)(out.ptr);
    REQUIRE(cudaGetLastError() == cudaSuccess);
    CHECK(out.get() == std::vector<unsigned>{0xFFFFFFFFu, 100, 0xFFFFFFFFu, 101, 0xFFFFFFFFu, 102});
  }
  {
    Settings s("shared=zero");
    Buffer<unsigned> out(2);
    HALFSTEP_LAUNCH(1, 32, 0, nullptr, shared_garbage)(out.ptr);
    CHECK(out.get() == std::vector<unsigned>{0u, 100u});
  }
  {
    Settings s("shared=random,seed=7");
    Buffer<unsigned> out(6);
    HALFSTEP_LAUNCH(3, 32, 0, nullptr, shared_garbage)(out.ptr);
    const auto got = out.get();
    CHECK(got[0] != got[2]);  // different garbage per block
    CHECK(got[3] == 101u);
  }
}

// --- the runtime: registry, stream models, capture --------------------------------------------------

namespace {
__global__ void fill(float* p, int n, float value) {
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) p[i] = value;
}
__global__ void copy_kernel(const float* in, float* out, int n) {
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) out[i] = in[i];
}
}  // namespace

TEST_CASE("fresh device memory holds NaN bytes and copies check kind and range", "[emulator]") {
  Settings s("streams=eager");
  Buffer<float> d(4);
  for (float x : d.get()) CHECK(std::isnan(x));
  std::vector<float> h(4, 1.0f);
  CHECK(cudaMemcpy(d.ptr, h.data(), 16, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue);
  CHECK_THAT(std::string(cudaGetErrorString(cudaErrorInvalidValue)), Catch::Contains("dst is device memory, not host memory"));
  CHECK(cudaMemcpy(h.data(), d.ptr, 16, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  CHECK_THAT(std::string(cudaGetErrorString(cudaErrorInvalidValue)), Catch::Contains("dst is pageable host memory, not device memory"));
  CHECK(cudaMemcpy(d.ptr, h.data(), 20, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  CHECK_THAT(std::string(cudaGetErrorString(cudaErrorInvalidValue)), Catch::Contains("runs 4 bytes past the end"));
  CHECK(cudaMemcpy(d.ptr + 1, h.data(), 12, cudaMemcpyHostToDevice) == cudaSuccess);
  CHECK(cudaMemset(h.data(), 0, 16) == cudaErrorInvalidValue);
  CHECK(cudaFree(h.data()) == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);  // not sticky
  cudaPointerAttributes a{};
  CHECK(cudaPointerGetAttributes(&a, d.ptr + 2) == cudaSuccess);
  CHECK(a.type == cudaMemoryTypeDevice);
  CHECK(cudaPointerGetAttributes(&a, h.data()) == cudaSuccess);
  CHECK(a.type == cudaMemoryTypeUnregistered);
  void* pinned = nullptr;
  REQUIRE(cudaMallocHost(&pinned, 64) == cudaSuccess);
  CHECK(cudaPointerGetAttributes(&a, pinned) == cudaSuccess);
  CHECK(a.type == cudaMemoryTypeHost);
  CHECK(cudaFreeHost(pinned) == cudaSuccess);
}

TEST_CASE("lazy streams: a read CUDA does not order after a write sees the old data", "[emulator]") {
  Settings s("streams=lazy");
  cudaStream_t nb;
  REQUIRE(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking) == cudaSuccess);
  Buffer<float> d(8);
  d.set(std::vector<float>(8, 1.0f));
  // A kernel on a non-blocking stream; a synchronous copy on the legacy stream is not ordered after it.
  HALFSTEP_LAUNCH(1, 32, 0, nb, fill)(d.ptr, 8, 2.0f);
  CHECK(d.get() == std::vector<float>(8, 1.0f));
  REQUIRE(cudaStreamSynchronize(nb) == cudaSuccess);
  CHECK(d.get() == std::vector<float>(8, 2.0f));

  // A copy from pageable memory may land after a kernel on a non-blocking stream reads it...
  Buffer<float> src(8), dst(8);
  src.set(std::vector<float>(8, 3.0f));
  REQUIRE(cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess);
  std::vector<float> four(8, 4.0f);
  REQUIRE(cudaMemcpy(src.ptr, four.data(), 32, cudaMemcpyHostToDevice) == cudaSuccess);
  HALFSTEP_LAUNCH(1, 32, 0, nb, copy_kernel)(src.ptr, dst.ptr, 8);
  REQUIRE(cudaStreamSynchronize(nb) == cudaSuccess);
  CHECK(dst.get() == std::vector<float>(8, 3.0f));
  // ...unless the legacy stream is synchronised first.
  REQUIRE(cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess);
  HALFSTEP_LAUNCH(1, 32, 0, nb, copy_kernel)(src.ptr, dst.ptr, 8);
  REQUIRE(cudaStreamSynchronize(nb) == cudaSuccess);
  CHECK(dst.get() == std::vector<float>(8, 4.0f));

  // A blocking stream is ordered after the legacy stream, and an event orders two streams.
  cudaStream_t blocking;
  REQUIRE(cudaStreamCreate(&blocking) == cudaSuccess);
  HALFSTEP_LAUNCH(1, 32, 0, nullptr, fill)(d.ptr, 8, 5.0f);
  HALFSTEP_LAUNCH(1, 32, 0, blocking, copy_kernel)(d.ptr, dst.ptr, 8);
  REQUIRE(cudaStreamSynchronize(blocking) == cudaSuccess);
  CHECK(dst.get() == std::vector<float>(8, 5.0f));
  cudaEvent_t e;
  REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
  HALFSTEP_LAUNCH(1, 32, 0, blocking, fill)(d.ptr, 8, 6.0f);
  REQUIRE(cudaEventRecord(e, blocking) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(nb, e, 0) == cudaSuccess);
  HALFSTEP_LAUNCH(1, 32, 0, nb, copy_kernel)(d.ptr, dst.ptr, 8);
  REQUIRE(cudaStreamSynchronize(nb) == cudaSuccess);
  CHECK(dst.get() == std::vector<float>(8, 6.0f));

  // An asynchronous copy into pinned memory lands only when the host waits for it.
  float* pinned = nullptr;
  REQUIRE(cudaMallocHost(reinterpret_cast<void**>(&pinned), 32) == cudaSuccess);
  std::fill(pinned, pinned + 8, -1.0f);
  REQUIRE(cudaMemcpyAsync(pinned, d.ptr, 32, cudaMemcpyDeviceToHost, nb) == cudaSuccess);
  REQUIRE(cudaEventRecord(e, nb) == cudaSuccess);
  CHECK(pinned[0] == -1.0f);
  CHECK(cudaEventQuery(e) == cudaErrorNotReady);
  REQUIRE(cudaEventSynchronize(e) == cudaSuccess);
  CHECK(pinned[7] == 6.0f);
  cudaFreeHost(pinned);
  cudaEventDestroy(e);
  cudaStreamDestroy(blocking);
  cudaStreamDestroy(nb);
}

TEST_CASE("eager streams run work when it is enqueued", "[emulator]") {
  Settings s("streams=eager");
  cudaStream_t nb;
  REQUIRE(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking) == cudaSuccess);
  Buffer<float> d(8);
  HALFSTEP_LAUNCH(1, 32, 0, nb, fill)(d.ptr, 8, 2.0f);
  CHECK(d.get() == std::vector<float>(8, 2.0f));
  cudaStreamDestroy(nb);
}

TEST_CASE("stream capture records work, replays run it, and forbidden calls invalidate the capture", "[emulator]") {
  for (const char* model : {"eager", "lazy"}) {
    Settings s(std::string("streams=") + model);
    CAPTURE(model);
    cudaStream_t st;
    REQUIRE(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) == cudaSuccess);
    Buffer<float> d(4), e(4);
    d.set(std::vector<float>(4, 1.0f));
    REQUIRE(cudaStreamSynchronize(cudaStreamLegacy) == cudaSuccess);
    cudaGraph_t graph = nullptr;
    REQUIRE(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
    cudaStreamCaptureStatus status;
    REQUIRE(cudaStreamIsCapturing(st, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusActive);
    HALFSTEP_LAUNCH(1, 32, 0, st, fill)(d.ptr, 4, 7.0f);
    REQUIRE(cudaStreamEndCapture(st, &graph) == cudaSuccess);
    CHECK(d.get() == std::vector<float>(4, 1.0f));  // captured, not run
    cudaGraphExec_t exec;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, st) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
    CHECK(d.get() == std::vector<float>(4, 7.0f));

    // A synchronous copy during a global-mode capture is refused and invalidates the capture.
    REQUIRE(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal) == cudaSuccess);
    std::vector<float> h(4);
    CHECK(cudaMemcpy(h.data(), e.ptr, 16, cudaMemcpyDeviceToHost) == cudaErrorStreamCaptureUnsupported);
    cudaGraph_t broken = nullptr;
    CHECK(cudaStreamEndCapture(st, &broken) == cudaErrorStreamCaptureInvalidated);
    CHECK(broken == nullptr);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(st);
    CHECK(cudaGetLastError() == cudaErrorStreamCaptureInvalidated);
  }
}

TEST_CASE("launch configurations outside CUDA's limits are errors that do not stick", "[emulator]") {
  Buffer<float> d(4);
  HALFSTEP_LAUNCH(1, 2048, 0, nullptr, fill)(d.ptr, 4, 1.0f);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  HALFSTEP_LAUNCH(0, 32, 0, nullptr, fill)(d.ptr, 4, 1.0f);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  HALFSTEP_LAUNCH(1, 32, 0, nullptr, fill)(d.ptr, 4, 1.0f);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("HALFSTEP_EMU rejects unknown keys and values", "[emulator]") {
  const std::string saved = halfstep_emu::settings();
  CHECK_THROWS_WITH(halfstep_emu::configure("threads=sideways"), Catch::Contains("forward, reverse, random, warps, starve"));
  CHECK_THROWS_WITH(halfstep_emu::configure("speed=11"), Catch::Contains("unknown key 'speed'"));
  CHECK(halfstep_emu::settings() == saved);
}
