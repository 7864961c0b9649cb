// Internal: the two backends behind FusedAdamW.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "halfstep/fused_adamw.hpp"

namespace halfstep {

struct FusedAdamW::Impl {
  virtual ~Impl() = default;
  virtual void step(Stream stream) = 0;
  virtual void step_local(Stream stream) = 0;
  virtual void step_finish(Stream stream) = 0;
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
  /// Replaces the state and the learning rates (checked by halfstep::load_state before).
  virtual void restore(const OptimizerState& state, const std::vector<float>& lr) = 0;
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

/// Throws unless `group` names a group of `config`, `lr` is finite and >= 0, and lr·weight_decay
/// < 1 for decoupled decay.
void check_lr(const StepConfig& config, std::int32_t group, float lr);
/// Throws unless `group` names a group of `config`.
void check_group(const StepConfig& config, std::int32_t group);

}  // namespace detail
}  // namespace halfstep
