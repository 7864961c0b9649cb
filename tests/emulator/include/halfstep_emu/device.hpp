// The emulated CUDA device, as kernel code sees it. Kernels compiled by the host compiler with
// HALFSTEP_EMULATED include this (through kernels/device.cuh) instead of nvcc's built-ins:
//
//   threadIdx, blockIdx, blockDim, gridDim, warpSize    of the CUDA thread running now
//   __syncthreads, __syncwarp                           barriers, checked for divergence
//   __shfl_sync / _up / _down / _xor for every type CUDA overloads, __ballot_sync, __any_sync,
//   __all_sync                                          lanes exchange in lockstep
//   __ldg, atomics, bit casts, fences                   with alignment and range checks
//
// Each CUDA thread is a fiber; they switch only at barriers, warp operations and exit, in the
// order the schedule (HALFSTEP_EMU) picks. Whatever a real device would do but the emulator cannot
// decide (a barrier not every thread reaches, a shuffle with a partial mask, a misaligned vector
// access, an access outside device memory) is a fault with a message, never a guess.
#pragma once

#if defined(__CUDACC__)
#error "halfstep_emu/device.hpp is for kernels compiled by the host compiler (the emulated device)"
#endif

#include <cuda_runtime_api.h>
#include <vector_functions.h>
// Before the fp16/bf16 headers: their host paths are what the emulated device converts with.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// CUDA device code sees the C math functions (fmaxf, sqrtf, ...) without an include.
#include <math.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

// Outside nvcc the CUDA headers define __global__, __device__ and __host__ as nothing, which is
// what the emulator wants. __shared__ would silently give every thread its own copy, so it is an
// error here: kernels declare shared memory with HALFSTEP_SHARED.
#undef __shared__
#define __shared__ static_assert(false, "the emulated device needs HALFSTEP_SHARED(type, name) for shared memory");
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __forceinline__
#define __forceinline__ inline
#endif

namespace halfstep_emu {

/// The built-in variables of the CUDA thread that is running.
struct ThreadState {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

/// The running CUDA thread; faults (and aborts) when called outside a kernel.
ThreadState& current();

/// Checks that a kernel may access [p, p + bytes): inside one live device allocation (or this
/// block's shared memory) and aligned to `align`. Faults otherwise, naming `what` and the site.
void check_access(const void* p, std::size_t bytes, std::size_t align, bool write,
                  const char* what, const char* file, int line);

/// A load of a T that must be naturally aligned and inside device memory.
template <class T>
T checked_load(const void* p, const char* file, int line) {
  check_access(p, sizeof(T), alignof(T), false, "vector load", file, line);
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
/// A store of a T that must be naturally aligned and inside device memory.
template <class T>
void checked_store(void* p, const T& v, const char* file, int line) {
  check_access(p, sizeof(T), alignof(T), true, "vector store", file, line);
  std::memcpy(p, &v, sizeof(T));
}

/// The block's shared object declared at `site`: the same address for every thread of the
/// block, fresh (filled with the schedule's garbage) for every block.
void* shared_bytes(const void* site, std::size_t bytes, std::size_t align, const char* name);
template <class T>
T& shared_object(const void* site, const char* name) {
  static_assert(std::is_trivially_default_constructible<T>::value &&
                    std::is_trivially_destructible<T>::value,
                "shared memory holds trivial types only");
  return *static_cast<T*>(shared_bytes(site, sizeof(T), alignof(T), name));
}

/// The warp-level operations the emulator runs in lockstep.
enum class WarpOp : std::uint8_t { shfl_idx, shfl_up, shfl_down, shfl_xor, syncwarp, ballot, any, all };

/// Waits until every lane named by `mask` has reached a matching warp operation, then exchanges:
/// `value` (`bytes` <= 8) is this lane's contribution, `arg` the source lane, delta or lane mask
/// (the predicate for votes); the lane's result is written to `result`.
void warp_operation(WarpOp op, unsigned mask, const void* value, std::size_t bytes, int arg,
                    int width, void* result, const char* file, int line);

/// Enqueues a grid on `stream` (the stream model decides when it runs).
void enqueue_kernel(const char* name, dim3 grid, dim3 block, std::size_t shared_bytes,
                    cudaStream_t stream, std::function<void()> body);

/// kernel<<<grid, block, shared_bytes, stream>>>(args...): the arguments are copied at launch into
/// the kernel's parameter types, as CUDA copies them into parameter space.
template <class... Params>
class Launch {
 public:
  Launch(dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream, const char* name,
         void (*kernel)(Params...))
      : grid_(grid), block_(block), shared_(shared_bytes), stream_(stream), name_(name),
        kernel_(kernel) {}
  template <class... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "wrong number of kernel arguments");
    auto params = std::make_shared<std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
    auto kernel = kernel_;
    enqueue_kernel(name_, grid_, block_, shared_, stream_,
                   [kernel, params] { std::apply(kernel, *params); });
  }

