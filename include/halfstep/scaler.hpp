// halfstep: the dynamic loss scaler. One transition function, next_state, runs on the host
// (DynamicLossScaler, host-driven steps) and inside the finalize kernel (device-resident steps),
// so both ways of driving it follow the same trajectory bit for bit.
#pragma once

#include <math.h>

#include <cstdint>

#include "halfstep/config.hpp"
#include "halfstep/portable_math.hpp"

namespace halfstep {

/// Counters of a run (steps, attempts, overflows, ...) never exceed this: 2^53, more steps than a
/// run at a million steps a second makes in 280 years. A checkpoint with a larger counter is
/// refused, a step that would pass it throws, and counting saturates here rather than wrap.
inline constexpr std::int64_t kCounterLimit = std::int64_t{1} << 53;

/// `count` + 1, saturating at kCounterLimit.
HALFSTEP_HD inline std::int64_t count_up(std::int64_t count) {
  return count < kCounterLimit ? count + 1 : kCounterLimit;
}

/// Rules of the dynamic loss scale. Defaults follow common practice for fp16 training.
struct HALFSTEP_API ScalerConfig {
  float init_scale = 65536.0f;         ///< scale of the first step; within [min_scale, max_scale]
  float growth_factor = 2.0f;          ///< multiplier after growth_interval clean steps; > 1
  float backoff_factor = 0.5f;         ///< multiplier on overflow; in (0, 1)
  std::int32_t growth_interval = 2000; ///< consecutive clean steps before the scale grows; >= 1
  std::int32_t hysteresis = 1;         ///< overflows tolerated before a backoff; >= 1
  bool consecutive_hysteresis = false; ///< refill hysteresis on every clean step (else on growth)
  float min_scale = 1.0f;              ///< lower clamp; finite and > 0
  float max_scale = 16777216.0f;       ///< upper clamp; finite and >= min_scale
  /// Opt-in: on a clean step whose measured headroom (log2 of format max over the largest scaled
  /// gradient) is at least log2(growth_factor) + headroom_margin_log2, grow at once instead of
  /// waiting for the growth window. Backoff still catches what the final gradients miss.
  bool headroom_growth = false;
  float headroom_margin_log2 = 4.0f;   ///< headroom kept after an early growth; finite and >= 0

  /// Throws halfstep::Error naming the first field that breaks its rule.
  void validate() const;
  /// A scale that never changes: growth and backoff are disabled by clamping (bf16 runs).
  static ScalerConfig constant(float scale);
};

/// Where the scaler stands. Counters are cumulative over the run.
struct HALFSTEP_API ScalerState {
  float scale;                  ///< the loss scale of the next step
  std::int32_t good_steps;      ///< consecutive clean steps since the last growth or overflow
  std::int32_t hysteresis_left; ///< overflows still tolerated before the next backoff
  std::int64_t overflows;       ///< steps with a non-finite gradient
  std::int64_t growths;         ///< times the scale grew
  std::int64_t backoffs;        ///< times the scale was backed off

  /// The state before the first step.
  static ScalerState initial(const ScalerConfig& config);
};

/// Equality of every field, the scale compared bitwise.
HALFSTEP_API bool operator==(const ScalerState& a, const ScalerState& b);
inline bool operator!=(const ScalerState& a, const ScalerState& b) { return !(a == b); }

/// `x` clamped to [lo, hi]; NaN maps to lo, so a scale can never become NaN.
HALFSTEP_HD inline float clamp_scale(float x, float lo, float hi) {
  if (x > hi) return hi;
  if (x >= lo) return x;
  return lo;
}

/// The scaler's transition after one step whose gradients did (`overflow`) or did not contain a
/// non-finite value; `headroom_log2` is the step's measured headroom (StepReport::headroom_log2),
/// used only by the opt-in headroom growth (NaN or +inf: no information). Steps skipped for
/// another reason (a gradient spike) must not call it.
HALFSTEP_HD inline ScalerState next_state(const ScalerState& s, const ScalerConfig& c,
                                          bool overflow, float headroom_log2) {
  ScalerState n = s;
  if (overflow) {
    n.overflows = count_up(s.overflows);
    n.good_steps = 0;
    n.hysteresis_left = s.hysteresis_left - 1;
    if (n.hysteresis_left <= 0) {  // this overflow used up the tolerance: back off, refill
      const float backed = clamp_scale(s.scale * c.backoff_factor, c.min_scale, c.max_scale);
      if (backed != s.scale) n.backoffs = count_up(s.backoffs);
      n.scale = backed;
      n.hysteresis_left = c.hysteresis;
    }
    return n;
  }
  n.good_steps = s.good_steps + 1;
  if (c.consecutive_hysteresis) n.hysteresis_left = c.hysteresis;
  // log2(growth_factor) in float; headroom above it plus the margin means one growth still
  // leaves the margin below the format's maximum.
  const bool room = c.headroom_growth && headroom_log2 < HUGE_VALF &&
                    headroom_log2 >= static_cast<float>(portable_log2(c.growth_factor)) + c.headroom_margin_log2;
  if (n.good_steps >= c.growth_interval || room) {  // a full window of clean steps, or room: grow
    const float grown = clamp_scale(s.scale * c.growth_factor, c.min_scale, c.max_scale);
    if (grown != s.scale) n.growths = count_up(s.growths);
    n.scale = grown;
    n.good_steps = 0;
    n.hysteresis_left = c.hysteresis;
  }
  return n;
}

/// The transition without headroom information (the classic rules).
HALFSTEP_HD inline ScalerState next_state(const ScalerState& s, const ScalerConfig& c,
                                          bool overflow) {
  return next_state(s, c, overflow, NAN);
}

/// Host-side driver around next_state, for trainers that decide on the host.
class HALFSTEP_API DynamicLossScaler {
 public:
  /// Validates `config` (throws halfstep::Error) and starts at config.init_scale.
  explicit DynamicLossScaler(const ScalerConfig& config = {});
  /// The loss scale to multiply the next step's loss by.
  float scale() const { return state_.scale; }
  /// Records one step's verdict; returns true when the step may be applied.
  bool update(bool overflow);
  /// Records one step's verdict and measured headroom (for ScalerConfig::headroom_growth).
  bool update(bool overflow, float headroom_log2);
  /// Where the scaler stands.
  const ScalerState& state() const { return state_; }
  /// The rules it follows.
  const ScalerConfig& config() const { return config_; }
  /// Replaces the state (from a checkpoint); throws halfstep::Error if it breaks the config.
  void set_state(const ScalerState& state);

 private:
  ScalerConfig config_;
  ScalerState state_;
};

/// Throws halfstep::Error if `state` could not have come from `config` (scale out of range or not
/// finite, negative counters, hysteresis outside [1, config.hysteresis]).
HALFSTEP_API void validate_state(const ScalerState& state, const ScalerConfig& config);

}  // namespace halfstep
