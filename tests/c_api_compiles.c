/* The C API header compiles as C (C99) and can be used from C. */
#include <halfstep/halfstep.h>

int halfstep_c_api_compiles(void) {
  halfstep_config config;
  halfstep_group group;
  halfstep_config_init(&config);
  halfstep_group_init(&group);
  config.backend = HALFSTEP_BACKEND_REFERENCE;
  return config.grad_dtype == HALFSTEP_F16 && group.bias_correction == 1 ? 0 : 1;
}
