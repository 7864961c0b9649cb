// The host backend's passes: pass 1 (the inf/NaN check, the exact Σg², the largest magnitude and
// the subnormal and zero counts) and pass 2 (unscale, clip, AdamW in every state format, the
// model copy) over one chunk, with the kernels' own per-element arithmetic.
//
// Written for the compiler's vectoriser: each pass is a plain loop over a chunk's elements that
// converts, computes and stores with selects, no branch (a rare held element is stored by a
// second, scalar loop), so GCC turns it into 8-wide AVX2 or 16-wide AVX-512 code; the CTest
// host_passes_are_vectorised checks the generated code. The file is compiled once for the
// baseline instruction set; the AVX2 and AVX-512 variants are the same templates instantiated
// inside functions marked target("avx2,fma,f16c") or target("avx512f,...") and flatten, so
// everything they call is compiled into them for that instruction set, and nothing compiled for a
// wider one is ever shared with code that runs without it. Every variant computes the same bits: IEEE operations as written (no contraction, fmaf where
// the kernels fuse), exact conversions, and integer sums.
#include "host_passes.hpp"

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 intrinsics start from a deliberately undefined vector (`__m512i __Y = __Y;`),
// which -Wmaybe-uninitialized reports wherever they inline; the warning is off for the header's
// own lines only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define HALFSTEP_HOST_X86 1
#else
#define HALFSTEP_HOST_X86 0
#endif

#include "pass2_element.hpp"
#include "step_math.hpp"

