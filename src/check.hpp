// Internal: building halfstep::Error messages that name the argument and the rule.
#pragma once

#include <sstream>
#include <string>
#include <utility>

#include "halfstep/error.hpp"

namespace halfstep::detail {

template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  out.precision(9);
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

/// Throws an invalid-argument Error whose message is the parts, streamed.
template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(ErrorKind::invalid_argument, concat(std::forward<Parts>(parts)...));
}

/// Throws an invalid-argument Error whose message is the parts, streamed, when `ok` is false.
template <class... Parts>
void require(bool ok, Parts&&... parts) {
  if (!ok) fail(std::forward<Parts>(parts)...);
}

/// True for finite floats (not NaN, not ±inf).
inline bool finite(double x) { return x - x == 0.0; }

}  // namespace halfstep::detail

namespace halfstep {
struct AdamWConfig;
}

namespace halfstep::detail {

/// Throws unless lr·weight_decay < 1 where decay is decoupled; `what` names the learning rate.
void check_decay_rate(const AdamWConfig& h, float lr, const char* what);

}  // namespace halfstep::detail
