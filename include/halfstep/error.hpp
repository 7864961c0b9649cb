// halfstep: the one exception type the library throws.
#pragma once

#include "halfstep/config.hpp"
#include <stdexcept>
#include <string>

namespace halfstep {

/// What kind of failure an Error reports; the C API maps these to return codes.
enum class ErrorKind {
  invalid_argument,  ///< an argument broke a documented rule; nothing was changed
  corrupt_state,     ///< a checkpoint could not be decoded; nothing was changed
  cuda,              ///< a CUDA runtime call or kernel launch failed
  usage,             ///< a call that is not allowed in the object's current state
};

/// Every failure halfstep reports. The message names the argument and the rule it broke.
class HALFSTEP_API Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  explicit Error(const std::string& message) : Error(ErrorKind::invalid_argument, message) {}
  /// Which kind of failure this is.
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace halfstep
