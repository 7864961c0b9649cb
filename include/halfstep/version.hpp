// halfstep: the library's version at run time, which may differ from the headers a program was
// compiled with (HALFSTEP_VERSION_* in halfstep/config.hpp) when the shared library is replaced.
#pragma once

#include "halfstep/config.hpp"

namespace halfstep {

/// "MAJOR.MINOR.PATCH" of the library in use.
HALFSTEP_API const char* version();

/// MAJOR * 10000 + MINOR * 100 + PATCH of the library in use.
HALFSTEP_API int version_number();

}  // namespace halfstep
