// The C API: converts C structs to halfstep's C++ types, and every exception into a status code
// plus a per-thread message.
#include "halfstep/halfstep.h"

#include <climits>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/safetensors.hpp"
#include "halfstep/version.hpp"

#include "block8_geometry.hpp"

struct halfstep_optimizer {
  halfstep::FusedAdamW opt;
};

namespace {

thread_local std::string g_last_error;

halfstep_status fail(halfstep_status status, const char* message) {
  g_last_error = message;
  return status;
}

// Runs `f`, mapping each exception to its status.
template <class F>
halfstep_status guarded(F&& f) {
  try {
    f();
    return HALFSTEP_OK;
  } catch (const halfstep::Error& e) {
    switch (e.kind()) {
      case halfstep::ErrorKind::invalid_argument: return fail(HALFSTEP_ERROR_INVALID_ARGUMENT, e.what());
      case halfstep::ErrorKind::corrupt_state: return fail(HALFSTEP_ERROR_CORRUPT_STATE, e.what());
      case halfstep::ErrorKind::cuda: return fail(HALFSTEP_ERROR_CUDA, e.what());
      case halfstep::ErrorKind::usage: return fail(HALFSTEP_ERROR_USAGE, e.what());
    }
    return fail(HALFSTEP_ERROR_INTERNAL, e.what());
  } catch (const std::bad_alloc&) {
    return fail(HALFSTEP_ERROR_INTERNAL, "out of host memory");
  } catch (const std::exception& e) {
    return fail(HALFSTEP_ERROR_INTERNAL, e.what());
  } catch (...) {
    return fail(HALFSTEP_ERROR_INTERNAL, "unknown error");
  }
}

void require(bool ok, const char* message) {
  if (!ok) throw halfstep::Error(halfstep::ErrorKind::invalid_argument, message);
}

halfstep::DType dtype(int32_t code, const char* field) {
  switch (code) {
    case HALFSTEP_F16: return halfstep::DType::f16;
    case HALFSTEP_BF16: return halfstep::DType::bf16;
    case HALFSTEP_F32: return halfstep::DType::f32;
  }
  throw halfstep::Error(halfstep::ErrorKind::invalid_argument,
                        std::string(field) + " must be HALFSTEP_F16, HALFSTEP_BF16 or HALFSTEP_F32, got " +
                            std::to_string(code));
}

halfstep::StepConfig step_config(const halfstep_group* groups, int32_t n_groups,
                                 const halfstep_config& c) {
  require(n_groups >= 1 && groups != nullptr, "groups must point to n_groups >= 1 halfstep_group");
  halfstep::StepConfig s;
  s.groups.clear();
  for (int32_t g = 0; g < n_groups; ++g) {
    halfstep::AdamWConfig h;
    h.lr = groups[g].lr;
    h.beta1 = groups[g].beta1;
    h.beta2 = groups[g].beta2;
    h.eps = groups[g].eps;
    h.weight_decay = groups[g].weight_decay;
    h.decoupled_weight_decay = groups[g].decoupled_weight_decay != 0;
    h.bias_correction = groups[g].bias_correction != 0;
    h.step_offset = groups[g].step_offset;
    s.groups.push_back(h);
  }
  s.grad_dtype = dtype(c.grad_dtype, "halfstep_config.grad_dtype");
  s.model_dtype = dtype(c.model_dtype, "halfstep_config.model_dtype");
  s.compute_dtype = dtype(c.compute_dtype, "halfstep_config.compute_dtype");
  s.max_grad_norm = c.max_grad_norm;
  s.host_driven = c.host_driven != 0;
  s.scaler.init_scale = c.init_scale;
  s.scaler.growth_factor = c.growth_factor;
  s.scaler.backoff_factor = c.backoff_factor;
  s.scaler.min_scale = c.min_scale;
  s.scaler.max_scale = c.max_scale;
  s.scaler.growth_interval = c.growth_interval;
  s.scaler.hysteresis = c.hysteresis;
  s.scaler.consecutive_hysteresis = c.consecutive_hysteresis != 0;
  s.scaler.headroom_growth = c.headroom_growth != 0;
  s.scaler.headroom_margin_log2 = c.headroom_margin_log2;
  s.spike.enabled = c.spike_enabled != 0;
  s.spike.action = c.spike_skip ? halfstep::SpikeConfig::Action::skip : halfstep::SpikeConfig::Action::log;
  s.spike.warmup_steps = c.spike_warmup_steps;
  s.spike.max_consecutive = c.spike_max_consecutive;
  s.spike.z_threshold = c.spike_z_threshold;
  s.spike.ema_beta = c.spike_ema_beta;
  s.spike.min_std = c.spike_min_std;
  require(c.master_format == HALFSTEP_MASTER_F32 || c.master_format == HALFSTEP_MASTER_BF16_REMAINDER ||
              c.master_format == HALFSTEP_MASTER_NONE,
          "halfstep_config.master_format must be HALFSTEP_MASTER_F32, HALFSTEP_MASTER_BF16_REMAINDER or "
          "HALFSTEP_MASTER_NONE");
  for (const int32_t f : {c.exp_avg_format, c.exp_avg_sq_format}) {
    require(f == HALFSTEP_MOMENT_F32 || f == HALFSTEP_MOMENT_BF16 || f == HALFSTEP_MOMENT_BLOCK8,
            "halfstep_config.exp_avg_format and exp_avg_sq_format must be HALFSTEP_MOMENT_F32, HALFSTEP_MOMENT_BF16 "
            "or HALFSTEP_MOMENT_BLOCK8");
  }
  require(c.rounding == HALFSTEP_ROUND_NEAREST || c.rounding == HALFSTEP_ROUND_STOCHASTIC,
          "halfstep_config.rounding must be HALFSTEP_ROUND_NEAREST or HALFSTEP_ROUND_STOCHASTIC");
  s.state.master = static_cast<halfstep::MasterFormat>(c.master_format);
  s.state.exp_avg = static_cast<halfstep::MomentFormat>(c.exp_avg_format);
  s.state.exp_avg_sq = static_cast<halfstep::MomentFormat>(c.exp_avg_sq_format);
  s.state.rounding = static_cast<halfstep::Rounding>(c.rounding);
  s.state.seed = c.seed;
  return s;
}

}  // namespace