namespace halfstep::detail {
namespace {

// -- conversions (state_codec.hpp: f16_value, f16_nearest, bf16) ------------------------------------

/// A gradient in fp32 (exact for every format).
template <DType kGrad>
inline float grad_value(const void* grad, std::int64_t i) {
  if constexpr (kGrad == DType::f32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (kGrad == DType::bf16) {
    return bf16_value(static_cast<const std::uint16_t*>(grad)[i]);
  } else {
    return f16_value(static_cast<const std::uint16_t*>(grad)[i]);
  }
}

// -- pass 1 ------------------------------------------------------------------------------------

/// The value of a finite magnitude pattern of the gradient format in fp64, exactly.
template <DType kGrad>
inline double magnitude_double(std::uint32_t mag) {
  if constexpr (kGrad == DType::f32) {
    return static_cast<double>(float_of(mag));
  } else if constexpr (kGrad == DType::bf16) {
    return static_cast<double>(float_of(mag << 16));
  } else {
    return static_cast<double>(f16_value(static_cast<std::uint16_t>(mag)));
  }
}

template <DType kGrad>
struct Pass1Format {
  static constexpr int kParts = kGrad == DType::f32 ? 3 : 2;
  static constexpr std::uint32_t kMag = format_bits(kGrad).magnitude();
  static constexpr std::uint32_t kInf = format_bits(kGrad).infinity();
  static constexpr bool kWindowed = kGrad != DType::f16;
  static constexpr int kMagBits = kGrad == DType::f32 ? 31 : 15;  // kMag is 2^kMagBits - 1
};

/// Adds v (an integer multiple of 2^-298, >= 0) to limbs exactly.
inline void deposit(std::uint64_t (&limbs)[kSumLimbs], double v) {
  const LimbDeposit d = limb_deposit(v);
  if (d.index < 0) return;
  for (int k = 0; k < 3 && d.index + k < kSumLimbs; ++k) limbs[d.index + k] += d.digit[k];
}

/// The integer y / 2^unit of a double y that is an integer multiple of 2^unit below 2^(unit + 51)
/// in magnitude: y + 1.5·2^(unit + 52) lies in a binade whose ulp is 2^unit, so the addition is
/// exact and the sum's bits less the constant's are the integer (two's complement below zero).
inline std::int64_t count_of(double y, double magic) {
  return static_cast<std::int64_t>(double_bits(y + magic) - double_bits(magic));
}

/// What pass 1's loops measure on a chunk: the counts, the largest pattern (inf and NaN included)
/// and the squares' parts of the window's values, each an integer in its unit.
struct Measured {
  std::uint32_t max_all = 0, nonfinite = 0, nonzero = 0, subnormal = 0, outside = 0;
  std::int64_t sum[3] = {0, 0, 0};
  int parts = 0;                  ///< 0: the split's parts; else the sums' units are unit_log2
  int unit_log2[2] = {0, 0};
};

/// How far ahead of its loads pass 1 asks for the gradients (bytes). Pass 1 reads one stream with
/// little arithmetic per line, and the hardware's prefetch alone left it waiting on memory: on a
/// Xeon server core, 10^7 fp32 gradients took 21 ms (2 GB/s) without and 5.6 ms with it, where
/// they fit in the caches as fast as without. (Pass 2 reads four or five streams and keeps pace
/// without: asked for ahead, it got slower.)
inline constexpr int kPass1Prefetch = 4096;

/// Pass 1's loops over `n` gradient words, portable: two loops over the chunk (the second reads
/// it from cache), each of one kind of reduction, so that the compiler vectorises both: the counts
/// and the largest pattern, then the squares' parts, each converted to its integer count.
template <DType kGrad, class Word>
inline Measured measure_portable(const Word* words, int n, const SquareSplit& split, std::uint32_t normal) {
  using P = Pass1Format<kGrad>;
  constexpr int kParts = P::kParts;
  const std::uint32_t low = split.low, high = split.high;
  const double m0 = split.magic[0], m1 = split.magic[1];
  double magic[3] = {0.0, 0.0, 0.0};
  for (int k = 0; k < kParts; ++k) magic[k] = ::ldexp(1.5, split.unit_log2[k] + 52);
  const double c0 = magic[0], c1 = magic[1], c2 = magic[2];
  std::int64_t s0 = 0, s1 = 0, s2 = 0;
  std::uint32_t max_all = 0, nonfinite = 0, nonzero = 0, subnormal = 0, outside = 0;
  // (the first loop over blocks of kBlock words, each block asking first for the lines
  // kPass1Prefetch bytes ahead; the inner loop is what the compiler vectorises)
  constexpr int kBlock = 512;
  for (int i0 = 0; i0 < n; i0 += kBlock) {
    for (int b = 0; b < kBlock * static_cast<int>(sizeof(Word)); b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(words + i0) + kPass1Prefetch + b, 0, 3);
    }
    const int i1 = n - i0 < kBlock ? n : i0 + kBlock;
    for (int i = i0; i < i1; ++i) {
      const std::uint32_t mag = static_cast<std::uint32_t>(words[i]) & P::kMag;
      nonfinite += mag >= P::kInf ? 1u : 0u;
      max_all = mag > max_all ? mag : max_all;  // inf and NaN lie above every finite pattern
      nonzero += (mag + P::kMag) >> P::kMagBits;  // 1 unless mag is 0 (as arithmetic, which vectorises here)
      subnormal += mag - 1u < normal - 1u ? 1u : 0u;  // 0 < mag < normal: zero wraps past it
      if constexpr (P::kWindowed) outside += mag - 1u < low - 1u || (mag >= high && mag < P::kInf) ? 1u : 0u;
    }
  }
  for (int i = 0; i < n; ++i) {
    const std::uint32_t mag = static_cast<std::uint32_t>(words[i]) & P::kMag;
    // fp16: every finite value is in the window; zero adds nothing
    const bool summed = P::kWindowed ? mag >= low && mag < high : mag < P::kInf;
    const double x = summed ? magnitude_double<kGrad>(mag) : 0.0;
    const double hi = ::fma(x, x, m0) - m0;  // x² rounded to a multiple of the first split point
    const double rest = ::fma(x, x, -hi);    // x² - hi, exactly
    s0 += count_of(hi, c0);
    if constexpr (kParts == 2) {
      s1 += count_of(rest, c1);
    } else {
      const double mid = (rest + m1) - m1;  // rest rounded to a multiple of the second split point
      s1 += count_of(mid, c1);
      s2 += count_of(rest - mid, c2);
    }
  }
  Measured r;
  r.max_all = max_all;
  r.nonfinite = nonfinite;
  r.nonzero = nonzero;
  r.subnormal = subnormal;
  r.outside = outside;
  r.sum[0] = s0;
  r.sum[1] = s1;
  r.sum[2] = s2;
  return r;
}

// The block step's table reads, element by element: the baseline's, and the vector variants'
// last few elements.
void decode8_scalar(const float* map, const std::uint8_t* codes, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = map[codes[i]];
}
void gather64_scalar(const void* table, const std::int32_t* index, int n, std::uint64_t* out) {
  for (int i = 0; i < n; ++i) std::memcpy(&out[i], static_cast<const unsigned char*>(table) + 8 * index[i], 8);
}

/// A gradient buffer's element i.
template <DType kGrad>
inline const void* grad_at(const void* grad, std::int64_t i) {
  return static_cast<const unsigned char*>(grad) + i * static_cast<std::int64_t>(element_size(kGrad));
}

/// Whether pass 2 of the format F has a tile loop of intrinsics per instruction set
/// (host_apply_simd.inc): fp32 or bf16 moments, an fp32 master or none (bf16 weights); and F's
/// model copy format.
template <class F>
struct TileFormat : std::false_type {};
template <DType kCopy, MasterFormat kMaster, MomentFormat kM, MomentFormat kV>
struct TileFormat<Formats<kCopy, kMaster, kM, kV>>
    : std::integral_constant<bool, (kMaster == MasterFormat::f32 || kMaster == MasterFormat::none) &&
                                       kM != MomentFormat::block8 && kV != MomentFormat::block8> {
  static constexpr DType kModel = kCopy;
};

/// One tile of pass 2 for a tile loop: its buffers from its first element, its old values' and
/// model copies' temporaries, and its draw's tensor key and first element's index in the whole
/// tensor.
template <class F>
struct TileArgs {
  using PS = typename F::Master::Stored;
  using MS = typename F::M::Stored;
  using VS = typename F::V::Stored;
  const void* grad;
  PS* master;
  MS* exp_avg;
  VS* exp_avg_sq;
  std::uint16_t* model;
  PS* ps_old;
  MS* m_old;
  VS* v_old;
  std::uint16_t* w_old;
  std::uint16_t* w_out;
  std::uint64_t key;
  std::int64_t first;
  /// Whether the indices of the tile's n elements share their upper 32 bits.
  bool draws_in_one_half(int n) const {
    return static_cast<std::uint64_t>(first) >> 32 == static_cast<std::uint64_t>(first + n - 1) >> 32;
  }
};

#if HALFSTEP_HOST_X86
// Pass 1's vector loop is written once (host_measure_simd.inc) over a small set of vector
// operations and compiled twice, each time inside a `#pragma GCC target` region with that set's
// operations, so that the loop and everything it calls are compiled for one instruction set, even
// where nothing is inlined (at -O0, `flatten` does nothing): no vector ever passes between code
// compiled for two instruction sets, whose calling conventions for vectors differ.
//
// The vector operations pass 1's intrinsics loop uses, for AVX2 (8 lanes of 32 bits, comparisons
// as lanes of all ones) and AVX-512 (16 lanes, comparisons as mask registers).
#define HALFSTEP_SIMD_OP __attribute__((always_inline)) static inline

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
struct Avx2Ops {
  static constexpr int kLanes = 8;
  using I = __m256i;
  using D = __m256d;
  using Mask = __m256i;
  HALFSTEP_SIMD_OP I load32(const std::uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  HALFSTEP_SIMD_OP I load16(const std::uint16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  HALFSTEP_SIMD_OP I set1(std::uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
  HALFSTEP_SIMD_OP I zero() { return _mm256_setzero_si256(); }
  HALFSTEP_SIMD_OP I bit_and(I a, I b) { return _mm256_and_si256(a, b); }
  HALFSTEP_SIMD_OP I shl16(I a) { return _mm256_slli_epi32(a, 16); }
  HALFSTEP_SIMD_OP I max_u(I a, I b) { return _mm256_max_epu32(a, b); }
  // (signed compares: every pattern the loop compares lies below 2^31)
  HALFSTEP_SIMD_OP Mask equal(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  HALFSTEP_SIMD_OP Mask greater(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  HALFSTEP_SIMD_OP Mask both(Mask a, Mask b) { return _mm256_and_si256(a, b); }
  HALFSTEP_SIMD_OP I count(I counts, Mask m) { return _mm256_sub_epi32(counts, m); }  // +1 where m holds
  HALFSTEP_SIMD_OP I keep(Mask m, I a) { return _mm256_and_si256(a, m); }             // a where m holds, else 0
  /// The lanes' 32-bit patterns as floats, widened to doubles: lanes [0, 4) and [4, 8).
  HALFSTEP_SIMD_OP D low_half(I a) { return _mm256_cvtps_pd(_mm256_castps256_ps128(_mm256_castsi256_ps(a))); }
  HALFSTEP_SIMD_OP D high_half(I a) { return _mm256_cvtps_pd(_mm256_extractf128_ps(_mm256_castsi256_ps(a), 1)); }
  HALFSTEP_SIMD_OP D dzero() { return _mm256_setzero_pd(); }
  HALFSTEP_SIMD_OP D dset1(double v) { return _mm256_set1_pd(v); }
  HALFSTEP_SIMD_OP D add(D a, D b) { return _mm256_add_pd(a, b); }
  HALFSTEP_SIMD_OP D sub(D a, D b) { return _mm256_sub_pd(a, b); }
  HALFSTEP_SIMD_OP D fmadd(D a, D b, D c) { return _mm256_fmadd_pd(a, b, c); }
  HALFSTEP_SIMD_OP D fmsub(D a, D b, D c) { return _mm256_fmsub_pd(a, b, c); }
  HALFSTEP_SIMD_OP void store(std::uint32_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a); }
  HALFSTEP_SIMD_OP void dstore(double* p, D a) { _mm256_storeu_pd(p, a); }
  HALFSTEP_SIMD_OP I min_u(I a, I b) { return _mm256_min_epu32(a, b); }
  HALFSTEP_SIMD_OP I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  /// The bits of the lanes' doubles as 64-bit integers, and 64-bit integer lanes.
  HALFSTEP_SIMD_OP I dbits(D a) { return _mm256_castpd_si256(a); }
  HALFSTEP_SIMD_OP I add64(I a, I b) { return _mm256_add_epi64(a, b); }
  HALFSTEP_SIMD_OP I sub64(I a, I b) { return _mm256_sub_epi64(a, b); }
  HALFSTEP_SIMD_OP void store64(std::int64_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a); }
  // Pass 2's tile loop (host_apply_simd.inc): fp32 lanes, and the gradient and model formats.
  using F = __m256;
  HALFSTEP_SIMD_OP F fload(const float* p) { return _mm256_loadu_ps(p); }
  HALFSTEP_SIMD_OP void fstore(float* p, F a) { _mm256_storeu_ps(p, a); }
  HALFSTEP_SIMD_OP F fset1(float v) { return _mm256_set1_ps(v); }
  HALFSTEP_SIMD_OP F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  HALFSTEP_SIMD_OP F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }  // a·b + c rounded once
  HALFSTEP_SIMD_OP F div(F a, F b) { return _mm256_div_ps(a, b); }
  HALFSTEP_SIMD_OP F sqrt(F a) { return _mm256_sqrt_ps(a); }
  HALFSTEP_SIMD_OP F bit_or(F a, F b) { return _mm256_or_ps(a, b); }
  HALFSTEP_SIMD_OP I bits(F a) { return _mm256_castps_si256(a); }
  HALFSTEP_SIMD_OP F floats(I a) { return _mm256_castsi256_ps(a); }
  HALFSTEP_SIMD_OP I shr16(I a) { return _mm256_srli_epi32(a, 16); }
  HALFSTEP_SIMD_OP I minus_one_where(Mask m, I a) { return _mm256_add_epi32(a, m); }  // m: all ones where it holds
  template <int kShift>
  HALFSTEP_SIMD_OP I shr(I a) { return _mm256_srli_epi32(a, kShift); }
  HALFSTEP_SIMD_OP I bit_xor(I a, I b) { return _mm256_xor_si256(a, b); }
  HALFSTEP_SIMD_OP I mul32(I a, I b) { return _mm256_mullo_epi32(a, b); }  // the low 32 bits of the products
  HALFSTEP_SIMD_OP I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }  // lane l holds l
  HALFSTEP_SIMD_OP bool any_nan(F a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
  /// binary16 words as fp32 (exact), and fp32 to binary16 to nearest (ties to even).
  HALFSTEP_SIMD_OP F f16_load(const std::uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  HALFSTEP_SIMD_OP F f16_store(std::uint16_t* p, F a) {  // returns the stored words' values
    const __m128i h = _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
    return _mm256_cvtph_ps(h);
  }
  /// The low 16 bits of each lane (every lane below 2^16).
  HALFSTEP_SIMD_OP void store16(std::uint16_t* p, I a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
  }
  // The block step's table reads (pointers in and out, no vectors: callable from code compiled
  // for any instruction set).
  static void decode8(const float* map, const std::uint8_t* codes, int n, float* out) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
      _mm256_storeu_ps(out + i, _mm256_i32gather_ps(map, index, 4));
    }
    decode8_scalar(map, codes + i, n - i, out + i);
  }
  static void gather64(const void* table, const std::int32_t* index, int n, std::uint64_t* out) {
    const auto* const entries = static_cast<const long long*>(table);
    int i = 0;
    for (; i + 4 <= n; i += 4) {
      const __m128i at = _mm_loadu_si128(reinterpret_cast<const __m128i*>(index + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_i32gather_epi64(entries, at, 8));
    }
    gather64_scalar(table, index + i, n - i, out + i);
  }
};
#define HALFSTEP_SIMD_OPS Avx2Ops
#define HALFSTEP_SIMD_MEASURE measure_avx2
#define HALFSTEP_SIMD_MEASURE_NEAR measure_near_avx2
#define HALFSTEP_SIMD_APPLY apply_tile_avx2
#include "host_measure_simd.inc"
#include "host_apply_simd.inc"
#undef HALFSTEP_SIMD_APPLY
#undef HALFSTEP_SIMD_MEASURE_NEAR
#undef HALFSTEP_SIMD_MEASURE
#undef HALFSTEP_SIMD_OPS
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
struct Avx512Ops {
  static constexpr int kLanes = 16;
  using I = __m512i;
  using D = __m512d;
  using Mask = __mmask16;
  HALFSTEP_SIMD_OP I load32(const std::uint32_t* p) { return _mm512_loadu_si512(p); }
  HALFSTEP_SIMD_OP I load16(const std::uint16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  HALFSTEP_SIMD_OP I set1(std::uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
  HALFSTEP_SIMD_OP I zero() { return _mm512_setzero_si512(); }
  HALFSTEP_SIMD_OP I bit_and(I a, I b) { return _mm512_and_si512(a, b); }
  HALFSTEP_SIMD_OP I shl16(I a) { return _mm512_slli_epi32(a, 16); }
  HALFSTEP_SIMD_OP I max_u(I a, I b) { return _mm512_max_epu32(a, b); }
  HALFSTEP_SIMD_OP Mask equal(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  HALFSTEP_SIMD_OP Mask greater(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  HALFSTEP_SIMD_OP Mask both(Mask a, Mask b) { return static_cast<Mask>(a & b); }
  HALFSTEP_SIMD_OP I count(I counts, Mask m) { return _mm512_mask_sub_epi32(counts, m, counts, _mm512_set1_epi32(-1)); }
  HALFSTEP_SIMD_OP I keep(Mask m, I a) { return _mm512_maskz_mov_epi32(m, a); }
  HALFSTEP_SIMD_OP D low_half(I a) { return _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_castsi512_ps(a))); }
  HALFSTEP_SIMD_OP D high_half(I a) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(_mm512_castsi512_ps(a), 1)); }
  HALFSTEP_SIMD_OP D dzero() { return _mm512_setzero_pd(); }
  HALFSTEP_SIMD_OP D dset1(double v) { return _mm512_set1_pd(v); }
  HALFSTEP_SIMD_OP D add(D a, D b) { return _mm512_add_pd(a, b); }
  HALFSTEP_SIMD_OP D sub(D a, D b) { return _mm512_sub_pd(a, b); }
  HALFSTEP_SIMD_OP D fmadd(D a, D b, D c) { return _mm512_fmadd_pd(a, b, c); }
  HALFSTEP_SIMD_OP D fmsub(D a, D b, D c) { return _mm512_fmsub_pd(a, b, c); }
  HALFSTEP_SIMD_OP void store(std::uint32_t* p, I a) { _mm512_storeu_si512(p, a); }
  HALFSTEP_SIMD_OP void dstore(double* p, D a) { _mm512_storeu_pd(p, a); }
  HALFSTEP_SIMD_OP I min_u(I a, I b) { return _mm512_min_epu32(a, b); }
  HALFSTEP_SIMD_OP I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  HALFSTEP_SIMD_OP I dbits(D a) { return _mm512_castpd_si512(a); }
  HALFSTEP_SIMD_OP I add64(I a, I b) { return _mm512_add_epi64(a, b); }
  HALFSTEP_SIMD_OP I sub64(I a, I b) { return _mm512_sub_epi64(a, b); }
  HALFSTEP_SIMD_OP void store64(std::int64_t* p, I a) { _mm512_storeu_si512(p, a); }
  using F = __m512;
  HALFSTEP_SIMD_OP F fload(const float* p) { return _mm512_loadu_ps(p); }
  HALFSTEP_SIMD_OP void fstore(float* p, F a) { _mm512_storeu_ps(p, a); }
  HALFSTEP_SIMD_OP F fset1(float v) { return _mm512_set1_ps(v); }
  HALFSTEP_SIMD_OP F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  HALFSTEP_SIMD_OP F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  HALFSTEP_SIMD_OP F div(F a, F b) { return _mm512_div_ps(a, b); }
  HALFSTEP_SIMD_OP F sqrt(F a) { return _mm512_sqrt_ps(a); }
  HALFSTEP_SIMD_OP F bit_or(F a, F b) { return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(a), _mm512_castps_si512(b))); }
  HALFSTEP_SIMD_OP I bits(F a) { return _mm512_castps_si512(a); }
  HALFSTEP_SIMD_OP F floats(I a) { return _mm512_castsi512_ps(a); }
  HALFSTEP_SIMD_OP I shr16(I a) { return _mm512_srli_epi32(a, 16); }
  HALFSTEP_SIMD_OP I minus_one_where(Mask m, I a) { return _mm512_mask_sub_epi32(a, m, a, _mm512_set1_epi32(1)); }
  template <int kShift>
  HALFSTEP_SIMD_OP I shr(I a) { return _mm512_srli_epi32(a, kShift); }
  HALFSTEP_SIMD_OP I bit_xor(I a, I b) { return _mm512_xor_si512(a, b); }
  HALFSTEP_SIMD_OP I mul32(I a, I b) { return _mm512_mullo_epi32(a, b); }
  HALFSTEP_SIMD_OP I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  HALFSTEP_SIMD_OP bool any_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
  HALFSTEP_SIMD_OP F f16_load(const std::uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  HALFSTEP_SIMD_OP F f16_store(std::uint16_t* p, F a) {
    const __m256i h = _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return _mm512_cvtph_ps(h);
  }
  HALFSTEP_SIMD_OP void store16(std::uint16_t* p, I a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a)); }
  static void decode8(const float* map, const std::uint8_t* codes, int n, float* out) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
      _mm512_storeu_ps(out + i, _mm512_i32gather_ps(index, map, 4));
    }
    decode8_scalar(map, codes + i, n - i, out + i);
  }
  static void gather64(const void* table, const std::int32_t* index, int n, std::uint64_t* out) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256i at = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index + i));
      _mm512_storeu_si512(out + i, _mm512_i32gather_epi64(at, table, 8));
    }
    gather64_scalar(table, index + i, n - i, out + i);
  }
};
#define HALFSTEP_SIMD_OPS Avx512Ops
#define HALFSTEP_SIMD_MEASURE measure_avx512
#define HALFSTEP_SIMD_MEASURE_NEAR measure_near_avx512
#define HALFSTEP_SIMD_APPLY apply_tile_avx512
#include "host_measure_simd.inc"
#include "host_apply_simd.inc"
#undef HALFSTEP_SIMD_APPLY
#undef HALFSTEP_SIMD_MEASURE_NEAR
#undef HALFSTEP_SIMD_MEASURE
#undef HALFSTEP_SIMD_OPS
#pragma GCC pop_options
#undef HALFSTEP_SIMD_OP
#endif

