// Pass 2 of the step: unscale, clip and AdamW in fp32 from fp16, bf16 or fp32 gradients, on the
// masters and moments in their state formats (fp32; remainders with the bf16 model copy; no
// master, the bf16 model copy rounded to nearest or stochastically; bf16 moments, likewise), and the model copy in its 16-bit format. Every block reads finalize's decision
// first and returns at once on a skipped step, so a skipped step writes nothing anywhere. An element whose new master, moments
// or model copy would not be finite (which finalize cannot see: it depends on the stored values)
// keeps its old values and is counted in the report's held_elements, so no step ever writes a
// non-finite value.
#include "device.cuh"

#include "block8.hpp"
#include "cuda_check.hpp"
#include "gradient.cuh"
#include "launch.hpp"
#include "pass2_element.hpp"
#include "step_math.hpp"

namespace halfstep::detail {
namespace {

// One vector of a pass: kW consecutive elements of every buffer, read and written with one access
// per buffer and 16 bytes of 4-byte or 16-bit values at a time (8 bytes for four 16-bit values).
// kW is 8 for 16-bit gradients (16 bytes of them) and 4 for fp32 gradients, so that a thread's
// registers hold one vector of each buffer within the kernel's 64.
template <DType kGrad>
inline constexpr int kWidth = kGrad == DType::f32 ? 4 : 8;

template <int kW>
__device__ inline void load_vec(const float* src, float (&dst)[kW]) {
#pragma unroll
  for (int q = 0; q < kW / 4; ++q) {
    const float4 a = load16<float4>(src + 4 * q);
    dst[4 * q] = a.x;
    dst[4 * q + 1] = a.y;
    dst[4 * q + 2] = a.z;
    dst[4 * q + 3] = a.w;
  }
}
template <int kW>
__device__ inline void store_vec(float* dst, const float (&src)[kW]) {
#pragma unroll
  for (int q = 0; q < kW / 4; ++q) store16(dst + 4 * q, make_float4(src[4 * q], src[4 * q + 1], src[4 * q + 2], src[4 * q + 3]));
}
// kW 16-bit patterns: one 16-byte access for eight, one 8-byte access for four.
template <int kW>
__device__ inline void load_vec(const std::uint16_t* src, std::uint16_t (&dst)[kW]) {
  if constexpr (kW == 8) {
    unpack8(load16<uint4>(src), dst);
  } else {
    const uint2 q = load8b<uint2>(src);
    dst[0] = static_cast<std::uint16_t>(q.x & 0xFFFFu);
    dst[1] = static_cast<std::uint16_t>(q.x >> 16);
    dst[2] = static_cast<std::uint16_t>(q.y & 0xFFFFu);
    dst[3] = static_cast<std::uint16_t>(q.y >> 16);
  }
}
template <int kW>
__device__ inline void store_vec(std::uint16_t* dst, const std::uint16_t (&src)[kW]) {
  if constexpr (kW == 8) {
    store16(dst, pack8(src));
  } else {
    store8b(dst, make_uint2(static_cast<unsigned>(src[0]) | (static_cast<unsigned>(src[1]) << 16),
                            static_cast<unsigned>(src[2]) | (static_cast<unsigned>(src[3]) << 16)));
  }
}

// A vector of gradients as stored: 16-bit patterns packed two to a word, or fp32 values.
template <DType kGrad>
struct GradVector {
  uint4 bits;
  __device__ void load(const void* grad, std::int64_t at) { bits = load16<uint4>(static_cast<const std::uint16_t*>(grad) + at); }
  __device__ float operator[](int j) const {  // converted one at a time: the packed vector is the smaller
    const unsigned w = j < 2 ? bits.x : j < 4 ? bits.y : j < 6 ? bits.z : bits.w;
    return Format16<kGrad>::to_float(static_cast<std::uint16_t>((j & 1) != 0 ? w >> 16 : w & 0xFFFFu));
  }
};
template <>
struct GradVector<DType::f32> {
  float4 v;
  __device__ void load(const void* grad, std::int64_t at) { v = load16<float4>(static_cast<const float*>(grad) + at); }
  __device__ float operator[](int j) const { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }
};

template <DType kGrad>
__device__ inline float load_grad(const void* grad, std::int64_t i) {
  if constexpr (kGrad == DType::f32) {
    return static_cast<const float*>(grad)[i];
  } else {
    return Format16<kGrad>::to_float(static_cast<const std::uint16_t*>(grad)[i]);
  }
}

// Pass 2 over one chunk of a tensor, with the rounding's random bits drawn (kDraw) or not: kept
// apart so that each loop holds only its own code. Returns the elements held.
template <DType kGrad, class F, bool kDraw>
__device__ inline unsigned apply_chunk(const TensorDesc& tensor, const ChunkDesc& chunk, const Decision& d,
                                       const GroupConsts& k) {
  using PS = typename F::Master::Stored;
  using MS = typename F::M::Stored;
  using VS = typename F::V::Stored;
  constexpr int kW = kWidth<kGrad>;
  const void* grad = kGrad == DType::f32 ? static_cast<const void*>(static_cast<const float*>(tensor.grad) + chunk.begin)
                                          : static_cast<const void*>(static_cast<const std::uint16_t*>(tensor.grad) + chunk.begin);
  PS* master = F::Master::kStored ? static_cast<PS*>(tensor.master) + chunk.begin : nullptr;  // none: no buffer
  MS* exp_avg = static_cast<MS*>(tensor.exp_avg) + chunk.begin;
  VS* exp_avg_sq = static_cast<VS*>(tensor.exp_avg_sq) + chunk.begin;
  auto* model = tensor.model ? static_cast<std::uint16_t*>(tensor.model) + chunk.begin : nullptr;
  const bool with_model = model != nullptr;
  // Stochastic rounding's bits: keyed by the step, the tensor and each element's index in it.
  const std::uint64_t key = kDraw ? tensor_key(d.rounding_key, tensor.key_id) : 0;
  const std::int64_t first = tensor.key_offset + chunk.begin;

  unsigned held = 0;  // elements this thread kept because their update was not finite
  int done = 0;
  if (tensor.all_vec) {  // kW elements per thread: vector accesses to every buffer
    const int n_vec = chunk.len / kW;
    for (int i = static_cast<int>(threadIdx.x); i < n_vec; i += kPassThreads) {
      const std::int64_t at = static_cast<std::int64_t>(i) * kW;
      GradVector<kGrad> g;
      g.load(grad, at);
      PS p[kW] = {};
      MS m[kW];
      VS v[kW];
      std::uint16_t out[kW] = {};  // the model copy: read with remainders and without a master, else written from the master
      if constexpr (F::Master::kStored) load_vec(master + at, p);
      load_vec(exp_avg + at, m);
      load_vec(exp_avg_sq + at, v);
      if (F::Master::kReadsModel) load_vec(model + at, out);
      unsigned kept = 0;  // bit j: element j keeps its old values
#pragma unroll
      for (int j = 0; j < kW; ++j) {
        std::uint32_t random, random_w;
        draw<F, kDraw>(key, first + at + j, random, random_w);
        if (update_element<F, kDraw>(p[j], out[j], m[j], v[j], unscale(g[j], d), with_model, random, random_w, k)) {
          kept |= 1u << j;
        }
      }
      if constexpr (F::Master::kStored) store_vec(master + at, p);
      store_vec(exp_avg + at, m);
      store_vec(exp_avg_sq + at, v);
      if (with_model) {
        if (!F::Master::kReadsModel && kept != 0) {  // rare: keep the held elements' model copies as they are
          std::uint16_t old[kW];
          load_vec(model + at, old);
#pragma unroll
          for (int j = 0; j < kW; ++j) {
            if (kept >> j & 1u) out[j] = old[j];
          }
        }
        store_vec(model + at, out);
      }
      held += static_cast<unsigned>(__popc(kept));
    }
    done = n_vec * kW;
  }
  for (int i = done + static_cast<int>(threadIdx.x); i < chunk.len; i += kPassThreads) {
    PS p{};
    if constexpr (F::Master::kStored) p = master[i];
    MS m = exp_avg[i];
    VS v = exp_avg_sq[i];
    std::uint16_t out = F::Master::kReadsModel ? model[i] : 0;
    std::uint32_t random, random_w;
    draw<F, kDraw>(key, first + i, random, random_w);
    if (update_element<F, kDraw>(p, out, m, v, unscale(load_grad<kGrad>(grad, i), d), with_model, random, random_w, k)) {
      ++held;
      continue;
    }
    if constexpr (F::Master::kStored) master[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (with_model) model[i] = out;
  }
  return held;
}

// Where block `b` of a quantized tensor starts in the whole tensor, and its size: the block's row
// and place in it by a multiply (Divisor32) where the tensor's blocks are numbered below 2^32.
__device__ inline void block_place(const TensorDesc& tensor, std::int64_t b, std::int64_t& start, int& n) {
  const Block8Geometry& geo = tensor.blocks;
  std::int64_t row, in_row;
  if (tensor.blocks32 != 0) {
    const auto b32 = static_cast<std::uint32_t>(b);
    const std::uint32_t q = tensor.per_row.divide(b32);
    row = q;
    in_row = b32 - q * static_cast<std::uint32_t>(geo.blocks_per_row);
  } else {
    row = b / geo.blocks_per_row;
    in_row = b % geo.blocks_per_row;
  }
  start = row * geo.row + in_row * kBlock8;
  n = static_cast<int>(in_row + 1 < geo.blocks_per_row ? kBlock8 : geo.row - in_row * kBlock8);
}

// kW bytes (8) at p, 8-byte aligned: one access.
__device__ inline void load_codes(const std::uint8_t* p, std::uint8_t (&out)[kBlock8PerLane]) {
  const uint2 q = load8b<uint2>(p);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    out[j] = static_cast<std::uint8_t>(q.x >> (8 * j));
    out[4 + j] = static_cast<std::uint8_t>(q.y >> (8 * j));
  }
}
__device__ inline void store_codes(std::uint8_t* p, const std::uint8_t (&in)[kBlock8PerLane]) {
  unsigned x = 0, y = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    x |= static_cast<unsigned>(in[j]) << (8 * j);
    y |= static_cast<unsigned>(in[4 + j]) << (8 * j);
  }
  store8b(p, make_uint2(x, y));
}

// Pass 2 over one chunk of a tensor with block8 moments: a warp per block, the blocks that start
// in the chunk (the last may run past its end: pieces hold whole blocks), lane l holding elements
// 8l .. 8l + 7 of its block (kernels/block8.hpp, warp_step_block8). Blocks are numbered in the
// whole tensor (block8_geometry.hpp). A held block keeps all it held; returns the elements held
// (counted on lane 0). With kVec (TensorDesc::all_vec: every block starts at a multiple of 8 in
// aligned buffers) a lane reads and writes its 8 elements of each buffer with one vector access;
// otherwise every element is guarded and accessed alone.
template <DType kGrad, class Master, bool kDraw, bool kVec>
__device__ inline unsigned apply_chunk8(const TensorDesc& tensor, const ChunkDesc& chunk, const Decision& d,
                                        const GroupConsts& k, const Codec8* codecs, const float* maps) {
  using PS = typename Master::Stored;
  constexpr int kWarps = kPassThreads / 32;
  constexpr int kL = kBlock8PerLane;
  const int lane = static_cast<int>(threadIdx.x % 32u);
  const int first = lane * kL;
  const Block8Geometry& geo = tensor.blocks;
  const std::int64_t b_end = geo.first_block_from(tensor.key_offset + chunk.begin + chunk.len);
  auto* master = static_cast<PS*>(tensor.master);
  auto* model = static_cast<std::uint16_t*>(tensor.model);
  auto* m_codes = static_cast<std::uint8_t*>(tensor.exp_avg);
  auto* v_codes = static_cast<std::uint8_t*>(tensor.exp_avg_sq);
  const bool with_model = model != nullptr;
  const std::uint64_t key = kDraw ? tensor_key(d.rounding_key, tensor.key_id) : 0;
  unsigned held = 0;
  for (std::int64_t b = geo.first_block_from(tensor.key_offset + chunk.begin) + static_cast<int>(threadIdx.x / 32u);
       b < b_end; b += kWarps) {  // warp-uniform
    std::int64_t start;  // in the whole tensor
    int n;
    block_place(tensor, b, start, n);
    // kVec: n is a multiple of 8, so a lane holds all of its 8 elements or none; a lane past a short
    // block's end reads and computes the block's first 8 elements again (lane 0's, with their
    // random bits): the same finite or non-finite values, so neither the scales nor the vote
    // change, and it stores nothing.
    const bool mine = first < n;
    const int own = kVec && !mine ? 0 : first;
    const std::int64_t at = start - tensor.key_offset + own;  // this lane's first element in the piece
    PS ps[kL];
    std::uint16_t out[kL];
    std::uint8_t mc[kL], vc[kL];
    float g[kL];
    std::uint32_t random[kL];
    if constexpr (kVec) {
      if constexpr (Master::kStored) load_vec(master + at, ps);
      if (Master::kReadsModel) load_vec(model + at, out);
      load_codes(m_codes + at, mc);
      load_codes(v_codes + at, vc);
      if constexpr (kGrad == DType::f32) {
        GradVector<kGrad> lo, hi;
        lo.load(tensor.grad, at);
        hi.load(tensor.grad, at + 4);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          g[j] = unscale(lo[j], d);
          g[4 + j] = unscale(hi[j], d);
        }
      } else {
        GradVector<kGrad> v;
        v.load(tensor.grad, at);
#pragma unroll
        for (int j = 0; j < kL; ++j) g[j] = unscale(v[j], d);
      }
      if constexpr (kDraw) {
        element_bits8(key, start + own, random);
      } else {
#pragma unroll
        for (int j = 0; j < kL; ++j) random[j] = 0u;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kL; ++j) {
        const bool in = first + j < n;
        ps[j] = Master::kStored && in ? master[at + j] : PS{};
        out[j] = Master::kReadsModel && in ? model[at + j] : std::uint16_t{0};
        mc[j] = in ? m_codes[at + j] : kSignedZero8;
        vc[j] = in ? v_codes[at + j] : kUnsignedZero8;
        g[j] = in ? unscale(load_grad<kGrad>(tensor.grad, at + j), d) : 0.0f;
        random[j] = kDraw ? element_bits(key, start + first + j) : 0u;
      }
    }
    const std::int64_t s = b - tensor.first_block;
    PS ps_new[kL];
    std::uint16_t model_new[kL];
    std::uint8_t m_new[kL], v_new[kL];
    float m_scale = 0.0f, v_scale = 0.0f;
    if (!warp_step_block8<Master, kDraw, !kVec>(codecs[0], codecs[1], maps, maps + 256, ps, out, mc, vc, tensor.exp_avg_scale[s],
                                                tensor.exp_avg_sq_scale[s], g, n, with_model, random, k, ps_new,
                                                model_new, m_new, v_new, m_scale, v_scale)) {
      if (lane == 0) held += static_cast<unsigned>(n);
      continue;
    }
    if constexpr (kVec) {
      if (mine) {
        if constexpr (Master::kStored) store_vec(master + at, ps_new);
        if (with_model) store_vec(model + at, model_new);
        store_codes(m_codes + at, m_new);
        store_codes(v_codes + at, v_new);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kL; ++j) {
        if (first + j < n) {
          if constexpr (Master::kStored) master[at + j] = ps_new[j];
          if (with_model) model[at + j] = model_new[j];
          m_codes[at + j] = m_new[j];
          v_codes[at + j] = v_new[j];
        }
      }
    }
    if (lane == 0) {
      tensor.exp_avg_scale[s] = m_scale;
      tensor.exp_avg_sq_scale[s] = v_scale;
    }
  }
  return held;
}

