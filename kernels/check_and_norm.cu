// Pass 1 of the step: one read of every gradient of every tensor, in one launch. Each block owns
// one chunk and writes its partial: the exact Σg² of the finite values (kernels/exact_sum.hpp),
// the largest finite magnitude, and the counts of inf/NaN, subnormal and zero elements. Nothing
// is decided here; the reduce stage of finalize adds the partials.
//
// The loop classifies two 16-bit values per 32-bit operation: with the magnitude m = w & 0x7FFF
// and the exponent field e of each lane, adding a constant carries into the lane's bit 15 exactly
// when e is all ones (inf/NaN), m is not zero, or e is not zero; the three flags are summed as
// two 16-bit counters per word, and max.u16x2 keeps the larger finite magnitude per lane (the
// bit patterns of non-negative floats order as their values).
#include "device.cuh"

#include "cuda_check.hpp"
#include "exact_sum.hpp"
#include "gradient.cuh"
#include "launch.hpp"

namespace halfstep::detail {
namespace {

static_assert(kChunkElems / kPassThreads <= kMaxPerThread,
              "a thread's class sums are exact for at most kMaxPerThread squares");

__device__ inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }

// Adds x² to the one class sum the predicates pick: s0 when p0, else s1 when below1, else s2 —
// or to none when !in. x has at most 24 significant bits (an fp16 or bf16 value), so the low word
// of its fp64 form is zero and x² is exact: the device selects x's high word or zero once per
// class and issues the same three FMAs x·a + s for every element (no branch), each rounded once —
// which the class bounds make exact.
__device__ __forceinline__ void add_square(double x, bool p0, bool below1, bool in, double& s0,
                                           double& s1, double& s2) {
#if defined(__CUDA_ARCH__)
  const int hi = __double2hiint(x), lo = __double2loint(x);  // lo is zero
  const int h = in ? hi : 0;
  const int a0 = p0 ? h : 0;
  const int a2 = below1 ? 0 : h;
  const int a1 = h - a0 - a2;  // h in the class between, else zero
  s0 = fma(x, __hiloint2double(a0, lo), s0);
  s1 = fma(x, __hiloint2double(a1, lo), s1);
  s2 = fma(x, __hiloint2double(a2, lo), s2);
#else
  if (!in) return;
  const double sq = x * x;
  if (p0) {
    s0 += sq;
  } else if (below1) {
    s1 += sq;
  } else {
    s2 += sq;
  }
#endif
}

/// Adds a non-negative multiple of 2^-266 to limbs in shared memory (the bf16 squares outside the
/// window: rare, so an atomic per digit is fine). Not inlined: the loop keeps one call.
__device__ HALFSTEP_NOINLINE void deposit_shared(unsigned long long* limbs, double x) {
  const LimbDeposit d = limb_deposit(x);
  if (d.index < 0) return;
  limbs[kSumLimbs] = 1;  // a plain store: every writer writes the same value
  for (int i = 0; i < 3; ++i) {
    if (d.digit[i] != 0) atomicAdd(limbs + d.index + i, static_cast<unsigned long long>(d.digit[i]));
  }
}

template <DType kFormat>
struct Classes;

// fp16: three fixed classes cover every value (kernels/exact_sum.hpp).
template <>
struct Classes<DType::f16> {
  static constexpr int kShift1 = 26, kShift2 = 52;
  __device__ explicit Classes(int /*window_bottom*/) {}
  // `lane` holds a magnitude pattern in its low 16 bits (inf/NaN only lands in s2, and a thread
  // that saw one discards its sums).
  __device__ void add(unsigned lane, double& s0, double& s1, double& s2) const {
    const float x = __half2float(__ushort_as_half(static_cast<unsigned short>(lane)));
    add_square(static_cast<double>(x), x < 0x1p-1f, x < 0x1p12f, true, s0, s1, s2);
  }
  // Scale factors from class sums to integers in each class's unit.
  __device__ double inv_unit(int c) const { return c == 0 ? 0x1p48 : c == 1 ? 0x1p22 : 0x1p-4; }
};

// bf16: three classes of 16 exponents from the window's bottom; squares outside go to the limbs.
template <>
struct Classes<DType::bf16> {
  static constexpr int kShift1 = 32, kShift2 = 64;
  unsigned bottom;  // the window's bottom exponent field, in place in the high half of a word
  double inv0;
  __device__ explicit Classes(int window_bottom)
      : bottom(static_cast<unsigned>(window_bottom) << 23), inv0(::ldexp(1.0, 268 - 2 * window_bottom)) {}
  // `high` holds a magnitude pattern in its high 16 bits: the fp32 value itself. The main loop
  // assumes every nonzero value lies in the window (zero adds nothing wherever it goes); the
  // thread checks that assumption at the end from its smallest and largest value (in_window),
  // and a thread for which it failed adds its values again with add_checked.
  __device__ void add(unsigned high, double& s0, double& s1, double& s2) const {
    const unsigned key = high - bottom;
    add_square(static_cast<double>(__uint_as_float(high)), key < (16u << 23), key < (32u << 23), true,
               s0, s1, s2);
  }
  __device__ void add_checked(unsigned high, double& s0, double& s1, double& s2,
                              unsigned long long* spill) const {
    const double x = static_cast<double>(__uint_as_float(high));
    const unsigned key = high - bottom;  // wraps below the window
    const bool in = key < (48u << 23);
    add_square(x, key < (16u << 23), key < (32u << 23), in, s0, s1, s2);
    if (!in && high - 1u < 0x7F7FFFFFu) deposit_shared(spill, x * x);  // finite, not zero
  }
  // Whether the nonzero magnitude patterns in [min_m, max_m] all lie in the window.
  __device__ bool in_window(unsigned min_m, unsigned max_m) const {
    return (min_m << 16) >= bottom && (max_m << 16) - bottom < (48u << 23);
  }
  __device__ double inv_unit(int c) const {
    return c == 0 ? inv0 : c == 1 ? inv0 * 0x1p-32 : inv0 * 0x1p-64;
  }
};

// What one thread has measured so far. Counters hold two 16-bit lanes (a thread reads at most
// 128 elements, so neither lane can carry into the other). With m the magnitude of a lane,
// m + 0x0400 (fp16; 0x0080 bf16) reaches bit 15 exactly when the exponent is all ones (inf/NaN),
// m + 0x7FFF when m is not zero, m + 0x7C00 (0x7F80) when the exponent is not zero.
template <DType kFormat>
struct Measure {
  using F = Format16<kFormat>;
  static constexpr unsigned kPair = 0x00010001u;   // one in each lane
  static constexpr unsigned kTop = 0x80008000u;    // bit 15 of each lane
  double s0 = 0.0, s1 = 0.0, s2 = 0.0;
  unsigned nonfinite = 0, nonzero = 0, exp_nonzero = 0;
  unsigned max_pair = 0;           // per lane; includes inf/NaN patterns
  unsigned min_pair = 0xFFFFFFFFu;  // per lane, of m - 1 (zero: 0xFFFF); bf16 only

