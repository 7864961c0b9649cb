// halfstep: the fused optimizer step. Two passes over memory per step — check and norm, then
// unscale, clip, AdamW and the model copy — with the loss-scale decision made on the device in
// between (or on the host, in host-driven mode).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "halfstep/distributed.hpp"
#include "halfstep/step.hpp"

struct CUstream_st;

namespace halfstep {

namespace detail {
struct FusedAccess;  // the benchmark times the passes of a step one by one
}

/// A CUDA stream (the same type as cudaStream_t); null is the default stream.
using Stream = CUstream_st*;

/// Where a FusedAdamW runs.
enum class Backend {
  cuda,       ///< the fused kernels; ParamTensor pointers are device memory of the current device
  reference,  ///< reference::step on host memory: the independent oracle, in double, one thread
  host,       ///< the kernels' own arithmetic on host memory, vectorised and on set_threads()
              ///< threads: bit for bit the CUDA backend's results (CPU training, offloaded state)
};

/// Bytes of device workspace a FusedAdamW with Backend::cuda allocates for tensors of these
/// sizes in `groups` parameter groups (the tensor table, per-chunk partials, state and report).
HALFSTEP_API std::size_t workspace_bytes(const std::vector<std::int64_t>& tensor_numels, std::size_t groups);

/// The same from counts alone, for planning without a list: `tensors` tensors split into `chunks`
/// chunks in all (chunk_count of each tensor, summed). Throws halfstep::Error past what one step
/// can hold (2^31 - 1 tensors or chunks).
HALFSTEP_API std::size_t workspace_bytes(std::uint64_t tensors, std::uint64_t chunks, std::size_t groups);

/// Elements per chunk: a step launches one thread block per chunk of every tensor.
HALFSTEP_API std::int64_t chunk_elements();

/// Chunks a tensor of `numel` >= 0 elements splits into.
HALFSTEP_API std::int64_t chunk_count(std::int64_t numel);

/// The fused step over a fixed set of parameter tensors.
///
/// Setup (the constructor) validates everything, builds the table of tensors and chunks in
/// device memory once and allocates all workspace. In device-resident mode (the default) step()
/// then never allocates and never waits for the device, so it can be captured in a CUDA graph.
class HALFSTEP_API FusedAdamW {
 public:
  /// Validates `tensors` and `config` (throws halfstep::Error naming the argument and the rule)
  /// and prepares the step. For Backend::cuda every non-null buffer must be device memory of the
  /// current device, and no two buffers may overlap.
  FusedAdamW(const std::vector<ParamTensor>& tensors, const StepConfig& config,
             Backend backend = Backend::cuda);

  /// The same, as one rank of a multi-rank step: every step reduces its totals over
  /// `distributed.comms` (NCCL, on the step's stream) before deciding, so every rank holds the
  /// same report, decision, scale and counters. `tensors` are this rank's: whole tensors, or
  /// shards of them cut anywhere (halfstep::shard). Backend::reference takes no communicators; it
  /// reduces through step_local / step_finish.
  FusedAdamW(const std::vector<ParamTensor>& tensors, const StepConfig& config,
             const Distributed& distributed, Backend backend = Backend::cuda);
  ~FusedAdamW();
  FusedAdamW(FusedAdamW&&) noexcept;
  FusedAdamW& operator=(FusedAdamW&&) noexcept;
  FusedAdamW(const FusedAdamW&) = delete;
  FusedAdamW& operator=(const FusedAdamW&) = delete;

  /// Enqueues one step on `stream`. Device-resident: never blocks. Host-driven: waits once for
  /// pass 1's verdict, runs DynamicLossScaler on the host and launches pass 2 only to apply.
  /// Backend::reference runs the step at once on the host and ignores `stream`. Steps read and
  /// write the same workspace: successive steps must be ordered (one stream, or streams joined
  /// by events), as must the work that writes the gradients before a step.
  void step(Stream stream = nullptr);

  /// The first half of a step, for callers that reduce the totals with their own engine: pass 1
  /// and this rank's StepTotals record at device_totals(), on `stream`. The caller all-reduces
  /// the record (SUM over `sum`, MAX over `max`, in place, ordered after this call on the
  /// stream), then calls step_finish. Never blocks; can be captured in a CUDA graph.
  void step_local(Stream stream = nullptr);

