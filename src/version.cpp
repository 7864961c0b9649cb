// The version the library was built as.
#include "halfstep/version.hpp"

#define HALFSTEP_STRINGIFY2(x) #x
#define HALFSTEP_STRINGIFY(x) HALFSTEP_STRINGIFY2(x)

namespace halfstep {

const char* version() {
  return HALFSTEP_STRINGIFY(HALFSTEP_VERSION_MAJOR) "." HALFSTEP_STRINGIFY(HALFSTEP_VERSION_MINOR) "." HALFSTEP_STRINGIFY(
      HALFSTEP_VERSION_PATCH);
}

int version_number() {
  return HALFSTEP_VERSION_MAJOR * 10000 + HALFSTEP_VERSION_MINOR * 100 + HALFSTEP_VERSION_PATCH;
}

}  // namespace halfstep
