// Test helper: a 200-step free-running comparison of a fused step against the reference, with
// random overflow injection. Shared by the GPU suite (the real kernels) and a host test (the
// kernels' arithmetic on the CPU), so the tolerance logic itself is exercised without a GPU.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "adam_bound.hpp"
#include "halfstep/reference.hpp"
#include "host_buffers.hpp"
#include "step_check.hpp"

namespace halfstep_test {

/// The fused step under test, as the harness drives it.
struct FusedSide {
  virtual ~FusedSide() = default;
  /// Takes the gradients of `grads` and runs one step.
  virtual halfstep::StepReport step(const HostModel& grads) = 0;
  /// The side's buffers now, shaped like `like`.
  virtual HostModel buffers(const HostModel& like) = 0;
};

/// Runs `steps` steps on `side` and on the reference from the same start `h` (whose buffers the side
/// must hold too). Verdicts, scales and counters must agree exactly at every step; masters must
/// stay within the CarriedBound accumulated over the applied steps. Requires decoupled decay.
inline void free_running_trajectory(FusedSide& side, HostModel h, const halfstep::StepConfig& c,
                                    std::uint64_t seed, int steps = 200) {
  using namespace halfstep;
  REQUIRE(c.groups.size() == 1);
  REQUIRE(c.groups[0].decoupled_weight_decay);
  const AdamWConfig& hp = c.groups[0];
  HostModel ref = h;
  OptimizerState ref_state = OptimizerState::initial(c);
  std::vector<std::vector<CarriedBound>> bound(h.tensors.size());
  for (std::size_t t = 0; t < h.tensors.size(); ++t) bound[t].resize(h.tensors[t].master.size());
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  int skipped = 0;
  for (int step = 1; step <= steps; ++step) {
    for (std::size_t t = 0; t < h.tensors.size(); ++t) {
      refill_grads(g, h.tensors[t], c.grad_dtype, ref_state.scaler.scale);
    }
    if (u(g) < 0.1) {  // an injected NaN in the last tensor
      auto& last = h.tensors.back().grad;
      last[static_cast<std::size_t>(step * 97) % last.size()] = 0x7E00;
    }
    for (std::size_t t = 0; t < h.tensors.size(); ++t) ref.tensors[t].grad = h.tensors[t].grad;
    const HostModel ref_before = ref;
    const StepReport got = side.step(h);
    const StepReport want = reference::step(ref.views(), c, ref_state);
    CAPTURE(step);
    REQUIRE(got.outcome == want.outcome);
    REQUIRE(got.scale_used == want.scale_used);
    REQUIRE(got.scale_next == want.scale_next);
    REQUIRE(got.step == want.step);
    REQUIRE(got.nonfinite_count == want.nonfinite_count);
    skipped += got.outcome != Outcome::applied;
    if (want.outcome != Outcome::applied) continue;
    const double clip = c.max_grad_norm > 0.0f
                            ? std::min(1.0, static_cast<double>(c.max_grad_norm) / (want.grad_norm + 1e-6))
                            : 1.0;
    const double clip_tol = 1.2e-7;  // the norm is exact; the factor clip/S rounds once to fp32
    for (std::size_t t = 0; t < h.tensors.size(); ++t) {
      const HostTensor& b = ref_before.tensors[t];
      for (std::size_t i = 0; i < b.master.size(); ++i) {
        bound[t][i].add_step(adam_bound(b.master[i], b.exp_avg[i], b.exp_avg_sq[i],
                                        from_bits16(c.grad_dtype, b.grad[i]), want.scale_used,
                                        clip, clip_tol, hp, ref_state.step),
                             hp);
      }
    }
  }
  const HostModel fused = side.buffers(h);
  double widest = 0.0;
  for (std::size_t t = 0; t < h.tensors.size(); ++t) {
    for (std::size_t i = 0; i < fused.tensors[t].master.size(); ++i) {
      const double diff = std::fabs(static_cast<double>(fused.tensors[t].master[i]) - ref.tensors[t].master[i]);
      widest = std::max(widest, bound[t][i].p);
      if (diff > bound[t][i].p) {
        CAPTURE(t, i, diff, bound[t][i].p);
        FAIL("master drifted beyond its carried bound");
      }
    }
  }
  CHECK(widest < 1e-3);  // far below the displacement of 200 steps of size ~lr = 1e-3
  CHECK(skipped >= steps / 40);  // about one step in ten overflows
}

}  // namespace halfstep_test
