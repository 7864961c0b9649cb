/* halfstep: a C API over halfstep::FusedAdamW, for bindings (Python ctypes, other languages).
 * Every function that can fail returns a halfstep_status; halfstep_last_error() then holds a
 * message naming the argument and the rule (per thread). No C++ exception crosses this API. */
#ifndef HALFSTEP_HALFSTEP_H
#define HALFSTEP_HALFSTEP_H

#include <stddef.h>
#include <stdint.h>

/** What libhalfstep exports (the library is built with hidden visibility). */
#if defined(__GNUC__) || defined(__clang__)
#define HALFSTEP_C_API __attribute__((visibility("default")))
#else
#define HALFSTEP_C_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/** Outcome of a call. */
typedef enum halfstep_status {
  HALFSTEP_OK = 0,
  HALFSTEP_ERROR_INVALID_ARGUMENT = 1, /**< an argument broke a rule; nothing changed */
  HALFSTEP_ERROR_CORRUPT_STATE = 2,    /**< a checkpoint could not be decoded; nothing changed */
  HALFSTEP_ERROR_CUDA = 3,             /**< a CUDA call or launch failed */
  HALFSTEP_ERROR_USAGE = 4,            /**< not allowed now (e.g. a report before any step) */
  HALFSTEP_ERROR_INTERNAL = 5          /**< anything else (out of host memory, ...) */
} halfstep_status;

/** Element formats (halfstep::DType). */
enum { HALFSTEP_F16 = 0, HALFSTEP_BF16 = 1, HALFSTEP_F32 = 2 };
/** Backends (halfstep::Backend). */
enum { HALFSTEP_BACKEND_CUDA = 0, HALFSTEP_BACKEND_REFERENCE = 1, HALFSTEP_BACKEND_HOST = 2 };
/** Step outcomes (halfstep::Outcome). */
enum {
  HALFSTEP_APPLIED = 0,
  HALFSTEP_SKIPPED_OVERFLOW = 1,
  HALFSTEP_SKIPPED_SPIKE = 2,
  HALFSTEP_SKIPPED_NONFINITE_UPDATE = 3, /**< finite gradients, an update that would not be */
  HALFSTEP_SKIPPED_INCONSISTENT = 4      /**< a totals record that cannot be acted on */
};
/** Why a step was not applied (halfstep::SkipReason). */
enum {
  HALFSTEP_REASON_NONE = 0,
  HALFSTEP_REASON_NONFINITE_GRADIENT = 1,
  HALFSTEP_REASON_SPIKE = 2,
  HALFSTEP_REASON_GRADIENT_EXCEEDS_FP32 = 3,
  HALFSTEP_REASON_SECOND_MOMENT_EXCEEDS_FP32 = 4,
  HALFSTEP_REASON_STEP_SIZE_EXCEEDS_FP32 = 5,
  HALFSTEP_REASON_INVALID_LEARNING_RATE = 6,
  HALFSTEP_REASON_INCONSISTENT_TOTALS = 7,
  HALFSTEP_REASON_HYPERPARAMETERS_DIFFER = 8,
  HALFSTEP_REASON_RANK_REFUSED = 9,
  HALFSTEP_REASON_EXTERNAL_FOUND_INF = 10, /**< the external scaler's check found an inf/NaN */
  HALFSTEP_REASON_INVALID_LOSS_SCALE = 11  /**< the external loss scale is not finite and > 0 */
};

/** Master formats (halfstep::MasterFormat), moment formats (halfstep::MomentFormat) and roundings
 *  (halfstep::Rounding). */
enum { HALFSTEP_MASTER_F32 = 0, HALFSTEP_MASTER_BF16_REMAINDER = 1, HALFSTEP_MASTER_NONE = 2 };
enum { HALFSTEP_MOMENT_F32 = 0, HALFSTEP_MOMENT_BF16 = 1, HALFSTEP_MOMENT_BLOCK8 = 2 };
enum { HALFSTEP_ROUND_NEAREST = 0, HALFSTEP_ROUND_STOCHASTIC = 1 };

