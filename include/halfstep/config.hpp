// halfstep: build-wide macros shared by host and device code.
#pragma once

/// Marks a function callable from host and device code. Empty outside nvcc, so public headers
/// compile in plain C++ translation units.
#if defined(__CUDACC__)
#define HALFSTEP_HD __host__ __device__
#else
#define HALFSTEP_HD
#endif

#define HALFSTEP_VERSION_MAJOR 0
#define HALFSTEP_VERSION_MINOR 1
#define HALFSTEP_VERSION_PATCH 0