  /// The second half: decides from the (reduced) record at device_totals() and applies the step,
  /// as step() does after its reduction. Throws unless step_local ran since the last step.
  void step_finish(Stream stream = nullptr);

  /// What a rank of a multi-rank step does instead of step_local when its own inputs failed its
  /// checks (a gradient it will not read, an error of the caller's): it takes part without them,
  /// so that the other ranks do not wait for it in the all-reduce. Its record holds no elements
  /// and the refusal mark (StepTotals, max[2] and max[3]); after the reduction and step_finish,
  /// every rank's step is skipped_inconsistent with SkipReason::rank_refused: nothing is written,
  /// the scaler and the counters stay (the attempt counts), and the ranks stay in step. Reads no
  /// gradient; never blocks.
  void step_local_refused(Stream stream = nullptr);

  /// step_local_refused, the all-reduce over this optimizer's communicators and step_finish: a
  /// refusing rank's step(). Throws (usage) for an optimizer without communicators: reduce with
  /// step_local_refused and step_finish there.
  void step_refused(Stream stream = nullptr);

  /// The step's StepTotals record: device memory for Backend::cuda, host memory for
  /// Backend::reference. Written by step_local (and step), read by step_finish.
  StepTotals* device_totals();

  /// How this optimizer takes part in a multi-rank step (rank 0 and no communicators when built
  /// without Distributed).
  const Distributed& distributed() const;

  /// The last step's report; waits for that step only. Throws if no step has run.
  StepReport last_report();

  /// Inf and NaN counts of the last step's gradients, one per tensor; waits for that step.
  std::vector<std::int64_t> nonfinite_counts();

  /// Sets the learning rate of `group` for the following steps, ordered on `stream` (a tiny
  /// kernel, so it can sit between graph replays without a host synchronisation).
  void set_lr(std::int32_t group, float lr, Stream stream = nullptr);

  /// Device memory holding the learning rate of `group` (fp32), for schedules computed on the
  /// device. Backend::reference: host memory.
  float* device_lr(std::int32_t group);

  /// Sets every hyperparameter of `group` for the following steps — lr, beta1, beta2, eps and
  /// weight_decay (schedules that cycle the betas: OneCycleLR, CyclicLR) — ordered on `stream` like
  /// set_lr. decoupled_weight_decay and bias_correction are fixed at construction: another value
  /// is refused. The bias corrections use the new betas with the applied-step count, as
  /// torch.optim.AdamW does. Checked first (AdamWConfig::validate); nothing changes on error.
  void set_group(std::int32_t group, const AdamWConfig& hyperparameters, Stream stream = nullptr);

  /// Points the following steps at new gradient buffers: grads[i] for tensors()[i], in
  /// StepConfig::grad_dtype (device memory of this device for Backend::cuda). A null pointer means
  /// tensor i has no gradient: until it gets one, it is left out of the inf/NaN check, the norm and
  /// the counts, and steps leave its master, moments and model copy alone (torch.optim skips a
  /// parameter whose .grad is None). Ordered on `stream` (the pointers travel as kernel arguments:
  /// no host synchronisation); a step captured in a CUDA graph replays with the pointers it was
  /// captured with. Checked first — one pointer per tensor, aligned to the element size, none
  /// overlapping another or a buffer the step writes; nothing changes on error. `key` says which of
  /// the model's tensors have a gradient, in a form every rank of a multi-rank step computes alike
  /// (a hash of the presence of every tensor's gradient, including the ones this rank holds none
  /// of): it is part of the ranks' fingerprint, so that ranks that would update different tensors
  /// all skip (hyperparameters_differ) instead of diverging. 0: no key (ranks compare nothing).
  void set_gradients(const std::vector<const void*>& grads, Stream stream = nullptr, std::uint64_t key = 0);

  /// The next step's gradients are already divided by the loss scale (a GradScaler-style unscale_
  /// divided them in place, so that the caller could clip them): that step divides them by 1
  /// instead, and measures the headroom from them times the scale. The scaler moves as usual.
  /// Ordered on `stream`; holds for one step.
  void mark_unscaled(Stream stream = nullptr);

