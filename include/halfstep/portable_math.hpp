// halfstep: the logarithms the step's decision takes, computed the same way on every machine.
//
// A math library's log may differ in its last bit between the CPU and the GPU (CUDA's log is
// within 1 ulp of the true value, as is the C library's, but not always the same ulp), and the
// spike detector's statistics and the report's headroom feed decisions. These are written out in
// IEEE operations (no contraction: the library compiles with it off), so the host backend, the
// reference backend and the CUDA kernels compute them bit for bit alike; within 2 ulps of the
// true logarithm.
#pragma once

#include <math.h>

#include "halfstep/config.hpp"

namespace halfstep {
namespace detail {

/// log(m) for m in [sqrt(1/2), sqrt(2)): with s = (m - 1) / (m + 1), log(m) = 2·atanh(s) =
/// 2s·(1 + s²/3 + s⁴/5 + ...); |s| <= 0.1716, so s² <= 0.0295 and twelve terms leave less than
/// 2^-60 of relative truncation.
HALFSTEP_HD inline double log_reduced(double m) {
  const double f = m - 1.0;
  const double s = f / (m + 1.0);
  const double z = s * s;
  double p = 1.0 / 23.0;
  p = p * z + 1.0 / 21.0;
  p = p * z + 1.0 / 19.0;
  p = p * z + 1.0 / 17.0;
  p = p * z + 1.0 / 15.0;
  p = p * z + 1.0 / 13.0;
  p = p * z + 1.0 / 11.0;
  p = p * z + 1.0 / 9.0;
  p = p * z + 1.0 / 7.0;
  p = p * z + 1.0 / 5.0;
  p = p * z + 1.0 / 3.0;
  // 2s + 2s·z·p, the small part added last
  return 2.0 * s + 2.0 * s * (z * p);
}

/// x = m · 2^e with m in [sqrt(1/2), sqrt(2)) (x > 0, finite, normal or subnormal).
HALFSTEP_HD inline double log_split(double x, int& e) {
  double m = ::frexp(x, &e);  // [0.5, 1)
  if (m < 0.70710678118654752440) {
    m *= 2.0;
    --e;
  }
  return m;
}

}  // namespace detail

/// The natural logarithm of x > 0 (finite), the same bits on every machine and on the GPU.
HALFSTEP_HD inline double portable_log(double x) {
  int e = 0;
  const double m = detail::log_split(x, e);
  // ln 2 in two parts: the high one has 32 significant bits, so e · high is exact.
  const double ln2_hi = 6.93147180369123816490e-01, ln2_lo = 1.90821492927058770002e-10;
  const double de = static_cast<double>(e);
  return de * ln2_hi + (de * ln2_lo + detail::log_reduced(m));
}

/// log2(x) for x > 0 (finite): exactly e for x = 2^e; the same bits on every machine.
HALFSTEP_HD inline double portable_log2(double x) {
  int e = 0;
  const double m = detail::log_split(x, e);
  return static_cast<double>(e) + detail::log_reduced(m) * 1.44269504088896340736;
}

}  // namespace halfstep
