// Pass 1 of the step: one read of every gradient of every tensor, in one launch. Each block owns
// one chunk and writes its partial: the exact Σg² of the finite values (kernels/exact_sum.hpp),
// the largest finite magnitude, and the counts of inf/NaN, subnormal and zero elements. Nothing
// is decided here; the reduce stage of finalize adds the partials.
//
// The main loop is written for instruction issue, which bounds pass 1 on an H200 (docs/design.md,
// "Pass 1's instruction budget"):
// - 16-bit gradients go two to a 32-bit word: their magnitudes m = w & 0x7FFF7FFF, the largest per
//   lane (max.u16x2: the patterns of non-negative floats order as their values), and two counts per
//   lane in 8-bit slots of one word (adding a constant carries into a lane's bit 15 exactly when m
//   is not zero, or when m is at least the smallest normal);
// - inf and NaN are not counted in the loop: a thread's largest pattern says whether it read one
//   (their patterns lie above every finite one), and only such a thread reads its elements again to
//   count them and find its largest finite magnitude;
// - each square is split into parts that fp64 sums exactly (exact_sum.hpp), with no branch and no
//   select. bf16 and fp32 threads also track their smallest nonzero magnitude: a thread that read a
//   value outside the window adds its squares again, on the slower exact path.
#include "device.cuh"

#include "cuda_check.hpp"
#include "exact_sum.hpp"
#include "gradient.cuh"
#include "launch.hpp"

namespace halfstep::detail {
namespace {

// A thread reads at most kMaxPerThread gradients of a chunk. Element by element, thread t takes
// elements t, t + kPassThreads, ...; with 16-byte loads it takes vectors t, t + kPassThreads, ...
// (at most kChunkElems / kPassThreads elements) and the last thread also the few elements after
// the last vector: there are such elements only in a chunk shorter than kChunkElems, where the
// last thread holds at least one vector fewer than the most, more than the elements it adds.
static_assert(kChunkElems / kPassThreads == kMaxPerThread, "a thread's part sums are exact for kMaxPerThread squares");

__device__ inline unsigned umax(unsigned a, unsigned b) { return a > b ? a : b; }
__device__ inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }

/// Adds a non-negative multiple of 2^-298 to limbs in shared memory (squares outside the window:
/// rare, so an atomic per digit is fine). Not inlined: the loop keeps one call.
__device__ HALFSTEP_NOINLINE void deposit_shared(unsigned long long* limbs, double x) {
  const LimbDeposit d = limb_deposit(x);
  if (d.index < 0) return;
  limbs[kSumLimbs] = 1;  // a plain store: every writer writes the same value
  for (int i = 0; i < 3; ++i) {
    if (d.digit[i] != 0) atomicAdd(limbs + d.index + i, static_cast<unsigned long long>(d.digit[i]));
  }
}

// The gradient formats: what a 32-bit word holds, and its values in fp64 (exact).
template <DType kFormat>
struct Grad;

template <>
struct Grad<DType::f16> {
  static constexpr int kPerWord = 2;           // values per 32-bit word
  static constexpr int kParts = 2;             // parts of each square (exact_sum.hpp)
  static constexpr bool kWindowed = false;     // every finite value is in the split's window
  static constexpr unsigned kMag = format_bits(DType::f16).magnitude();        // everything but the sign
  static constexpr unsigned kInf = format_bits(DType::f16).infinity();         // NaN's lie above it
  static constexpr unsigned kNormal = format_bits(DType::f16).exponent_lsb;   // the smallest normal's pattern
  __device__ static void to_f64(unsigned mag, double (&x)[2]) {
#if defined(__CUDA_ARCH__)
    asm("{\n\t.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f64.f16 %0, lo;\n\tcvt.f64.f16 %1, hi;\n\t}"
        : "=d"(x[0]), "=d"(x[1])
        : "r"(mag));
#else
    x[0] = static_cast<double>(Format16<DType::f16>::to_float(static_cast<std::uint16_t>(mag & 0xFFFFu)));
    x[1] = static_cast<double>(Format16<DType::f16>::to_float(static_cast<std::uint16_t>(mag >> 16)));
#endif
  }
};

template <>
struct Grad<DType::bf16> {
  static constexpr int kPerWord = 2;
  static constexpr int kParts = 2;
  static constexpr bool kWindowed = true;
  static constexpr unsigned kMag = format_bits(DType::bf16).magnitude();
  static constexpr unsigned kInf = format_bits(DType::bf16).infinity();
  static constexpr unsigned kNormal = format_bits(DType::bf16).exponent_lsb;
  __device__ static void to_f64(unsigned mag, double (&x)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f64.bf16 %0, lo;\n\tcvt.f64.bf16 %1, hi;\n\t}"
        : "=d"(x[0]), "=d"(x[1])
        : "r"(mag));
#else  // the fp32 value's bits are the bf16 pattern's, shifted (sm_80 has no cvt.f64.bf16)
    x[0] = static_cast<double>(__uint_as_float(mag << 16));
    x[1] = static_cast<double>(__uint_as_float(mag & 0xFFFF0000u));
#endif
  }
};

