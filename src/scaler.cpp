// Host side of the loss scaler: validation and the DynamicLossScaler driver. The transition
// itself, next_state, is inline in the header so the finalize kernel runs the same code.
#include "halfstep/scaler.hpp"

#include <cstring>
#include <limits>

#include "check.hpp"

namespace halfstep {

using detail::finite;
using detail::require;

void ScalerConfig::validate() const {
  require(finite(growth_factor) && growth_factor > 1.0f,
          "ScalerConfig.growth_factor must be finite and > 1, got ", growth_factor);
  require(backoff_factor > 0.0f && backoff_factor < 1.0f,
          "ScalerConfig.backoff_factor must be in (0, 1), got ", backoff_factor);
  require(growth_interval >= 1, "ScalerConfig.growth_interval must be >= 1, got ", growth_interval);
  require(hysteresis >= 1, "ScalerConfig.hysteresis must be >= 1, got ", hysteresis);
  require(finite(min_scale) && min_scale >= 0x1p-126f,
          "ScalerConfig.min_scale must be a normal fp32 number >= 2^-126 (1.18e-38), so that 1/S is "
          "a finite fp32 number, got ", min_scale);
  require(finite(max_scale) && max_scale >= min_scale,
          "ScalerConfig.max_scale must be finite and >= min_scale (", min_scale, "), got ",
          max_scale);
  require(finite(headroom_margin_log2) && headroom_margin_log2 >= 0.0f,
          "ScalerConfig.headroom_margin_log2 must be finite and >= 0, got ", headroom_margin_log2);
  require(init_scale >= min_scale && init_scale <= max_scale,
          "ScalerConfig.init_scale must be in [min_scale, max_scale] = [", min_scale, ", ",
          max_scale, "], got ", init_scale);
}

ScalerConfig ScalerConfig::constant(float scale) {
  ScalerConfig c;
  c.init_scale = scale;
  c.min_scale = scale;
  c.max_scale = scale;
  c.growth_interval = std::numeric_limits<std::int32_t>::max();
  return c;
}

ScalerState ScalerState::initial(const ScalerConfig& config) {
  return ScalerState{config.init_scale, 0, config.hysteresis, 0, 0, 0};
}

bool operator==(const ScalerState& a, const ScalerState& b) {
  return std::memcmp(&a.scale, &b.scale, sizeof(float)) == 0 && a.good_steps == b.good_steps &&
         a.hysteresis_left == b.hysteresis_left && a.overflows == b.overflows &&
         a.growths == b.growths && a.backoffs == b.backoffs;
}

void validate_state(const ScalerState& s, const ScalerConfig& c) {
  require(s.scale >= c.min_scale && s.scale <= c.max_scale,
          "ScalerState.scale must be in [min_scale, max_scale] = [", c.min_scale, ", ",
          c.max_scale, "], got ", s.scale);
  require(s.good_steps >= 0 && s.good_steps < c.growth_interval,
          "ScalerState.good_steps must be in [0, growth_interval) = [0, ", c.growth_interval,
          "), got ", s.good_steps);
  require(s.hysteresis_left >= 1 && s.hysteresis_left <= c.hysteresis,
          "ScalerState.hysteresis_left must be in [1, hysteresis] = [1, ", c.hysteresis,
          "], got ", s.hysteresis_left);
  auto counter = [](std::int64_t value, const char* name) {
    require(value >= 0 && value <= kCounterLimit, "ScalerState.", name,
            " must be in [0, kCounterLimit = 2^53], got ", value);
  };
  counter(s.overflows, "overflows");
  counter(s.growths, "growths");
  counter(s.backoffs, "backoffs");
}

DynamicLossScaler::DynamicLossScaler(const ScalerConfig& config) : config_(config) {
  config_.validate();
  state_ = ScalerState::initial(config_);
}

bool DynamicLossScaler::update(bool overflow) {
  state_ = next_state(state_, config_, overflow);
  return !overflow;
}

bool DynamicLossScaler::update(bool overflow, float headroom_log2) {
  state_ = next_state(state_, config_, overflow, headroom_log2);
  return !overflow;
}

void DynamicLossScaler::set_state(const ScalerState& state) {
  validate_state(state, config_);
  state_ = state;
}

}  // namespace halfstep
