// Backend::host against the device, bit for bit: the same tensors, state and gradients stepped by
// both, every buffer, report and state compared byte for byte after every step. On the emulated
// device this checks the host backend against the kernels' own source; on a GPU, against the
// CUDA backend itself (both compute without contraction, fmaf where the kernels fuse).
//
// The matrix: fp16, bf16 and fp32 gradients; every master format (fp32, remainders, none) and
// moment format (fp32, bf16 either way, block8) with both roundings; 1, 2 and 3 host threads;
// tensors of odd sizes, a tensor past one chunk, a piece of a tensor cut where blocks start,
// tensors that keep wide moments under block8, buffers off 16-byte alignment (the scalar paths);
// two groups (classic L2, no bias correction), clipping, a held element (a weight near fp32's
// largest pushed past it), an overflow skip (an inf injected), external scales and
// mark_unscaled.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "gpu_support.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/state.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

// One tensor's buffers, on the device and on the host, with the same bytes.
struct Twin {
  ParamTensor shape;                 // numel, offset, whole_numel, row, group, tensor_id
  std::vector<std::vector<unsigned char>> host;  // per slot, then the two scale buffers
  std::vector<void*> device;
  std::vector<std::size_t> bytes;
  std::vector<std::size_t> misalign;  // bytes each device and host buffer is moved by (an element)
};

constexpr int kScaleSlots = 2;  // after the five slots: exp_avg_scale, exp_avg_sq_scale

struct Model {
  std::vector<Twin> tensors;
  std::vector<ParamTensor> host_views, device_views;
  ~Model() {
    for (Twin& t : tensors) {
      for (void* p : t.device) {
        if (p != nullptr) cudaFree(p);
      }
    }
  }
};

void* offset(void* p, std::size_t by) { return p == nullptr ? nullptr : static_cast<unsigned char*>(p) + by; }

