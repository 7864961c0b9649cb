// Fuzz target: configuration and tensor validation. Any StepConfig and any tensor list — sizes,
// groups, addresses, overlaps, alignment — is either accepted or refused with an invalid_argument
// Error (never another exception, never a crash), and the derived sizes (workspace, tensor table)
// never wrap. Accepted configurations then run reference steps on small real buffers filled from
// the input, which must keep the step's invariants.
#include <new>
#include <stdexcept>

#include "fuzz_input.hpp"
#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/reference.hpp"
#include "tensor_table.hpp"

using namespace halfstep;
using halfstep_fuzz::Input;
using halfstep_fuzz::violated;

namespace {

DType dtype(std::uint8_t code) { return static_cast<DType>(code % 4); }  // 3: not a DType at all

StepConfig config_from(Input& in) {
  StepConfig c;
  c.grad_dtype = dtype(in.take<std::uint8_t>());
  c.model_dtype = dtype(in.take<std::uint8_t>());
  c.max_grad_norm = in.take<float>();
  c.host_driven = in.flag();
  c.scaler.init_scale = in.take<float>();
  c.scaler.growth_factor = in.take<float>();
  c.scaler.backoff_factor = in.take<float>();
  c.scaler.growth_interval = in.take<std::int32_t>();
  c.scaler.hysteresis = in.take<std::int32_t>();
  c.scaler.consecutive_hysteresis = in.flag();
  c.scaler.min_scale = in.take<float>();
  c.scaler.max_scale = in.take<float>();
  c.scaler.headroom_growth = in.flag();
  c.scaler.headroom_margin_log2 = in.take<float>();
  c.spike.enabled = in.flag();
  c.spike.z_threshold = in.take<float>();
  c.spike.ema_beta = in.take<float>();
  c.spike.warmup_steps = in.take<std::int32_t>();
  c.spike.action = in.flag() ? SpikeConfig::Action::skip : SpikeConfig::Action::log;
  c.spike.min_std = in.take<float>();
  c.spike.max_consecutive = in.take<std::int32_t>();
  c.groups.resize(in.take<std::uint8_t>() % 5);
  for (AdamWConfig& g : c.groups) {
    g.lr = in.take<float>();
    g.beta1 = in.take<float>();
    g.beta2 = in.take<float>();
    g.eps = in.take<float>();
    g.weight_decay = in.take<float>();
    g.decoupled_weight_decay = in.flag();
    g.bias_correction = in.flag();
  }
  // The state formats, codes past the enums included (validation refuses them by name).
  c.state.master = static_cast<MasterFormat>(in.take<std::uint8_t>() % 4);
  c.state.exp_avg = static_cast<MomentFormat>(in.take<std::uint8_t>() % 3);
  c.state.exp_avg_sq = static_cast<MomentFormat>(in.take<std::uint8_t>() % 3);
  c.state.rounding = static_cast<Rounding>(in.take<std::uint8_t>() % 3);
  c.state.seed = in.take<std::uint64_t>();
  return c;
}

template <class F>
bool refused_cleanly(F&& f) {
  try {
    f();
    return false;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::invalid_argument) violated("a validation Error that is not invalid_argument");
    return true;
  } catch (const std::bad_alloc&) {
    violated("validation ran out of memory instead of refusing");
  } catch (const std::exception&) {
    violated("validation threw something other than halfstep::Error");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  const StepConfig c = config_from(in);

  // Tensors at arbitrary addresses (never dereferenced by validation).
  std::vector<ParamTensor> tensors(in.take<std::uint8_t>() % 6);
  std::vector<std::int64_t> numels;
  for (ParamTensor& p : tensors) {
    p.numel = in.take<std::int64_t>() >> (in.take<std::uint8_t>() % 64);
    p.group = in.take<std::int32_t>() % 6;
    p.master = in.flag() ? nullptr : reinterpret_cast<float*>(in.take<std::uint64_t>());  // null: no master
    p.grad = reinterpret_cast<const void*>(in.take<std::uint64_t>());
    p.exp_avg = reinterpret_cast<float*>(in.take<std::uint64_t>());
    p.exp_avg_sq = reinterpret_cast<float*>(in.take<std::uint64_t>());
    p.model = in.flag() ? nullptr : reinterpret_cast<void*>(in.take<std::uint64_t>());
    numels.push_back(p.numel);
  }
  const bool config_ok = !refused_cleanly([&] { c.validate(); });
  const bool tensors_ok = !refused_cleanly([&] { validate(tensors, c); });
  if (tensors_ok && !config_ok) violated("validate accepted tensors with an invalid config");
  std::size_t bytes = 0;
  if (!refused_cleanly([&] { bytes = workspace_bytes(numels, c.groups.size()); }) && bytes == 0) {
    violated("workspace_bytes returned 0");
  }
  if (tensors_ok) {
    std::uint64_t chunks = 0;
    for (std::int64_t n : numels) chunks += static_cast<std::uint64_t>(detail::chunks_of(n));
    if (chunks <= 4096) {  // a table small enough to build here
      const detail::TensorTable table = detail::build_tensor_table(tensors);
      if (table.chunks.size() != chunks) violated("the tensor table has the wrong number of chunks");
    } else if (chunks > detail::kMaxChunks && !refused_cleanly([&] { (void)detail::build_tensor_table(tensors); })) {
      violated("a tensor table past one launch's grid was built");
    }
  }
  if (!config_ok) return 0;

  // Real buffers: up to four small tensors, contents from the input, three reference steps, the
  // state in fp32 (the buffers' format; the lean formats have their own tests).
  StepConfig run = c;
  run.state.master = MasterFormat::f32;
  run.state.exp_avg = run.state.exp_avg_sq = MomentFormat::f32;
  halfstep_fuzz::Model model(c.grad_dtype);
  const std::size_t n_tensors = 1 + in.take<std::uint8_t>() % 4;
  for (std::size_t t = 0; t < n_tensors; ++t) {
    model.add(1 + in.take<std::uint8_t>() % 24, static_cast<std::int32_t>(t % c.groups.size()), in.flag());
    for (float& x : model.master[t]) x = in.take<float>();
    for (float& x : model.m[t]) x = in.take<float>();
    for (float& x : model.v[t]) x = in.take<float>();
  }
  OptimizerState state = OptimizerState::initial(run);
  for (int k = 0; k < 3; ++k) {
    for (std::size_t t = 0; t < model.grad.size(); ++t) {
      for (std::size_t i = 0; i < model.master[t].size(); ++i) {
        model.set_grad(t, i, model.grad_bytes == 4 ? in.take<std::uint32_t>() : in.take<std::uint16_t>());
      }
    }
    const halfstep_fuzz::Model before = model;
    StepReport r{};
    try {
      r = reference::step(model.views(), run, state);
    } catch (const Error& e) {
      violated("a step with a valid config and valid buffers threw");
    }
    halfstep_fuzz::check_step(r, before, model, c.model_dtype);
  }
  return 0;
}