// Pass 1 on one chunk: the kernel's split of each square (exact_sum.hpp) into parts at fixed
// points, each part counted as an integer in its unit and added in 64-bit integers, so the loop
// is one flat reduction of integers that the compiler may vectorise in any order. Every part of an
// element in the window is below 2^51 units and a chunk holds at most 2^15 elements, so no sum
// passes 2^63 (the kernel's block sums have the same bound); the digits are the kernel's.
template <DType kGrad, class Ops>
inline void measure_chunk(const HostPass1& a, const TensorDesc& tensor, const ChunkDesc& chunk, ChunkPartial& out,
                          std::uint64_t (&spill)[kSumLimbs], bool& spilled) {
  using P = Pass1Format<kGrad>;
  using Word = std::conditional_t<kGrad == DType::f32, std::uint32_t, std::uint16_t>;
  constexpr int kParts = P::kParts;
  out = ChunkPartial{};
  if (tensor.grad == nullptr) return;  // no gradient for this tensor in this step: nothing measured
  const Word* const words = static_cast<const Word*>(tensor.grad) + chunk.begin;
  const int n = chunk.len;
  const SquareSplit& split = a.split;
  const std::uint32_t normal = kGrad == DType::f32 ? a.normal_bits : format_bits(kGrad).exponent_lsb;
  const std::uint32_t low = split.low, high = split.high;
  Measured r;
  if constexpr (Ops::kLanes == 0 || kGrad == DType::f16) {
    r = measure_portable<kGrad>(words, n, split, normal);
#if HALFSTEP_HOST_X86
  } else if constexpr (Ops::kLanes == 8) {  // one loop, with intrinsics
    r = measure_avx2<kGrad, kParts>(words, n, split, normal);
  } else {
    r = measure_avx512<kGrad, kParts>(words, n, split, normal);
#endif
  }
  const std::uint32_t max_all = r.max_all, nonfinite = r.nonfinite, nonzero = r.nonzero, subnormal = r.subnormal,
                      outside = r.outside;
  const std::int64_t s0 = r.sum[0], s1 = r.sum[1], s2 = r.sum[2];
  std::uint32_t max_bits = max_all;
  if (nonfinite != 0) {  // the largest finite magnitude, read again (rare: the step will be skipped)
    max_bits = 0;
    for (int i = 0; i < n; ++i) {
      const std::uint32_t mag = static_cast<std::uint32_t>(words[i]) & P::kMag;
      if (mag < P::kInf && mag > max_bits) max_bits = mag;
    }
  }
  out.max_bits = max_bits;
  out.nonfinite = nonfinite;
  if (!tensor.in_norm) return;  // a tensor outside the norm adds only its inf/NaN count and its maximum
  const std::int64_t part[3] = {s0, s1, s2};
  if (r.parts == 0) {
    place_parts(split, part, out.digit);
  } else {
    place_units(split, r.parts, part, r.unit_log2, out.digit);
  }
  out.subnormal = subnormal;
  out.zero = static_cast<std::uint32_t>(n) - nonzero;
  if (P::kWindowed && outside != 0) {
    // Squares outside the window (rare): exactly into limbs, normalised on the way as the kernel
    // adds them, so each limb gains less than 2^32 per chunk.
    std::uint64_t local[kSumLimbs] = {};
    for (int i = 0; i < n; ++i) {
      const std::uint32_t mag = static_cast<std::uint32_t>(words[i]) & P::kMag;
      if (mag != 0 && mag < P::kInf && (mag < low || mag >= high)) {
        const double x = magnitude_double<kGrad>(mag);
        deposit(local, x * x);  // exact: at most 48 significant bits
      }
    }
    std::uint64_t carry = 0;
    for (int i = 0; i < kSumLimbs; ++i) {
      const std::uint64_t v = local[i] + carry;
      spill[i] += i + 1 < kSumLimbs ? (v & 0xFFFFFFFFull) : v;
      carry = v >> 32;
    }
    spilled = true;
  }
}