/** One parameter tensor (halfstep::ParamTensor): each buffer in its format under the config; fill
 *  with halfstep_tensor_init. */
typedef struct halfstep_tensor {
  void* master;      /**< fp32 masters, int16 remainders (HALFSTEP_MASTER_BF16_REMAINDER), or NULL
                         (HALFSTEP_MASTER_NONE: the bf16 model copy is the weight) */
  const void* grad;
  void* exp_avg;     /**< in halfstep_config.exp_avg_format */
  void* exp_avg_sq;  /**< in halfstep_config.exp_avg_sq_format */
  void* model; /**< may be NULL (not with remainders or without a master) */
  int64_t numel;
  int32_t group;
  /** Nonzero: another rank of the reduction holds this tensor too and counts it; it is left out of
   *  the norm and the counts here (halfstep::ParamTensor::duplicate). Zero, the default: count it. */
  int32_t duplicate;
  /** The tensor's id in stochastic rounding's random bits (halfstep::ParamTensor::tensor_id): 1 +
   *  its index in the model's tensors, the same on every rank; 0: 1 + its index in this list. */
  uint32_t tensor_id;
  int32_t pad_;
  /** The index in the whole tensor of this buffer's first element (a shard's start). */
  int64_t offset;
  /** Elements of the whole tensor this buffer is a piece of; 0: numel (required with offset > 0
   *  under HALFSTEP_MOMENT_BLOCK8) (halfstep::ParamTensor::whole_numel). */
  int64_t whole_numel;
  /** Elements per row of the whole tensor; 0: one row (halfstep::ParamTensor::row). */
  int64_t row;
  /** HALFSTEP_MOMENT_BLOCK8, a quantized tensor (halfstep_moment_blocks_of): the fp32 scale of each
   *  block of exp_avg and of exp_avg_sq the piece holds; NULL otherwise. */
  float* exp_avg_scale;
  float* exp_avg_sq_scale;
} halfstep_tensor;

/** One parameter group (halfstep::AdamWConfig); booleans are 0 or 1. */
typedef struct halfstep_group {
  float lr, beta1, beta2, eps, weight_decay;
  int32_t decoupled_weight_decay, bias_correction;
  /** Applied steps taken before the group joined the run: its bias corrections count from there
   *  (halfstep::AdamWConfig::step_offset; 0 by default). */
  int64_t step_offset;
} halfstep_group;

/** Everything else of halfstep::StepConfig, flattened; fill with halfstep_config_init. */
typedef struct halfstep_config {
  int32_t grad_dtype, model_dtype, backend, host_driven;
  float max_grad_norm;
  float init_scale, growth_factor, backoff_factor, min_scale, max_scale;
  int32_t growth_interval, hysteresis, consecutive_hysteresis, headroom_growth;
  float headroom_margin_log2;
  int32_t spike_enabled, spike_skip, spike_warmup_steps, spike_max_consecutive;
  float spike_z_threshold, spike_ema_beta, spike_min_std;
  /** For HALFSTEP_F32 gradients, the format the backward pass computed them in (HALFSTEP_F16 by
   *  default): the headroom and subnormal count are measured against it. */
  int32_t compute_dtype;
  /** How the state is held (halfstep::StateFormat): HALFSTEP_MASTER_*, HALFSTEP_MOMENT_* (each
   *  moment), HALFSTEP_ROUND_*, and the seed of stochastic rounding's bits. */
  int32_t master_format, exp_avg_format, exp_avg_sq_format, rounding;
  uint64_t seed;
} halfstep_config;

/** Bytes per parameter element (halfstep::StateBytes). */
typedef struct halfstep_state_bytes {
  uint64_t state, gradient, model, moved;
} halfstep_state_bytes;