template <>
struct Grad<DType::f32> {
  static constexpr int kPerWord = 1;
  static constexpr int kParts = 3;
  static constexpr bool kWindowed = true;
  static constexpr unsigned kMag = format_bits(DType::f32).magnitude();
  static constexpr unsigned kInf = format_bits(DType::f32).infinity();
  __device__ static void to_f64(unsigned mag, double (&x)[1]) { x[0] = static_cast<double>(__uint_as_float(mag)); }
};

// The value of one magnitude pattern of the format, exactly.
template <DType kFormat>
__device__ inline double value_of(unsigned mag) {
  double x[Grad<kFormat>::kPerWord];
  Grad<kFormat>::to_f64(mag, x);  // a 16-bit pattern in the low lane
  return x[0];
}

// Gradient elements per 16-byte vector.
template <DType kFormat>
inline constexpr int kPerVec = kFormat == DType::f32 ? 4 : 8;

// What one thread has measured so far, 16-bit formats: two values per word, a lane each.
template <DType kFormat>
struct Measure {
  using G = Grad<kFormat>;
  static constexpr unsigned kPair = 0x00010001u;   // one in each lane
  static constexpr unsigned kTop = 0x80008000u;    // bit 15 of each lane
  double sum[2][G::kParts] = {};   // a set of part sums per lane: two independent chains
  unsigned max_pair = 0;           // per lane; includes inf/NaN patterns
  unsigned min_pair = 0xFFFFFFFFu; // per lane, of m - 1 (zero: 0xFFFF); windowed formats only
  unsigned counts = 0;             // 8-bit slots: lane 0 nonzero, lane 0 normal, lane 1 ..., 1 ...

  __device__ explicit Measure(unsigned /*normal_bits*/) {}

  // Adds the two values of `w` (a single value: the low lane, the high lane zero).
  __device__ void add_word(unsigned w, const SquareSplit& split) {
    const unsigned mag = w & (G::kMag * kPair);
    max_pair = __vmaxu2(max_pair, mag);
    const unsigned nz = mag + G::kMag * kPair;              // lanes: bit 15 set unless m is zero
    const unsigned normal = mag + (0x8000u - G::kNormal) * kPair;  // bit 15 set from the smallest normal
    if (G::kWindowed) min_pair = __vminu2(min_pair, nz ^ kTop);   // m - 1; zero wraps to 0xFFFF
    counts += ((normal & kTop) | ((nz >> 8) & (kTop >> 8))) >> 7;
    double x[2];
    G::to_f64(mag, x);
    add_square<G::kParts>(split, x[0], sum[0]);
    add_square<G::kParts>(split, x[1], sum[1]);
  }
  __device__ unsigned largest() const { return umax(max_pair & 0xFFFFu, max_pair >> 16); }
  // The smallest nonzero magnitude, or 0x10000 if every value was zero.
  __device__ unsigned smallest_nonzero() const { return umin(min_pair & 0xFFFFu, min_pair >> 16) + 1u; }
  __device__ unsigned nonzero() const { return (counts & 0xFFu) + ((counts >> 16) & 0xFFu); }
  __device__ unsigned normal() const { return ((counts >> 8) & 0xFFu) + (counts >> 24); }
  __device__ double part(int k) const { return sum[0][k] + sum[1][k]; }  // exact: integers in range
};

// fp32 gradients: one value per word.
template <>
struct Measure<DType::f32> {
  using G = Grad<DType::f32>;
  double sum[G::kParts] = {};
  unsigned max_mag = 0;            // includes inf/NaN patterns
  unsigned min_less1 = 0xFFFFFFFFu;  // of m - 1 (zero: 0xFFFFFFFF)
  unsigned zero = 0, below = 0;    // zeros; values below the compute format's smallest normal
  unsigned normal_bits;

  __device__ explicit Measure(unsigned normal_bits_) : normal_bits(normal_bits_) {}

  __device__ void add_word(unsigned w, const SquareSplit& split) {
    const unsigned mag = w & G::kMag;
    max_mag = umax(max_mag, mag);
    const unsigned less1 = mag - 1u;   // bit 31 set exactly when m is zero
    min_less1 = umin(min_less1, less1);
    zero += less1 >> 31;
    below += (mag - normal_bits) >> 31;  // m < normal_bits (both below 2^31)
    double x[1];
    G::to_f64(mag, x);
    add_square<G::kParts>(split, x[0], sum);
  }
  __device__ unsigned largest() const { return max_mag; }
  // The smallest nonzero magnitude, or 2^32 (here 0) if every value was zero.
  __device__ unsigned smallest_nonzero() const { return min_less1 + 1u; }
  __device__ double part(int k) const { return sum[k]; }
};

