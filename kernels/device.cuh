// Internal: what kernel code needs beyond C++, for the two compilers it meets. Under nvcc these
// are CUDA's own syntax; compiled by the host compiler with HALFSTEP_EMULATED (tests/emulator),
// the same kernel text runs on the emulated device, one fiber per CUDA thread. Every kernel file
// and device header includes this first.
//
//   HALFSTEP_SHARED(type, name)           a __shared__ declaration: one object per thread block
//   HALFSTEP_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...)
//                                         kernel<<<grid, block, shared_bytes, stream>>>(args...)
//   load16<V>(p) / store16(p, v)          16-byte vector accesses; p must be 16-byte aligned
//                                         (the emulated device checks it and faults otherwise)
//   load8b<V>(p) / store8b(p, v)          8-byte vector accesses; p 8-byte aligned
//   HALFSTEP_NOINLINE                     __noinline__ (a device function kept out of line)
#pragma once

#if defined(__CUDACC__)

#include <cuda_runtime_api.h>

#define HALFSTEP_SHARED(type, name) __shared__ ::halfstep::detail::Declared<type> name
#define HALFSTEP_NOINLINE __noinline__
#define HALFSTEP_LAUNCH(grid, block, shared_bytes, stream, ...) \
  __VA_ARGS__<<<(grid), (block), (shared_bytes), (stream)>>>

#elif defined(HALFSTEP_EMULATED)

#include "halfstep_emu/device.hpp"

#define HALFSTEP_SHARED(type, name)                                                      \
  ::halfstep::detail::Declared<type>& name = ::halfstep_emu::shared_object<              \
      ::halfstep::detail::Declared<type>>([] {                                          \
        static const char site = 0;                                                      \
        return static_cast<const void*>(&site);                                          \
      }(), #name)
#define HALFSTEP_NOINLINE __attribute__((noinline))
#define HALFSTEP_LAUNCH(grid, block, shared_bytes, stream, ...)                         \
  ::halfstep_emu::make_launch((grid), (block), (shared_bytes), (stream), #__VA_ARGS__, \
                              &__VA_ARGS__)

#else
#error "kernels/*.cu compile with nvcc, or with a host compiler for the emulated device (HALFSTEP_EMULATED)"
#endif

#include <cstdint>

namespace halfstep::detail {

/// Names a type as written (`double[8]`), so one macro declares scalars and arrays alike.
template <class T>
using Declared = T;

#if defined(__CUDACC__)
template <class V>
__device__ __forceinline__ V load16(const void* p) {
  return *static_cast<const V*>(p);
}
template <class V>
__device__ __forceinline__ void store16(void* p, const V& v) {
  *static_cast<V*>(p) = v;
}
template <class V>
__device__ __forceinline__ V load8b(const void* p) {
  return *static_cast<const V*>(p);
}
template <class V>
__device__ __forceinline__ void store8b(void* p, const V& v) {
  *static_cast<V*>(p) = v;
}
#else
template <class V>
inline V load16(const void* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(sizeof(V) == 16, "load16 reads 16-byte vectors");
  return ::halfstep_emu::checked_load<V>(p, file, line);
}
template <class V>
inline void store16(void* p, const V& v, const char* file = __builtin_FILE(),
                    int line = __builtin_LINE()) {
  static_assert(sizeof(V) == 16, "store16 writes 16-byte vectors");
  ::halfstep_emu::checked_store<V>(p, v, file, line);
}
template <class V>
inline V load8b(const void* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(sizeof(V) == 8, "load8b reads 8-byte vectors");
  return ::halfstep_emu::checked_load<V>(p, file, line);
}
template <class V>
inline void store8b(void* p, const V& v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(sizeof(V) == 8, "store8b writes 8-byte vectors");
  ::halfstep_emu::checked_store<V>(p, v, file, line);
}
#endif

}  // namespace halfstep::detail