/** How one tensor holds its moments under HALFSTEP_MOMENT_BLOCK8 (halfstep::MomentBlocks). */
typedef struct halfstep_moment_blocks {
  int32_t quantized; /**< 1: 8-bit codes and scales; 0: fp32 moments */
  int32_t pad_;
  int64_t blocks;    /**< scales per moment the piece holds */
  int64_t first;     /**< the index of the piece's first block in the whole tensor */
} halfstep_moment_blocks;

/** A step's report (halfstep::StepReport). */
typedef struct halfstep_report {
  int64_t attempt, step;
  int32_t outcome, spike;
  float scale_used, scale_next;
  double grad_norm;
  float clip_coef;
  int64_t nonfinite_count;
  int32_t first_nonfinite_tensor;
  float max_abs_scaled, headroom_log2;
  int64_t subnormal_count, zero_count, numel;
  int32_t reason;        /**< HALFSTEP_REASON_* */
  int64_t held_elements; /**< elements kept because their update would not have been finite */
  int32_t first_nonfinite_rank; /**< lowest rank holding an inf/NaN; -1 if none */
} halfstep_report;

/** The words of a step's totals record (halfstep::StepTotals): reduce the first
 *  HALFSTEP_TOTALS_SUM_WORDS with SUM and the next HALFSTEP_TOTALS_MAX_WORDS with MAX, as
 *  unsigned 64-bit integers. */
#define HALFSTEP_TOTALS_SUM_WORDS 24
#define HALFSTEP_TOTALS_MAX_WORDS 4

/** The optimizer's own state (halfstep::OptimizerState): loss scaler, spike detector, counters. */
typedef struct halfstep_state {
  float scale;
  int32_t good_steps, hysteresis_left;
  int64_t overflows, growths, backoffs;
  double spike_mean, spike_var;
  int64_t spike_seen, spikes, spike_consecutive;
  int64_t step, attempts;
} halfstep_state;

typedef struct halfstep_optimizer halfstep_optimizer;

/** The library's version, "MAJOR.MINOR.PATCH", and as MAJOR * 10000 + MINOR * 100 + PATCH. */
HALFSTEP_C_API const char* halfstep_version(void);
/** 1 if this library was built with NCCL (communicators may be passed to
 *  halfstep_create_distributed), 0 if not (reduce the totals record yourself). */
HALFSTEP_C_API int32_t halfstep_has_nccl(void);
HALFSTEP_C_API int32_t halfstep_version_number(void);
/** Names of outcomes and skip reasons ("applied", "second_moment_exceeds_fp32", ...); "unknown"
 *  for codes that are neither. */
HALFSTEP_C_API const char* halfstep_outcome_name(int32_t outcome);
HALFSTEP_C_API const char* halfstep_reason_name(int32_t reason);
/** Bytes of device workspace Backend::cuda allocates for tensors of these sizes. */
HALFSTEP_C_API halfstep_status halfstep_workspace_bytes(const int64_t* numels, int64_t n_tensors, int32_t n_groups, size_t* out);

/** Fills `config` with halfstep's defaults (CUDA backend, fp16, no clipping, spike off).
 *  grad_dtype may be HALFSTEP_F16, HALFSTEP_BF16 or HALFSTEP_F32; model_dtype HALFSTEP_F16 or
 *  HALFSTEP_BF16 (tensors without a model copy pass model = NULL). */
HALFSTEP_C_API void halfstep_config_init(halfstep_config* config);
/** Fills `group` with AdamW's defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8, no decay). */
HALFSTEP_C_API void halfstep_group_init(halfstep_group* group);
/** Fills `tensor` with halfstep::ParamTensor's defaults: every buffer NULL, every count, index and
 *  flag 0. Start from it, so that fields a later version adds keep their defaults. */
HALFSTEP_C_API void halfstep_tensor_init(halfstep_tensor* tensor);

/** Validates everything and builds the step; *out receives the optimizer. */
HALFSTEP_C_API halfstep_status halfstep_create(const halfstep_tensor* tensors, int64_t n_tensors,
                                const halfstep_group* groups, int32_t n_groups,
                                const halfstep_config* config, halfstep_optimizer** out);