// -- pass 2 ------------------------------------------------------------------------------------

/// Elements pass 2 updates at a time (its temporaries stay in L1).
inline constexpr int kTile = 256;

/// The tile loop of the instruction set of Ops for the format F (TileFormat): the elements it took.
template <DType kGrad, class F, bool kDraw, bool kWithModel, class Ops>
inline int apply_tile(const TileArgs<F>& t, int n, const Decision& d, const GroupConsts& k, bool& held) {
  held = false;
#if HALFSTEP_HOST_X86
  if constexpr (Ops::kLanes == 8) return apply_tile_avx2<kGrad, F, kDraw, kWithModel>::run(t, n, d, k, held);
  if constexpr (Ops::kLanes == 16) return apply_tile_avx512<kGrad, F, kDraw, kWithModel>::run(t, n, d, k, held);
#endif
  return 0;
}

template <DType kGrad, class F, bool kDraw, bool kWithModel, class Ops>
inline std::uint64_t apply_elements(const HostPass2& a, const TensorDesc& tensor, const ChunkDesc& chunk) {
  using PS = typename F::Master::Stored;
  using MS = typename F::M::Stored;
  using VS = typename F::V::Stored;
  static_assert(kWithModel || !F::Master::kReadsModel, "a master held in the model copy needs one");
  // Distinct buffers (validation refuses overlapping ones), so the compiler may keep a vector of
  // one in registers while storing another.
  PS* __restrict const master = F::Master::kStored ? static_cast<PS*>(tensor.master) + chunk.begin : nullptr;
  MS* __restrict const exp_avg = static_cast<MS*>(tensor.exp_avg) + chunk.begin;
  VS* __restrict const exp_avg_sq = static_cast<VS*>(tensor.exp_avg_sq) + chunk.begin;
  std::uint16_t* __restrict const model = kWithModel ? static_cast<std::uint16_t*>(tensor.model) + chunk.begin : nullptr;
  const void* const grad = grad_at<kGrad>(tensor.grad, chunk.begin);
  const Decision d = a.decision;
  const GroupConsts k = a.consts[tensor.group];
  const std::uint64_t key = kDraw ? tensor_key(d.rounding_key, tensor.key_id) : 0;
  const std::int64_t first = tensor.key_offset + chunk.begin;
  // Element i of the chunk from its old values: its new ones, and whether they are all finite.
  const auto compute = [&](int i, PS p, std::uint16_t w, MS m, VS v, PS& p_new, std::uint16_t& w_new, MS& m_new,
                           VS& v_new) {
    std::uint32_t random, random_w;
    draw<F, kDraw>(key, first + i, random, random_w);
    return encode_element<F, kDraw>(p, w, m, v, unscale(grad_value<kGrad>(grad, i), d), kWithModel, random, random_w,
                                    k, p_new, w_new, m_new, v_new);
  };
  std::uint64_t held = 0;
  for (int t0 = 0; t0 < chunk.len; t0 += kTile) {
    const int n = chunk.len - t0 < kTile ? chunk.len - t0 : kTile;
    // Every element's new values are stored in place, unconditionally, and its old ones kept in the
    // tile's temporaries, so that the rare element that is held (an encoded value not finite) gets
    // them back after the loop. (Stores of "the new or the old value" a compiler may turn into
    // masked stores, which are slow.) A model copy written from an fp32 master is not read: its
    // new values wait in the tile and are stored where the element is not held. The loop keeps no
    // per-element flag: an array of bytes makes the vectoriser take 32 elements a step, four
    // vectors of every fp32 value, more than the registers hold; a tile with a held element finds
    // them again by computing its elements once more from the kept old values (the same function
    // of the same inputs: the same bits).
    PS ps_old[kTile];
    MS m_old[kTile];
    VS v_old[kTile];
    std::uint16_t w_old[kTile];
    std::uint16_t w_out[kTile];
    bool tile_has_held = false;
    int j0 = 0;
    if constexpr (TileFormat<F>::value && Ops::kLanes != 0) {
      const TileArgs<F> t{grad_at<kGrad>(grad, t0), F::Master::kStored ? master + t0 : nullptr, exp_avg + t0,
                          exp_avg_sq + t0, kWithModel ? model + t0 : nullptr, ps_old, m_old, v_old, w_old, w_out,
                          key, first + t0};
      j0 = apply_tile<kGrad, F, kDraw, kWithModel, Ops>(t, n, d, k, tile_has_held);
    }
    for (int j = j0; j < n; ++j) {
      const int i = t0 + j;
      const PS p = F::Master::kStored ? master[i] : PS{};
      const std::uint16_t w = F::Master::kReadsModel ? model[i] : std::uint16_t{0};
      const MS m = exp_avg[i];
      const VS v = exp_avg_sq[i];
      PS p_new;
      MS m_new;
      VS v_new;
      std::uint16_t w_new;
      const bool ok = compute(i, p, w, m, v, p_new, w_new, m_new, v_new);
      if constexpr (F::Master::kStored) {
        master[i] = p_new;
        ps_old[j] = p;
      }
      exp_avg[i] = m_new;
      exp_avg_sq[i] = v_new;
      m_old[j] = m;
      v_old[j] = v;
      if constexpr (F::Master::kReadsModel) {
        model[i] = w_new;
        w_old[j] = w;
      } else if constexpr (kWithModel) {
        w_out[j] = w_new;
      }
      tile_has_held |= !ok;
    }
    if (!tile_has_held) {
      if constexpr (!F::Master::kReadsModel && kWithModel) {
        for (int j = 0; j < n; ++j) model[t0 + j] = w_out[j];
      }
    } else {  // rare: the held elements' old values back (and counted), the others' model copy stored
      for (int j = 0; j < n; ++j) {
        const int i = t0 + j;
        PS p_new;
        MS m_new;
        VS v_new;
        std::uint16_t w_new;
        const bool ok = compute(i, F::Master::kStored ? ps_old[j] : PS{}, F::Master::kReadsModel ? w_old[j] : std::uint16_t{0},
                                m_old[j], v_old[j], p_new, w_new, m_new, v_new);
        if (ok) {
          if constexpr (!F::Master::kReadsModel && kWithModel) model[i] = w_out[j];
        } else {
          ++held;
          if constexpr (F::Master::kStored) master[i] = ps_old[j];
          exp_avg[i] = m_old[j];
          exp_avg_sq[i] = v_old[j];
          if constexpr (F::Master::kReadsModel) model[i] = w_old[j];
        }
      }
    }
  }
  return held;
}

