// halfstep: the checkpoint of the optimizer's own state — scaler, spike detector, step counters,
// the learning rates — and of the configuration it came from, so that a run can stop, move between
// Backend::cuda and Backend::reference, and resume exactly, and a checkpoint from another
// configuration is refused instead of silently misread. (The masters and moments live in the
// caller's buffers.)
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "halfstep/step.hpp"

namespace halfstep {

/// Format version written by encode_state. decode_state also reads version 3, which had no state
/// formats (they read as fp32, the rounding as stochastic with seed 0), and version 2, which had no
/// compute_dtype either (it reads as f16).
inline constexpr std::uint32_t kStateFormatVersion = 4;

/// What a checkpoint holds.
struct SavedState {
  OptimizerState state;  ///< scaler, spike statistics, counters
  /// The configuration at save time. Each group's lr, beta1, beta2, eps and weight_decay are the
  /// values in force then (after set_lr, device_lr or set_group), which FusedAdamW::load_state
  /// restores (set them again after loading to change them). These fields must match when
  /// loading: the number of groups, grad_dtype, model_dtype, every ScalerConfig rule but
  /// init_scale, every SpikeConfig field, and each group's decoupled_weight_decay and
  /// bias_correction (the state was built with them). These may differ: the groups'
  /// hyperparameters and the stochastic-rounding seed (restored), the rounding, compute_dtype, max_grad_norm,
  /// init_scale, host_driven, and the state formats (the buffers are converted by whoever loads
  /// them: load_checkpoint, halfstep.torch).
  StepConfig config;
  std::uint32_t version = kStateFormatVersion;  ///< the format version it was written in
};

/// Encodes `state` and `config` (floating-point fields bit-exact, little-endian, CRC-32 protected).
/// Throws halfstep::Error (invalid_argument) if the config is invalid or the state could not have
/// come from it: a checkpoint that could not be loaded is never written.
HALFSTEP_API std::string encode_state(const OptimizerState& state, const StepConfig& config);

/// Decodes what encode_state wrote and checks it on its own: truncated or extended input, a wrong
/// magic, an unknown version, a checksum mismatch, an invalid recorded configuration or a state
/// that could not have come from it throw halfstep::Error (ErrorKind::corrupt_state).
HALFSTEP_API SavedState decode_state(std::string_view bytes);

/// decode_state, then checks that the checkpoint fits `config` (see SavedState): a mismatch
/// throws halfstep::Error (corrupt_state) naming the field. Returns what to restore.
HALFSTEP_API SavedState load_state(std::string_view bytes, const StepConfig& config);

}  // namespace halfstep
