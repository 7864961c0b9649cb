// Internal: block-wise 8-bit moments, host-and-device so that the reference backend, the host
// tests and pass 2 run the very same code.
//
// A moment stored in 8 bits is a code per element and one fp32 scale per block: the block's
// largest magnitude (its absmax). A code indexes a map of 256 values in [-1, 1] (signed, for
// exp_avg) or [0, 1] (unsigned, for exp_avg_sq's square root); the element's value is
// map[code] · absmax. Both maps are dynamic: seven decades, 1e-7 to 1, each a linear grid over
// [0.1, 1] of its decade whose cell count halves per decade down (the map measured best in
// bench/RESULTS.md, "choosing the 8-bit moment map": the only 8-bit format for exp_avg_sq that was
// unbiased and never 0 on both runs, and the pair with the smallest update error).
//
// exp_avg_sq is stored as the codes of sqrt(v): the update divides by sqrt(v), so a relative step
// of the map is half as large in the update, and the range of seven decades covers fourteen of v.
// A positive sqrt(v) never encodes to 0 (the map's smallest positive value, 3.25e-7 of the absmax,
// instead): an exp_avg_sq decoded as 0 would turn the update into m / eps.
//
// Blocks lie in the whole tensor's index space, never a shard's (block8_geometry): 256 consecutive
// elements of a row, a row's last block holding what is left, a row shorter than 256 one block.
// A shard that starts at a row boundary (FSDP2's Shard(0)) or at a block start therefore holds
// whole blocks, and every rank count encodes every block alike. Tensors of fewer than 4096
// elements, or with rows shorter than 32, keep their moments wide (a row shorter than 32 would
// spend more than an eighth of its codes' bytes on its scale).
#pragma once

#include <cstdint>

#include "halfstep/config.hpp"