  /// The next step's gradients were computed from a loss multiplied by a scale that another scaler
  /// owns (torch.amp.GradScaler driving the step): `scale` points to it (one fp32; null: the
  /// gradients are already divided by it), `found_inf` to that scaler's own inf/NaN check (one
  /// fp32, nonzero or NaN: found; null: none). Both are device memory for Backend::cuda, read when
  /// the step's work reaches them on `stream` (no host synchronisation, capturable), host memory
  /// read at once for Backend::reference. That step divides by *scale (1 when null), skips as
  /// skipped_overflow if either check finds an inf/NaN (reason external_found_inf for the other
  /// scaler's), skips as skipped_nonfinite_update (invalid_loss_scale) for a scale that is not a
  /// finite positive number, and leaves the optimizer's own scaler as it is: the other scaler
  /// moves its scale. The scale is part of the ranks' fingerprint. Holds for one step.
  void use_external_scale(const float* scale, const float* found_inf, Stream stream = nullptr);

  /// Sets the loss scale for the following steps (as GradScaler.update(new_scale) does), ordered
  /// on `stream`; the scaler's counters stay. The scale must be finite and within
  /// [ScalerConfig::min_scale, ScalerConfig::max_scale].
  void set_loss_scale(float scale, Stream stream = nullptr);

  /// Device memory holding the loss scale for the next backward pass (fp32). The step updates
  /// it in stream order. Backend::reference: host memory.
  const float* device_loss_scale() const;

  /// Device memory holding the applied-step counter (the Adam t, int64), which each applied step
  /// advances in stream order: schedules computed on the device can follow applied steps only.
  /// Backend::reference: host memory.
  const std::int64_t* device_step_count() const;

  /// The loss scale for the next step; waits for the last step.
  float loss_scale();

  /// The optimizer state (scaler, spike detector, step counters); waits for the last step.
  OptimizerState state();

  /// The learning rate of each group as the next step reads it (set_lr, device_lr or a restored
  /// checkpoint); waits for the last step.
  std::vector<float> learning_rates();

  /// Replaces the optimizer's own state — scaler, spike detector, step counters — with `state`,
  /// keeping this optimizer's configuration and learning rates: carries a run over to a new
  /// FusedAdamW built on other tensors (a parameter group added, another layout). Checked with
  /// validate_state against this configuration first (nothing changes on error); waits for the
  /// last step.
  void set_state(const OptimizerState& state);

  /// The versioned checkpoint of the optimizer state, the learning rates and the configuration
  /// they belong to (encode_state); waits for the last step.
  std::string save_state();

  /// Restores a checkpoint from save_state of either backend: the state and each group's learning
  /// rate. Corrupt input, or a checkpoint from a configuration this one cannot continue (see
  /// SavedState), throws halfstep::Error naming the field and leaves everything unchanged.
  void load_state(std::string_view bytes);

  /// The configuration this step was built with (learning rates as set by set_lr on the host).
  const StepConfig& config() const;

  /// The tensors this step was built with, in order.
  const std::vector<ParamTensor>& tensors() const;

  /// The backend it runs on.
  Backend backend() const;

  /// Backend::host: the step runs on `threads` host threads (>= 1; 1 at construction), each over
  /// its own contiguous range of the tensor table's chunks. The results are the same bits on any
  /// number of threads. Throws (usage) for the other backends, (invalid_argument) for a count
  /// outside [1, 1024].
  void set_threads(int threads);

  /// The threads the step runs on (1 for Backend::reference; Backend::cuda runs on its device).
  int threads() const;

  /// Number of chunks in the tensor table (one thread block each per pass); 0 for
  /// Backend::reference, which has no device passes.
  std::int64_t chunk_count() const;

  /// halfstep's kernel launches in one device-resident step: pass 1 and pass 2 when there is at
  /// least one element, and finalize once, or twice (on both sides of the all-reduce) with NCCL
  /// communicators, whose all-reduce launches kernels of its own. A host-driven step launches
  /// pass 2 only when it applies. 0 for Backend::reference.
  int launches_per_step() const;

  struct Impl;

 private:
  friend struct detail::FusedAccess;
  Impl& impl() const;  // throws on a moved-from object
  std::unique_ptr<Impl> impl_;
  Backend backend_ = Backend::cuda;
  Distributed distributed_;
};

}  // namespace halfstep
