/* The layout the C compiler gives the structs of halfstep.h that the Python package mirrors with
 * ctypes (python/halfstep/_lib.py): one JSON object a line,
 *   {"struct": "halfstep_group", "size": 28, "fields": [{"name": "lr", "offset": 0, "size": 4}, ...]}
 * with every field in declaration order. python/tests/test_abi.py compares them with the ctypes
 * structs, and these field lists with the header's, so a field missing here fails there too. */
#include <halfstep/halfstep.h>

#include <stddef.h>
#include <stdio.h>

static const char* separator;

#define BEGIN(T) \
  (printf("{\"struct\": \"%s\", \"size\": %zu, \"fields\": [", #T, sizeof(T)), separator = "")
#define FIELD(T, f)                                                                        \
  (printf("%s{\"name\": \"%s\", \"offset\": %zu, \"size\": %zu}", separator, #f, offsetof(T, f), \
          sizeof(((T*)0)->f)),                                                              \
   separator = ", ")
#define END() printf("]}\n")

int main(void) {
  BEGIN(halfstep_tensor);
  FIELD(halfstep_tensor, master);
  FIELD(halfstep_tensor, grad);
  FIELD(halfstep_tensor, exp_avg);
  FIELD(halfstep_tensor, exp_avg_sq);
  FIELD(halfstep_tensor, model);
  FIELD(halfstep_tensor, numel);
  FIELD(halfstep_tensor, group);
  FIELD(halfstep_tensor, duplicate);
  FIELD(halfstep_tensor, tensor_id);
  FIELD(halfstep_tensor, pad_);
  FIELD(halfstep_tensor, offset);
  FIELD(halfstep_tensor, whole_numel);
  FIELD(halfstep_tensor, row);
  FIELD(halfstep_tensor, exp_avg_scale);
  FIELD(halfstep_tensor, exp_avg_sq_scale);
  END();

  BEGIN(halfstep_moment_blocks);
  FIELD(halfstep_moment_blocks, quantized);
  FIELD(halfstep_moment_blocks, pad_);
  FIELD(halfstep_moment_blocks, blocks);
  FIELD(halfstep_moment_blocks, first);
  END();

  BEGIN(halfstep_group);
  FIELD(halfstep_group, lr);
  FIELD(halfstep_group, beta1);
  FIELD(halfstep_group, beta2);
  FIELD(halfstep_group, eps);
  FIELD(halfstep_group, weight_decay);
  FIELD(halfstep_group, decoupled_weight_decay);
  FIELD(halfstep_group, bias_correction);
  FIELD(halfstep_group, step_offset);
  END();

  BEGIN(halfstep_config);
  FIELD(halfstep_config, grad_dtype);
  FIELD(halfstep_config, model_dtype);
  FIELD(halfstep_config, backend);
  FIELD(halfstep_config, host_driven);
  FIELD(halfstep_config, max_grad_norm);
  FIELD(halfstep_config, init_scale);
  FIELD(halfstep_config, growth_factor);
  FIELD(halfstep_config, backoff_factor);
  FIELD(halfstep_config, min_scale);
  FIELD(halfstep_config, max_scale);
  FIELD(halfstep_config, growth_interval);
  FIELD(halfstep_config, hysteresis);
  FIELD(halfstep_config, consecutive_hysteresis);
  FIELD(halfstep_config, headroom_growth);
  FIELD(halfstep_config, headroom_margin_log2);
  FIELD(halfstep_config, spike_enabled);
  FIELD(halfstep_config, spike_skip);
  FIELD(halfstep_config, spike_warmup_steps);
  FIELD(halfstep_config, spike_max_consecutive);
  FIELD(halfstep_config, spike_z_threshold);
  FIELD(halfstep_config, spike_ema_beta);
  FIELD(halfstep_config, spike_min_std);
  FIELD(halfstep_config, compute_dtype);
  FIELD(halfstep_config, master_format);
  FIELD(halfstep_config, exp_avg_format);
  FIELD(halfstep_config, exp_avg_sq_format);
  FIELD(halfstep_config, rounding);
  FIELD(halfstep_config, seed);
  END();

  BEGIN(halfstep_state_bytes);
  FIELD(halfstep_state_bytes, state);
  FIELD(halfstep_state_bytes, gradient);
  FIELD(halfstep_state_bytes, model);
  FIELD(halfstep_state_bytes, moved);
  END();

  BEGIN(halfstep_report);
  FIELD(halfstep_report, attempt);
  FIELD(halfstep_report, step);
  FIELD(halfstep_report, outcome);
  FIELD(halfstep_report, spike);
  FIELD(halfstep_report, scale_used);
  FIELD(halfstep_report, scale_next);
  FIELD(halfstep_report, grad_norm);
  FIELD(halfstep_report, clip_coef);
  FIELD(halfstep_report, nonfinite_count);
  FIELD(halfstep_report, first_nonfinite_tensor);
  FIELD(halfstep_report, max_abs_scaled);
  FIELD(halfstep_report, headroom_log2);
  FIELD(halfstep_report, subnormal_count);
  FIELD(halfstep_report, zero_count);
  FIELD(halfstep_report, numel);
  FIELD(halfstep_report, reason);
  FIELD(halfstep_report, held_elements);
  FIELD(halfstep_report, first_nonfinite_rank);
  END();

  BEGIN(halfstep_state);
  FIELD(halfstep_state, scale);
  FIELD(halfstep_state, good_steps);
  FIELD(halfstep_state, hysteresis_left);
  FIELD(halfstep_state, overflows);
  FIELD(halfstep_state, growths);
  FIELD(halfstep_state, backoffs);
  FIELD(halfstep_state, spike_mean);
  FIELD(halfstep_state, spike_var);
  FIELD(halfstep_state, spike_seen);
  FIELD(halfstep_state, spikes);
  FIELD(halfstep_state, spike_consecutive);
  FIELD(halfstep_state, step);
  FIELD(halfstep_state, attempts);
  END();
  return 0;
}
