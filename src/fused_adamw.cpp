// FusedAdamW: the public class forwards to a backend (src/cuda_backend.cpp, src/reference_backend.cpp).
#include "halfstep/fused_adamw.hpp"

#include "check.hpp"
#include "fused_impl.hpp"
#include "halfstep/checkpoint.hpp"

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

}  // namespace detail

FusedAdamW::FusedAdamW(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                       Backend backend)
    : FusedAdamW(tensors, config, Distributed{}, backend) {}

FusedAdamW::FusedAdamW(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                       const Distributed& distributed, Backend backend) {
  detail::require(backend == Backend::cuda || backend == Backend::reference || backend == Backend::host,
                  "backend must be Backend::cuda, Backend::reference or Backend::host, got ",
                  static_cast<int>(backend));
  impl_ = backend == Backend::cuda        ? detail::make_cuda_impl(tensors, config, distributed)
          : backend == Backend::reference ? detail::make_reference_impl(tensors, config, distributed)
                                          : detail::make_host_impl(tensors, config, distributed);
  impl_->written = detail::written_spans(tensors, config);
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
void FusedAdamW::step_local_refused(Stream stream) { impl().step_local_refused(stream); }
void FusedAdamW::step_refused(Stream stream) { impl().step_refused(stream); }
StepTotals* FusedAdamW::device_totals() { return impl().device_totals(); }
const Distributed& FusedAdamW::distributed() const {
  impl();
  return distributed_;
}
StepReport FusedAdamW::last_report() { return impl().last_report(); }
std::vector<std::int64_t> FusedAdamW::nonfinite_counts() { return impl().nonfinite_counts(); }
void FusedAdamW::set_lr(std::int32_t group, float lr, Stream stream) { impl().set_lr(group, lr, stream); }
float* FusedAdamW::device_lr(std::int32_t group) { return impl().device_lr(group); }

void FusedAdamW::set_group(std::int32_t group, const AdamWConfig& h, Stream stream) {
  Impl& i = impl();
  detail::check_group(i.config(), group);
  const AdamWConfig& built = i.config().groups[static_cast<std::size_t>(group)];
  try {
    h.validate();
  } catch (const Error& e) {
    throw Error(ErrorKind::invalid_argument, detail::concat("set_group(", group, "): ", e.what()));
  }
  detail::require(h.decoupled_weight_decay == built.decoupled_weight_decay && h.bias_correction == built.bias_correction,
                  "set_group(", group, "): decoupled_weight_decay and bias_correction are fixed at construction (",
                  built.decoupled_weight_decay, ", ", built.bias_correction, "), got ", h.decoupled_weight_decay, ", ",
                  h.bias_correction);
  i.set_group(group, h, stream);
}

void FusedAdamW::set_gradients(const std::vector<const void*>& grads, Stream stream, std::uint64_t key) {
  Impl& i = impl();
  detail::validate_gradients(i.tensors(), i.config(), i.written, grads);
  i.set_gradients(grads, stream, key);
}

void FusedAdamW::mark_unscaled(Stream stream) { impl().mark_unscaled(stream); }

void FusedAdamW::use_external_scale(const float* scale, const float* found_inf, Stream stream) {
  impl().use_external_scale(scale, found_inf, stream);
}

void FusedAdamW::set_loss_scale(float scale, Stream stream) {
  Impl& i = impl();
  const ScalerConfig& c = i.config().scaler;
  detail::require(detail::finite(scale) && scale >= c.min_scale && scale <= c.max_scale,
                  "set_loss_scale: the scale must be finite and in [min_scale, max_scale] = [", c.min_scale, ", ",
                  c.max_scale, "], got ", scale);
  i.set_loss_scale(scale, stream);
}
const float* FusedAdamW::device_loss_scale() const { return impl().device_loss_scale(); }
const std::int64_t* FusedAdamW::device_step_count() const { return impl().device_step_count(); }
float FusedAdamW::loss_scale() { return impl().state().scaler.scale; }
OptimizerState FusedAdamW::state() { return impl().state(); }
std::vector<float> FusedAdamW::learning_rates() { return impl().learning_rates(); }

void FusedAdamW::set_state(const OptimizerState& state) {
  Impl& i = impl();
  try {
    validate_state(state, i.config());
  } catch (const Error& e) {
    throw Error(ErrorKind::invalid_argument, std::string("set_state: ") + e.what());
  }
  std::vector<AdamWConfig> groups = i.config().groups;  // with the rates as the next step reads them
  const std::vector<float> lr = i.learning_rates();
  for (std::size_t g = 0; g < groups.size(); ++g) groups[g].lr = lr[g];
  i.restore(state, groups, i.config().state.rounding, i.config().state.seed);
}

std::string FusedAdamW::save_state() {
  Impl& i = impl();
  StepConfig c = i.config();  // the groups' hyperparameters as set_group left them
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
  // The seed is the run's (versions before 4 recorded none: this optimizer's stays); the rounding
  // is this optimizer's configuration, as every other format choice.
  const std::uint64_t seed = saved.version >= 4 ? saved.config.state.seed : i.config().state.seed;
  i.restore(saved.state, saved.config.groups, i.config().state.rounding, seed);
}

const StepConfig& FusedAdamW::config() const { return impl().config(); }
const std::vector<ParamTensor>& FusedAdamW::tensors() const { return impl().tensors(); }
Backend FusedAdamW::backend() const {
  impl();
  return backend_;
}
void FusedAdamW::set_threads(int threads) {
  Impl& i = impl();
  if (backend_ != Backend::host) i.set_threads(threads);  // throws: not a host backend
  detail::require(threads >= 1 && threads <= 1024, "set_threads: threads must be in [1, 1024], got ", threads);
  i.set_threads(threads);
}
int FusedAdamW::threads() const { return impl().threads(); }
std::int64_t FusedAdamW::chunk_count() const { return impl().chunk_count(); }
int FusedAdamW::launches_per_step() const { return impl().launches_per_step(); }

}  // namespace halfstep
