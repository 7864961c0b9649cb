// Internal: the two backends behind FusedAdamW.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"

namespace halfstep {
namespace detail {

/// The buffers a step writes (masters, moments, model copies), sorted by address and disjoint
/// (validate checked that at construction), for set_gradients' overlap check.
struct WrittenSpans {
  struct Span {
    std::uintptr_t begin, end;  // [begin, end)
    std::size_t tensor;
    const char* field;
  };
  std::vector<Span> spans;
};
WrittenSpans written_spans(const std::vector<ParamTensor>& tensors, const StepConfig& config);

/// Throws halfstep::Error naming the entry and the rule unless `grads` can replace the gradients
/// of `tensors`: one per tensor, each null or aligned to the gradient format's element size, none
/// overlapping another or a buffer the step writes.
void validate_gradients(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                        const WrittenSpans& written, const std::vector<const void*>& grads);

}  // namespace detail

struct FusedAdamW::Impl {
  virtual ~Impl() = default;
  virtual void step(Stream stream) = 0;
  virtual void step_local(Stream stream) = 0;
  virtual void step_finish(Stream stream) = 0;
  virtual void step_local_refused(Stream stream) = 0;
  virtual void step_refused(Stream stream) = 0;
  virtual StepTotals* device_totals() = 0;
  virtual StepReport last_report() = 0;
  virtual std::vector<std::int64_t> nonfinite_counts() = 0;
  virtual void set_lr(std::int32_t group, float lr, Stream stream) = 0;
  virtual float* device_lr(std::int32_t group) = 0;
  virtual const float* device_loss_scale() const = 0;
  virtual const std::int64_t* device_step_count() const = 0;
  virtual OptimizerState state() = 0;
  /// The learning rate of each group as the next step will read it (waits for the last step).
  virtual std::vector<float> learning_rates() = 0;
  /// Replaces the state, every group's hyperparameters and the rounding of the state formats and
  /// its seed (checked by halfstep::load_state before: the groups' flags are this optimizer's).
  virtual void restore(const OptimizerState& state, const std::vector<AdamWConfig>& groups, Rounding rounding,
                       std::uint64_t seed) = 0;
  virtual const StepConfig& config() const = 0;
  virtual const std::vector<ParamTensor>& tensors() const = 0;
  virtual std::int64_t chunk_count() const = 0;
  virtual int launches_per_step() const = 0;
  /// Enqueues one pass of a device-resident step alone (Backend::cuda only; for benchmarks).
  virtual void enqueue_pass(int pass, Stream stream) = 0;
  /// Copies `bytes` of one of the optimizer's buffers (device memory for Backend::cuda) into host
  /// memory, after the last step has written it.
  virtual void copy_out(void* host, const void* buffer, std::size_t bytes) = 0;
  /// Copies host memory into one of the optimizer's buffers; a step enqueued afterwards, on any
  /// stream, reads the new values.
  virtual void copy_in(void* buffer, const void* host, std::size_t bytes) = 0;
  /// A group's hyperparameters from the next step on (checked by FusedAdamW::set_group).
  virtual void set_group(std::int32_t group, const AdamWConfig& h, Stream stream) = 0;
  /// New gradient pointers from the next step on (checked by FusedAdamW::set_gradients).
  virtual void set_gradients(const std::vector<const void*>& grads, Stream stream, std::uint64_t key) = 0;
  /// The next step's gradients are already unscaled.
  virtual void mark_unscaled(Stream stream) = 0;
  /// The next step's gradients were scaled by another scaler's scale (FusedAdamW::use_external_scale).
  virtual void use_external_scale(const float* scale, const float* found_inf, Stream stream) = 0;
  /// The loss scale from the next step on (checked by FusedAdamW::set_loss_scale).
  virtual void set_loss_scale(float scale, Stream stream) = 0;

  /// Threads the step runs on (Backend::host; the others run on their device or on one thread).
  virtual int threads() const { return 1; }
  virtual void set_threads(int /*threads*/) {
    throw Error(ErrorKind::usage, "set_threads: only Backend::host runs its step on host threads");
  }

  /// What the step writes, for set_gradients' check (filled by FusedAdamW's constructor).
  detail::WrittenSpans written;
};

namespace detail {

/// The passes of a step, for timing them one by one.
enum Pass : int { kCheckAndNorm = 0, kFinalize = 1, kApply = 2 };

/// Reaches a FusedAdamW's backend (the benchmark's passes, the checkpoint's buffer copies).
struct FusedAccess {
  static FusedAdamW::Impl& impl(FusedAdamW& f) { return f.impl(); }  // throws if moved from
};

std::unique_ptr<FusedAdamW::Impl> make_reference_impl(const std::vector<ParamTensor>& tensors,
                                                      const StepConfig& config, const Distributed& dist);
std::unique_ptr<FusedAdamW::Impl> make_cuda_impl(const std::vector<ParamTensor>& tensors,
                                                 const StepConfig& config, const Distributed& dist);
std::unique_ptr<FusedAdamW::Impl> make_host_impl(const std::vector<ParamTensor>& tensors,
                                                 const StepConfig& config, const Distributed& dist);

/// Throws unless `group` names a group of `config`, `lr` is finite and >= 0, and lr·weight_decay
/// < 1 for decoupled decay.
void check_lr(const StepConfig& config, std::int32_t group, float lr);
/// Throws unless `group` names a group of `config`.
void check_group(const StepConfig& config, std::int32_t group);

}  // namespace detail
}  // namespace halfstep