// At most 64 registers a thread, so an H100/H200 SM holds 4 blocks (half occupancy) to keep
// enough loads in flight; with block8 moments 128 (2 blocks): a lane holds 8 elements of a block
// and their new values until the block's vote and scales are known.
template <DType kGrad, DType kModel, MasterFormat kMaster, MomentFormat kM, MomentFormat kV>
__global__ void __launch_bounds__(kPassThreads, kM == MomentFormat::block8 ? 2 : 4)
    apply_kernel(const TensorDesc* __restrict__ tensors, const ChunkDesc* __restrict__ chunks,
                 const Decision* __restrict__ decision, const GroupConsts* __restrict__ consts,
                 unsigned long long* __restrict__ held_elements, const int stochastic,
                 const Codec8* __restrict__ codecs) {
  using F = Formats<kModel, kMaster, kM, kV>;
  if (decision->apply == 0) return;
  const Decision d = *decision;
  const ChunkDesc chunk = chunks[blockIdx.x];
  const TensorDesc tensor = tensors[chunk.tensor];
  const GroupConsts k = consts[tensor.group];
  if (tensor.grad == nullptr) return;  // no gradient for this tensor in this step: left alone
  unsigned held;
  if constexpr (kM == MomentFormat::block8) {  // a warp per block; a tensor that keeps wide moments: fp32
    using W = Formats<kModel, kMaster, MomentFormat::f32, MomentFormat::f32>;
    if (tensor.quantized != 0) {
      using WM = typename W::Master;
      // Both maps in shared memory, decoded from with 32-bit addresses (exp_avg's, then exp_avg_sq's).
      HALFSTEP_SHARED(float[2 * 256], maps);
      for (int i = static_cast<int>(threadIdx.x); i < 2 * 256; i += kPassThreads) maps[i] = codecs[i / 256].map.value[i % 256];
      __syncthreads();
      if (tensor.all_vec) {
        held = stochastic != 0 ? apply_chunk8<kGrad, WM, true, true>(tensor, chunk, d, k, codecs, maps)
                               : apply_chunk8<kGrad, WM, false, true>(tensor, chunk, d, k, codecs, maps);
      } else {
        held = stochastic != 0 ? apply_chunk8<kGrad, WM, true, false>(tensor, chunk, d, k, codecs, maps)
                               : apply_chunk8<kGrad, WM, false, false>(tensor, chunk, d, k, codecs, maps);
      }
    } else if constexpr (W::kNarrow) {
      held = stochastic != 0 ? apply_chunk<kGrad, W, true>(tensor, chunk, d, k) : apply_chunk<kGrad, W, false>(tensor, chunk, d, k);
    } else {
      held = apply_chunk<kGrad, W, false>(tensor, chunk, d, k);
    }
  } else if constexpr (F::kNarrow) {  // stochastic rounding draws bits only where a format rounds with them
    held = stochastic != 0 ? apply_chunk<kGrad, F, true>(tensor, chunk, d, k) : apply_chunk<kGrad, F, false>(tensor, chunk, d, k);
  } else {
    held = apply_chunk<kGrad, F, false>(tensor, chunk, d, k);
  }
  if (held != 0) atomicAdd(held_elements, static_cast<unsigned long long>(held));  // integer: exact
}