/// apply_elements with the model copy's presence known to the compiler: without one nothing of it
/// is computed (fp32 parameters that are their own masters).
template <DType kGrad, class F, bool kDraw, class Ops>
inline std::uint64_t apply_elements(const HostPass2& a, const TensorDesc& tensor, const ChunkDesc& chunk) {
  if constexpr (F::Master::kReadsModel) {
    return apply_elements<kGrad, F, kDraw, true, Ops>(a, tensor, chunk);
  } else {
    return tensor.model != nullptr ? apply_elements<kGrad, F, kDraw, true, Ops>(a, tensor, chunk)
                                   : apply_elements<kGrad, F, kDraw, false, Ops>(a, tensor, chunk);
  }
}

// The block step of 8-bit moments: update_block8 (block8.hpp) split into loops, one per stage,
// over the block's elements, so that each vectorises: the moments' decode and the encodes' table
// reads are gathers (Ops::decode8, Ops::gather64: AVX2 or AVX-512 gathers, plain reads in the
// baseline), and everything between them is arithmetic on arrays in L1. The same functions of the
// same values as update_block8 (the same adamw_update, master codec, guess_entry8, guessed8,
// rounds_up8 and code8_as), so the same bits; the host tests and the emulated device check it.

/// The low and high 32 bits of a table entry read by gather64 (Guess8: next, index; Step8: lo, gap).
inline float entry_low(std::uint64_t e) { return float_of(static_cast<std::uint32_t>(e)); }
inline std::uint32_t entry_high(std::uint64_t e) { return static_cast<std::uint32_t>(e >> 32); }
static_assert(sizeof(Guess8) == 8 && offsetof(Guess8, next) == 0 && offsetof(Guess8, index) == 4 &&
                  sizeof(Step8) == 8 && offsetof(Step8, lo) == 0 && offsetof(Step8, gap) == 4,
              "gather64 reads a table entry as one 64-bit word: its first field low, its second high");