// A 32-bit word of gradients at `grad` (16-bit formats: one value, in the low lane).
template <DType kFormat>
__device__ inline unsigned scalar_word(const void* grad, int i) {
  if constexpr (kFormat == DType::f32) {
    return __ldg(static_cast<const unsigned*>(grad) + i);
  } else {
    return __ldg(static_cast<const std::uint16_t*>(grad) + i);
  }
}

// Calls f(word) for the words thread `t` reads, in the main loop's order (the 16-bit words of the
// scalar tail hold one value): a second read, for the rare thread that needs one (an inf/NaN, or
// a value outside the window).
template <DType kFormat, class F>
__device__ void for_each_word(const void* grad, const ChunkDesc& chunk, bool vec, int t, F f) {
  if (vec) {
    const int n_vec = chunk.len / kPerVec<kFormat>;
    const auto* v = static_cast<const uint4*>(grad);
    for (int i = t; i < n_vec; i += kPassThreads) {
      const uint4 q = __ldg(v + i);
      f(q.x);
      f(q.y);
      f(q.z);
      f(q.w);
    }
    if (t == kPassThreads - 1) {
      for (int i = n_vec * kPerVec<kFormat>; i < chunk.len; ++i) f(scalar_word<kFormat>(grad, i));
    }
    return;
  }
  for (int i = t; i < chunk.len; i += kPassThreads) f(scalar_word<kFormat>(grad, i));
}