// The instantiations the API offers: every gradient format with either model format, fp32 masters
// or (with a bf16 model copy) remainders or no master, and each moment in fp32 or bf16.
template <DType kGrad, DType kModel, MasterFormat kMaster, MomentFormat kM, MomentFormat kV>
void launch_one(dim3 grid, const ApplyArgs& a, unsigned long long* held, cudaStream_t stream) {
  const int stochastic = a.state.rounding == Rounding::stochastic ? 1 : 0;
  HALFSTEP_LAUNCH(grid, kPassThreads, 0, stream, apply_kernel<kGrad, kModel, kMaster, kM, kV>)(
      a.tensors, a.chunks, a.decision, a.consts, held, stochastic, a.codecs);
}

template <DType kGrad, DType kModel, MasterFormat kMaster>
void launch_moments(const StateFormat& s, dim3 grid, const ApplyArgs& a, unsigned long long* held, cudaStream_t stream) {
  using MF = MomentFormat;
  if (s.exp_avg == MF::block8) {  // both moments (StepConfig::validate)
    launch_one<kGrad, kModel, kMaster, MF::block8, MF::block8>(grid, a, held, stream);
  } else if (s.exp_avg == MF::bf16) {
    if (s.exp_avg_sq == MF::bf16) {
      launch_one<kGrad, kModel, kMaster, MF::bf16, MF::bf16>(grid, a, held, stream);
    } else {
      launch_one<kGrad, kModel, kMaster, MF::bf16, MF::f32>(grid, a, held, stream);
    }
  } else if (s.exp_avg_sq == MF::bf16) {
    launch_one<kGrad, kModel, kMaster, MF::f32, MF::bf16>(grid, a, held, stream);
  } else {
    launch_one<kGrad, kModel, kMaster, MF::f32, MF::f32>(grid, a, held, stream);
  }
}