/// The codes of the n values x (finite: the block applies) of one block and its scale, as
/// encode_block8 computes them from `largest`, the largest |x| pattern: to nearest, or with
/// kStochastic from bits 16 and up of random[i]; kUnsigned values that are positive never take
/// code 0.
template <bool kSigned, bool kStochastic, class Ops>
inline float encode_block8_host(const Codec8& codec, const float* x, int n, std::uint32_t largest,
                                const std::uint32_t* random, std::uint8_t* codes) {
  const float scale = scale8(float_of(largest));
  const float inverse = inverse8(scale);
  float scaled[kBlock8], y[kBlock8];
  std::int32_t index[kBlock8];
  std::uint64_t entry[kBlock8];
  for (int i = 0; i < n; ++i) {
    scaled[i] = x[i] * inverse;
    y[i] = scaled[i] < 0.0f ? -scaled[i] : scaled[i];
    index[i] = guess_entry8(scaled[i]);
  }
  Ops::gather64(kStochastic ? static_cast<const void*>(codec.floor) : static_cast<const void*>(codec.nearest), index, n,
                entry);
  for (int i = 0; i < n; ++i) {
    index[i] = guessed8(Guess8{entry_low(entry[i]), static_cast<std::int32_t>(entry_high(entry[i]))}, y[i]);
  }
  if constexpr (kStochastic) {
    Ops::gather64(codec.step, index, n, entry);
    for (int i = 0; i < n; ++i) {
      index[i] += rounds_up8(Step8{entry_low(entry[i]), float_of(entry_high(entry[i]))}, y[i], random[i] >> 16);
    }
  }
  for (int i = 0; i < n; ++i) codes[i] = code8_as<kSigned>(index[i], scaled[i], !kSigned & (x[i] > 0.0f));
  return scale;
}