extern "C" {

void halfstep_config_init(halfstep_config* c) {
  if (c == nullptr) return;
  const halfstep::StepConfig s;
  std::memset(c, 0, sizeof *c);
  c->grad_dtype = HALFSTEP_F16;
  c->model_dtype = HALFSTEP_F16;
  c->compute_dtype = static_cast<int32_t>(s.compute_dtype);
  c->backend = HALFSTEP_BACKEND_CUDA;
  c->max_grad_norm = s.max_grad_norm;
  c->init_scale = s.scaler.init_scale;
  c->growth_factor = s.scaler.growth_factor;
  c->backoff_factor = s.scaler.backoff_factor;
  c->min_scale = s.scaler.min_scale;
  c->max_scale = s.scaler.max_scale;
  c->growth_interval = s.scaler.growth_interval;
  c->hysteresis = s.scaler.hysteresis;
  c->headroom_margin_log2 = s.scaler.headroom_margin_log2;
  c->spike_warmup_steps = s.spike.warmup_steps;
  c->spike_max_consecutive = s.spike.max_consecutive;
  c->spike_z_threshold = s.spike.z_threshold;
  c->spike_ema_beta = s.spike.ema_beta;
  c->spike_min_std = s.spike.min_std;
  c->master_format = static_cast<int32_t>(s.state.master);
  c->exp_avg_format = static_cast<int32_t>(s.state.exp_avg);
  c->exp_avg_sq_format = static_cast<int32_t>(s.state.exp_avg_sq);
  c->rounding = static_cast<int32_t>(s.state.rounding);
  c->seed = s.state.seed;
}

void halfstep_tensor_init(halfstep_tensor* t) {
  if (t == nullptr) return;
  const halfstep::ParamTensor p;
  *t = halfstep_tensor{p.master, p.grad, p.exp_avg, p.exp_avg_sq, p.model, p.numel, p.group, p.duplicate ? 1 : 0,
                       p.tensor_id, 0, p.offset, p.whole_numel, p.row, p.exp_avg_scale, p.exp_avg_sq_scale};
}

void halfstep_group_init(halfstep_group* g) {
  if (g == nullptr) return;
  const halfstep::AdamWConfig h;
  g->lr = h.lr;
  g->beta1 = h.beta1;
  g->beta2 = h.beta2;
  g->eps = h.eps;
  g->weight_decay = h.weight_decay;
  g->decoupled_weight_decay = h.decoupled_weight_decay ? 1 : 0;
  g->bias_correction = h.bias_correction ? 1 : 0;
  g->step_offset = h.step_offset;
}

namespace {

halfstep::ParamTensor param_tensor(const halfstep_tensor& c) {
  halfstep::ParamTensor t;
  t.master = c.master;
  t.grad = c.grad;
  t.exp_avg = c.exp_avg;
  t.exp_avg_sq = c.exp_avg_sq;
  t.model = c.model;
  t.numel = c.numel;
  t.group = c.group;
  t.duplicate = c.duplicate != 0;
  t.tensor_id = c.tensor_id;
  t.offset = c.offset;
  t.whole_numel = c.whole_numel;
  t.row = c.row;
  t.exp_avg_scale = c.exp_avg_scale;
  t.exp_avg_sq_scale = c.exp_avg_sq_scale;
  return t;
}

}  // namespace

halfstep_status halfstep_moment_blocks_of(const halfstep_config* config, const halfstep_tensor* tensor,
                                          halfstep_moment_blocks* out) {
  return guarded([&] {
    require(config != nullptr && tensor != nullptr && out != nullptr, "config, tensor and out must not be NULL");
    halfstep_group group;
    halfstep_group_init(&group);
    const halfstep::StepConfig c = step_config(&group, 1, *config);
    const halfstep::ParamTensor t = param_tensor(*tensor);
    halfstep::detail::check_block_shape("tensor", t, c);  // the shape rules halfstep_create applies
    const halfstep::MomentBlocks b = halfstep::moment_blocks(c, t);
    *out = halfstep_moment_blocks{b.quantized ? 1 : 0, 0, b.blocks, b.first};
  });
}

namespace {
halfstep::Slot moment_slot(int32_t moment) {
  require(moment == HALFSTEP_EXP_AVG || moment == HALFSTEP_EXP_AVG_SQ,
          "moment must be HALFSTEP_EXP_AVG (0) or HALFSTEP_EXP_AVG_SQ (1)");
  return moment == HALFSTEP_EXP_AVG ? halfstep::Slot::exp_avg : halfstep::Slot::exp_avg_sq;
}
}  // namespace

halfstep_status halfstep_encode_moment(const halfstep_tensor* tensor, int32_t moment, const float* values,
                                       uint8_t* codes, float* scales) {
  return guarded([&] {
    require(tensor != nullptr, "tensor must not be NULL");
    halfstep::encode_moment(param_tensor(*tensor), moment_slot(moment), values, codes, scales);
  });
}

halfstep_status halfstep_decode_moment(const halfstep_tensor* tensor, int32_t moment, const uint8_t* codes,
                                       const float* scales, float* values) {
  return guarded([&] {
    require(tensor != nullptr, "tensor must not be NULL");
    halfstep::decode_moment(param_tensor(*tensor), moment_slot(moment), codes, scales, values);
  });
}

halfstep_status halfstep_create(const halfstep_tensor* tensors, int64_t n_tensors,
                                const halfstep_group* groups, int32_t n_groups,
                                const halfstep_config* config, halfstep_optimizer** out) {
  return halfstep_create_distributed(tensors, n_tensors, groups, n_groups, config, 0, nullptr, 0, out);
}

halfstep_status halfstep_create_distributed(const halfstep_tensor* tensors, int64_t n_tensors,
                                            const halfstep_group* groups, int32_t n_groups,
                                            const halfstep_config* config, int32_t rank,
                                            void* const* comms, int32_t n_comms, halfstep_optimizer** out) {
  return guarded([&] {
    require(out != nullptr, "out must not be NULL");
    *out = nullptr;
    require(config != nullptr, "config must not be NULL");
    require(n_tensors >= 0 && n_tensors <= INT32_MAX, "n_tensors must be in [0, 2^31 - 1]");
    require(n_tensors == 0 || tensors != nullptr, "tensors must not be NULL when n_tensors > 0");
    require(config->backend == HALFSTEP_BACKEND_CUDA || config->backend == HALFSTEP_BACKEND_REFERENCE ||
                config->backend == HALFSTEP_BACKEND_HOST,
            "halfstep_config.backend must be HALFSTEP_BACKEND_CUDA, HALFSTEP_BACKEND_REFERENCE or HALFSTEP_BACKEND_HOST");
    std::vector<halfstep::ParamTensor> list(static_cast<std::size_t>(n_tensors));
    for (int64_t t = 0; t < n_tensors; ++t) {
      list[static_cast<std::size_t>(t)] = param_tensor(tensors[t]);
    }
    require(n_comms >= 0 && n_comms <= 64, "n_comms must be in [0, 64]");
    require(n_comms == 0 || comms != nullptr, "comms must not be NULL when n_comms > 0");
    halfstep::Distributed dist;
    dist.rank = rank;
    for (int32_t c = 0; c < n_comms; ++c) dist.comms.push_back(static_cast<ncclComm*>(comms[c]));
    const halfstep::Backend backend = config->backend == HALFSTEP_BACKEND_CUDA        ? halfstep::Backend::cuda
                                      : config->backend == HALFSTEP_BACKEND_REFERENCE ? halfstep::Backend::reference
                                                                                      : halfstep::Backend::host;
    *out = new halfstep_optimizer{halfstep::FusedAdamW(list, step_config(groups, n_groups, *config), dist, backend)};
  });
}

void halfstep_destroy(halfstep_optimizer* opt) { delete opt; }

namespace {

// The calls that run one of FusedAdamW's stream-ordered members and take nothing else.
using StreamMember = void (halfstep::FusedAdamW::*)(halfstep::Stream);

halfstep_status on_stream(halfstep_optimizer* opt, void* stream, StreamMember member) {
  return guarded([&] {
    require(opt != nullptr, "opt must not be NULL");
    (opt->opt.*member)(static_cast<halfstep::Stream>(stream));
  });
}

}  // namespace

halfstep_status halfstep_step(halfstep_optimizer* opt, void* stream) {
  return on_stream(opt, stream, &halfstep::FusedAdamW::step);
}

halfstep_status halfstep_step_local(halfstep_optimizer* opt, void* stream) {
  return on_stream(opt, stream, &halfstep::FusedAdamW::step_local);
}

halfstep_status halfstep_step_finish(halfstep_optimizer* opt, void* stream) {
  return on_stream(opt, stream, &halfstep::FusedAdamW::step_finish);
}

halfstep_status halfstep_step_local_refused(halfstep_optimizer* opt, void* stream) {
  return on_stream(opt, stream, &halfstep::FusedAdamW::step_local_refused);
}

halfstep_status halfstep_step_refused(halfstep_optimizer* opt, void* stream) {
  return on_stream(opt, stream, &halfstep::FusedAdamW::step_refused);
}

uint64_t* halfstep_device_totals(halfstep_optimizer* opt) {
  uint64_t* out = nullptr;
  (void)guarded([&] {
    require(opt != nullptr, "opt must not be NULL");
    static_assert(HALFSTEP_TOTALS_SUM_WORDS == halfstep::StepTotals::kSumWords &&
                      HALFSTEP_TOTALS_MAX_WORDS == halfstep::StepTotals::kMaxWords,
                  "the C record is the C++ one");
    out = opt->opt.device_totals()->sum;
  });
  return out;
}

halfstep_status halfstep_last_report(halfstep_optimizer* opt, halfstep_report* out) {
  return guarded([&] {
    require(opt != nullptr && out != nullptr, "opt and out must not be NULL");
    const halfstep::StepReport r = opt->opt.last_report();
    out->attempt = r.attempt;
    out->step = r.step;
    out->outcome = static_cast<int32_t>(r.outcome);
    out->spike = r.spike ? 1 : 0;
    out->scale_used = r.scale_used;
    out->scale_next = r.scale_next;
    out->grad_norm = r.grad_norm;
    out->clip_coef = r.clip_coef;
    out->nonfinite_count = r.nonfinite_count;
    out->first_nonfinite_tensor = r.first_nonfinite_tensor;
    out->max_abs_scaled = r.max_abs_scaled;
    out->headroom_log2 = r.headroom_log2;
    out->subnormal_count = r.subnormal_count;
    out->zero_count = r.zero_count;
    out->numel = r.numel;
    out->reason = static_cast<int32_t>(r.reason);
    out->held_elements = r.held_elements;
    out->first_nonfinite_rank = r.first_nonfinite_rank;
  });
}

halfstep_status halfstep_nonfinite_counts(halfstep_optimizer* opt, int64_t* out, int64_t n_tensors) {
  return guarded([&] {
    require(opt != nullptr && out != nullptr, "opt and out must not be NULL");
    const std::vector<std::int64_t> counts = opt->opt.nonfinite_counts();
    require(n_tensors == static_cast<int64_t>(counts.size()), "n_tensors must equal the optimizer's tensor count");
    std::memcpy(out, counts.data(), counts.size() * sizeof(int64_t));
  });
}

halfstep_status halfstep_set_threads(halfstep_optimizer* opt, int32_t threads) {
  return guarded([&] {
    require(opt != nullptr, "opt must not be NULL");
    opt->opt.set_threads(threads);
  });
}

halfstep_status halfstep_threads(halfstep_optimizer* opt, int32_t* out) {
  return guarded([&] {
    require(opt != nullptr, "opt must not be NULL");
    require(out != nullptr, "out must not be NULL");
    *out = opt->opt.threads();
  });
}

halfstep_status halfstep_set_lr(halfstep_optimizer* opt, int32_t group, float lr, void* stream) {
  return guarded([&] {
    require(opt != nullptr, "opt must not be NULL");
    opt->opt.set_lr(group, lr, static_cast<halfstep::Stream>(stream));
  });
}

halfstep_status halfstep_set_group(halfstep_optimizer* opt, int32_t group, const halfstep_group* h, void* stream) {
  return guarded([&] {
    require(opt != nullptr && h != nullptr, "opt and group must not be NULL");
    halfstep::AdamWConfig c;
    c.lr = h->lr;
    c.beta1 = h->beta1;
    c.beta2 = h->beta2;
    c.eps = h->eps;
    c.weight_decay = h->weight_decay;
    c.decoupled_weight_decay = h->decoupled_weight_decay != 0;
    c.bias_correction = h->bias_correction != 0;
    c.step_offset = h->step_offset;
    opt->opt.set_group(group, c, static_cast<halfstep::Stream>(stream));
  });
}

halfstep_status halfstep_set_gradients(halfstep_optimizer* opt, const void* const* grads, int64_t n_tensors,
                                       void* stream, uint64_t key) {
  return guarded([&] {
    require(opt != nullptr, "opt must not be NULL");
    require(n_tensors >= 0 && (grads != nullptr || n_tensors == 0), "grads must point to n_tensors >= 0 pointers");
    opt->opt.set_gradients(std::vector<const void*>(grads, grads + n_tensors), static_cast<halfstep::Stream>(stream),
                           key);
  });
}

halfstep_status halfstep_state_bytes_of(const halfstep_config* config, int32_t model_copy, halfstep_state_bytes* out) {
  return guarded([&] {
    require(config != nullptr && out != nullptr, "config and out must not be NULL");
    const halfstep_group g = [] {
      halfstep_group h;
      halfstep_group_init(&h);
      return h;
    }();
    const halfstep::StepConfig c = step_config(&g, 1, *config);
    c.validate();  // a format the step cannot serve is refused, as at creation
    const halfstep::StateBytes b = halfstep::state_bytes(c, model_copy != 0);
    *out = halfstep_state_bytes{b.state, b.gradient, b.model, b.moved};
  });
}

halfstep_status halfstep_mark_unscaled(halfstep_optimizer* opt, void* stream) {
  return on_stream(opt, stream, &halfstep::FusedAdamW::mark_unscaled);
}

halfstep_status halfstep_use_external_scale(halfstep_optimizer* opt, const float* scale, const float* found_inf,
                                            void* stream) {
  return guarded([&] {
    require(opt != nullptr, "opt must not be NULL");
    opt->opt.use_external_scale(scale, found_inf, static_cast<halfstep::Stream>(stream));
  });
}

halfstep_status halfstep_set_loss_scale(halfstep_optimizer* opt, float scale, void* stream) {
  return guarded([&] {
    require(opt != nullptr, "opt must not be NULL");
    opt->opt.set_loss_scale(scale, static_cast<halfstep::Stream>(stream));
  });
}

halfstep_status halfstep_loss_scale(halfstep_optimizer* opt, float* out) {
  return guarded([&] {
    require(opt != nullptr && out != nullptr, "opt and out must not be NULL");
    *out = opt->opt.loss_scale();
  });
}

const float* halfstep_device_loss_scale(halfstep_optimizer* opt) {
  if (opt == nullptr) {
    fail(HALFSTEP_ERROR_INVALID_ARGUMENT, "opt must not be NULL");
    return nullptr;
  }
  return opt->opt.device_loss_scale();
}

const int64_t* halfstep_device_step_count(halfstep_optimizer* opt) {
  if (opt == nullptr) {
    fail(HALFSTEP_ERROR_INVALID_ARGUMENT, "opt must not be NULL");
    return nullptr;
  }
  return opt->opt.device_step_count();
}

halfstep_status halfstep_step_count(halfstep_optimizer* opt, int64_t* applied, int64_t* attempts) {
  return guarded([&] {
    require(opt != nullptr && applied != nullptr && attempts != nullptr,
            "opt, applied and attempts must not be NULL");
    const halfstep::OptimizerState s = opt->opt.state();
    *applied = s.step;
    *attempts = s.attempts;
  });
}

halfstep_status halfstep_save_state(halfstep_optimizer* opt, void* buffer, size_t capacity, size_t* size) {
  return guarded([&] {
    require(opt != nullptr && size != nullptr, "opt and size must not be NULL");
    const std::string bytes = opt->opt.save_state();
    *size = bytes.size();
    if (buffer == nullptr) return;
    require(capacity >= bytes.size(), "capacity is smaller than the checkpoint (query *size first)");
    std::memcpy(buffer, bytes.data(), bytes.size());
  });
}

halfstep_status halfstep_load_state(halfstep_optimizer* opt, const void* data, size_t size) {
  return guarded([&] {
    require(opt != nullptr && (data != nullptr || size == 0), "opt and data must not be NULL");
    opt->opt.load_state(std::string_view(static_cast<const char*>(data), size));
  });
}

float* halfstep_device_lr(halfstep_optimizer* opt, int32_t group) {
  float* out = nullptr;
  if (guarded([&] {
        require(opt != nullptr, "opt must not be NULL");
        out = opt->opt.device_lr(group);
      }) != HALFSTEP_OK) {
    return nullptr;
  }
  return out;
}

halfstep_status halfstep_learning_rates(halfstep_optimizer* opt, float* out, int32_t n_groups) {
  return guarded([&] {
    require(opt != nullptr && out != nullptr, "opt and out must not be NULL");
    const std::vector<float> lr = opt->opt.learning_rates();
    require(n_groups == static_cast<int32_t>(lr.size()), "n_groups must equal the optimizer's group count");
    std::memcpy(out, lr.data(), lr.size() * sizeof(float));
  });
}

halfstep_status halfstep_get_group(halfstep_optimizer* opt, int32_t group, halfstep_group* out) {
  return guarded([&] {
    require(opt != nullptr && out != nullptr, "opt and out must not be NULL");
    const std::vector<halfstep::AdamWConfig>& groups = opt->opt.config().groups;
    require(group >= 0 && group < static_cast<int32_t>(groups.size()), "group must name one of the optimizer's groups");
    const halfstep::AdamWConfig& c = groups[static_cast<std::size_t>(group)];
    out->lr = opt->opt.learning_rates()[static_cast<std::size_t>(group)];
    out->beta1 = c.beta1;
    out->beta2 = c.beta2;
    out->eps = c.eps;
    out->weight_decay = c.weight_decay;
    out->decoupled_weight_decay = c.decoupled_weight_decay ? 1 : 0;
    out->bias_correction = c.bias_correction ? 1 : 0;
    out->step_offset = c.step_offset;
  });
}

halfstep_status halfstep_sizes(halfstep_optimizer* opt, int64_t* n_tensors, int32_t* n_groups) {
  return guarded([&] {
    require(opt != nullptr && n_tensors != nullptr && n_groups != nullptr,
            "opt, n_tensors and n_groups must not be NULL");
    *n_tensors = static_cast<int64_t>(opt->opt.tensors().size());
    *n_groups = static_cast<int32_t>(opt->opt.config().groups.size());
  });
}

halfstep_status halfstep_get_state(halfstep_optimizer* opt, halfstep_state* out) {
  return guarded([&] {
    require(opt != nullptr && out != nullptr, "opt and out must not be NULL");
    const halfstep::OptimizerState s = opt->opt.state();
    out->scale = s.scaler.scale;
    out->good_steps = s.scaler.good_steps;
    out->hysteresis_left = s.scaler.hysteresis_left;
    out->overflows = s.scaler.overflows;
    out->growths = s.scaler.growths;
    out->backoffs = s.scaler.backoffs;
    out->spike_mean = s.spike.mean;
    out->spike_var = s.spike.var;
    out->spike_seen = s.spike.seen;
    out->spikes = s.spike.spikes;
    out->spike_consecutive = s.spike.consecutive;
    out->step = s.step;
    out->attempts = s.attempts;
  });
}

halfstep_status halfstep_set_state(halfstep_optimizer* opt, const halfstep_state* in) {
  return guarded([&] {
    require(opt != nullptr && in != nullptr, "opt and state must not be NULL");
    halfstep::OptimizerState s;
    s.scaler.scale = in->scale;
    s.scaler.good_steps = in->good_steps;
    s.scaler.hysteresis_left = in->hysteresis_left;
    s.scaler.overflows = in->overflows;
    s.scaler.growths = in->growths;
    s.scaler.backoffs = in->backoffs;
    s.spike.mean = in->spike_mean;
    s.spike.var = in->spike_var;
    s.spike.seen = in->spike_seen;
    s.spike.spikes = in->spikes;
    s.spike.consecutive = in->spike_consecutive;
    s.step = in->step;
    s.attempts = in->attempts;
    opt->opt.set_state(s);
  });
}

namespace {
std::vector<std::string> strings(const char* const* list, int64_t n, const char* what) {
  require(n >= 0 && n <= INT32_MAX && (n == 0 || list != nullptr),
          (std::string(what) + " must point to n strings").c_str());
  std::vector<std::string> out;
  for (int64_t i = 0; i < n; ++i) {
    require(list[i] != nullptr, (std::string(what) + " holds a NULL string").c_str());
    out.emplace_back(list[i]);
  }
  return out;
}
}  // namespace

halfstep_status halfstep_save_checkpoint(halfstep_optimizer* opt, const char* const* names, int64_t n_names,
                                         const char* path, int32_t include_model,
                                         const char* const* metadata_keys,
                                         const char* const* metadata_values, int64_t n_metadata) {
  return guarded([&] {
    require(opt != nullptr && path != nullptr, "opt and path must not be NULL");
    halfstep::CheckpointOptions options;
    options.include_model = include_model != 0;
    const auto keys = strings(metadata_keys, n_metadata, "metadata_keys");
    const auto values = strings(metadata_values, n_metadata, "metadata_values");
    for (std::size_t i = 0; i < keys.size(); ++i) options.metadata[keys[i]] = values[i];
    halfstep::save_checkpoint(opt->opt, strings(names, n_names, "names"), path, options);
  });
}

halfstep_status halfstep_load_checkpoint(halfstep_optimizer* opt, const char* const* names, int64_t n_names,
                                         const char* path) {
  return guarded([&] {
    require(opt != nullptr && path != nullptr, "opt and path must not be NULL");
    (void)halfstep::load_checkpoint(opt->opt, strings(names, n_names, "names"), path);
  });
}

halfstep_status halfstep_checkpoint_metadata(const char* path, const char* key, char* buffer,
                                             size_t capacity, size_t* size) {
  return guarded([&] {
    require(path != nullptr && key != nullptr && size != nullptr, "path, key and size must not be NULL");
    const auto meta = halfstep::checkpoint_metadata(path);
    const auto it = meta.find(key);
    require(it != meta.end(), (std::string("the checkpoint has no metadata key '") + key + "'").c_str());
    *size = it->second.size();
    if (buffer == nullptr) return;
    require(capacity > it->second.size(), "capacity must hold the value and its NUL (query *size first)");
    std::memcpy(buffer, it->second.c_str(), it->second.size() + 1);
  });
}

const char* halfstep_version(void) { return halfstep::version(); }
int32_t halfstep_has_nccl(void) { return halfstep::has_nccl() ? 1 : 0; }
int32_t halfstep_version_number(void) { return halfstep::version_number(); }

const char* halfstep_outcome_name(int32_t outcome) {
  if (outcome < 0 || outcome > static_cast<int32_t>(halfstep::Outcome::skipped_inconsistent)) return "unknown";
  return halfstep::outcome_name(static_cast<halfstep::Outcome>(outcome));
}

const char* halfstep_reason_name(int32_t reason) {
  if (reason < 0 || reason > static_cast<int32_t>(halfstep::SkipReason::invalid_loss_scale)) return "unknown";
  return halfstep::skip_reason_name(static_cast<halfstep::SkipReason>(reason));
}

halfstep_status halfstep_workspace_bytes(const int64_t* numels, int64_t n_tensors, int32_t n_groups, size_t* out) {
  return guarded([&] {
    require(out != nullptr && n_tensors >= 0 && n_tensors <= INT32_MAX && (n_tensors == 0 || numels != nullptr) &&
                n_groups >= 1,
            "numels must point to n_tensors in [0, 2^31 - 1] sizes, n_groups >= 1 and out not NULL");
    *out = halfstep::workspace_bytes(std::vector<std::int64_t>(numels, numels + n_tensors),
                                     static_cast<std::size_t>(n_groups));
  });
}

const char* halfstep_last_error(void) { return g_last_error.c_str(); }

}  // extern "C"