/** The same, as rank `rank` of a multi-rank step (halfstep::Distributed): each step all-reduces
 *  its totals over the n_comms NCCL communicators (ncclComm_t) in `comms` (may be 0: reduce with
 *  halfstep_step_local / halfstep_step_finish instead). */
HALFSTEP_C_API halfstep_status halfstep_create_distributed(const halfstep_tensor* tensors, int64_t n_tensors,
                                            const halfstep_group* groups, int32_t n_groups,
                                            const halfstep_config* config, int32_t rank,
                                            void* const* comms, int32_t n_comms, halfstep_optimizer** out);
/** Releases the optimizer (NULL is fine). */
HALFSTEP_C_API void halfstep_destroy(halfstep_optimizer* opt);

/** Enqueues one step on `stream` (a cudaStream_t; NULL: the default stream). */
HALFSTEP_C_API halfstep_status halfstep_step(halfstep_optimizer* opt, void* stream);
/** The two halves of a step for callers that all-reduce the totals record themselves: pass 1
 *  and this rank's record (halfstep_device_totals), then the decision and the update. */
HALFSTEP_C_API halfstep_status halfstep_step_local(halfstep_optimizer* opt, void* stream);
HALFSTEP_C_API halfstep_status halfstep_step_finish(halfstep_optimizer* opt, void* stream);
/** A rank whose own inputs failed its checks takes part in the step without them (FusedAdamW::
 *  step_local_refused / step_refused): every rank skips with HALFSTEP_REASON_RANK_REFUSED and no
 *  rank waits. The split form's record is reduced and finished as halfstep_step_local's. */
HALFSTEP_C_API halfstep_status halfstep_step_local_refused(halfstep_optimizer* opt, void* stream);
HALFSTEP_C_API halfstep_status halfstep_step_refused(halfstep_optimizer* opt, void* stream);
/** The totals record: HALFSTEP_TOTALS_SUM_WORDS + HALFSTEP_TOTALS_MAX_WORDS words of device
 *  memory (host memory for the reference backend). NULL on error. */
HALFSTEP_C_API uint64_t* halfstep_device_totals(halfstep_optimizer* opt);
/** The last step's report; waits for that step. */
HALFSTEP_C_API halfstep_status halfstep_last_report(halfstep_optimizer* opt, halfstep_report* out);
/** Per-tensor inf/NaN counts of the last step into out[0 .. n_tensors). */
HALFSTEP_C_API halfstep_status halfstep_nonfinite_counts(halfstep_optimizer* opt, int64_t* out, int64_t n_tensors);
/** HALFSTEP_BACKEND_HOST: the step runs on `threads` host threads, 1 to 1024 (1 at creation;
 *  halfstep::FusedAdamW::set_threads), with the same results on any number. */
HALFSTEP_C_API halfstep_status halfstep_set_threads(halfstep_optimizer* opt, int32_t threads);
/** The threads the step runs on into *out (1 but for HALFSTEP_BACKEND_HOST). */
HALFSTEP_C_API halfstep_status halfstep_threads(halfstep_optimizer* opt, int32_t* out);
/** Sets a group's learning rate, ordered on `stream`. */
HALFSTEP_C_API halfstep_status halfstep_set_lr(halfstep_optimizer* opt, int32_t group, float lr, void* stream);
/** Sets every hyperparameter of a group (lr, betas, eps, weight decay) for the following steps,
 *  ordered on `stream` (halfstep::FusedAdamW::set_group); its two flags must stay as built. */
HALFSTEP_C_API halfstep_status halfstep_set_group(halfstep_optimizer* opt, int32_t group, const halfstep_group* h,
                                                  void* stream);
/** Points the following steps at new gradient buffers, grads[i] for tensor i (NULL: no gradient;
 *  the tensor is left alone), ordered on `stream`, with no host synchronisation; `key` names which
 *  of the model's tensors have a gradient, the same on every rank that steps them alike (0: none
 *  given) (halfstep::FusedAdamW::set_gradients). */
