// FusedAdamW: the public class forwards to a backend; the reference backend lives here.
#include "halfstep/fused_adamw.hpp"

#include "check.hpp"
#include "fused_impl.hpp"
#include "halfstep/checkpoint.hpp"
#include "halfstep/reference.hpp"
#include "tensor_table.hpp"

namespace halfstep {
namespace detail {

void check_group(const StepConfig& config, std::int32_t group) {
  require(group >= 0 && static_cast<std::size_t>(group) < config.groups.size(),
          "group must name one of the ", config.groups.size(), " StepConfig.groups, got ", group);
}

void check_lr(const StepConfig& config, std::int32_t group, float lr) {
  check_group(config, group);
  require(finite(lr) && lr >= 0.0f, "lr must be finite and >= 0, got ", lr);
}

namespace {

// Runs reference::step on host buffers: one training loop works with or without a GPU.
class ReferenceImpl final : public FusedAdamW::Impl {
 public:
  ReferenceImpl(const std::vector<ParamTensor>& tensors, const StepConfig& config)
      : tensors_(tensors), config_(config), state_(OptimizerState::initial(config)) {
    validate(tensors_, config_);
  }
  void step(Stream) override {
    report_ = reference::step(tensors_, config_, state_, &nonfinite_);
    has_report_ = true;
  }
  StepReport last_report() override {
    require_step();
    return report_;
  }
  std::vector<std::int64_t> nonfinite_counts() override {
    require_step();
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
  OptimizerState state() override { return state_; }
  void load_state(std::string_view bytes) override { halfstep::load_state(state_, bytes, config_); }
  const StepConfig& config() const override { return config_; }
  std::int64_t chunk_count() const override { return 0; }
  int launches_per_step() const override { return 0; }
  void enqueue_pass(int, Stream) override {
    throw Error(ErrorKind::usage, "enqueue_pass: the reference backend has no device passes");
  }

 private:
  void require_step() const {
    if (!has_report_) throw Error(ErrorKind::usage, "last_report: no step has run yet");
  }
  std::vector<ParamTensor> tensors_;
  StepConfig config_;
  OptimizerState state_;
  StepReport report_{};
  std::vector<std::int64_t> nonfinite_;
  bool has_report_ = false;
};

}  // namespace

std::unique_ptr<FusedAdamW::Impl> make_reference_impl(const std::vector<ParamTensor>& tensors,
                                                      const StepConfig& config) {
  return std::make_unique<ReferenceImpl>(tensors, config);
}

}  // namespace detail

std::size_t workspace_bytes(const std::vector<std::int64_t>& tensor_numels, std::size_t groups) {
  std::int64_t chunks = 0;
  for (std::size_t t = 0; t < tensor_numels.size(); ++t) {
    detail::require(tensor_numels[t] >= 0, "tensor_numels[", t, "] must be >= 0, got ", tensor_numels[t]);
    chunks += detail::chunks_of(tensor_numels[t]);
  }
  return detail::WorkspaceLayout::make(tensor_numels.size(), static_cast<std::size_t>(chunks), groups).bytes;
}

FusedAdamW::FusedAdamW(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                       Backend backend) {
  detail::require(backend == Backend::cuda || backend == Backend::reference,
                  "backend must be Backend::cuda or Backend::reference, got ",
                  static_cast<int>(backend));
  impl_ = backend == Backend::cuda ? detail::make_cuda_impl(tensors, config)
                                   : detail::make_reference_impl(tensors, config);
  backend_ = backend;
}

FusedAdamW::~FusedAdamW() = default;
FusedAdamW::FusedAdamW(FusedAdamW&&) noexcept = default;
FusedAdamW& FusedAdamW::operator=(FusedAdamW&&) noexcept = default;

void FusedAdamW::step(Stream stream) { impl_->step(stream); }
StepReport FusedAdamW::last_report() { return impl_->last_report(); }
std::vector<std::int64_t> FusedAdamW::nonfinite_counts() { return impl_->nonfinite_counts(); }
void FusedAdamW::set_lr(std::int32_t group, float lr, Stream stream) { impl_->set_lr(group, lr, stream); }
float* FusedAdamW::device_lr(std::int32_t group) { return impl_->device_lr(group); }
const float* FusedAdamW::device_loss_scale() const { return impl_->device_loss_scale(); }
float FusedAdamW::loss_scale() { return impl_->state().scaler.scale; }
OptimizerState FusedAdamW::state() { return impl_->state(); }
std::string FusedAdamW::save_state() { return encode_state(impl_->state()); }
void FusedAdamW::load_state(std::string_view bytes) { impl_->load_state(bytes); }
const StepConfig& FusedAdamW::config() const { return impl_->config(); }
Backend FusedAdamW::backend() const { return backend_; }
std::int64_t FusedAdamW::chunk_count() const { return impl_->chunk_count(); }
int FusedAdamW::launches_per_step() const { return impl_->launches_per_step(); }

}  // namespace halfstep
