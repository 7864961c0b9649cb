// halfstep: a versioned, checksummed binary encoding of OptimizerState, shared by both backends,
// so a run can move between Backend::cuda and Backend::reference.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "halfstep/step.hpp"

namespace halfstep {

/// Format version written by encode_state.
inline constexpr std::uint32_t kStateFormatVersion = 1;

/// Encodes `state` (floating-point fields bit-exact, little-endian, CRC-32 protected).
std::string encode_state(const OptimizerState& state);

/// Decodes what encode_state wrote. Truncated or extended input, a wrong magic, an unknown
/// version or a checksum mismatch throw halfstep::Error (ErrorKind::corrupt_state).
OptimizerState decode_state(std::string_view bytes);

/// Decodes `bytes` and checks the state against `config` (validate_state); only when both
/// succeed is `target` replaced. Otherwise throws halfstep::Error and `target` is unchanged.
void load_state(OptimizerState& target, std::string_view bytes, const StepConfig& config);

}  // namespace halfstep