  // Adds the two values of `w` (a single value: the low lane, the high lane zero).
  __device__ void add_pair(unsigned w, const Classes<kFormat>& classes) {
    const unsigned mag = w & 0x7FFF7FFFu;
    const unsigned nz = mag + 0x7FFF7FFFu;  // lanes: 0x7FFF for zero, else 0x8000 + m - 1
    nonfinite += ((mag + F::kExpLsb * kPair) & kTop) >> 15;
    nonzero += (nz & kTop) >> 15;
    exp_nonzero += ((mag + F::kExpBits * kPair) & kTop) >> 15;
    max_pair = __vmaxu2(max_pair, mag);
    if (kFormat == DType::bf16) {
      min_pair = __vminu2(min_pair, nz ^ kTop);
      classes.add(mag << 16, s0, s1, s2);
      classes.add(mag & 0xFFFF0000u, s0, s1, s2);
    } else {
      classes.add(mag & 0xFFFFu, s0, s1, s2);
      classes.add(mag >> 16, s0, s1, s2);
    }
  }
};

// Calls f(pattern) for each 16-bit gradient thread `t` reads, in the main loop's order: a second
// read, for the rare thread that needs one (an inf/NaN, or a bf16 square outside the window).
template <class F>
__device__ void for_each_element(const std::uint16_t* grad, const ChunkDesc& chunk, bool vec, int t, F f) {
  int done = 0;
  if (vec) {
    const int n_vec = chunk.len / kVecElems;
    const auto* v = reinterpret_cast<const uint4*>(grad);
    for (int i = t; i < n_vec; i += kPassThreads) {
      const uint4 q = __ldg(v + i);
      const unsigned words[4] = {q.x, q.y, q.z, q.w};
      for (unsigned w : words) {
        f(w & 0xFFFFu);
        f(w >> 16);
      }
    }
    done = n_vec * kVecElems;
  }
  for (int i = done + t; i < chunk.len; i += kPassThreads) f(static_cast<unsigned>(__ldg(grad + i)));
}

template <DType kFormat>
__global__ void __launch_bounds__(kPassThreads) check_and_norm_kernel(const Pass1Args a) {
  const ChunkDesc chunk = a.chunks[blockIdx.x];
  const TensorDesc& tensor = a.tensors[chunk.tensor];
  const auto* grad = static_cast<const std::uint16_t*>(tensor.grad) + chunk.begin;
  const int window = kFormat == DType::bf16 ? bf16_window_bottom(*a.window_hint) : 0;
  const Classes<kFormat> classes(window);

  // bf16 squares outside the window; the last word says whether there were any.
  HALFSTEP_SHARED(unsigned long long[kSumLimbs + 1], spill);
  if (kFormat == DType::bf16) {
    for (int i = static_cast<int>(threadIdx.x); i <= kSumLimbs; i += kPassThreads) spill[i] = 0;
    __syncthreads();
  }

  Measure<kFormat> m;
  int done = 0;
  if (tensor.grad_vec) {  // 16-byte loads; the chunk start keeps the tensor's alignment
    const int n_vec = chunk.len / kVecElems;
    const auto* vec = reinterpret_cast<const uint4*>(grad);
    // kBatch loads are issued before any is used, so each thread keeps 64 bytes in flight.
    constexpr int kBatch = 4;
    for (int base = static_cast<int>(threadIdx.x); base < n_vec; base += kBatch * kPassThreads) {
      uint4 q[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kPassThreads;
        if (i < n_vec) q[u] = __ldg(vec + i);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (base + u * kPassThreads < n_vec) {
          m.add_pair(q[u].x, classes);
          m.add_pair(q[u].y, classes);
          m.add_pair(q[u].z, classes);
          m.add_pair(q[u].w, classes);
        }
      }
    }
    done = n_vec * kVecElems;
  }
  for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len; i += kPassThreads) {
    m.add_pair(__ldg(grad + i), classes);  // the low lane; the high lane is zero
  }