/// One block's step: its n elements from element `at` of the piece (`start` in the whole tensor),
/// updated in place; returns true, changing nothing, if the block is held.
template <DType kGrad, class Master, bool kDraw, class Ops>
inline bool step_block8(const HostPass2& a, const TensorDesc& tensor, std::int64_t at, std::int64_t start, int n,
                        std::int64_t s, std::uint64_t key, const Decision& d, const GroupConsts& k) {
  using PS = typename Master::Stored;
  PS* __restrict const ps = Master::kStored ? static_cast<PS*>(tensor.master) + at : nullptr;
  const bool with_model = tensor.model != nullptr;
  std::uint16_t* __restrict const model = with_model ? static_cast<std::uint16_t*>(tensor.model) + at : nullptr;
  std::uint8_t* __restrict const m_codes = static_cast<std::uint8_t*>(tensor.exp_avg) + at;
  std::uint8_t* __restrict const v_codes = static_cast<std::uint8_t*>(tensor.exp_avg_sq) + at;
  const float m_scale = tensor.exp_avg_scale[s], v_scale = tensor.exp_avg_sq_scale[s];
  const Codec8& m_codec = *a.exp_avg_codec;
  const Codec8& v_codec = *a.exp_avg_sq_codec;
  float m[kBlock8], root[kBlock8];
  Ops::decode8(m_codec.map.value, m_codes, n, m);
  Ops::decode8(v_codec.map.value, v_codes, n, root);
  PS ps_new[kBlock8];
  std::uint16_t model_new[kBlock8];
  std::uint32_t random[kBlock8];
  std::uint32_t m_largest = 0, root_largest = 0;
  int ok = 1;  // an int, not a bool: the compiler vectorises an int reduction
  for (int i = 0; i < n; ++i) {
    // update_element8, its moments' map values read above
    const PS stored = Master::kStored ? ps[i] : PS{};
    const std::uint16_t weight = Master::kReadsModel || with_model ? model[i] : std::uint16_t{0};
    const std::uint32_t r = kDraw ? element_bits(key, start + i) : 0u;
    float p = Master::decode(stored, weight);
    float mi = m[i] * m_scale;
    const float ri = root[i] * v_scale;
    float v = ri * ri;
    adamw_update(p, mi, v, unscale(grad_value<kGrad>(tensor.grad, at + i), d), k);
    const float root_i = sqrtf(v);
    const std::uint32_t random_w = kDraw && Master::kRounds ? weight_bits(r) : 0u;
    ok &= static_cast<int>(Master::encode(p, with_model, kDraw, random_w, ps_new[i], model_new[i]) & finite32(mi) &
                           finite32(v));
    m[i] = mi;
    root[i] = root_i;
    random[i] = r;
    // encode_block8's largest magnitudes, as patterns
    const std::uint32_t m_bits = bits_of(mi) & 0x7FFFFFFFu, root_bits = bits_of(root_i) & 0x7FFFFFFFu;
    m_largest = m_bits > m_largest ? m_bits : m_largest;
    root_largest = root_bits > root_largest ? root_bits : root_largest;
  }
  if (ok == 0) return true;
  std::uint8_t mc[kBlock8], vc[kBlock8];
  // exp_avg to nearest; sqrt(exp_avg_sq) with the state's rounding, never to 0 while positive
  const float ms = encode_block8_host<true, false, Ops>(m_codec, m, n, m_largest, random, mc);
  const float vs = encode_block8_host<false, kDraw, Ops>(v_codec, root, n, root_largest, random, vc);
  for (int i = 0; i < n; ++i) {
    if constexpr (Master::kStored) ps[i] = ps_new[i];
    if (with_model) model[i] = model_new[i];
    m_codes[i] = mc[i];
    v_codes[i] = vc[i];
  }
  tensor.exp_avg_scale[s] = ms;
  tensor.exp_avg_sq_scale[s] = vs;
  return false;
}

/// Pass 2 over the blocks of a tensor with block8 moments that start in the chunk (the last may
/// run past its end: pieces hold whole blocks), a block at a time.
template <DType kGrad, class Master, bool kDraw, class Ops>
inline std::uint64_t apply_blocks(const HostPass2& a, const TensorDesc& tensor, const ChunkDesc& chunk) {
  const Block8Geometry& geo = tensor.blocks;
  const std::int64_t b_end = geo.first_block_from(tensor.key_offset + chunk.begin + chunk.len);
  const Decision d = a.decision;
  const GroupConsts k = a.consts[tensor.group];
  const std::uint64_t key = kDraw ? tensor_key(d.rounding_key, tensor.key_id) : 0;
  std::uint64_t held = 0;
  for (std::int64_t b = geo.first_block_from(tensor.key_offset + chunk.begin); b < b_end; ++b) {
    const std::int64_t start = geo.block_start(b);  // in the whole tensor
    const int n = static_cast<int>(geo.block_size(b));
    if (step_block8<kGrad, Master, kDraw, Ops>(a, tensor, start - tensor.key_offset, start, n, b - tensor.first_block,
                                               key, d, k)) {
      held += static_cast<std::uint64_t>(n);
    }
  }
  return held;
}

// -- dispatch over the formats the API offers (as the kernels' launch_apply) ---------------------

template <DType kGrad, DType kModel, MasterFormat kMaster, MomentFormat kM, MomentFormat kV, class Ops>
inline std::uint64_t apply_one(const HostPass2& a, const TensorDesc& tensor, const ChunkDesc& chunk) {
  const bool stochastic = a.state.rounding == Rounding::stochastic;
  if constexpr (kM == MomentFormat::block8) {  // a tensor that keeps wide moments: fp32
    using W = Formats<kModel, kMaster, MomentFormat::f32, MomentFormat::f32>;
    if (tensor.quantized != 0) {
      return stochastic ? apply_blocks<kGrad, typename W::Master, true, Ops>(a, tensor, chunk)
                        : apply_blocks<kGrad, typename W::Master, false, Ops>(a, tensor, chunk);
    }
    if constexpr (W::kNarrow) {
      return stochastic ? apply_elements<kGrad, W, true, Ops>(a, tensor, chunk) : apply_elements<kGrad, W, false, Ops>(a, tensor, chunk);
    } else {
      return apply_elements<kGrad, W, false, Ops>(a, tensor, chunk);
    }
  } else {
    using F = Formats<kModel, kMaster, kM, kV>;
    if constexpr (F::kNarrow) {
      return stochastic ? apply_elements<kGrad, F, true, Ops>(a, tensor, chunk) : apply_elements<kGrad, F, false, Ops>(a, tensor, chunk);
    } else {
      return apply_elements<kGrad, F, false, Ops>(a, tensor, chunk);
    }
  }
}

template <DType kGrad, DType kModel, MasterFormat kMaster, class Ops>
inline std::uint64_t apply_moments(const HostPass2& a, const TensorDesc& tensor, const ChunkDesc& chunk) {
  using MF = MomentFormat;
  const StateFormat& s = a.state;
  if (s.exp_avg == MF::block8) return apply_one<kGrad, kModel, kMaster, MF::block8, MF::block8, Ops>(a, tensor, chunk);
  if (s.exp_avg == MF::bf16) {
    return s.exp_avg_sq == MF::bf16 ? apply_one<kGrad, kModel, kMaster, MF::bf16, MF::bf16, Ops>(a, tensor, chunk)
                                    : apply_one<kGrad, kModel, kMaster, MF::bf16, MF::f32, Ops>(a, tensor, chunk);
  }
  return s.exp_avg_sq == MF::bf16 ? apply_one<kGrad, kModel, kMaster, MF::f32, MF::bf16, Ops>(a, tensor, chunk)
                                  : apply_one<kGrad, kModel, kMaster, MF::f32, MF::f32, Ops>(a, tensor, chunk);
}

