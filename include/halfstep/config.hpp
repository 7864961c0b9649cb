// halfstep: build-wide macros shared by host and device code.
#pragma once

/// Marks a function callable from host and device code. Empty outside nvcc, so public headers
/// compile in plain C++ translation units.
#if defined(__CUDACC__)
#define HALFSTEP_HD __host__ __device__
#else
#define HALFSTEP_HD
#endif

/// Marks what libhalfstep exports: the library is built with hidden visibility, so only the
/// public API declared with this is visible to programs that link it.
#if defined(__GNUC__) || defined(__clang__)
#define HALFSTEP_API __attribute__((visibility("default")))
#else
#define HALFSTEP_API
#endif

/// halfstep's version; CMake reads it from here. The library reports the version it was built as
/// at run time (halfstep::version(), halfstep_version()).
#define HALFSTEP_VERSION_MAJOR 0
#define HALFSTEP_VERSION_MINOR 5
#define HALFSTEP_VERSION_PATCH 0
