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
