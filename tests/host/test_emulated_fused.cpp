// The GPU suite's checks, run on the host against a CPU model of the CUDA backend: the same
// tensor table, pass 1's per-thread sums in the same element order and precision, decide(),
// group_consts() and adamw_update() from kernels/step_math.hpp. It differs from the device only
// where the device compiler fuses a multiply and an add (one rounding instead of two, which the
// derived bounds cover). This keeps the GPU tests' tolerance logic honest without a GPU; the
// kernels themselves are exercised only by tests/gpu.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "halfstep/reference.hpp"
#include "host_buffers.hpp"
#include "step_check.hpp"
#include "step_math.hpp"
#include "tensor_table.hpp"
#include "trajectory.hpp"

using namespace halfstep;
using namespace halfstep::detail;
using namespace halfstep_test;

namespace {

class EmulatedFused final : public FusedSide {
 public:
  EmulatedFused(const HostModel& start, const StepConfig& c) : model_(start), config_(c) {
    table_ = build_tensor_table(model_.views());
    state_ = to_device_state(OptimizerState::initial(c));
    for (const AdamWConfig& h : c.groups) params_.push_back(group_params(h));
  }

  StepReport step(const HostModel& grads) override {
    for (std::size_t t = 0; t < model_.tensors.size(); ++t) model_.tensors[t].grad = grads.tensors[t].grad;
    table_ = build_tensor_table(model_.views());  // the grad buffers may have moved
    Totals totals;
    std::vector<ChunkPartial> partials;
    for (const ChunkDesc& chunk : table_.chunks) partials.push_back(pass1_chunk(chunk));
    for (std::size_t k = 0; k < partials.size(); ++k) {  // finalize's fold, in fp64
      totals.sum_sq += partials[k].sum_sq;
      totals.max_abs = std::max(totals.max_abs, partials[k].max_abs);
      totals.nonfinite += partials[k].nonfinite;
      totals.subnormal += partials[k].subnormal;
      totals.zero += partials[k].zero;
      if (partials[k].nonfinite && totals.first_nonfinite_tensor < 0) {
        totals.first_nonfinite_tensor = table_.chunks[k].tensor;
      }
    }
    StepReport report{};
    Decision d{};
    decide(totals, state_, decide_params(config_, table_.numel), report, d);
    if (d.apply) {
      for (std::size_t t = 0; t < model_.tensors.size(); ++t) {
        HostTensor& x = model_.tensors[t];
        const GroupConsts k = group_consts(params_[static_cast<std::size_t>(x.group)],
                                           config_.groups[static_cast<std::size_t>(x.group)].lr, state_.step);
        for (std::size_t i = 0; i < x.master.size(); ++i) {
          const float g = static_cast<float>(from_bits16(config_.grad_dtype, x.grad[i])) * d.coef;
          adamw_update(x.master[i], x.exp_avg[i], x.exp_avg_sq[i], g, k);
          if (x.with_model) x.model[i] = to_bits16(config_.model_dtype, x.master[i]);
        }
      }
    }
    return report;
  }

  HostModel buffers(const HostModel&) override { return model_; }
  HostModel& model() { return model_; }
  OptimizerState state() const { return to_optimizer_state(state_); }

 private:
  // Pass 1 on one chunk: thread j of kPassThreads folds vectors j, j + T, ... (8 elements each),
  // then tail elements, in fp32 for f16 (fp64 for bf16); the block combines threads in fp64.
  ChunkPartial pass1_chunk(const ChunkDesc& chunk) const {
    const TensorDesc& t = table_.tensors[static_cast<std::size_t>(chunk.tensor)];
    const auto* g = static_cast<const std::uint16_t*>(t.grad) + chunk.begin;
    ChunkPartial out{0.0, 0.0f, 0, 0, 0};
    const int n_vec = t.grad_vec ? chunk.len / kVecElems : 0;
    for (int j = 0; j < kPassThreads; ++j) {
      float sum32 = 0.0f;
      double sum64 = 0.0;
      auto add = [&](std::uint16_t bits) {
        const BitClass c = classify_bits16(config_.grad_dtype, bits);
        if (c == BitClass::infinite || c == BitClass::nan) {
          ++out.nonfinite;
          return;
        }
        out.zero += c == BitClass::zero;
        out.subnormal += c == BitClass::subnormal;
        const float a = static_cast<float>(std::fabs(from_bits16(config_.grad_dtype, bits)));
        if (config_.grad_dtype == DType::f16) {
          sum32 += a * a;
        } else {
          sum64 += static_cast<double>(a) * a;
        }
        out.max_abs = std::max(out.max_abs, a);
      };
      for (int v = j; v < n_vec; v += kPassThreads) {
        for (int e = 0; e < kVecElems; ++e) add(g[v * kVecElems + e]);
      }
      for (int i = n_vec * kVecElems + j; i < chunk.len; i += kPassThreads) add(g[i]);
      out.sum_sq += config_.grad_dtype == DType::f16 ? static_cast<double>(sum32) : sum64;
    }
    return out;
  }

  HostModel model_;
  StepConfig config_;
  TensorTable table_;
  DeviceState state_{};
  std::vector<GroupParams> params_;
};

}  // namespace

TEST_CASE("the kernels' arithmetic passes the GPU suite's per-step checks", "[emulated]") {
  const std::int64_t C = kChunkElems;
  const std::vector<std::int64_t> sizes = {0, 1, 7, 33, C - 1, C, C + 1, 200003, 0};
  std::uint64_t seed = 500;
  for (DType grad : {DType::f16, DType::bf16}) {
    for (DType model : {DType::f16, DType::bf16}) {
      for (float max_norm : {0.0f, 0.5f}) {
        const float scale = grad == DType::f16 ? 1024.0f : 1.0f;
        HostModel h = poisoned_model(++seed, sizes, scale, grad, model);
        h.tensors[3].with_model = false;
        const StepConfig c = config_for(grad, model, scale, max_norm);
        EmulatedFused fused(h, c);
        std::mt19937_64 g(seed);
        for (int step = 0; step < 3; ++step) {
          const HostModel before = fused.model();
          HostModel next_grads = before;
          for (auto& t : next_grads.tensors) refill_grads(g, t, grad, fused.state().scaler.scale);
          HostModel ref = before;
          for (std::size_t t = 0; t < ref.tensors.size(); ++t) ref.tensors[t].grad = next_grads.tensors[t].grad;
          HostModel ref_before = ref;
          OptimizerState s = fused.state();
          const StepReport got = fused.step(next_grads);
          const StepReport want = reference::step(ref.views(), c, s);
          CAPTURE(seed, dtype_name(grad), dtype_name(model), max_norm, step);
          check_step(got, want, ref_before, fused.model(), ref, c, s.step);
          REQUIRE(fused.state().scaler == s.scaler);
        }
      }
    }
  }
}

TEST_CASE("the kernels' arithmetic stays within the GPU suite's trajectory bound", "[emulated]") {
  const HostModel h = poisoned_model(13, {3000, 1, kChunkElems + 11}, 32768.0f, DType::f16, DType::f16);
  StepConfig c = config_for(DType::f16, DType::f16, 32768.0f, 0.05f);
  c.scaler.growth_interval = 9;
  EmulatedFused fused(h, c);
  free_running_trajectory(fused, h, c, 14);
}
