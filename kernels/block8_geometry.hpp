// Internal: where the blocks of block8 moments lie in a tensor (the rest of the format is in
// block8.hpp). Apart so that the tensor table (step_types.hpp) can hold a tensor's geometry.
#pragma once

#include <cstdint>
#include <string>

#include "halfstep/config.hpp"
#include "halfstep/step.hpp"

namespace halfstep::detail {

inline constexpr int kBlock8 = 256;                    ///< elements per block
inline constexpr std::int64_t kBlock8MinNumel = 4096;  ///< smaller tensors keep wide moments
inline constexpr std::int64_t kBlock8MinRow = 32;      ///< so do tensors with shorter rows

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
  /// The first block that starts at or after element `index` (blocks when index is numel).
  HALFSTEP_HD std::int64_t first_block_from(std::int64_t index) const {
    return index / row * blocks_per_row + (index % row + kBlock8 - 1) / kBlock8;
  }
  /// The element block `b` starts at.
  HALFSTEP_HD std::int64_t block_start(std::int64_t b) const {
    return b / blocks_per_row * row + b % blocks_per_row * kBlock8;
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

/// Unsigned 32-bit division by a divisor fixed at setup, with a multiply instead of a division
/// (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994, fig.
/// 4.1): for 1 <= d < 2^32 and l = ceil(log2 d), m = floor(2^32 · (2^l - d) / d) + 1 and
/// q = (t + ((n - t) >> min(l, 1))) >> max(l - 1, 0) with t = the high word of m·n give
/// q = floor(n / d) for every n < 2^32. Pass 2 finds a block's row with it (blocks_per_row).
struct Divisor32 {
  std::uint32_t magic = 1;
  std::uint8_t shift1 = 0, shift2 = 0;
  std::uint8_t pad_[2] = {0, 0};
  HALFSTEP_HD std::uint32_t divide(std::uint32_t n) const {
    const std::uint32_t t = static_cast<std::uint32_t>((static_cast<std::uint64_t>(magic) * n) >> 32);
    return (t + ((n - t) >> shift1)) >> shift2;
  }
};

/// The Divisor32 of d (1 <= d < 2^32).
inline Divisor32 divisor32(std::uint32_t d) {
  int l = 0;
  while (l < 32 && (std::uint64_t{1} << l) < d) ++l;
  Divisor32 v;
  v.magic = static_cast<std::uint32_t>(((std::uint64_t{1} << 32) * ((std::uint64_t{1} << l) - d)) / d + 1);
  v.shift1 = static_cast<std::uint8_t>(l < 1 ? l : 1);
  v.shift2 = static_cast<std::uint8_t>(l > 1 ? l - 1 : 0);
  return v;
}

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

/// The elements of the whole tensor `t` is (a piece of): ParamTensor::whole_numel, or its own
/// numel where that is 0.
inline std::int64_t whole_numel_of(const ParamTensor& t) { return t.whole_numel != 0 ? t.whole_numel : t.numel; }

/// The geometry of the whole tensor `t` is (a piece of).
inline Block8Geometry block8_geometry_of(const ParamTensor& t) { return block8_geometry(whole_numel_of(t), t.row); }

#if !defined(__CUDACC__)
/// The rules of a tensor's shape under `config` (numel, offset, whole_numel, row; under block8 a
/// piece with whole_numel, inside its tensor, a row that divides it, cut where blocks start), as
/// validate applies them: throws halfstep::Error naming `what` (e.g. "tensors[3]") and the rule.
void check_block_shape(const std::string& what, const ParamTensor& p, const StepConfig& config);
#endif

}  // namespace halfstep::detail