// Random but sane initial state in each slot's format: masters (and weights) N(0, 0.5), moments
// 0 (the first steps fill them), the model copy the master rounded, scales 0.
void build(Model& m, const StepConfig& c, const std::vector<ParamTensor>& shapes, std::mt19937_64& rng) {
  std::normal_distribution<float> w(0.0f, 0.5f);
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    Twin twin;
    twin.shape = shapes[t];
    const bool off = t % 4 == 3;  // every fourth tensor's buffers an element off 16-byte alignment
    const auto layouts = slot_layouts(c, twin.shape);
    const MomentBlocks blocks = moment_blocks(c, twin.shape);
    const auto n = static_cast<std::size_t>(twin.shape.numel);
    twin.host.resize(kSlotCount + kScaleSlots);
    twin.device.assign(kSlotCount + kScaleSlots, nullptr);
    twin.bytes.assign(kSlotCount + kScaleSlots, 0);
    twin.misalign.assign(kSlotCount + kScaleSlots, off ? 4 : 0);
    for (const SlotLayout& s : layouts) {
      const auto k = static_cast<std::size_t>(s.slot);
      if (!s.present) continue;
      twin.bytes[k] = n * s.element_bytes;
      twin.misalign[k] = off ? s.element_bytes : 0;
    }
    if (blocks.quantized) {
      twin.bytes[kSlotCount] = twin.bytes[kSlotCount + 1] = static_cast<std::size_t>(blocks.blocks) * 4;
    }
    for (std::size_t k = 0; k < twin.host.size(); ++k) {
      twin.host[k].assign(twin.bytes[k] + twin.misalign[k] + 16, 0);
      if (twin.bytes[k] == 0) continue;
      GPU_CHECK(cudaMalloc(&twin.device[k], twin.bytes[k] + twin.misalign[k] + 16));
    }
    // Masters and model copies from one set of fp32 weights.
    for (std::size_t i = 0; i < n; ++i) {
      float x = w(rng);
      if (c.model_dtype == DType::bf16) x = static_cast<float>(from_bits16(DType::bf16, to_bits16(DType::bf16, x)));
      std::uint32_t bits;
      std::memcpy(&bits, &x, 4);
      bits = canonical_master(bits);
      unsigned char* base = twin.host[static_cast<std::size_t>(Slot::master)].data() + twin.misalign[static_cast<std::size_t>(Slot::master)];
      if (c.state.master == MasterFormat::f32) {
        std::memcpy(base + 4 * i, &bits, 4);
      } else if (c.state.master == MasterFormat::bf16_remainder) {
        std::uint16_t model = 0;
        std::int16_t rest = 0;
        REQUIRE(split_master(bits, model, rest));
        std::memcpy(base + 2 * i, &rest, 2);
      }
      const std::uint16_t model = to_bits16(c.model_dtype, static_cast<double>(x));
      std::memcpy(twin.host[static_cast<std::size_t>(Slot::model)].data() + twin.misalign[static_cast<std::size_t>(Slot::model)] + 2 * i,
                  &model, 2);
    }
    m.tensors.push_back(std::move(twin));
  }
  // A weight near fp32's largest in tensor 1 (group 1, classic L2 decay): its decay term joins the
  // gradient, whose square overflows the second moment, so its element (or block) is held.
  Twin& big = m.tensors[1];
  const float huge = 3.38e38f;
  if (c.state.master == MasterFormat::f32) {
    std::memcpy(big.host[static_cast<std::size_t>(Slot::master)].data() + big.misalign[static_cast<std::size_t>(Slot::master)], &huge, 4);
  }
  if (c.model_dtype == DType::bf16 && c.state.master != MasterFormat::f32) {
    const std::uint16_t model = to_bits16(DType::bf16, huge);
    std::memcpy(big.host[static_cast<std::size_t>(Slot::model)].data() + big.misalign[static_cast<std::size_t>(Slot::model)], &model, 2);
    if (c.state.master == MasterFormat::bf16_remainder) {
      const std::int16_t rest = 0;
      std::memcpy(big.host[static_cast<std::size_t>(Slot::master)].data() + big.misalign[static_cast<std::size_t>(Slot::master)], &rest, 2);
    }
  }
  for (Twin& t : m.tensors) {
    for (std::size_t k = 0; k < t.host.size(); ++k) {
      if (t.bytes[k] == 0) continue;
      GPU_CHECK(cudaMemcpy(t.device[k], t.host[k].data(), t.host[k].size(), cudaMemcpyHostToDevice));
    }
    ParamTensor hv = t.shape, dv = t.shape;
    for (int k = 0; k < kSlotCount; ++k) {
      const auto s = static_cast<Slot>(k);
      const bool present = t.bytes[static_cast<std::size_t>(k)] != 0;
      const std::size_t by = t.misalign[static_cast<std::size_t>(k)];
      if (s == Slot::grad) {
        hv.grad = present ? offset(t.host[static_cast<std::size_t>(k)].data(), by) : nullptr;
        dv.grad = present ? offset(t.device[static_cast<std::size_t>(k)], by) : nullptr;
        continue;
      }
      set_slot_pointer(hv, s, present ? offset(t.host[static_cast<std::size_t>(k)].data(), by) : nullptr);
      set_slot_pointer(dv, s, present ? offset(t.device[static_cast<std::size_t>(k)], by) : nullptr);
    }
    if (t.bytes[kSlotCount] != 0) {
      hv.exp_avg_scale = static_cast<float*>(offset(t.host[kSlotCount].data(), t.misalign[kSlotCount]));
      hv.exp_avg_sq_scale = static_cast<float*>(offset(t.host[kSlotCount + 1].data(), t.misalign[kSlotCount + 1]));
      dv.exp_avg_scale = static_cast<float*>(offset(t.device[kSlotCount], t.misalign[kSlotCount]));
      dv.exp_avg_sq_scale = static_cast<float*>(offset(t.device[kSlotCount + 1], t.misalign[kSlotCount + 1]));
    }
    m.host_views.push_back(hv);
    m.device_views.push_back(dv);
  }
}