HALFSTEP_C_API halfstep_status halfstep_set_gradients(halfstep_optimizer* opt, const void* const* grads,
                                                      int64_t n_tensors, void* stream, uint64_t key);
/** The next step's gradients are already divided by the loss scale (halfstep::FusedAdamW::mark_unscaled). */
HALFSTEP_C_API halfstep_status halfstep_mark_unscaled(halfstep_optimizer* opt, void* stream);
/** The next step's gradients were scaled by *scale, a scale another scaler owns (torch.amp.GradScaler),
 *  whose own check found an inf/NaN where *found_inf != 0; both are device memory read in stream
 *  order (host memory for the reference backend), scale NULL for gradients already unscaled,
 *  found_inf NULL for no check (halfstep::FusedAdamW::use_external_scale). */
HALFSTEP_C_API halfstep_status halfstep_use_external_scale(halfstep_optimizer* opt, const float* scale,
                                                           const float* found_inf, void* stream);
/** Sets the loss scale for the following steps, ordered on `stream` (halfstep::FusedAdamW::set_loss_scale). */
HALFSTEP_C_API halfstep_status halfstep_set_loss_scale(halfstep_optimizer* opt, float scale, void* stream);
/** Device memory holding a group's learning rate, for schedules computed on the device (host
 *  memory for the reference backend); an invalid value written there skips the step with
 *  HALFSTEP_REASON_INVALID_LEARNING_RATE. NULL on error. */
HALFSTEP_C_API float* halfstep_device_lr(halfstep_optimizer* opt, int32_t group);
/** Bytes per parameter element of a step with `config` (halfstep::state_bytes), for tensors with
 *  (`model_copy` nonzero) or without a model copy; a config a step would refuse is refused here. */
HALFSTEP_C_API halfstep_status halfstep_state_bytes_of(const halfstep_config* config, int32_t model_copy,
                                                       halfstep_state_bytes* out);
/** How `tensor` (its numel, offset, whole_numel and row) holds its moments under `config`
 *  (halfstep::moment_blocks): under HALFSTEP_MOMENT_BLOCK8, whether it is quantized and how many
 *  scales each moment's buffer holds. The buffers' pointers are not read; a shape halfstep_create
 *  would refuse (a piece without whole_numel, past its tensor's end, a row that does not divide
 *  it, a cut inside a block) is refused here, by name. */
HALFSTEP_C_API halfstep_status halfstep_moment_blocks_of(const halfstep_config* config, const halfstep_tensor* tensor,
                                                         halfstep_moment_blocks* out);
/** Which moment halfstep_encode_moment and halfstep_decode_moment convert. */
enum { HALFSTEP_EXP_AVG = 0, HALFSTEP_EXP_AVG_SQ = 1 };
/** Host-memory moment values (`tensor`->numel floats, finite; exp_avg_sq's >= 0) as the block8
 *  codes (numel bytes) and scales (halfstep_moment_blocks_of's blocks floats) of `tensor` (its
 *  numel, offset, whole_numel and row; a shape with blocks; the buffers' pointers are not read):
 *  to nearest, as a checkpoint conversion stores them (halfstep::encode_moment). `moment` is
 *  HALFSTEP_EXP_AVG or HALFSTEP_EXP_AVG_SQ. Nothing is written on error. */
HALFSTEP_C_API halfstep_status halfstep_encode_moment(const halfstep_tensor* tensor, int32_t moment, const float* values,
                                                      uint8_t* codes, float* scales);
/** The values host-memory block8 codes and scales (finite, >= 0) of `tensor` hold
 *  (halfstep::decode_moment: exp_avg_sq's squared). Nothing is written on error. */
HALFSTEP_C_API halfstep_status halfstep_decode_moment(const halfstep_tensor* tensor, int32_t moment, const uint8_t* codes,
                                                      const float* scales, float* values);
