// Internal: the scalar math of the fused step, host-and-device so that host tests can check it
// against the CPU reference. decide() is what the finalize kernel runs after reducing the
// partials; adamw_update() is what every thread of pass 2 runs per element.
#pragma once

#include <math.h>
#include <string.h>

#include <cstdint>

#include "exact_sum.hpp"
#include "halfstep/config.hpp"
#include "halfstep/portable_math.hpp"
#include "state_codec.hpp"
#include "halfstep/distributed.hpp"
#include "step_types.hpp"

namespace halfstep::detail {

static_assert(kSumLimbs == StepTotals::kSumLimbs && StepTotals::kSumWords == kSumLimbs + 4,
              "StepTotals holds the limbs, then four counts");

/// The value of a magnitude pattern of the gradient format (15 bits of f16 or bf16, 31 of f32),
/// exactly.
HALFSTEP_HD inline float magnitude_value(std::uint32_t bits, DType format) {
  bits &= format_bits(format).magnitude();
  if (format == DType::f32) {
    float x;
    ::memcpy(&x, &bits, sizeof x);
    return x;
  }
  if (format == DType::bf16) {
    const int e = static_cast<int>(bits >> 7);
    const double significand = static_cast<double>((bits & 0x7Fu) | (e != 0 ? 0x80u : 0u));
    return static_cast<float>(::ldexp(significand, (e != 0 ? e : 1) - 134));
  }
  const int e = static_cast<int>(bits >> 10);
  const double significand = static_cast<double>((bits & 0x3FFu) | (e != 0 ? 0x400u : 0u));
  return static_cast<float>(::ldexp(significand, (e != 0 ? e : 1) - 25));
}

/// The pattern of infinity in the gradient format (NaN patterns lie above it).
HALFSTEP_HD inline std::uint32_t infinity_pattern(DType format) { return format_bits(format).infinity(); }

/// One more 64-bit word into a fingerprint (splitmix64's finalizer over the running value).
HALFSTEP_HD inline std::uint64_t fingerprint_add(std::uint64_t h, std::uint64_t word) {
  std::uint64_t z = (h ^ word) + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// The scale the gradients of this step are divided by: the optimizer's own (`own`), or an
/// external scaler's; 1 for gradients already unscaled.
HALFSTEP_HD inline float step_scale(const ScaleInputs& in, float own) { return in.external ? in.external_scale : own; }

/// The fingerprint of what a rank steps with, for the record's max[2] and max[3]: every group's
/// learning rate as the step reads it and its fixed values, max_grad_norm, and how the gradients
/// are unscaled — the loss scale (`own`, or the external one), whether they came unscaled, and
/// whether an external scaler found an inf/NaN — and set_gradients' key of which tensors have a
/// gradient. Ranks that must take the same step compare it through the all-reduce: a rank with
/// another rate, another loss scale or other gradients present makes every rank skip.
HALFSTEP_HD inline std::uint64_t hyperparameter_fingerprint(const GroupParams* groups, const float* lr,
                                                            std::int32_t n_groups, float max_grad_norm,
                                                            const ScaleInputs& in, float own, std::uint64_t grads_key) {
  std::uint64_t h = fingerprint_add(0, static_cast<std::uint64_t>(n_groups));
  h = fingerprint_add(h, grads_key);
  h = fingerprint_add(h, double_bits(static_cast<double>(max_grad_norm)));
  h = fingerprint_add(h, double_bits(static_cast<double>(step_scale(in, own))));
  h = fingerprint_add(h, static_cast<std::uint64_t>(in.unscaled != 0) | static_cast<std::uint64_t>(in.external != 0) << 1 |
                             static_cast<std::uint64_t>(in.found_inf != 0.0f) << 2);
  for (std::int32_t i = 0; i < n_groups; ++i) {
    const GroupParams& g = groups[i];
    h = fingerprint_add(h, double_bits(static_cast<double>(lr[i])));
    h = fingerprint_add(h, double_bits(static_cast<double>(g.beta1)));
    h = fingerprint_add(h, double_bits(static_cast<double>(g.beta2)));
    h = fingerprint_add(h, double_bits(static_cast<double>(g.eps)));
    h = fingerprint_add(h, double_bits(static_cast<double>(g.weight_decay)));
    h = fingerprint_add(h, static_cast<std::uint64_t>(g.decoupled) << 1 | g.bias_correction);
    h = fingerprint_add(h, static_cast<std::uint64_t>(g.step_offset));
  }
  return h;
}

/// base^n for n >= 0 by repeated squaring in double: the same bits on every machine and on the
/// device (a library's pow may differ in its last bit between the two), for the bias corrections.
/// About 2·log2(n) roundings, far below the fp32 rounding of what they feed.
HALFSTEP_HD inline double power(double base, std::int64_t n) {
  double result = 1.0, square = base;
  for (std::int64_t e = n; e > 0; e >>= 1) {
    if ((e & 1) != 0) result *= square;
    square *= square;
  }
  return result;
}

/// The step count a group's bias corrections use at applied step `t`: t less the steps taken
/// before the group joined, at least 1.
HALFSTEP_HD inline std::int64_t group_step(const GroupParams& g, std::int64_t t) {
  return t > g.step_offset ? t - g.step_offset : 1;
}

/// The mark of a rank that refused its step (max[2] and max[3] both all ones): no fingerprint
/// takes either value, so after MAX, max[2] holds it exactly when some rank refused.
inline constexpr std::uint64_t kRefusedMark = ~std::uint64_t{0};

/// Stores a rank's fingerprint in its record: MAX keeps the largest fingerprint in max[2] and the
/// complement of the smallest in max[3]. Fingerprints are kept inside [1, 2^64 - 2], clear of
/// kRefusedMark in both words.
HALFSTEP_HD inline void set_fingerprint(StepTotals& r, std::uint64_t fingerprint) {
  if (fingerprint == 0) fingerprint = 1;
  if (fingerprint == kRefusedMark) fingerprint = kRefusedMark - 1;
  r.max[2] = fingerprint;
  r.max[3] = ~fingerprint;
}

/// The record of a rank that refused its own step: no elements, and kRefusedMark in max[2] and
/// max[3]. Reduced with the others' records, it makes every rank skip with
/// SkipReason::rank_refused.
HALFSTEP_HD inline StepTotals refused_record() {
  StepTotals r;
  for (int i = 0; i < StepTotals::kSumWords; ++i) r.sum[i] = 0;
  r.max[0] = r.max[1] = 0;
  r.max[2] = r.max[3] = kRefusedMark;
  return r;
}

/// Checks `r` against every rule; `t` is r decoded by decode_totals.
HALFSTEP_HD inline TotalsFault totals_fault(const StepTotals& r, const Totals& t, DType format) {
  constexpr std::uint64_t kSign = 0x8000000000000000ull;
  for (int i = kSumLimbs; i < StepTotals::kSumWords; ++i) {
    if (r.sum[i] >= kSign) return TotalsFault::count_past_int64;
  }
  // Both below 2^63, so the sum cannot wrap.
  if (r.sum[kSumLimbs + 1] + r.sum[kSumLimbs + 2] > r.sum[kSumLimbs + 3]) return TotalsFault::counts_past_numel;
  if (r.max[0] >= infinity_pattern(format)) return TotalsFault::max_not_finite;
  if ((r.max[1] == 0) != (r.sum[kSumLimbs] == 0)) return TotalsFault::key_count_mismatch;
  if (r.max[1] != 0 && ((r.max[1] >> 32) < 0x80000000u || (r.max[1] & 0xFFFFFFFFu) < 0x80000000u)) {
    return TotalsFault::malformed_key;
  }
  // A refusing rank marks both words; MAX with any fingerprint keeps both marks.
  if (r.max[2] == kRefusedMark && r.max[3] != kRefusedMark) return TotalsFault::half_refusal_mark;
  // Each of the numel squares is at most max|g|² (exact in double); the bound is computed with
  // two roundings (numel, the product) and Σg² was rounded once, each at most 2^-52 relative:
  // a margin of 2^-40 covers them and no real excess hides in it.
  const double max_abs = static_cast<double>(t.max_abs);
  if (t.sum_sq > static_cast<double>(t.numel) * (max_abs * max_abs) * (1.0 + 0x1p-40)) {
    return TotalsFault::sum_past_bound;
  }
  return TotalsFault::none;
}

/// Decodes a (reduced) StepTotals record into the decision's totals: Σg² rounded once to nearest.
HALFSTEP_HD inline Totals decode_totals(const StepTotals& r, DType format) {
  std::uint64_t limbs[kSumLimbs];
  for (int i = 0; i < kSumLimbs; ++i) limbs[i] = r.sum[i];
  limbs_normalize(limbs);
  Totals t;
  t.sum_sq = limbs_to_double(limbs);
  t.nonfinite = static_cast<std::int64_t>(r.sum[kSumLimbs]);
  t.subnormal = static_cast<std::int64_t>(r.sum[kSumLimbs + 1]);
  t.zero = static_cast<std::int64_t>(r.sum[kSumLimbs + 2]);
  t.numel = static_cast<std::int64_t>(r.sum[kSumLimbs + 3]);
  t.max_abs = magnitude_value(static_cast<std::uint32_t>(r.max[0]), format);
  const std::uint64_t key = r.max[1];
  if (key != 0) {
    t.first_nonfinite_rank = static_cast<std::int32_t>(0xFFFFFFFFu - static_cast<std::uint32_t>(key >> 32));
    t.first_nonfinite_tensor = static_cast<std::int32_t>(0xFFFFFFFFu - static_cast<std::uint32_t>(key));
  }
  t.fault = totals_fault(r, t, format);
  t.hyperparameters_agree = r.max[2] == ~r.max[3];
  t.rank_refused = r.max[2] == kRefusedMark;
  return t;
}

/// Why a record that is not acted on is not: the first rule it breaks, in the order the step checks.
HALFSTEP_HD inline SkipReason inconsistent_reason(const Totals& t) {
  if (t.fault != TotalsFault::none) return SkipReason::inconsistent_totals;
  if (t.rank_refused) return SkipReason::rank_refused;
  return SkipReason::hyperparameters_differ;
}

/// The record's key for the first inf/NaN at (rank, tensor): larger for lower ranks, then lower
/// tensors, so MAX finds the first.
HALFSTEP_HD inline std::uint64_t first_bad_key(std::int32_t rank, std::int32_t tensor) {
  return (static_cast<std::uint64_t>(0xFFFFFFFFu - static_cast<std::uint32_t>(rank)) << 32) |
         (0xFFFFFFFFu - static_cast<std::uint32_t>(tensor));
}

/// Stores c > 0 as pre · coef · post_a · post_b (see Decision), c = coef · 2^e. For e > 0 half the
/// exponent comes first, lifting a subnormal bf16 gradient into fp32's normal range before coef
/// rounds it; for e <= 0 it all comes after, split in two so each factor is an fp32 number. The
/// product moves monotonically towards its final magnitude, so no intermediate leaves the range
/// the result lies in. Exponents stop at -149, the smallest fp32 power of two (c < 2^-298 takes
/// every fp16/bf16 gradient below fp32's range anyway).
HALFSTEP_HD inline void set_coefficient(Decision& d, double c) {
  int e = 0;
  const double m = ::frexp(c, &e);  // c = m · 2^e, m in [0.5, 1)
  int pre = 0, a = 0, b = 0;
  if (e > 0) {
    pre = (e + 1) / 2;
    a = e - pre;
  } else {
    a = e / 2;
    if (a < -149) a = -149;
    b = e - a;
    if (b < -149) b = -149;
  }
  d.coef = static_cast<float>(m);
  d.pre = static_cast<float>(::ldexp(1.0, pre));
  d.post_a = static_cast<float>(::ldexp(1.0, a));
  d.post_b = static_cast<float>(::ldexp(1.0, b));
}

/// The unscaled, clipped gradient raw · clip / S, rounded once (by coef) where it is an fp32
/// normal number; the powers of two are exact.
HALFSTEP_HD inline float unscale(float raw, const Decision& d) {
  return raw * d.pre * d.coef * d.post_a * d.post_b;
}

/// Why applying a step whose largest unscaled, clipped gradient is `g_max` (computed in double
/// from pass 1's max|g|) could not give finite fp32 values, or SkipReason::none. These are the
/// cases finalize can decide before anything is written; every rule is evaluated in double in a
/// fixed order, so the reference backend, which states the same rules independently, reaches
/// the same verdict bit for bit. `t` is the applied-step counter the step would have.
HALFSTEP_HD inline SkipReason range_check(double g_max, const GroupParams* groups, const float* lr,
                                          std::int32_t n_groups, std::int64_t t) {
  const double fp32_max = 3.4028234663852886e38;  // FLT_MAX
  for (std::int32_t i = 0; i < n_groups; ++i) {
    const double rate = lr[i];
    if (!(rate >= 0.0 && rate <= fp32_max)) return SkipReason::invalid_learning_rate;  // NaN too
    if (groups[i].decoupled && rate * static_cast<double>(groups[i].weight_decay) >= 1.0) {
      return SkipReason::invalid_learning_rate;
    }
  }
  if (!(g_max <= fp32_max)) return SkipReason::gradient_exceeds_fp32;
  for (std::int32_t i = 0; i < n_groups; ++i) {
    const GroupParams& g = groups[i];
    if ((1.0 - static_cast<double>(g.beta2)) * g_max * g_max > fp32_max) {
      return SkipReason::second_moment_exceeds_fp32;
    }
    const double bc1 = g.bias_correction ? 1.0 - power(static_cast<double>(g.beta1), group_step(g, t)) : 1.0;
    const float step_size = static_cast<float>(static_cast<double>(lr[i]) / bc1);
    if (!(step_size <= 3.40282347e38f)) return SkipReason::step_size_exceeds_fp32;
  }
  return SkipReason::none;
}

/// Turns one step's totals into the outcome, the report, the decision for pass 2 and the next
/// state. `groups` and `lr` (the learning rates as they are now, in device memory on the device)
/// hold `n_groups` entries. `in` says how the gradients were scaled: by the optimizer's own scale,
/// or by an external scaler's (whose found_inf skips the step, and whose scale the optimizer's
/// own scaler leaves alone); unscaled: already divided by the scale, so they are unscaled by 1,
/// and the headroom is that of the gradients times the scale. Every field of `report` is written
/// here (held_elements = 0; pass 2 adds to it).
HALFSTEP_HD inline void decide(const Totals& totals, OptimizerState& state, const DecideParams& p,
                               const GroupParams* groups, const float* lr, std::int32_t n_groups,
                               const ScaleInputs& in, StepReport& report, Decision& decision) {
  const bool unscaled = in.unscaled != 0;
  const bool own_scaler = p.device_scaler && in.external == 0;  // the optimizer's scaler moves
  const float scale = step_scale(in, state.scaler.scale);
  const double divisor = unscaled ? 1.0 : static_cast<double>(scale);  // what unscales the gradients
  state.attempts = count_up(state.attempts);
  report.attempt = state.attempts;
  report.scale_used = scale;
  report.spike = false;
  report.reason = SkipReason::none;
  report.held_elements = 0;
  report.nonfinite_count = totals.nonfinite;
  report.first_nonfinite_tensor = totals.first_nonfinite_tensor;
  report.first_nonfinite_rank = totals.first_nonfinite_rank;
  const double max_scaled = unscaled ? static_cast<double>(totals.max_abs) * scale : totals.max_abs;
  report.max_abs_scaled = static_cast<float>(max_scaled);
  report.headroom_log2 = max_scaled > 0.0 ? static_cast<float>(portable_log2(static_cast<double>(p.format_max) / max_scaled))
                                          : HUGE_VALF;
  report.subnormal_count = totals.subnormal;
  report.zero_count = totals.zero;
  report.numel = totals.numel;
  decision.apply = 0;
  decision.coef = 0.0f;
  decision.rounding_key = 0;
  decision.pad_ = 0;
  decision.pre = decision.post_a = decision.post_b = 1.0f;

  if (totals.fault != TotalsFault::none || totals.rank_refused || !totals.hyperparameters_agree) {
    // A record no reduction of this step's records gives, a rank that refused its step, or ranks
    // that would not take the same step: nothing is written and nothing advances but the attempt.
    report.outcome = Outcome::skipped_inconsistent;
    report.reason = inconsistent_reason(totals);
    report.grad_norm = NAN;
    report.clip_coef = NAN;
  } else if (totals.nonfinite > 0 || in.found_inf != 0.0f) {
    // Overflow (ours, or the external scaler's check): nothing may be written; the scaler backs off.
    if (own_scaler) state.scaler = next_state(state.scaler, p.scaler, true);
    report.outcome = Outcome::skipped_overflow;
    report.reason = totals.nonfinite > 0 ? SkipReason::nonfinite_gradient : SkipReason::external_found_inf;
    report.grad_norm = NAN;
    report.clip_coef = NAN;
  } else if (!(scale > 0.0f && scale <= 3.40282347e38f)) {
    // An external scale that is not a finite positive number (only the optimizer's own is
    // checked where it is set): no gradient can be unscaled by it.
    report.outcome = Outcome::skipped_nonfinite_update;
    report.reason = SkipReason::invalid_loss_scale;
    report.grad_norm = NAN;
    report.clip_coef = NAN;
  } else {
    // The norm of the unscaled gradient, from the same read that checked it.
    const double norm = ::sqrt(totals.sum_sq) / divisor;
    double clip = 1.0;
    if (p.max_grad_norm > 0.0f) {
      clip = static_cast<double>(p.max_grad_norm) / (norm + 1e-6);
      if (clip > 1.0) clip = 1.0;
    }
    report.grad_norm = norm;
    report.clip_coef = static_cast<float>(clip);
    const double factor = clip / divisor;
    const SkipReason range = range_check(static_cast<double>(totals.max_abs) * factor, groups, lr,
                                         n_groups, count_up(state.step));
    if (range != SkipReason::none) {
      // Finite gradients, an update that would not be: nothing is written and nothing advances
      // (the scale, the spike statistics, the applied-step counter); only the attempt counts.
      report.outcome = Outcome::skipped_nonfinite_update;
      report.reason = range;
    } else {
      const SpikeVerdict verdict = observe_norm(state.spike, p.spike, norm);
      state.spike = verdict.next;
      report.spike = verdict.spike;
      if (verdict.spike && p.spike.action == SpikeConfig::Action::skip) {
        report.outcome = Outcome::skipped_spike;  // the scale stays, nothing advances
        report.reason = SkipReason::spike;
      } else {
        state.step = count_up(state.step);
        if (own_scaler) state.scaler = next_state(state.scaler, p.scaler, false, report.headroom_log2);
        report.outcome = Outcome::applied;
        decision.apply = 1;
        decision.rounding_key = step_key(p.seed, state.step);
        set_coefficient(decision, factor);
      }
    }
  }
  report.step = state.step;
  report.scale_next = in.external ? scale : state.scaler.scale;  // an external scaler moves its own
}

/// The constants of a group for applied step `t` (>= 1), in double, rounded once to fp32.
HALFSTEP_HD inline GroupConsts group_consts(const GroupParams& g, float lr, std::int64_t t) {
  const double beta1 = g.beta1, beta2 = g.beta2;
  const std::int64_t n = group_step(g, t);
  const double bc1 = g.bias_correction ? 1.0 - power(beta1, n) : 1.0;
  const double bc2 = g.bias_correction ? 1.0 - power(beta2, n) : 1.0;
  GroupConsts k{};
  k.step_size = static_cast<float>(static_cast<double>(lr) / bc1);
  k.inv_sqrt_bc2 = static_cast<float>(1.0 / ::sqrt(bc2));
  k.decay = g.decoupled ? static_cast<float>(1.0 - static_cast<double>(lr) * g.weight_decay) : 1.0f;
  k.l2 = g.decoupled ? 0.0f : g.weight_decay;
  k.classic = g.decoupled ? 0 : 1;
  k.beta1 = g.beta1;
  k.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  k.beta2 = g.beta2;
  k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  k.eps = g.eps;
  return k;
}

/// AdamW on one element in fp32: `g` is the unscaled, clipped gradient. Every multiply-add that
/// a compiler could contract is written as the fused one (fmaf, one rounding) or kept apart, and
/// the kernels are compiled with contraction off (nvcc --fmad=false, the host -ffp-contract=off),
/// so the GPU, the host backend and the emulated device round alike: bit for bit the same results.
HALFSTEP_HD inline void adamw_update(float& p, float& m, float& v, float g, const GroupConsts& k) {
  const float with_l2 = fmaf(k.l2, p, g);  // classic L2: the decay joins the gradient (computed
  g = k.classic ? with_l2 : g;             // either way and selected: no branch, no masked load)
  p = p * k.decay;                      // decoupled decay shrinks the weight (decay is 1 otherwise)
  m = fmaf(k.beta1, m, k.one_minus_beta1 * g);        // first moment
  v = fmaf(k.beta2, v, (k.one_minus_beta2 * g) * g);  // second moment; (1 - beta2)·g first, so
                                                      // g² past fp32 (|g| > 1.8e19) does not
                                                      // overflow where (1 - beta2)·g² itself fits
  // √v / √bc2 as √v times 1/√bc2 rounded once: the same three roundings as a division by √bc2
  // rounded once, without an IEEE division per element (about nine instructions)
  const float denom = fmaf(sqrtf(v), k.inv_sqrt_bc2, k.eps);
  p = fmaf(-k.step_size, m / denom, p);
}

}  // namespace halfstep::detail