// New gradients, the same bytes on both sides: N(0, 0.01)·S with zeros and subnormals of the format
// the gradients were computed in.
void fill_grads(Model& m, const StepConfig& c, float scale, std::mt19937_64& rng, bool inject_inf) {
  std::normal_distribution<double> g(0.0, 1e-2);
  const DType measured = c.grad_dtype == DType::f32 ? DType::f16 : c.grad_dtype;
  for (std::size_t t = 0; t < m.tensors.size(); ++t) {
    Twin& twin = m.tensors[t];
    const auto n = static_cast<std::size_t>(twin.shape.numel);
    unsigned char* base = twin.host[static_cast<std::size_t>(Slot::grad)].data() + twin.misalign[static_cast<std::size_t>(Slot::grad)];
    for (std::size_t i = 0; i < n; ++i) {
      const auto kind = rng() % 8;
      double x = kind == 0 ? 0.0 : kind == 1 ? format_info(measured).min_subnormal * static_cast<double>(1 + rng() % 100) : g(rng);
      x *= scale;
      if (inject_inf && t + 1 == m.tensors.size() && i == n / 2) x = INFINITY;
      if (c.grad_dtype == DType::f32) {
        const float f = static_cast<float>(x);
        std::memcpy(base + 4 * i, &f, 4);
      } else {
        const std::uint16_t b = to_bits16(c.grad_dtype, x);
        std::memcpy(base + 2 * i, &b, 2);
      }
    }
    GPU_CHECK(cudaMemcpy(twin.device[static_cast<std::size_t>(Slot::grad)],
                         twin.host[static_cast<std::size_t>(Slot::grad)].data(),
                         twin.host[static_cast<std::size_t>(Slot::grad)].size(), cudaMemcpyHostToDevice));
  }
  GPU_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

// Every byte of every buffer the same on both sides.
void require_same_buffers(const Model& m) {
  for (std::size_t t = 0; t < m.tensors.size(); ++t) {
    const Twin& twin = m.tensors[t];
    for (std::size_t k = 0; k < twin.host.size(); ++k) {
      if (twin.bytes[k] == 0) continue;
      std::vector<unsigned char> dev(twin.host[k].size());
      GPU_CHECK(cudaMemcpy(dev.data(), twin.device[k], dev.size(), cudaMemcpyDeviceToHost));
      if (dev != twin.host[k]) {
        std::size_t at = 0;
        while (dev[at] == twin.host[k][at]) ++at;
        CAPTURE(t, k, at, int{dev[at]}, int{twin.host[k][at]});
        FAIL("a buffer differs between the device and the host backend");
      }
    }
  }
}

void require_same_reports(const StepReport& a, const StepReport& b) {
  CHECK(a.outcome == b.outcome);
  CHECK(a.reason == b.reason);
  CHECK(a.attempt == b.attempt);
  CHECK(a.step == b.step);
  CHECK(std::memcmp(&a.scale_used, &b.scale_used, sizeof a.scale_used) == 0);
  CHECK(std::memcmp(&a.scale_next, &b.scale_next, sizeof a.scale_next) == 0);
  CHECK(std::memcmp(&a.grad_norm, &b.grad_norm, sizeof a.grad_norm) == 0);
  CHECK(std::memcmp(&a.clip_coef, &b.clip_coef, sizeof a.clip_coef) == 0);
  CHECK(std::memcmp(&a.max_abs_scaled, &b.max_abs_scaled, sizeof a.max_abs_scaled) == 0);
  CHECK(std::memcmp(&a.headroom_log2, &b.headroom_log2, sizeof a.headroom_log2) == 0);
  CHECK(a.nonfinite_count == b.nonfinite_count);
  CHECK(a.first_nonfinite_tensor == b.first_nonfinite_tensor);
  CHECK(a.subnormal_count == b.subnormal_count);
  CHECK(a.zero_count == b.zero_count);
  CHECK(a.numel == b.numel);
  CHECK(a.held_elements == b.held_elements);
  CHECK(a.spike == b.spike);
}

struct Format {
  DType grad, model;
  MasterFormat master;
  MomentFormat exp_avg, exp_avg_sq;
  Rounding rounding;
};

StepConfig config_of(const Format& f) {
  StepConfig c;
  c.grad_dtype = f.grad;
  c.model_dtype = f.model;
  c.compute_dtype = f.grad == DType::bf16 ? DType::bf16 : DType::f16;
  c.scaler.init_scale = f.grad == DType::bf16 ? 1.0f : 1024.0f;
  c.scaler.growth_interval = 2;
  c.max_grad_norm = 0.5f;
  c.state.master = f.master;
  c.state.exp_avg = f.exp_avg;
  c.state.exp_avg_sq = f.exp_avg_sq;
  c.state.rounding = f.rounding;
  c.state.seed = 2026;
  c.groups[0].lr = 1e-3f;
  c.groups[0].weight_decay = 0.01f;
  AdamWConfig l2;  // group 1: classic L2 decay, no bias correction
  l2.lr = 3e-3f;
  l2.weight_decay = 0.02f;
  l2.decoupled_weight_decay = false;
  l2.bias_correction = false;
  c.groups.push_back(l2);
  return c;
}

std::vector<ParamTensor> shapes_of(const StepConfig& c) {
  // (numel, whole, row, offset): the held weight's tensor first; a tensor past one chunk; odd
  // sizes; under block8 a tensor with rows and a piece of one cut where its blocks start, and
  // tensors that keep wide moments (few elements, short rows).
  struct S {
    std::int64_t numel, whole, row, offset;
  };
  std::vector<S> list = {{4096, 0, 512, 0}, {40000, 0, 1000, 0}, {7, 0, 0, 0}, {9, 0, 0, 0}, {8448, 0, 264, 0},
                         {5000, 0, 0, 0},   {300, 0, 0, 0},      {2048, 0, 16, 0}, {16000, 48000, 1000, 8000}};
  if (c.state.exp_avg != MomentFormat::block8) {  // no shapes without blocks: whole tensors only
    list.back() = {16000, 0, 0, 0};
  }
  std::vector<ParamTensor> out;
  for (std::size_t t = 0; t < list.size(); ++t) {
    ParamTensor p;
    p.numel = list[t].numel;
    p.whole_numel = list[t].whole;
    p.row = list[t].row;
    p.offset = list[t].offset;
    p.group = static_cast<std::int32_t>(t % 2);
    p.tensor_id = static_cast<std::uint32_t>(t + 1);
    out.push_back(p);
  }
  return out;
}

void run_format(const Format& f, int threads) {
  const StepConfig c = config_of(f);
  std::mt19937_64 rng(static_cast<std::uint64_t>(threads) * 977 + static_cast<std::uint64_t>(f.grad) * 31 +
                      static_cast<std::uint64_t>(f.master) * 7 + static_cast<std::uint64_t>(f.exp_avg) * 3);
  Model m;
  build(m, c, shapes_of(c), rng);
  FusedAdamW device(m.device_views, c);
  FusedAdamW host(m.host_views, c, Backend::host);
  host.set_threads(threads);
  REQUIRE(host.threads() == threads);
  require_same_buffers(m);
  float external = 512.0f;
  for (int step = 0; step < 6; ++step) {
    CAPTURE(step);
    const bool inject = step == 3;
    if (step == 4) {  // gradients scaled by another scaler's scale
      fill_grads(m, c, external, rng, false);
      void* raw = nullptr;
      GPU_CHECK(cudaMalloc(&raw, sizeof(float)));
      auto* d_scale = static_cast<float*>(raw);
      GPU_CHECK(cudaMemcpy(d_scale, &external, sizeof(float), cudaMemcpyHostToDevice));
      device.use_external_scale(d_scale, nullptr);
      host.use_external_scale(&external, nullptr);
      device.step();
      host.step();
      GPU_CHECK(cudaDeviceSynchronize());
      cudaFree(d_scale);
    } else {
      fill_grads(m, c, device.loss_scale(), rng, inject);
      if (step == 5) {  // as if already unscaled: divided by 1
        device.mark_unscaled();
        host.mark_unscaled();
      }
      device.step();
      host.step();
    }
    const StepReport a = device.last_report(), b = host.last_report();
    require_same_reports(a, b);
    if (inject) REQUIRE(a.outcome == Outcome::skipped_overflow);
    if (step == 0) REQUIRE(a.outcome == Outcome::applied);
    if (a.outcome == Outcome::applied) REQUIRE(a.held_elements > 0);  // the weight near fp32's largest
    const OptimizerState sa = device.state(), sb = host.state();
    CHECK(sa.scaler == sb.scaler);
    CHECK(std::memcmp(&sa.spike, &sb.spike, sizeof sa.spike) == 0);
    CHECK(sa.step == sb.step);
    CHECK(sa.attempts == sb.attempts);
    CHECK(device.nonfinite_counts() == host.nonfinite_counts());
    require_same_buffers(m);
  }
}

}  // namespace