/** A group's hyperparameters as the next step uses them (its learning rate as the step reads it,
 *  its step_offset): what set_group, set_lr, device_lr and load_state left; waits. */
HALFSTEP_C_API halfstep_status halfstep_get_group(halfstep_optimizer* opt, int32_t group, halfstep_group* out);
/** Each group's learning rate as the next step reads it into out[0 .. n_groups); waits. */
HALFSTEP_C_API halfstep_status halfstep_learning_rates(halfstep_optimizer* opt, float* out, int32_t n_groups);
/** Tensors and groups the optimizer was built with. */
HALFSTEP_C_API halfstep_status halfstep_sizes(halfstep_optimizer* opt, int64_t* n_tensors, int32_t* n_groups);
/** The loss scale for the next step; waits for the last step. */
HALFSTEP_C_API halfstep_status halfstep_loss_scale(halfstep_optimizer* opt, float* out);
/** Device memory holding the loss scale (host memory for the reference backend); NULL on error. */
HALFSTEP_C_API const float* halfstep_device_loss_scale(halfstep_optimizer* opt);
/** Device memory holding the applied-step counter (int64, the Adam t) that each applied step
 *  advances in stream order (host memory for the reference backend); NULL on error. */
HALFSTEP_C_API const int64_t* halfstep_device_step_count(halfstep_optimizer* opt);
/** Applied steps and attempts so far; waits for the last step. */
HALFSTEP_C_API halfstep_status halfstep_step_count(halfstep_optimizer* opt, int64_t* applied, int64_t* attempts);
/** The whole optimizer state; waits for the last step. */
HALFSTEP_C_API halfstep_status halfstep_get_state(halfstep_optimizer* opt, halfstep_state* out);
/** Replaces the optimizer's own state (scaler, spike detector, counters), keeping its
 *  configuration and rates (halfstep::FusedAdamW::set_state): carries a run over to a new
 *  optimizer with more tensors. Checked first; waits for the last step. */
HALFSTEP_C_API halfstep_status halfstep_set_state(halfstep_optimizer* opt, const halfstep_state* state);
/** Writes the checkpoint into `buffer` (capacity bytes) and its size into *size. With a NULL
 *  buffer only *size is written. A buffer that is too small is an invalid argument. */
HALFSTEP_C_API halfstep_status halfstep_save_state(halfstep_optimizer* opt, void* buffer, size_t capacity, size_t* size);
/** Restores a checkpoint; on error the state is unchanged. */
HALFSTEP_C_API halfstep_status halfstep_load_state(halfstep_optimizer* opt, const void* data, size_t size);

/** A full checkpoint (halfstep/safetensors.hpp) at `path`: each tensor's master, moments and
 *  (include_model != 0) model copy under names[i] (+ ".exp_avg", ".exp_avg_sq", ".model"), the
 *  optimizer state, and n_metadata string pairs of the caller's (may be 0). */
HALFSTEP_C_API halfstep_status halfstep_save_checkpoint(halfstep_optimizer* opt, const char* const* names, int64_t n_names,
                                         const char* path, int32_t include_model,
                                         const char* const* metadata_keys,
                                         const char* const* metadata_values, int64_t n_metadata);
/** Restores a full checkpoint into the optimizer's buffers and state; on error nothing changes. */
HALFSTEP_C_API halfstep_status halfstep_load_checkpoint(halfstep_optimizer* opt, const char* const* names, int64_t n_names,
                                         const char* path);
/** The value of the caller's metadata `key` in the checkpoint at `path`, into `buffer` (capacity
 *  bytes, including the terminating NUL) with its length in *size; a NULL buffer writes only
 *  *size. A key that is not there is an invalid argument. */
HALFSTEP_C_API halfstep_status halfstep_checkpoint_metadata(const char* path, const char* key, char* buffer,
                                             size_t capacity, size_t* size);

/** The message of this thread's last failed call ("" if none). */
HALFSTEP_C_API const char* halfstep_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* HALFSTEP_HALFSTEP_H */
