// Host side of the spike detector: validation. The transition, observe_norm, is inline in the
// header so the finalize kernel runs the same code.
#include "halfstep/spike.hpp"

#include <cstring>

#include "check.hpp"

namespace halfstep {

using detail::finite;
using detail::require;

void SpikeConfig::validate() const {
  require(finite(z_threshold) && z_threshold > 0.0f,
          "SpikeConfig.z_threshold must be finite and > 0, got ", z_threshold);
  require(ema_beta > 0.0f && ema_beta < 1.0f, "SpikeConfig.ema_beta must be in (0, 1), got ",
          ema_beta);
  require(warmup_steps >= 1, "SpikeConfig.warmup_steps must be >= 1, got ", warmup_steps);
  require(action == Action::log || action == Action::skip,
          "SpikeConfig.action must be log or skip, got ", static_cast<int>(action));
  require(finite(min_std) && min_std >= 0.0f, "SpikeConfig.min_std must be finite and >= 0, got ",
          min_std);
  require(max_consecutive >= 1, "SpikeConfig.max_consecutive must be >= 1, got ",
          max_consecutive);
}

bool operator==(const SpikeState& a, const SpikeState& b) {
  return std::memcmp(&a.mean, &b.mean, sizeof(double)) == 0 &&
         std::memcmp(&a.var, &b.var, sizeof(double)) == 0 && a.seen == b.seen &&
         a.spikes == b.spikes && a.consecutive == b.consecutive;
}

}  // namespace halfstep
