// FusedAdamW: the public class forwards to a backend; the reference backend lives here.
#include "halfstep/fused_adamw.hpp"

#include "check.hpp"
#include "fused_impl.hpp"
#include "halfstep/checkpoint.hpp"
#include "halfstep/reference.hpp"
#include "reference_impl.hpp"
#include "tensor_table.hpp"
#include "distributed_impl.hpp"

namespace halfstep {
namespace detail {

void check_group(const StepConfig& config, std::int32_t group) {
  require(group >= 0 && static_cast<std::size_t>(group) < config.groups.size(),
          "group must name one of the ", config.groups.size(), " StepConfig.groups, got ", group);
}

void check_lr(const StepConfig& config, std::int32_t group, float lr) {
  check_group(config, group);
  require(finite(lr) && lr >= 0.0f, "lr must be finite and >= 0, got ", lr);
  check_decay_rate(config.groups[static_cast<std::size_t>(group)], lr, "lr");
}

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
    if (local_pending_) {
      throw Error(ErrorKind::usage, "step_local: step_local has run; step_finish must end that step first");
    }
    if (state_.attempts >= kCounterLimit) {
      throw Error(ErrorKind::usage, concat("step: this optimizer has attempted ", kCounterLimit,
                                           " steps (kCounterLimit); its counters are full"));
    }
    totals_ = reference_measure(tensors_, config_, rank_, &nonfinite_);
    local_pending_ = true;
  }
  void step_finish(Stream) override {
    if (!local_pending_) {
      throw Error(ErrorKind::usage, "step_finish: no step_local since the last step finished");
    }
    local_pending_ = false;
    report_ = reference_finish(tensors_, config_, state_, totals_);
    has_report_ = true;
  }
  StepTotals* device_totals() override { return &totals_; }
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
  void restore(const OptimizerState& state, const std::vector<float>& lr) override {
    state_ = state;
    for (std::size_t g = 0; g < lr.size(); ++g) config_.groups[g].lr = lr[g];
  }
  const StepConfig& config() const override { return config_; }
  const std::vector<ParamTensor>& tensors() const override { return tensors_; }
  std::int64_t chunk_count() const override { return 0; }
  int launches_per_step() const override { return 0; }
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
  bool local_pending_ = false;
};

}  // namespace

std::unique_ptr<FusedAdamW::Impl> make_reference_impl(const std::vector<ParamTensor>& tensors,
                                                      const StepConfig& config, const Distributed& dist) {
  return std::make_unique<ReferenceImpl>(tensors, config, dist);
}

}  // namespace detail

FusedAdamW::FusedAdamW(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                       Backend backend)
    : FusedAdamW(tensors, config, Distributed{}, backend) {}

FusedAdamW::FusedAdamW(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                       const Distributed& distributed, Backend backend) {
  detail::require(backend == Backend::cuda || backend == Backend::reference,
                  "backend must be Backend::cuda or Backend::reference, got ",
                  static_cast<int>(backend));
  impl_ = backend == Backend::cuda ? detail::make_cuda_impl(tensors, config, distributed)
                                   : detail::make_reference_impl(tensors, config, distributed);
  backend_ = backend;
  distributed_ = distributed;
}

FusedAdamW::~FusedAdamW() = default;
FusedAdamW::FusedAdamW(FusedAdamW&&) noexcept = default;
FusedAdamW& FusedAdamW::operator=(FusedAdamW&&) noexcept = default;

FusedAdamW::Impl& FusedAdamW::impl() const {
  if (!impl_) {
    throw Error(ErrorKind::usage, "FusedAdamW: this object was moved from; use the one it was moved to");
  }
  return *impl_;
}

void FusedAdamW::step(Stream stream) { impl().step(stream); }
void FusedAdamW::step_local(Stream stream) { impl().step_local(stream); }
void FusedAdamW::step_finish(Stream stream) { impl().step_finish(stream); }
StepTotals* FusedAdamW::device_totals() { return impl().device_totals(); }
const Distributed& FusedAdamW::distributed() const {
  impl();
  return distributed_;
}
StepReport FusedAdamW::last_report() { return impl().last_report(); }
std::vector<std::int64_t> FusedAdamW::nonfinite_counts() { return impl().nonfinite_counts(); }
void FusedAdamW::set_lr(std::int32_t group, float lr, Stream stream) { impl().set_lr(group, lr, stream); }
float* FusedAdamW::device_lr(std::int32_t group) { return impl().device_lr(group); }
const float* FusedAdamW::device_loss_scale() const { return impl().device_loss_scale(); }
const std::int64_t* FusedAdamW::device_step_count() const { return impl().device_step_count(); }
float FusedAdamW::loss_scale() { return impl().state().scaler.scale; }
OptimizerState FusedAdamW::state() { return impl().state(); }
std::vector<float> FusedAdamW::learning_rates() { return impl().learning_rates(); }

std::string FusedAdamW::save_state() {
  Impl& i = impl();
  StepConfig c = i.config();
  const std::vector<float> lr = i.learning_rates();
  for (std::size_t g = 0; g < lr.size(); ++g) c.groups[g].lr = lr[g];
  try {
    return encode_state(i.state(), c);
  } catch (const Error& e) {  // e.g. a NaN written through device_lr
    throw Error(ErrorKind::usage, std::string("save_state: the optimizer cannot be checkpointed: ") + e.what());
  }
}

void FusedAdamW::load_state(std::string_view bytes) {
  Impl& i = impl();
  const SavedState saved = halfstep::load_state(bytes, i.config());  // throws before anything changes
  std::vector<float> lr;
  for (const AdamWConfig& h : saved.config.groups) lr.push_back(h.lr);
  i.restore(saved.state, lr);
}

const StepConfig& FusedAdamW::config() const { return impl().config(); }
const std::vector<ParamTensor>& FusedAdamW::tensors() const { return impl().tensors(); }
Backend FusedAdamW::backend() const {
  impl();
  return backend_;
}
std::int64_t FusedAdamW::chunk_count() const { return impl().chunk_count(); }
int FusedAdamW::launches_per_step() const { return impl().launches_per_step(); }

}  // namespace halfstep
