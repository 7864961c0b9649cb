// Conversions between moment values and block8 codes and scales, on the host: what checkpoint
// loads and the C API's encode/decode use (the step encodes on its backend, with the same codec).
#include <cmath>
#include <cstdint>
#include <vector>

#include "block8.hpp"
#include "block8_geometry.hpp"
#include "check.hpp"
#include "halfstep/state.hpp"
#include "halfstep/step.hpp"

namespace halfstep {
namespace {
using detail::require;

// The geometry of the whole tensor `tensor` is a piece of, refused by name where it has no blocks
// (after the shape rules: with `whole_blocks`, those of a step, which cuts pieces where blocks
// start; otherwise a piece may start and end anywhere inside its tensor).
detail::Block8Geometry geometry(const char* what, const ParamTensor& tensor, Slot slot, bool whole_blocks) {
  require(slot == Slot::exp_avg || slot == Slot::exp_avg_sq, what, ": slot must be exp_avg or exp_avg_sq");
  StepConfig config;
  if (whole_blocks) config.state.exp_avg = config.state.exp_avg_sq = MomentFormat::block8;
  detail::check_block_shape("tensor", tensor, config);
  const detail::Block8Geometry g = detail::block8_geometry_of(tensor);
  require(g.quantized, what, ": a tensor of ", detail::whole_numel_of(tensor), " elements in rows of ",
          tensor.row == 0 ? detail::whole_numel_of(tensor) : tensor.row,
          " has no blocks: it keeps its moments in fp32 (fewer than 4096 elements, rows shorter than 32, or rows "
          "that do not divide it)");
  require(tensor.offset <= g.numel - tensor.numel, what, ": the piece [", tensor.offset, ", ",
          tensor.offset + tensor.numel, ") runs past its tensor's ", g.numel, " elements");
  return g;
}

}  // namespace

void encode_moment(const ParamTensor& tensor, Slot slot, const float* values, std::uint8_t* codes, float* scales) {
  const detail::Block8Geometry g = geometry("encode_moment", tensor, slot, true);
  const std::int64_t first = g.block_of(tensor.offset);
  const std::int64_t blocks = g.blocks_in(tensor.offset, tensor.offset + tensor.numel);
  const bool sq = slot == Slot::exp_avg_sq;
  require(tensor.numel == 0 || (values != nullptr && codes != nullptr && scales != nullptr),
          "encode_moment: values, codes and scales must not be null");
  for (std::int64_t i = 0; i < tensor.numel; ++i) {
    require(std::isfinite(values[i]), "encode_moment: values[", i, "] is not finite");
    require(!sq || values[i] >= 0.0f, "encode_moment: exp_avg_sq's values[", i, "] is negative");
  }
  std::int64_t at = 0;
  for (std::int64_t k = 0; k < blocks; ++k) {
    const auto n = static_cast<int>(g.block_size(first + k));
    float in[detail::kBlock8];
    for (int j = 0; j < n; ++j) in[j] = sq ? static_cast<float>(std::sqrt(static_cast<double>(values[at + j]))) : values[at + j];
    // Finite, checked above: every block encodes.
    (void)detail::encode_block8(sq ? detail::kUnsignedCodec8 : detail::kSignedCodec8, in, n, false, nullptr, 0, sq,
                                codes + at, scales[k]);
    at += n;
  }
}

void decode_moment(const ParamTensor& tensor, Slot slot, const std::uint8_t* codes, const float* scales,
                   float* values) {
  const detail::Block8Geometry g = geometry("decode_moment", tensor, slot, false);
  const std::int64_t first = g.block_of(tensor.offset);
  const std::int64_t blocks = g.blocks_in(tensor.offset, tensor.offset + tensor.numel);
  require(tensor.numel == 0 || (values != nullptr && codes != nullptr && scales != nullptr),
          "decode_moment: codes, scales and values must not be null");
  for (std::int64_t k = 0; k < blocks; ++k) {
    require(std::isfinite(scales[k]) && scales[k] >= 0.0f, "decode_moment: scales[", k, "] must be finite and >= 0");
  }
  const bool sq = slot == Slot::exp_avg_sq;
  const detail::Codec8& codec = sq ? detail::kUnsignedCodec8 : detail::kSignedCodec8;
  for (std::int64_t i = 0; i < tensor.numel; ++i) {
    const double x = detail::decode8(codec, codes[i], scales[g.block_of(tensor.offset + i) - first]);
    values[i] = static_cast<float>(sq ? x * x : x);
  }
}

}  // namespace halfstep