namespace halfstep::detail {

inline constexpr int kBlock8 = 256;                 ///< elements per block
inline constexpr std::int64_t kBlock8MinNumel = 4096;  ///< smaller tensors keep wide moments
inline constexpr std::int64_t kBlock8MinRow = 32;      ///< so do tensors with shorter rows

// -- the maps ------------------------------------------------------------------------------------

/// 256 values, ascending; a code is an index.
struct Map8 {
  float value[256];
};

namespace map8_detail {
constexpr double kDecade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
/// The value of cell i of `cells` in decade k: the cell's midpoint on the linear grid over
/// [0.1, 1]·10^(k-6), computed in double and rounded once to fp32.
constexpr float cell(int k, int i, int cells) { return static_cast<float>((0.1 + 0.9 * (i + 0.5) / cells) * kDecade[k]); }
}  // namespace map8_detail

/// The signed dynamic map: 0, +1, and ±127 magnitudes (2^k cells in decade k = 0..6), so +1 and
/// no -1: a block whose absmax is negative stores it as -0.99296875 (its nearest code). Code 127 is 0.
constexpr Map8 make_signed_map8() {
  Map8 m{};
  int at = 0;
  for (int k = 6; k >= 0; --k) {
    for (int i = (1 << k) - 1; i >= 0; --i) m.value[at++] = -map8_detail::cell(k, i, 1 << k);
  }
  m.value[at++] = 0.0f;
  for (int k = 0; k <= 6; ++k) {
    for (int i = 0; i < (1 << k); ++i) m.value[at++] = map8_detail::cell(k, i, 1 << k);
  }
  m.value[at] = 1.0f;
  return m;
}

/// The unsigned dynamic map: 0, 1, and 254 magnitudes (2^(k+1) cells in decade k = 0..6). Code 0 is 0.
constexpr Map8 make_unsigned_map8() {
  Map8 m{};
  int at = 0;
  m.value[at++] = 0.0f;
  for (int k = 0; k <= 6; ++k) {
    for (int i = 0; i < (2 << k); ++i) m.value[at++] = map8_detail::cell(k, i, 2 << k);
  }
  m.value[at] = 1.0f;
  return m;
}

/// The maps' values for host code (device code copies them into shared memory).
inline constexpr Map8 kSignedMap8 = make_signed_map8();
inline constexpr Map8 kUnsignedMap8 = make_unsigned_map8();
inline constexpr std::uint8_t kSignedZero8 = 127;  ///< the signed map's code of 0
inline constexpr std::uint8_t kUnsignedZero8 = 0;  ///< the unsigned map's code of 0

// -- one value -----------------------------------------------------------------------------------

/// The largest code whose value is <= x (0 if none is): eight steps of a binary search, the same
/// number for every x. 128 + 64 + ... + 1 = 255, so no step reads past the map.
HALFSTEP_HD inline int floor_code8(const float* map, float x) {
  int c = 0;
  c += map[c + 128] <= x ? 128 : 0;
  c += map[c + 64] <= x ? 64 : 0;
  c += map[c + 32] <= x ? 32 : 0;
  c += map[c + 16] <= x ? 16 : 0;
  c += map[c + 8] <= x ? 8 : 0;
  c += map[c + 4] <= x ? 4 : 0;
  c += map[c + 2] <= x ? 2 : 0;
  c += map[c + 1] <= x ? 1 : 0;
  return c;
}

/// The code of `x`, a value already divided by its block's absmax (|x| <= 1 up to the rounding of
/// that division; beyond the map's ends the end codes): to the nearest value, a tie to the even
/// code; or stochastically, up with the probability (to 2^-16) that x lies past the lower of its
/// two neighbours, from 16 random bits (`random`'s low half). `positive` (the unsigned map only):
/// the value was positive before its division by the absmax, which may have flushed it to 0, and
/// must not encode to code 0, the map's 0; it takes code 1, the smallest positive value.
HALFSTEP_HD inline std::uint8_t encode8(const float* map, float x, bool stochastic, std::uint32_t random, bool positive) {
  int c = floor_code8(map, x);
  if (c < 255) {
    const float lo = map[c], hi = map[c + 1];
    if (x > lo) {
      const float below = x - lo;
      bool up;
      if (stochastic) {
        // u = (r + 1/2)·2^-16, r uniform in [0, 2^16): P(u·(hi - lo) < below) = below / (hi - lo).
        up = below > (hi - lo) * ((static_cast<float>(random & 0xFFFFu) + 0.5f) * 0x1p-16f);
      } else {
        const float above = hi - x;
        up = below > above || (below == above && (c & 1) != 0);
      }
      c += up ? 1 : 0;
    }
  }
  if (positive && c == 0) c = 1;
  return static_cast<std::uint8_t>(c);
}

/// The scale a block stores for its largest magnitude `absmax` (>= 0, finite): absmax itself, or
/// 0 below fp32's smallest normal (such a block stores zeros: its reciprocal would overflow).
HALFSTEP_HD inline float scale8(float absmax) { return absmax >= 0x1p-126f ? absmax : 0.0f; }
/// What the codes of a block with scale `scale` are computed from: x · inverse8(scale), 0 for a
/// block of zeros (every element then encodes to the map's 0). Scales above 2^126 have subnormal
/// reciprocals and lose precision in the codes; moments never come near.
HALFSTEP_HD inline float inverse8(float scale) { return scale != 0.0f ? 1.0f / scale : 0.0f; }
/// The value of `code` in a block with scale `scale`.
HALFSTEP_HD inline float decode8(const float* map, std::uint8_t code, float scale) { return map[code] * scale; }

// -- one block -------------------------------------------------------------------------------------

/// Encodes the `n` values `x` (1 <= n <= 256) of one block: its scale (scale8 of the largest |x|)
/// and a code per value (encode8 of x · inverse8(scale), with bits `shift` and up of `random[i]`
/// when stochastic; with `never_zero`, a positive value never takes the unsigned map's 0). Returns
/// false, writing nothing, if a value is not finite: the block then
/// keeps what it holds. Pass 2 computes the same codes a warp per block.
HALFSTEP_HD inline bool encode_block8(const float* map, const float* x, int n, bool stochastic, const std::uint32_t* random,
                                      int shift, bool never_zero, std::uint8_t* codes, float& scale) {
  float absmax = 0.0f;
  for (int i = 0; i < n; ++i) {
    if (!(x[i] - x[i] == 0.0f)) return false;  // inf or NaN
    const float a = x[i] < 0.0f ? -x[i] : x[i];
    absmax = a > absmax ? a : absmax;
  }
  scale = scale8(absmax);
  const float inverse = inverse8(scale);
  for (int i = 0; i < n; ++i) {
    codes[i] = encode8(map, x[i] * inverse, stochastic, stochastic ? random[i] >> shift : 0u, never_zero && x[i] > 0.0f);
  }
  return true;
}

// -- the geometry of a tensor's blocks -------------------------------------------------------------

/// Where the blocks of a whole tensor of `numel` elements lie, with rows of `row` elements (0:
/// the tensor is one row). All in the whole tensor's index space.
struct Block8Geometry {
  bool quantized = false;         ///< false: the tensor keeps wide moments (too small, or short
                                  ///< rows) and the members below are 0
  std::int64_t numel = 0;
  std::int64_t row = 0;           ///< elements per row
  std::int64_t blocks_per_row = 0;
  std::int64_t blocks = 0;        ///< scales the whole tensor holds per moment

  // For a quantized tensor only:
  /// The block element `index` belongs to.
  HALFSTEP_HD std::int64_t block_of(std::int64_t index) const {
    return index / row * blocks_per_row + index % row / kBlock8;
  }
  /// Whether a block starts at `index` (a shard may start there), or index is the tensor's end.
  HALFSTEP_HD bool starts_block(std::int64_t index) const {
    return index % row % kBlock8 == 0 || index == numel;
  }
  /// The number of elements of block `b`.
  HALFSTEP_HD std::int64_t block_size(std::int64_t b) const {
    const std::int64_t in_row = b % blocks_per_row;
    return in_row + 1 < blocks_per_row ? kBlock8 : row - in_row * kBlock8;
  }
  /// The scales a piece [begin, end) of the tensor holds (begin a block start; 0 if empty).
  HALFSTEP_HD std::int64_t blocks_in(std::int64_t begin, std::int64_t end) const {
    return end > begin ? block_of(end - 1) - block_of(begin) + 1 : 0;
  }
};

/// The geometry of a tensor of `numel` elements (>= 0) with rows of `row` elements (0 for one row),
/// under the rule above; rows that do not divide numel leave the tensor wide.
HALFSTEP_HD inline Block8Geometry block8_geometry(std::int64_t numel, std::int64_t row) {
  Block8Geometry g;
  const std::int64_t r = row == 0 ? numel : row;
  if (numel >= kBlock8MinNumel && r >= kBlock8MinRow && numel % r == 0) {
    g.quantized = true;
    g.numel = numel;
    g.row = r;
    g.blocks_per_row = (r + kBlock8 - 1) / kBlock8;
    g.blocks = numel / r * g.blocks_per_row;
  }
  return g;
}

}  // namespace halfstep::detail