 private:
  dim3 grid_, block_;
  std::size_t shared_;
  cudaStream_t stream_;
  const char* name_;
  void (*kernel_)(Params...);
};

template <class... Params>
Launch<Params...> make_launch(dim3 grid, dim3 block, std::size_t shared_bytes,
                              cudaStream_t stream, const char* name, void (*kernel)(Params...)) {
  return Launch<Params...>(grid, block, shared_bytes, stream, name, kernel);
}

namespace detail {
template <class T>
T shuffle(WarpOp op, unsigned mask, T value, int arg, int width, const char* file, int line) {
  static_assert(sizeof(T) <= 8, "shuffles move up to 8 bytes");
  T out;
  warp_operation(op, mask, &value, sizeof(T), arg, width, &out, file, line);
  return out;
}
}  // namespace detail

}  // namespace halfstep_emu

#define threadIdx (::halfstep_emu::current().thread_idx)
#define blockIdx (::halfstep_emu::current().block_idx)
#define blockDim (::halfstep_emu::current().block_dim)
#define gridDim (::halfstep_emu::current().grid_dim)
constexpr int warpSize = 32;

/// Block-wide barrier; every thread of the block must reach the same one.
void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE());

/// Warp barrier over the lanes in `mask` (which must include the caller).
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
  ::halfstep_emu::warp_operation(::halfstep_emu::WarpOp::syncwarp, mask, nullptr, 0, 0, warpSize,
                                 nullptr, file, line);
}

// The shuffles, one overload per type CUDA provides one for.
#define HALFSTEP_EMU_SHUFFLES(T)                                                                \
  inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,               \
                       const char* file = __builtin_FILE(), int line = __builtin_LINE()) {     \
    return ::halfstep_emu::detail::shuffle(::halfstep_emu::WarpOp::shfl_idx, mask, var,        \
                                           src_lane, width, file, line);                       \
  }                                                                                             \
  inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,          \
                          const char* file = __builtin_FILE(), int line = __builtin_LINE()) {  \
    return ::halfstep_emu::detail::shuffle(::halfstep_emu::WarpOp::shfl_up, mask, var,         \
                                           static_cast<int>(delta), width, file, line);        \
  }                                                                                             \
  inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,        \
                            const char* file = __builtin_FILE(), int line = __builtin_LINE()) { \
    return ::halfstep_emu::detail::shuffle(::halfstep_emu::WarpOp::shfl_down, mask, var,       \
                                           static_cast<int>(delta), width, file, line);        \
  }                                                                                             \
  inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,          \
                           const char* file = __builtin_FILE(), int line = __builtin_LINE()) { \
    return ::halfstep_emu::detail::shuffle(::halfstep_emu::WarpOp::shfl_xor, mask, var,        \
                                           lane_mask, width, file, line);                      \
  }
HALFSTEP_EMU_SHUFFLES(int)
HALFSTEP_EMU_SHUFFLES(unsigned int)
HALFSTEP_EMU_SHUFFLES(long)
HALFSTEP_EMU_SHUFFLES(unsigned long)
HALFSTEP_EMU_SHUFFLES(long long)
HALFSTEP_EMU_SHUFFLES(unsigned long long)
HALFSTEP_EMU_SHUFFLES(float)
HALFSTEP_EMU_SHUFFLES(double)
HALFSTEP_EMU_SHUFFLES(__half)
HALFSTEP_EMU_SHUFFLES(__half2)
HALFSTEP_EMU_SHUFFLES(__nv_bfloat16)
HALFSTEP_EMU_SHUFFLES(__nv_bfloat162)
#undef HALFSTEP_EMU_SHUFFLES