template <DType kGrad, class Ops>
inline std::uint64_t apply_grad(const HostPass2& a, const TensorDesc& tensor, const ChunkDesc& chunk) {
  if (a.model_dtype == DType::bf16) {
    if (a.state.master == MasterFormat::bf16_remainder) {
      return apply_moments<kGrad, DType::bf16, MasterFormat::bf16_remainder, Ops>(a, tensor, chunk);
    }
    if (a.state.master == MasterFormat::none) return apply_moments<kGrad, DType::bf16, MasterFormat::none, Ops>(a, tensor, chunk);
    return apply_moments<kGrad, DType::bf16, MasterFormat::f32, Ops>(a, tensor, chunk);
  }
  return apply_moments<kGrad, DType::f16, MasterFormat::f32, Ops>(a, tensor, chunk);
}

// The entry points of each variant, one per gradient format, so that each is a function of its
// own that the target attribute compiles for its instruction set.
#define HALFSTEP_HOST_VARIANT(NAME, ATTRIBUTES)                                                              \
  ATTRIBUTES void NAME##_measure_f16(const HostPass1& a, const TensorDesc& t, const ChunkDesc& c,             \
                                     ChunkPartial& out, std::uint64_t (&spill)[kSumLimbs], bool& spilled) {  \
    measure_chunk<DType::f16, NAME##_ops>(a, t, c, out, spill, spilled);                                                  \
  }                                                                                                           \
  ATTRIBUTES void NAME##_measure_bf16(const HostPass1& a, const TensorDesc& t, const ChunkDesc& c,            \
                                      ChunkPartial& out, std::uint64_t (&spill)[kSumLimbs], bool& spilled) { \
    measure_chunk<DType::bf16, NAME##_ops>(a, t, c, out, spill, spilled);                                                 \
  }                                                                                                           \
  ATTRIBUTES void NAME##_measure_f32(const HostPass1& a, const TensorDesc& t, const ChunkDesc& c,             \
                                     ChunkPartial& out, std::uint64_t (&spill)[kSumLimbs], bool& spilled) {  \
    measure_chunk<DType::f32, NAME##_ops>(a, t, c, out, spill, spilled);                                                  \
  }                                                                                                           \
  void NAME##_measure(const HostPass1& a, const TensorDesc& t, const ChunkDesc& c, ChunkPartial& out,         \
                      std::uint64_t (&spill)[kSumLimbs], bool& spilled) {                                     \
    if (a.grad_dtype == DType::f32) return NAME##_measure_f32(a, t, c, out, spill, spilled);                 \
    if (a.grad_dtype == DType::bf16) return NAME##_measure_bf16(a, t, c, out, spill, spilled);               \
    NAME##_measure_f16(a, t, c, out, spill, spilled);                                                         \
  }                                                                                                           \
  ATTRIBUTES std::uint64_t NAME##_apply_f16(const HostPass2& a, const TensorDesc& t, const ChunkDesc& c) {   \
    return apply_grad<DType::f16, NAME##_ops>(a, t, c);                                                       \
  }                                                                                                           \
  ATTRIBUTES std::uint64_t NAME##_apply_bf16(const HostPass2& a, const TensorDesc& t, const ChunkDesc& c) {  \
    return apply_grad<DType::bf16, NAME##_ops>(a, t, c);                                                      \
  }                                                                                                           \
  ATTRIBUTES std::uint64_t NAME##_apply_f32(const HostPass2& a, const TensorDesc& t, const ChunkDesc& c) {   \
    return apply_grad<DType::f32, NAME##_ops>(a, t, c);                                                       \
  }                                                                                                           \
  std::uint64_t NAME##_apply(const HostPass2& a, const TensorDesc& t, const ChunkDesc& c) {                  \
    if (a.grad_dtype == DType::f32) return NAME##_apply_f32(a, t, c);                                        \
    if (a.grad_dtype == DType::bf16) return NAME##_apply_bf16(a, t, c);                                      \
    return NAME##_apply_f16(a, t, c);                                                                         \
  }

struct BaselineOps {
  static constexpr int kLanes = 0;  // the portable loops
  static void decode8(const float* map, const std::uint8_t* codes, int n, float* out) {
    decode8_scalar(map, codes, n, out);
  }
  static void gather64(const void* table, const std::int32_t* index, int n, std::uint64_t* out) {
    gather64_scalar(table, index, n, out);
  }
};
using baseline_ops = BaselineOps;
HALFSTEP_HOST_VARIANT(baseline, __attribute__((flatten)))
#if HALFSTEP_HOST_X86
using avx2_ops = Avx2Ops;
HALFSTEP_HOST_VARIANT(avx2, __attribute__((target("avx2,fma,f16c"), flatten)))
using avx512_ops = Avx512Ops;
HALFSTEP_HOST_VARIANT(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"), flatten)))
#endif
#undef HALFSTEP_HOST_VARIANT

const HostPasses kBaseline{"baseline", baseline_measure, baseline_apply};
#if HALFSTEP_HOST_X86
const HostPasses kAvx2{"avx2", avx2_measure, avx2_apply};
const HostPasses kAvx512{"avx512", avx512_measure, avx512_apply};
#endif

}  // namespace

std::vector<const HostPasses*> host_passes_runnable() {
  std::vector<const HostPasses*> out{&kBaseline};
#if HALFSTEP_HOST_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
    out.push_back(&kAvx2);
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
      out.push_back(&kAvx512);
    }
  }
#endif
  return out;
}

const HostPasses& host_passes() {
  static const HostPasses* chosen = [] {
    const std::vector<const HostPasses*> runnable = host_passes_runnable();
    const char* forced = std::getenv("HALFSTEP_HOST_ISA");
    if (forced == nullptr || *forced == '\0') return runnable.back();
    for (const HostPasses* p : runnable) {
      if (std::strcmp(forced, p->isa) == 0) return p;
    }
    std::fprintf(stderr, "halfstep: HALFSTEP_HOST_ISA=%s names no variant this CPU runs; running %s\n", forced,
                 runnable.back()->isa);
    return runnable.back();
  }();
  return *chosen;
}

}  // namespace halfstep::detail
