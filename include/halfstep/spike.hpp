// halfstep: gradient-spike detection on the unscaled global norm. The statistics are an
// exponential moving average of log‖g‖ and of its variance; a finite norm far above that
// history is a spike, which can be logged or skipped. While the norm is still falling fast (often
// the first few hundred steps) its deviations from the lagging mean inflate the variance, and the
// detector is less sensitive until that history decays (a factor ema_beta per step).
#pragma once

#include <math.h>
#include <cstdint>

#include "halfstep/config.hpp"
#include "halfstep/portable_math.hpp"
#include "halfstep/scaler.hpp"

namespace halfstep {

/// Rules of the spike detector.
struct HALFSTEP_API SpikeConfig {
  bool enabled = false;           ///< off by default
  float z_threshold = 6.0f;       ///< deviations above the mean of log‖g‖ that make a spike; > 0
  float ema_beta = 0.99f;         ///< decay of the moving averages; in (0, 1)
  std::int32_t warmup_steps = 100;///< observations before any step can be a spike; >= 1
  enum class Action { log, skip } action = Action::log;  ///< what a spike does to the step
  float min_std = 0.05f;          ///< floor on the deviation of log‖g‖ (a 5% wobble); >= 0
  std::int32_t max_consecutive = 16;  ///< spikes in a row after which the level is accepted as the
                                      ///< new normal and the statistics restart; >= 1

  /// Throws halfstep::Error naming the first field that breaks its rule.
  void validate() const;
};

/// The detector's statistics. `seen` counts the norms folded into mean and var.
struct SpikeState {
  double mean = 0.0;               ///< EMA of log‖g‖
  double var = 0.0;                ///< EMA variance of log‖g‖
  std::int64_t seen = 0;           ///< observations folded into the statistics
  std::int64_t spikes = 0;         ///< spikes flagged so far
  std::int64_t consecutive = 0;    ///< spikes flagged in a row, up to now
};

/// Equality of every field, doubles compared bitwise.
HALFSTEP_API bool operator==(const SpikeState& a, const SpikeState& b);
inline bool operator!=(const SpikeState& a, const SpikeState& b) { return !(a == b); }

/// Result of observing one norm.
struct SpikeVerdict {
  SpikeState next;  ///< the statistics after the observation
  bool spike;       ///< the norm is a spike
};

/// Observes the unscaled global norm of a step without overflow (overflow steps must not call
/// it). Zero and non-finite norms carry no scale information and leave the statistics alone.
HALFSTEP_HD inline SpikeVerdict observe_norm(const SpikeState& s, const SpikeConfig& c,
                                             double norm) {
  SpikeVerdict r{s, false};
  if (!c.enabled || !(norm > 0.0) || !(norm < HUGE_VAL)) return r;
  const double x = portable_log(norm);  // the same bits on the CPU and the GPU
  if (s.seen == 0) {  // the first observation defines the level
    r.next.mean = x;
    r.next.var = 0.0;
    r.next.seen = 1;
    return r;
  }
  const double deviation = x - s.mean;
  if (s.seen >= c.warmup_steps) {
    double sd = ::sqrt(s.var);
    if (sd < c.min_std) sd = c.min_std;
    if (deviation > static_cast<double>(c.z_threshold) * sd) {
      r.next.spikes = count_up(s.spikes);
      r.next.consecutive = count_up(s.consecutive);
      if (r.next.consecutive <= c.max_consecutive) {  // a spike: statistics stay as they were
        r.spike = true;
        return r;
      }
      // A level that persists is the new normal: restart the statistics from it.
      r.next.spikes = s.spikes;
      r.next.mean = x;
      r.next.var = 0.0;
      r.next.seen = 1;
      r.next.consecutive = 0;
      return r;
    }
  }
  // Fold x into the moving mean and variance (the exponentially weighted form of Welford's update).
  const double a = 1.0 - static_cast<double>(c.ema_beta);
  r.next.mean = s.mean + a * deviation;
  r.next.var = static_cast<double>(c.ema_beta) * (s.var + a * deviation * deviation);
  r.next.seen = count_up(s.seen);
  r.next.consecutive = 0;
  return r;
}

}  // namespace halfstep
