// The reference backend of FusedAdamW: the CPU reference step (src/reference.cpp) over host
// buffers, so one training loop runs with or without a GPU, and the split step of a multi-rank
// run whose record the caller reduces.
#include <cstring>

#include "check.hpp"
#include "distributed_impl.hpp"
#include "fused_impl.hpp"
#include "halfstep/checkpoint.hpp"
#include "reference_impl.hpp"
#include "step_math.hpp"

namespace halfstep::detail {
namespace {

// Runs the reference step on host buffers: one training loop works with or without a GPU. The
// tensors and config are validated once, here; each step reads the learning rates as they are
// (device_lr may have changed them) and skips a step whose learning rate is invalid.
class ReferenceImpl final : public FusedAdamW::Impl {
 public:
  ReferenceImpl(const std::vector<ParamTensor>& tensors, const StepConfig& config, const Distributed& dist)
      : tensors_(tensors), config_(config), rank_(dist.rank), state_(OptimizerState::initial(config)) {
    validate(tensors_, config_);
    validate_distributed(dist);
    require(dist.comms.empty(), "Backend::reference takes no NCCL communicators (Distributed.comms has ",
            dist.comms.size(), "): reduce its totals between step_local and step_finish");
  }
  void step(Stream stream) override {
    step_local(stream);
    step_finish(stream);
  }
  void step_local(Stream) override {
    begin_local("step_local");
    totals_ = reference_measure(tensors_, config_, rank_, &nonfinite_, scale_, state_.scaler.scale, grads_key_);
    local_pending_ = true;
  }
  void step_local_refused(Stream) override {
    begin_local("step_local_refused");
    totals_ = refused_record();
    nonfinite_.assign(tensors_.size(), 0);
    local_pending_ = true;
  }
  void step_refused(Stream) override {
    throw Error(ErrorKind::usage, "step_refused: Backend::reference has no communicators; call "
                                  "step_local_refused, reduce the record and call step_finish");
  }
  void step_finish(Stream) override {
    if (!local_pending_) {
      throw Error(ErrorKind::usage, "step_finish: no step_local since the last step finished");
    }
    local_pending_ = false;
    report_ = reference_finish(tensors_, config_, state_, totals_, scale_);
    scale_ = ScaleInputs{};  // it held for this step only
    has_report_ = true;
  }
  StepTotals* device_totals() override { return &totals_; }
  void begin_local(const char* what) const {
    if (local_pending_) {
      throw Error(ErrorKind::usage, concat(what, ": step_local has run; step_finish must end that step first"));
    }
    if (state_.attempts >= kCounterLimit) {
      throw Error(ErrorKind::usage, concat("step: this optimizer has attempted ", kCounterLimit,
                                           " steps (kCounterLimit); its counters are full"));
    }
  }
  StepReport last_report() override {
    require_step("last_report");
    return report_;
  }
  std::vector<std::int64_t> nonfinite_counts() override {
    require_step("nonfinite_counts");
    return nonfinite_;
  }
  void set_lr(std::int32_t group, float lr, Stream) override {
    check_lr(config_, group, lr);
    config_.groups[static_cast<std::size_t>(group)].lr = lr;
  }
  float* device_lr(std::int32_t group) override {
    check_group(config_, group);
    return &config_.groups[static_cast<std::size_t>(group)].lr;
  }
  const float* device_loss_scale() const override { return &state_.scaler.scale; }
  const std::int64_t* device_step_count() const override { return &state_.step; }
  OptimizerState state() override { return state_; }
  std::vector<float> learning_rates() override {
    std::vector<float> lr;
    for (const AdamWConfig& h : config_.groups) lr.push_back(h.lr);
    return lr;
  }
  void restore(const OptimizerState& state, const std::vector<AdamWConfig>& groups, Rounding rounding,
               std::uint64_t seed) override {
    state_ = state;
    config_.groups = groups;
    config_.state.rounding = rounding;
    config_.state.seed = seed;
  }
  void set_group(std::int32_t group, const AdamWConfig& h, Stream) override {
    config_.groups[static_cast<std::size_t>(group)] = h;
  }
  void set_gradients(const std::vector<const void*>& grads, Stream, std::uint64_t key) override {
    for (std::size_t t = 0; t < grads.size(); ++t) tensors_[t].grad = grads[t];
    grads_key_ = key;
  }
  void mark_unscaled(Stream) override { scale_.unscaled = 1; }
  void use_external_scale(const float* scale, const float* found_inf, Stream) override {
    scale_.external = 1;
    scale_.external_scale = scale != nullptr ? *scale : 1.0f;
    if (scale == nullptr) scale_.unscaled = 1;
    scale_.found_inf = found_inf != nullptr ? *found_inf : 0.0f;
  }
  void set_loss_scale(float scale, Stream) override { state_.scaler.scale = scale; }
  const StepConfig& config() const override { return config_; }
  const std::vector<ParamTensor>& tensors() const override { return tensors_; }
  std::int64_t chunk_count() const override { return 0; }
  int launches_per_step() const override { return 0; }
  // memcpy's pointers must not be null even for zero bytes (an empty tensor's buffers may be).
  void copy_out(void* host, const void* buffer, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(host, buffer, bytes);
  }
  void copy_in(void* buffer, const void* host, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(buffer, host, bytes);
  }
  void enqueue_pass(int, Stream) override {
    throw Error(ErrorKind::usage, "enqueue_pass: the reference backend has no device passes");
  }

 private:
  void require_step(const char* what) const {
    if (!has_report_) throw Error(ErrorKind::usage, concat(what, ": no step has run yet"));
  }
  std::vector<ParamTensor> tensors_;
  StepConfig config_;
  std::int32_t rank_;
  OptimizerState state_;
  StepReport report_{};
  StepTotals totals_{};
  std::vector<std::int64_t> nonfinite_;
  bool has_report_ = false;
  ScaleInputs scale_{};  // mark_unscaled, use_external_scale: how the next step's gradients were scaled
  std::uint64_t grads_key_ = 0;  // set_gradients: which of the model's tensors have a gradient
  bool local_pending_ = false;
};

}  // namespace

std::unique_ptr<FusedAdamW::Impl> make_reference_impl(const std::vector<ParamTensor>& tensors,
                                                      const StepConfig& config, const Distributed& dist) {
  return std::make_unique<ReferenceImpl>(tensors, config, dist);
}

}  // namespace halfstep::detail
