// Test helper: how far an fp32 AdamW step may land from the double-precision reference, derived
// operation by operation. Used by the host test of the kernels' element math and by the GPU tests.
//
// With u = 2^-24 (fp32 unit roundoff), each fp32 operation adds at most u times its result.
// Following the kernel's order for one element with stored inputs p, m, v (fp32), raw gradient x
// (exact), loss scale S and clip coefficient c (relative error dc against the reference's):
//   g  = x·fl(c/S)                      |e_g|  <= |g|·(dc + 2u)   (c/S as an fp32 mantissa times
//                                                                  exact powers of two: one rounding)
//   g' = g + wd·p (classic only)        |e_g'| <= |e_g| + 2u(|g| + wd|p|)
//   pd = p·fl(1 - lr·wd)                |e_pd| <= 2u|p|
//   m' = b1·m + fl(1-b1)·g'             |e_m|  <= (1-b1)(|e_g'| + 2u|g'|) + u(b1|m| + |m'|)
//   v' = b2·v + (fl(1-b2)·g')·g'        |e_v|  <= (1-b2)(2|g'||e_g'| + 3u·g'²) + u(b2·v + v')
//   D  = sqrt(v')·fl(1/sqrt(bc2)) + eps |e_D|  <= (e_sqrt + 3u·sqrt(v'))/sqrt(bc2) + u·D,
//        with e_sqrt = min(|e_v| / (2 sqrt(v')), sqrt(|e_v|)), the absolute error of sqrt(v')
//   r  = m'/D                           |e_r|  <= |e_m|/D + |m'|·|e_D|/D² + u|r|
//   p' = pd - fl(lr/bc1)·r              |e_p|  <= |e_pd| + (lr/bc1)(|e_r| + 2u|r|) + u|p'|
// and the reference rounds its double results to fp32 once more (u times each). First-order
// terms only, so the bound is doubled.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "halfstep/step.hpp"

namespace halfstep_test {

struct AdamBound {
  double p, m, v;  // allowed |gpu - reference| for the stored master and moments
  // The reference's own values of the step, for propagating earlier differences (see
  // carried_p_error): the new moments, the denominator and the step size lr / bc1.
  double m1, v1, denom, step_size, sqrt_bc2;
};

/// How much differences already present in m and v (bounds `dm`, `dv`, carried into this step
/// after decaying by beta1 and beta2) can move this step's master update lr/bc1 · m'/D: through
/// m' directly, and through D, which dv moves by at most
/// dD = min(dv / (2 sqrt(v')), sqrt(dv)) / sqrt(bc2), changing m'/D by at most |m'|·dD/(D(D - dD)).
/// Infinite when dD reaches D (no bound).
inline double carried_p_error(const AdamBound& b, double dm, double dv) {
  const double sv = std::sqrt(b.v1);
  const double d_sqrt = sv > 0 ? std::min(dv / (2 * sv), std::sqrt(dv)) : std::sqrt(dv);
  const double d_denom = d_sqrt / b.sqrt_bc2;
  if (d_denom >= b.denom) return HUGE_VAL;
  return b.step_size * (dm / b.denom + std::fabs(b.m1) * d_denom / (b.denom * (b.denom - d_denom)));
}

/// Bounds on |fused - reference| of one element's p, m and v over a free-running trajectory.
struct CarriedBound {
  double p = 0, m = 0, v = 0;
  /// Folds in one applied step whose fresh error bounds are `ab`: m and v differences decay by
  /// beta1 and beta2 and move this update by at most carried_p_error; a p difference is carried
  /// on (decoupled weight decay only shrinks it; classic L2 would feed it back into g).
  void add_step(const AdamBound& ab, const halfstep::AdamWConfig& h) {
    const double dm = h.beta1 * m, dv = h.beta2 * v;
    p += ab.p + carried_p_error(ab, dm, dv);
    m = dm + ab.m;
    v = dv + ab.v;
  }
};

/// The bound for one element; `scaled_grad` is the stored gradient's exact value, `clip` the
/// reference's clip coefficient and `clip_rel_err` how far the fp32 path's may differ from it.
inline AdamBound adam_bound(float p, float m, float v, double scaled_grad, double scale,
                            double clip, double clip_rel_err, const halfstep::AdamWConfig& h,
                            std::int64_t t) {
  const double u = std::ldexp(1.0, -24);
  const double b1 = h.beta1, b2 = h.beta2, lr = h.lr, eps = h.eps;
  const double wd = h.weight_decay;
  const double bc1 = h.bias_correction ? 1 - std::pow(b1, static_cast<double>(t)) : 1.0;
  const double bc2 = h.bias_correction ? 1 - std::pow(b2, static_cast<double>(t)) : 1.0;
  const double pp = p, mm = m, vv = v;

  const double g = scaled_grad / scale * clip;
  double e_g = std::fabs(g) * (clip_rel_err + 2 * u);
  double gp = g;
  double pd = pp;
  double e_pd = 0.0;
  if (h.decoupled_weight_decay) {
    pd = pp * (1 - lr * wd);
    e_pd = 2 * u * std::fabs(pp);
  } else {
    gp = g + wd * pp;
    e_g += 2 * u * (std::fabs(g) + wd * std::fabs(pp));
  }
  const double m1 = b1 * mm + (1 - b1) * gp;
  const double v1 = b2 * vv + (1 - b2) * gp * gp;
  const double e_m = (1 - b1) * (e_g + 2 * u * std::fabs(gp)) + u * (b1 * std::fabs(mm) + std::fabs(m1));
  const double e_v = (1 - b2) * (2 * std::fabs(gp) * e_g + 3 * u * gp * gp) + u * (b2 * vv + v1);
  const double sv = std::sqrt(v1);
  const double e_sqrt = sv > 0 ? std::min(e_v / (2 * sv), std::sqrt(e_v)) : std::sqrt(e_v);
  const double D = sv / std::sqrt(bc2) + eps;
  const double e_D = (e_sqrt + 3 * u * sv) / std::sqrt(bc2) + u * D;
  const double r = m1 / D;
  const double e_r = e_m / D + std::fabs(m1) * e_D / (D * D) + u * std::fabs(r);
  const double p1 = pd - lr / bc1 * r;
  const double e_p = e_pd + lr / bc1 * (e_r + 2 * u * std::fabs(r)) + u * std::fabs(p1);
  const double tiny = 1e-40;  // both sides may flush a result this small differently
  return {2 * (e_p + u * std::fabs(p1)) + tiny, 2 * (e_m + u * std::fabs(m1)) + tiny,
          2 * (e_v + u * v1) + tiny, m1, v1, D, lr / bc1, std::sqrt(bc2)};
}

}  // namespace halfstep_test