template <DType kFormat>
__global__ void __launch_bounds__(kPassThreads) check_and_norm_kernel(const Pass1Args a) {
  using G = Grad<kFormat>;
  constexpr int kParts = G::kParts;
  const ChunkDesc chunk = a.chunks[blockIdx.x];
  const TensorDesc& tensor = a.tensors[chunk.tensor];
  if (tensor.grad == nullptr) {  // no gradient for this tensor in this step: nothing measured
    if (threadIdx.x == 0) a.partials[blockIdx.x] = ChunkPartial{};
    return;
  }
  const void* grad = static_cast<const unsigned char*>(tensor.grad) + chunk.begin * (kFormat == DType::f32 ? 4 : 2);
  const SquareSplit split = square_split(kFormat, *a.window_hint);
  const int t = static_cast<int>(threadIdx.x);

  // Squares outside the window; the last word says whether there were any.
  HALFSTEP_SHARED(unsigned long long[kSumLimbs + 1], spill);
  if (G::kWindowed) {
    for (int i = t; i <= kSumLimbs; i += kPassThreads) spill[i] = 0;
    __syncthreads();
  }

  Measure<kFormat> m(a.normal_bits);
  if (tensor.grad_vec) {  // 16-byte loads; the chunk start keeps the tensor's alignment
    const int n_vec = chunk.len / kPerVec<kFormat>;
    const auto* vec = static_cast<const uint4*>(grad);
    // kBatch loads are issued before any is used, so each thread keeps 64 bytes in flight.
    constexpr int kBatch = 4;
    for (int base = t; base < n_vec; base += kBatch * kPassThreads) {
      uint4 q[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int i = base + u * kPassThreads;
        if (i < n_vec) q[u] = __ldg(vec + i);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (base + u * kPassThreads < n_vec) {
          m.add_word(q[u].x, split);
          m.add_word(q[u].y, split);
          m.add_word(q[u].z, split);
          m.add_word(q[u].w, split);
        }
      }
    }
    if (t == kPassThreads - 1) {
      for (int i = n_vec * kPerVec<kFormat>; i < chunk.len; ++i) m.add_word(scalar_word<kFormat>(grad, i), split);
    }
  } else {
    for (int i = t; i < chunk.len; i += kPassThreads) m.add_word(scalar_word<kFormat>(grad, i), split);
  }

  // The thread's part sums as integers in their units (each an integer below 2^53 in its unit;
  // the scalings are exact powers of two). A thread that met an inf or NaN has no sum (the step
  // will not be applied) and reads its elements again for the count and its finite max.
  std::int64_t part[3] = {0, 0, 0};
  unsigned thread_max = m.largest();
  unsigned nonfinite = 0;
  // Each 16-bit word of the scalar tail holds one value: its high lane is no element, a zero that
  // counts neither as nonzero nor as normal, and adds nothing.
  auto for_each_value = [&](auto f) {
    for_each_word<kFormat>(grad, chunk, tensor.grad_vec != 0, t, [&](unsigned w) {
      if constexpr (G::kPerWord == 2) {
        f(w & G::kMag);
        f((w >> 16) & G::kMag);
      } else {
        f(w & G::kMag);
      }
    });
  };
  if (thread_max < G::kInf) {
    const unsigned low = m.smallest_nonzero();
    const bool all_zero = G::kPerWord == 2 ? low > 0xFFFFu : low == 0;
    if (!G::kWindowed || all_zero || (low >= split.low && thread_max < split.high)) {
      for (int k = 0; k < kParts; ++k) {
        part[k] = static_cast<std::int64_t>(m.part(k) * ::ldexp(1.0, -split.unit_log2[k]));
      }
    } else {
      // Squares in the window into part sums, the others into the block's limbs.
      double sum[kParts] = {};
      for_each_value([&](unsigned mag) {
        if (mag == 0) return;
        const double x = value_of<kFormat>(mag);
        if (mag >= split.low && mag < split.high) {
          add_square<kParts>(split, x, sum);
        } else {
          deposit_shared(spill, x * x);  // exact: at most 48 significant bits
        }
      });
      for (int k = 0; k < kParts; ++k) part[k] = static_cast<std::int64_t>(sum[k] * ::ldexp(1.0, -split.unit_log2[k]));
    }
  } else {
    thread_max = 0;
    for_each_value([&](unsigned mag) {
      if (mag >= G::kInf) {
        ++nonfinite;
      } else {
        thread_max = umax(thread_max, mag);
      }
    });
  }
  // The two counts pass 1 keeps: 16-bit, nonzero values and normal ones (inf and NaN are both);
  // f32, zeros and values below the compute format's smallest normal (zeros included).
  unsigned count0, count1;
  if constexpr (kFormat == DType::f32) {
    count0 = m.zero;
    count1 = m.below;
  } else {
    count0 = m.nonzero();
    count1 = m.normal();
  }

  // Block totals: every thread parks its values, one warp adds them (integers: any order gives
  // the same bits).
  HALFSTEP_SHARED(long long[kParts][kPassThreads], part_scratch);
  HALFSTEP_SHARED(unsigned[kPassThreads], nf_scratch);
  HALFSTEP_SHARED(unsigned[kPassThreads], nz_scratch);
  HALFSTEP_SHARED(unsigned[kPassThreads], nm_scratch);
  HALFSTEP_SHARED(unsigned[kPassThreads], max_scratch);
  for (int k = 0; k < kParts; ++k) part_scratch[k][t] = part[k];
  nf_scratch[t] = nonfinite;
  nz_scratch[t] = count0;
  nm_scratch[t] = count1;
  max_scratch[t] = thread_max;
  __syncthreads();
  if (t >= 32) return;
  long long block[kParts] = {};
  unsigned nf = 0, nz = 0, nm = 0, max_bits = 0;
  for (int i = t; i < kPassThreads; i += 32) {
    for (int k = 0; k < kParts; ++k) block[k] += part_scratch[k][i];
    nf += nf_scratch[i];
    nz += nz_scratch[i];
    nm += nm_scratch[i];
    max_bits = umax(max_bits, max_scratch[i]);
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    for (int k = 0; k < kParts; ++k) block[k] += __shfl_down_sync(0xffffffffu, block[k], offset);
    nf += __shfl_down_sync(0xffffffffu, nf, offset);
    nz += __shfl_down_sync(0xffffffffu, nz, offset);
    nm += __shfl_down_sync(0xffffffffu, nm, offset);
    max_bits = umax(max_bits, __shfl_down_sync(0xffffffffu, max_bits, offset));
  }
  if (t != 0) return;

  ChunkPartial p{};
  p.max_bits = max_bits;
  p.nonfinite = nf;
  if (tensor.in_norm) {  // a tensor outside the norm adds only its inf/NaN count and its maximum
    std::int64_t parts[3] = {0, 0, 0};
    for (int k = 0; k < kParts; ++k) parts[k] = block[k];
    place_parts(split, parts, p.digit);
    if constexpr (kFormat == DType::f32) {  // nz: zeros, nm: values below the smallest normal
      p.subnormal = nm - nz;
      p.zero = nz;
    } else {  // nz: nonzero values, nm: normal ones
      p.subnormal = nz - nm;
      p.zero = static_cast<unsigned>(chunk.len) - nz;
    }
    if (G::kWindowed && spill[kSumLimbs] != 0) {
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
  switch (grad_dtype) {
    case DType::bf16:
      HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, check_and_norm_kernel<DType::bf16>)(args);
      break;
    case DType::f32:
      HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, check_and_norm_kernel<DType::f32>)(args);
      break;
    default:
      HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, check_and_norm_kernel<DType::f16>)(args);
      break;
  }
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace halfstep::detail
