// Internal: the host backend's two passes over one chunk of the tensor table, the kernels' own
// per-element arithmetic (kernels/pass2_element.hpp, block8.hpp, exact_sum.hpp) on the CPU.
// src/host_passes.cpp is compiled once for the baseline instruction set and, on x86-64, twice more:
// for AVX2 with FMA and F16C, and for AVX-512 (F, BW, DQ, VL); the host backend picks one at run
// time (host_passes()). Every
// variant computes the same bits: the arithmetic is IEEE operations written out, with no
// contraction, and the conversions are exact or rounded to nearest by definition.
#pragma once

#include <cstdint>
#include <vector>

#include "block8.hpp"
#include "exact_sum.hpp"
#include "step_types.hpp"

namespace halfstep::detail {

/// What pass 1 measured on one chunk (as the kernel's ChunkPartial) and the squares outside the
/// window, which the chunk adds to `spill` (normalised: each limb gains less than 2^32).
struct HostPass1 {
  DType grad_dtype;
  SquareSplit split;
  std::uint32_t normal_bits;  // f32 gradients: the compute format's smallest normal, as an f32 pattern
};

/// Pass 2's arguments besides the chunk.
struct HostPass2 {
  DType grad_dtype, model_dtype;
  StateFormat state;
  Decision decision;
  const GroupConsts* consts;  // per group
  const Codec8* exp_avg_codec;     // block8: the signed map's
  const Codec8* exp_avg_sq_codec;  // and the unsigned map's
};

/// One instruction set's passes.
struct HostPasses {
  const char* isa;  // "baseline", "avx2" or "avx512"
  /// Pass 1 on `chunk` of `tensor`: writes `out`, adds the chunk's out-of-window squares to
  /// `spill` (sets `spilled`).
  void (*measure)(const HostPass1& args, const TensorDesc& tensor, const ChunkDesc& chunk, ChunkPartial& out,
                  std::uint64_t (&spill)[kSumLimbs], bool& spilled);
  /// Pass 2 on `chunk` of `tensor` (the decision applies): returns the elements held.
  std::uint64_t (*apply)(const HostPass2& args, const TensorDesc& tensor, const ChunkDesc& chunk);
};

/// The variants compiled into the library that this CPU can run, the baseline first, then AVX2
/// (with FMA and F16C), then AVX-512 (F, BW, DQ and VL besides).
std::vector<const HostPasses*> host_passes_runnable();

/// The variant this CPU runs: the last of host_passes_runnable(), unless HALFSTEP_HOST_ISA names
/// another of them ("baseline", "avx2", "avx512"; for tests and measurements; a name this CPU does
/// not run is said on stderr, once, and the widest runs).
const HostPasses& host_passes();

}  // namespace halfstep::detail
