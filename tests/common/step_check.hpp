// Test helper: checking one fused step against the reference step taken from the same inputs,
// with the tolerances derived in adam_bound.hpp. Shared by the GPU tests and the host test that
// runs the kernels' arithmetic on the CPU.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam_bound.hpp"
#include "halfstep/step.hpp"
#include "host_buffers.hpp"

namespace halfstep_test {

/// Bitwise equality of floating-point values.
inline bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }
inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

/// The step configuration most tests use: one group with a little weight decay.
inline halfstep::StepConfig config_for(halfstep::DType grad, halfstep::DType model, float scale,
                                       float max_norm) {
  halfstep::StepConfig c;
  c.grad_dtype = grad;
  c.model_dtype = model;
  c.scaler.init_scale = scale;
  c.max_grad_norm = max_norm;
  c.groups[0].weight_decay = 0.01f;
  return c;
}

/// How much further apart two bf16 moments may be than the fp32 values they were rounded from:
/// rounding (to nearest, or stochastically with the same random bits) moves each value to one of
/// the two bf16 values around it, so two fp32 values within d of each other land within d plus
/// one bf16 ulp (at most 2^-7 of the larger magnitude; 2^-133 below bf16's normal range).
/// The same holds for a weight without a master (MasterFormat::none), rounded to bf16 each step.
inline double bf16_slack(bool bf16, double a, double b) {
  return bf16 ? std::max(std::max(std::fabs(a), std::fabs(b)) * 0x1p-7, 0x1p-133) : 0.0;
}
inline double bf16_moment_slack(halfstep::MomentFormat format, double a, double b) {
  return bf16_slack(format == halfstep::MomentFormat::bf16, a, b);
}

/// Checks one fused step's report and buffers against the reference step taken from the same
/// inputs: verdicts, counters, scales, the norm and the clip coefficient exactly (both sum the
/// squares exactly and round once); masters and moments within adam_bound (bf16 moments, and
/// weights without a master, one bf16 ulp more: bf16_slack); the model copy bitwise equal to the fused step's own master
/// rounded to nearest even; untouched buffers bitwise unchanged. Buffers in another state format
/// are compared as their fp32 values (FlatBuffers::as_f32).
inline void check_step(const halfstep::StepReport& got, const halfstep::StepReport& want,
                       const HostModel& before, const HostModel& gpu_after,
                       const HostModel& ref_after, const halfstep::StepConfig& config,
                       std::int64_t applied_step) {
  using namespace halfstep;
  REQUIRE(got.outcome == want.outcome);
  REQUIRE(got.reason == want.reason);
  REQUIRE(got.held_elements == want.held_elements);
  REQUIRE(got.attempt == want.attempt);
  REQUIRE(got.step == want.step);
  REQUIRE(got.spike == want.spike);
  REQUIRE(got.scale_used == want.scale_used);
  REQUIRE(got.scale_next == want.scale_next);
  REQUIRE(got.nonfinite_count == want.nonfinite_count);
  REQUIRE(got.first_nonfinite_tensor == want.first_nonfinite_tensor);
  REQUIRE(got.first_nonfinite_rank == want.first_nonfinite_rank);
  REQUIRE(got.max_abs_scaled == want.max_abs_scaled);  // a max of exact values: exact
  REQUIRE(got.subnormal_count == want.subnormal_count);
  REQUIRE(got.zero_count == want.zero_count);
  REQUIRE(got.numel == want.numel);
  if (std::isinf(want.headroom_log2)) {
    REQUIRE(got.headroom_log2 == want.headroom_log2);
  } else {  // log2 of the same double on host and device: within one fp32 ulp
    REQUIRE(std::fabs(got.headroom_log2 - want.headroom_log2) <=
            std::fabs(want.headroom_log2) * 1.2e-7 + 1e-30);
  }
  if (want.outcome == Outcome::skipped_overflow) {
    REQUIRE(std::isnan(got.grad_norm));
  } else {
    REQUIRE(same_bits(got.grad_norm, want.grad_norm));
    REQUIRE(same_bits(got.clip_coef, want.clip_coef));
  }
  const double tol = 0.0;  // the norm is exact
  const double clip = config.max_grad_norm > 0.0f && want.outcome == Outcome::applied
                          ? std::min(1.0, static_cast<double>(config.max_grad_norm) /
                                              (want.grad_norm + 1e-6))
                          : 1.0;
  for (std::size_t t = 0; t < before.tensors.size(); ++t) {
    const HostTensor& b = before.tensors[t];
    const HostTensor& g = gpu_after.tensors[t];
    const HostTensor& r = ref_after.tensors[t];
    REQUIRE((g.grad == b.grad && g.grad32 == b.grad32));  // gradients are read, never written
    if (want.outcome != Outcome::applied) {
      REQUIRE(g == b);  // a skipped step writes nothing
      continue;
    }
    const AdamWConfig& h = config.groups[static_cast<std::size_t>(b.group)];
    for (std::size_t i = 0; i < b.master.size(); ++i) {
      const double x = b.grad_value(i);
      const AdamBound bound = adam_bound(b.master[i], b.exp_avg[i], b.exp_avg_sq[i], x,
                                         want.scale_used, clip, tol + 1.2e-7, h, applied_step);
      const std::uint16_t model_want =
          b.with_model ? to_bits16(config.model_dtype, g.master[i]) : b.model[i];
      const double slack_m = bf16_moment_slack(config.state.exp_avg, g.exp_avg[i], r.exp_avg[i]);
      const double slack_v = bf16_moment_slack(config.state.exp_avg_sq, g.exp_avg_sq[i], r.exp_avg_sq[i]);
      const double slack_p = bf16_slack(config.state.master == MasterFormat::none, g.master[i], r.master[i]);
      const bool ok = std::fabs(static_cast<double>(g.master[i]) - r.master[i]) <= bound.p + slack_p &&
                      std::fabs(static_cast<double>(g.exp_avg[i]) - r.exp_avg[i]) <= bound.m + slack_m &&
                      std::fabs(static_cast<double>(g.exp_avg_sq[i]) - r.exp_avg_sq[i]) <= bound.v + slack_v &&
                      g.model[i] == model_want;
      if (!ok) {  // Catch only on failure: millions of elements pass through here
        CAPTURE(t, i, x, b.master[i], g.master[i], r.master[i], bound.p);
        CAPTURE(g.exp_avg[i], r.exp_avg[i], bound.m, g.exp_avg_sq[i], r.exp_avg_sq[i], bound.v);
        CAPTURE(g.model[i], model_want);
        FAIL("element outside its bound (or model copy not the rounded master)");
      }
    }
  }
}

}  // namespace halfstep_test