/// Votes over the lanes in `mask`.
inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  unsigned out = 0;
  ::halfstep_emu::warp_operation(::halfstep_emu::WarpOp::ballot, mask, nullptr, 0, predicate != 0,
                                 warpSize, &out, file, line);
  return out;
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  int out = 0;
  ::halfstep_emu::warp_operation(::halfstep_emu::WarpOp::any, mask, nullptr, 0, predicate != 0,
                                 warpSize, &out, file, line);
  return out;
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
  int out = 0;
  ::halfstep_emu::warp_operation(::halfstep_emu::WarpOp::all, mask, nullptr, 0, predicate != 0,
                                 warpSize, &out, file, line);
  return out;
}

/// A read-only load: naturally aligned, inside device memory.
template <class T>
T __ldg(const T* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  ::halfstep_emu::check_access(p, sizeof(T), alignof(T), false, "__ldg", file, line);
  return *p;
}

// Atomics. Threads switch only at barriers and warp operations, so a read-modify-write here is
// atomic by construction; the checks are those of any access.
#define HALFSTEP_EMU_ATOMIC(name, T, expr)                                                    \
  inline T name(T* address, T val, const char* file = __builtin_FILE(),                      \
                int line = __builtin_LINE()) {                                                \
    ::halfstep_emu::check_access(address, sizeof(T), alignof(T), true, #name, file, line);   \
    const T old = *address;                                                                   \
    *address = (expr);                                                                        \
    return old;                                                                               \
  }
HALFSTEP_EMU_ATOMIC(atomicAdd, int, old + val)
HALFSTEP_EMU_ATOMIC(atomicAdd, unsigned int, old + val)
HALFSTEP_EMU_ATOMIC(atomicAdd, unsigned long long, old + val)
HALFSTEP_EMU_ATOMIC(atomicAdd, float, old + val)
HALFSTEP_EMU_ATOMIC(atomicAdd, double, old + val)
HALFSTEP_EMU_ATOMIC(atomicMax, int, old > val ? old : val)
HALFSTEP_EMU_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
HALFSTEP_EMU_ATOMIC(atomicMax, unsigned long long, old > val ? old : val)
HALFSTEP_EMU_ATOMIC(atomicMin, int, old < val ? old : val)
HALFSTEP_EMU_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
HALFSTEP_EMU_ATOMIC(atomicMin, unsigned long long, old < val ? old : val)
HALFSTEP_EMU_ATOMIC(atomicExch, int, val)
HALFSTEP_EMU_ATOMIC(atomicExch, unsigned int, val)
HALFSTEP_EMU_ATOMIC(atomicExch, unsigned long long, val)
HALFSTEP_EMU_ATOMIC(atomicExch, float, val)
#undef HALFSTEP_EMU_ATOMIC

/// Memory fences order nothing here: the emulator does not model the memory model (only real
/// hardware shows races between blocks).
inline void __threadfence() {}
inline void __threadfence_block() {}

// Integer intrinsics.
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
/// Per 16-bit half, the larger / smaller unsigned value (max.u16x2 / min.u16x2).
inline unsigned int __vmaxu2(unsigned int a, unsigned int b) {
  const unsigned lo = (a & 0xFFFFu) > (b & 0xFFFFu) ? (a & 0xFFFFu) : (b & 0xFFFFu);
  const unsigned hi = (a >> 16) > (b >> 16) ? (a >> 16) : (b >> 16);
  return (hi << 16) | lo;
}
inline unsigned int __vminu2(unsigned int a, unsigned int b) {
  const unsigned lo = (a & 0xFFFFu) < (b & 0xFFFFu) ? (a & 0xFFFFu) : (b & 0xFFFFu);
  const unsigned hi = (a >> 16) < (b >> 16) ? (a >> 16) : (b >> 16);
  return (hi << 16) | lo;
}
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }

// Bit casts.
#define HALFSTEP_EMU_BITCAST(name, From, To) \
  inline To name(From x) {                   \
    static_assert(sizeof(From) == sizeof(To), "bit casts keep the size"); \
    To y;                                    \
    std::memcpy(&y, &x, sizeof(To));         \
    return y;                                \
  }
HALFSTEP_EMU_BITCAST(__uint_as_float, unsigned int, float)
HALFSTEP_EMU_BITCAST(__float_as_uint, float, unsigned int)
HALFSTEP_EMU_BITCAST(__int_as_float, int, float)
HALFSTEP_EMU_BITCAST(__float_as_int, float, int)
HALFSTEP_EMU_BITCAST(__longlong_as_double, long long, double)
HALFSTEP_EMU_BITCAST(__double_as_longlong, double, long long)
#undef HALFSTEP_EMU_BITCAST