template <DType kGrad>
void launch_for_grad(const ApplyArgs& a, dim3 grid, unsigned long long* held, cudaStream_t stream) {
  if (a.model_dtype == DType::bf16) {
    if (a.state.master == MasterFormat::bf16_remainder) {
      launch_moments<kGrad, DType::bf16, MasterFormat::bf16_remainder>(a.state, grid, a, held, stream);
    } else if (a.state.master == MasterFormat::none) {
      launch_moments<kGrad, DType::bf16, MasterFormat::none>(a.state, grid, a, held, stream);
    } else {
      launch_moments<kGrad, DType::bf16, MasterFormat::f32>(a.state, grid, a, held, stream);
    }
  } else {
    launch_moments<kGrad, DType::f16, MasterFormat::f32>(a.state, grid, a, held, stream);
  }
}

}  // namespace

void launch_apply(const ApplyArgs& a, cudaStream_t stream) {
  if (a.n_chunks == 0) return;
  const dim3 grid(static_cast<unsigned>(a.n_chunks));
  auto* held = reinterpret_cast<unsigned long long*>(&a.report->held_elements);
  switch (a.grad_dtype) {
    case DType::bf16:
      launch_for_grad<DType::bf16>(a, grid, held, stream);
      break;
    case DType::f32:
      launch_for_grad<DType::f32>(a, grid, held, stream);
      break;
    default:
      launch_for_grad<DType::f16>(a, grid, held, stream);
      break;
  }
  HALFSTEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace halfstep::detail
