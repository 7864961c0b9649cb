// Test helper: a halfstep::ParamTensor as the C API's halfstep_tensor, field for field.
#pragma once

#include "halfstep/halfstep.h"
#include "halfstep/step.hpp"

namespace halfstep_test {

inline halfstep_tensor c_tensor(const halfstep::ParamTensor& p) {
  halfstep_tensor t{};
  t.master = p.master;
  t.grad = p.grad;
  t.exp_avg = p.exp_avg;
  t.exp_avg_sq = p.exp_avg_sq;
  t.model = p.model;
  t.numel = p.numel;
  t.group = p.group;
  t.duplicate = p.duplicate ? 1 : 0;
  t.tensor_id = p.tensor_id;
  t.offset = p.offset;
  t.whole_numel = p.whole_numel;
  t.row = p.row;
  t.exp_avg_scale = p.exp_avg_scale;
  t.exp_avg_sq_scale = p.exp_avg_sq_scale;
  return t;
}

}  // namespace halfstep_test