  // The thread's class sums as one integer in the lowest class's unit (each is an integer below
  // 2^53 in its own unit; the scalings are exact powers of two). A thread that met an inf or NaN
  // has no sum (the step will not be applied) and reads its elements again for the finite max.
  U128 n;
  unsigned thread_max = umax(m.max_pair & 0xFFFFu, m.max_pair >> 16);
  if (m.nonfinite == 0) {
    n.add_shifted(static_cast<std::uint64_t>(m.s0 * classes.inv_unit(0)), 0);
    n.add_shifted(static_cast<std::uint64_t>(m.s1 * classes.inv_unit(1)), Classes<kFormat>::kShift1);
    n.add_shifted(static_cast<std::uint64_t>(m.s2 * classes.inv_unit(2)), Classes<kFormat>::kShift2);
  } else {
    thread_max = 0;
    for_each_element(grad, chunk, tensor.grad_vec != 0, static_cast<int>(threadIdx.x), [&](unsigned bits) {
      const unsigned mag = bits & 0x7FFFu;
      if ((mag & Format16<kFormat>::kExpBits) != Format16<kFormat>::kExpBits) thread_max = umax(thread_max, mag);
    });
  }
  if constexpr (kFormat == DType::bf16) {
    const unsigned lo = m.min_pair & 0xFFFFu, hi = m.min_pair >> 16;
    const unsigned min_m = (lo < hi ? lo : hi) + 1u;  // 0x10000: no nonzero value
    if (m.nonfinite == 0 && min_m <= 0x7FFFu && !classes.in_window(min_m, thread_max)) {
      double s0 = 0.0, s1 = 0.0, s2 = 0.0;
      for_each_element(grad, chunk, tensor.grad_vec != 0, static_cast<int>(threadIdx.x), [&](unsigned bits) {
        classes.add_checked((bits & 0x7FFFu) << 16, s0, s1, s2, spill);
      });
      n = U128{};
      n.add_shifted(static_cast<std::uint64_t>(s0 * classes.inv_unit(0)), 0);
      n.add_shifted(static_cast<std::uint64_t>(s1 * classes.inv_unit(1)), Classes<kFormat>::kShift1);
      n.add_shifted(static_cast<std::uint64_t>(s2 * classes.inv_unit(2)), Classes<kFormat>::kShift2);
    }
  }

