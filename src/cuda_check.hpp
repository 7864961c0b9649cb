// Internal: every CUDA runtime call is checked; a failure becomes a halfstep::Error that names
// the call, the file and line, and CUDA's own error name and text.
#pragma once

#include <cuda_runtime_api.h>

#include "check.hpp"

namespace halfstep::detail {

inline void cuda_check(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    throw Error(ErrorKind::cuda, concat(file, ":", line, ": ", what, " failed: ",
                                        cudaGetErrorName(status), " (",
                                        cudaGetErrorString(status), ")"));
  }
}

}  // namespace halfstep::detail

/// Throws halfstep::Error (ErrorKind::cuda) when `expr`, a CUDA runtime call, fails.
#define HALFSTEP_CUDA_CHECK(expr) ::halfstep::detail::cuda_check((expr), #expr, __FILE__, __LINE__)