TEST_CASE("host backend: every state format steps bit for bit as the device, on 1, 2 and 3 threads", "[gpu][host]") {
  using MF = MasterFormat;
  using MoF = MomentFormat;
  const Rounding st = Rounding::stochastic, ne = Rounding::nearest;
  const std::vector<Format> formats = {
      {DType::f16, DType::f16, MF::f32, MoF::f32, MoF::f32, st},
      {DType::bf16, DType::bf16, MF::f32, MoF::f32, MoF::f32, st},
      {DType::f32, DType::bf16, MF::f32, MoF::f32, MoF::f32, st},
      {DType::f16, DType::f16, MF::f32, MoF::bf16, MoF::bf16, st},
      {DType::bf16, DType::bf16, MF::f32, MoF::f32, MoF::bf16, ne},
      {DType::bf16, DType::bf16, MF::bf16_remainder, MoF::f32, MoF::f32, st},
      {DType::bf16, DType::bf16, MF::bf16_remainder, MoF::bf16, MoF::bf16, st},
      {DType::bf16, DType::bf16, MF::none, MoF::bf16, MoF::bf16, st},
      {DType::bf16, DType::bf16, MF::none, MoF::f32, MoF::f32, ne},
      {DType::f16, DType::f16, MF::f32, MoF::block8, MoF::block8, st},
      {DType::bf16, DType::bf16, MF::f32, MoF::block8, MoF::block8, ne},
      {DType::f32, DType::bf16, MF::bf16_remainder, MoF::block8, MoF::block8, st},
      {DType::bf16, DType::bf16, MF::none, MoF::block8, MoF::block8, st},
      {DType::bf16, DType::bf16, MF::none, MoF::block8, MoF::block8, ne},
  };
  for (const Format& f : formats) {
    for (int threads : {1, 2, 3}) {
      CAPTURE(dtype_name(f.grad), dtype_name(f.model), master_format_name(f.master), moment_format_name(f.exp_avg),
              moment_format_name(f.exp_avg_sq), rounding_name(f.rounding), threads);
      run_format(f, threads);
    }
  }
}