  // Block totals: every thread parks its values, one warp adds them (integers: any order gives
  // the same bits).
  HALFSTEP_SHARED(unsigned long long[kPassThreads], sum_lo);
  HALFSTEP_SHARED(unsigned long long[kPassThreads], sum_hi);
  HALFSTEP_SHARED(unsigned[kPassThreads], nf_scratch);
  HALFSTEP_SHARED(unsigned[kPassThreads], nz_scratch);
  HALFSTEP_SHARED(unsigned[kPassThreads], ez_scratch);
  HALFSTEP_SHARED(unsigned[kPassThreads], max_scratch);
  const int t = static_cast<int>(threadIdx.x);
  sum_lo[t] = n.lo;
  sum_hi[t] = n.hi;
  nf_scratch[t] = (m.nonfinite & 0xFFFFu) + (m.nonfinite >> 16);
  nz_scratch[t] = (m.nonzero & 0xFFFFu) + (m.nonzero >> 16);
  ez_scratch[t] = (m.exp_nonzero & 0xFFFFu) + (m.exp_nonzero >> 16);
  max_scratch[t] = thread_max;
  __syncthreads();
  if (t >= 32) return;
  U128 block;
  unsigned nonfinite = 0, nonzero = 0, exp_nonzero = 0, max_bits = 0;
  for (int i = t; i < kPassThreads; i += 32) {
    block.add(sum_lo[i], sum_hi[i]);
    nonfinite += nf_scratch[i];
    nonzero += nz_scratch[i];
    exp_nonzero += ez_scratch[i];
    max_bits = umax(max_bits, max_scratch[i]);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const std::uint64_t lo = __shfl_down_sync(0xffffffffu, static_cast<unsigned long long>(block.lo), offset);
    const std::uint64_t hi = __shfl_down_sync(0xffffffffu, static_cast<unsigned long long>(block.hi), offset);
    block.add(lo, hi);
    nonfinite += __shfl_down_sync(0xffffffffu, nonfinite, offset);
    nonzero += __shfl_down_sync(0xffffffffu, nonzero, offset);
    exp_nonzero += __shfl_down_sync(0xffffffffu, exp_nonzero, offset);
    max_bits = umax(max_bits, __shfl_down_sync(0xffffffffu, max_bits, offset));
  }
  if (t != 0) return;

  ChunkPartial p{};
  p.max_bits = max_bits;
  p.nonfinite = nonfinite;
  if (tensor.in_norm) {  // a tensor outside the norm adds only its inf/NaN count and its maximum
    place_digits(block, class_unit_offset(kFormat == DType::bf16, window) % 32, p.digit);
    p.subnormal = nonzero - exp_nonzero;
    p.zero = static_cast<unsigned>(chunk.len) - nonzero;
    if (kFormat == DType::bf16 && spill[kSumLimbs] != 0) {
      // Normalised on the way, so each global limb gains less than 2^32 per chunk.
      unsigned long long carry = 0;
      for (int i = 0; i < kSumLimbs; ++i) {
        const unsigned long long v = spill[i] + carry;
        const unsigned long long digit = i + 1 < kSumLimbs ? (v & 0xFFFFFFFFull) : v;
        carry = v >> 32;
        if (digit != 0) atomicAdd(a.spill + i, digit);
      }
    }
  }
  a.partials[blockIdx.x] = p;
}

}  // namespace

void launch_check_and_norm(DType grad_dtype, const Pass1Args& args, std::int64_t n_chunks,
                           cudaStream_t stream) {
  if (n_chunks == 0) return;  // only empty tensors: finalize sees no partials
  const dim3 grid(static_cast<unsigned>(n_chunks));
  if (grad_dtype == DType::bf16) {
    HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, check_and_norm_kernel<DType::bf16>)(args);
  } else {
    HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, check_and_norm_kernel<DType::f16>)(args);
  }
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace halfstep::detail
