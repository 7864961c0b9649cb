// The fused CUDA step against the CPU reference, on fresh seeded random inputs. Verdicts,
// counters and scales compare exactly; norms, masters and moments within the bounds derived in
// gpu_support.hpp and adam_bound.hpp.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <string>

#include <unistd.h>

#include "gpu_support.hpp"
#include "trajectory.hpp"
#include "halfstep/checkpoint.hpp"
#include "halfstep/error.hpp"
#include "halfstep/safetensors.hpp"
#if defined(HALFSTEP_EMULATED)
#include "halfstep_emu/control.hpp"
#endif

using namespace halfstep;
using namespace halfstep_test;

namespace {

constexpr std::int64_t kChunk = 32768;  // kChunkElems of the kernels

// One fused step and one reference step from the same inputs and state, compared.
StepReport lockstep(FusedAdamW& opt, DeviceModel& dev, const HostModel& like,
                    const StepConfig& config, OptimizerState* ref_state_out = nullptr) {
  const HostModel before = dev.download(like);
  OptimizerState ref_state = opt.state();
  opt.step();
  const StepReport got = opt.last_report();
  HostModel ref = before;
  const StepReport want = reference::step(ref.views(), config, ref_state);
  check_step(got, want, before, dev.download(like), ref, config, ref_state.step);
  const OptimizerState now = opt.state();
  REQUIRE(now.scaler == ref_state.scaler);
  REQUIRE(now.step == ref_state.step);
  REQUIRE(now.attempts == ref_state.attempts);
  REQUIRE(now.spike.seen == ref_state.spike.seen);
  REQUIRE(now.spike.spikes == ref_state.spike.spikes);
  if (ref_state_out) *ref_state_out = ref_state;
  return got;
}

}  // namespace

TEST_CASE("gpu step matches the reference at edge sizes for every dtype pair", "[gpu]") {
  const std::int64_t large_odd = reduced_sizes() ? 100003 : 1000003;
  const std::vector<std::int64_t> sizes = {0, 1, 7, 33, kChunk - 1, kChunk, kChunk + 1, large_odd, 0};
  std::uint64_t seed = 1000;
  for (DType grad : {DType::f16, DType::bf16, DType::f32}) {
    for (DType model : {DType::f16, DType::bf16}) {
      for (float max_norm : {0.0f, 0.5f}) {
        const float scale = grad == DType::bf16 ? 1.0f : 1024.0f;
        HostModel h = poisoned_model(++seed, sizes, scale, grad, model);
        h.tensors[3].with_model = false;  // a tensor without a model copy
        DeviceModel dev(h);
        const StepConfig c = config_for(grad, model, scale, max_norm);
        FusedAdamW opt(dev.views(), c);
        CAPTURE(seed, dtype_name(grad), dtype_name(model), max_norm);
        REQUIRE(opt.launches_per_step() == 3);
        const StepReport r = lockstep(opt, dev, h, c);
        REQUIRE(r.outcome == Outcome::applied);
        if (max_norm > 0.0f) REQUIRE(r.clip_coef < 1.0f);
      }
    }
  }
}

TEST_CASE("gpu step matches the reference on seeded random sizes over several steps", "[gpu]") {
  std::mt19937_64 rng(77);
  std::uniform_int_distribution<std::int64_t> size(0, 3 * kChunk);
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<std::int64_t> sizes;
    for (int t = 0; t < 5; ++t) sizes.push_back(size(rng));
    const std::uint64_t seed = rng();
    const DType grad = trial % 3 == 0 ? DType::f16 : trial % 3 == 1 ? DType::bf16 : DType::f32;
    const float scale = grad == DType::bf16 ? 1.0f : 4096.0f;
    HostModel h = poisoned_model(seed, sizes, scale, grad, DType::f16);
    DeviceModel dev(h);
    StepConfig c = config_for(grad, DType::f16, scale, trial % 3 ? 1.0f : 0.0f);
    FusedAdamW opt(dev.views(), c);
    std::mt19937_64 g(seed);
    for (int step = 0; step < 4; ++step) {
      for (auto& t : h.tensors) refill_grads(g, t, grad, opt.loss_scale());
      dev.upload_grads(h);
      CAPTURE(trial, seed, step);
      lockstep(opt, dev, h, c);
    }
  }
}

TEST_CASE("gpu step handles 10000 tiny tensors in one step", "[gpu]") {
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<std::int64_t> size(0, 20);
  std::vector<std::int64_t> sizes(reduced_sizes() ? 1000 : 10000);
  for (auto& n : sizes) n = size(rng);
  HostModel h = poisoned_model(6, sizes, 512.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  const StepConfig c = config_for(DType::f16, DType::f16, 512.0f, 1.0f);
  FusedAdamW opt(dev.views(), c);
  CHECK(opt.launches_per_step() == 3);
  lockstep(opt, dev, h, c);
  // An overflow in the last non-empty tensor is found and named.
  HostModel bad = dev.download(h);
  std::size_t last = sizes.size() - 1;
  while (bad.tensors[last].grad.empty()) --last;
  bad.tensors[last].grad.back() = 0x7C00;
  dev.upload_grads(bad);
  const StepReport r = lockstep(opt, dev, h, c);
  CHECK(r.outcome == Outcome::skipped_overflow);
  CHECK(r.first_nonfinite_tensor == static_cast<std::int32_t>(last));
}

TEST_CASE("gpu step takes the scalar path for pointers offset by 1 to 3 elements", "[gpu]") {
  const std::vector<std::int64_t> sizes = {9, kChunk + 3, 1001};
  for (DType grad : {DType::f16, DType::bf16, DType::f32}) {
    HostModel h = poisoned_model(8, sizes, 256.0f, grad, DType::bf16);
    DeviceModel dev(h, /*misalign=*/true);
    const StepConfig c = config_for(grad, DType::bf16, 256.0f, 0.3f);
    FusedAdamW opt(dev.views(), c);
    CAPTURE(dtype_name(grad));
    for (int step = 0; step < 3; ++step) lockstep(opt, dev, h, c);
  }
}

TEST_CASE("gpu step skips the whole step for inf or NaN anywhere and writes nothing", "[gpu]") {
  const std::vector<std::int64_t> sizes = {kChunk + 5, 40, 3 * kChunk + 1};
  const std::uint16_t specials[] = {0x7C00, 0xFC00, 0x7E00, 0x7C01};
  for (std::size_t t : {std::size_t{0}, std::size_t{1}, std::size_t{2}}) {
    for (int where = 0; where < 3; ++where) {
      for (std::uint16_t bad : specials) {
        HostModel h = poisoned_model(9, sizes, 2048.0f, DType::f16, DType::f16);
        const std::size_t n = h.tensors[t].grad.size();
        const std::size_t i = where == 0 ? 0 : where == 1 ? n / 2 : n - 1;
        h.tensors[t].grad[i] = bad;
        DeviceModel dev(h);
        StepConfig c = config_for(DType::f16, DType::f16, 2048.0f, 1.0f);
        FusedAdamW opt(dev.views(), c);
        CAPTURE(t, i, bad);
        const StepReport r = lockstep(opt, dev, h, c);
        REQUIRE(r.outcome == Outcome::skipped_overflow);
        REQUIRE(r.step == 0);
        REQUIRE(r.scale_next == 1024.0f);
        REQUIRE(r.first_nonfinite_tensor == static_cast<std::int32_t>(t));
        const HostModel after = dev.download(h);
        for (std::size_t k = 0; k < sizes.size(); ++k) REQUIRE(after.tensors[k] == h.tensors[k]);
        std::vector<std::int64_t> expected(sizes.size(), 0);
        expected[t] = 1;
        REQUIRE(opt.nonfinite_counts() == expected);
      }
    }
  }
}

TEST_CASE("gpu second moment of bf16 gradients beyond 1.8e19 matches the reference", "[gpu]") {
  // |g| in [2e19, 4e20] at S = 1, unclipped: g² overflows fp32, (1 - beta2)·g² <= 1.6e38 fits.
  HostModel h = poisoned_model(31, {1000, 37}, 1.0f, DType::bf16, DType::bf16);
  std::mt19937_64 rng(32);
  std::uniform_real_distribution<double> log_mag(std::log(2e19), std::log(4e20));
  for (auto& t : h.tensors) {
    for (auto& g : t.grad) g = to_bf16_bits((rng() % 2 ? 1.0 : -1.0) * std::exp(log_mag(rng)));
  }
  DeviceModel dev(h);
  StepConfig c = config_for(DType::bf16, DType::bf16, 1.0f, 0.0f);
  c.scaler = ScalerConfig::constant(1.0f);
  FusedAdamW opt(dev.views(), c);
  REQUIRE(lockstep(opt, dev, h, c).outcome == Outcome::applied);
  for (const HostTensor& t : dev.download(h).tensors) {
    for (float v : t.exp_avg_sq) REQUIRE((std::isfinite(v) && v > 1e35f));
  }
}

TEST_CASE("gpu clipping keeps fp32 precision when clip / S is below fp32's normal range", "[gpu]") {
  // bf16 gradients of ~1e30 (norm ~6e31) clipped to 1e-10: clip / S ~ 1.6e-42, which as one fp32
  // number would be a subnormal with about 10 significant bits.
  HostModel h = poisoned_model(33, {4000}, 1.0f, DType::bf16, DType::f16);
  std::mt19937_64 rng(34);
  std::normal_distribution<double> g(0.0, 1e30);
  for (auto& x : h.tensors[0].grad) x = to_bf16_bits(g(rng));
  // Fresh moments: the first moment is then the clipped gradient itself, scaled by 1 - beta1.
  std::fill(h.tensors[0].exp_avg.begin(), h.tensors[0].exp_avg.end(), 0.0f);
  std::fill(h.tensors[0].exp_avg_sq.begin(), h.tensors[0].exp_avg_sq.end(), 0.0f);
  DeviceModel dev(h);
  StepConfig c = config_for(DType::bf16, DType::f16, 1.0f, 1e-10f);
  c.scaler = ScalerConfig::constant(1.0f);
  FusedAdamW opt(dev.views(), c);
  const StepReport r = lockstep(opt, dev, h, c);
  REQUIRE(r.outcome == Outcome::applied);
  CHECK(static_cast<double>(r.clip_coef) < 1e-40);
}

TEST_CASE("gpu step applies two groups with their own lr and weight decay", "[gpu]") {
  HostModel h = poisoned_model(10, {5000, 3000, 77}, 1024.0f, DType::f16, DType::f16);
  h.tensors[1].group = 1;
  h.tensors[2].group = 2;
  DeviceModel dev(h);
  StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 0.0f);
  c.groups.resize(3);
  c.groups[0].lr = 1e-2f;
  c.groups[0].weight_decay = 0.1f;
  c.groups[1].lr = 1e-4f;
  c.groups[1].weight_decay = 0.0f;
  c.groups[2].decoupled_weight_decay = false;  // classic L2
  c.groups[2].weight_decay = 0.05f;
  c.groups[2].bias_correction = false;
  FusedAdamW opt(dev.views(), c);
  for (int step = 0; step < 3; ++step) lockstep(opt, dev, h, c);
}

TEST_CASE("gpu spike skip leaves every buffer and the scale alone", "[gpu]") {
  HostModel h = poisoned_model(11, {4096, 100}, 1024.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 0.0f);
  c.spike.enabled = true;
  c.spike.warmup_steps = 10;
  c.spike.action = SpikeConfig::Action::skip;
  FusedAdamW opt(dev.views(), c);
  std::mt19937_64 g(12);
  for (int step = 0; step < 15; ++step) {
    for (auto& t : h.tensors) refill_grads(g, t, DType::f16, 1024.0f);
    dev.upload_grads(h);
    REQUIRE(lockstep(opt, dev, h, c).outcome == Outcome::applied);
  }
  for (auto& t : h.tensors) refill_grads(g, t, DType::f16, 1024.0f, 1.0f);  // 100x
  dev.upload_grads(h);
  const StepReport r = lockstep(opt, dev, h, c);
  CHECK(r.outcome == Outcome::skipped_spike);
  CHECK(r.spike);
  CHECK(r.scale_next == r.scale_used);
}

namespace {

// The CUDA backend as the trajectory harness drives it.
struct GpuSide final : FusedSide {
  DeviceModel dev;
  FusedAdamW opt;
  GpuSide(const HostModel& h, const StepConfig& c) : dev(h), opt(dev.views(), c) {}
  StepReport step(const HostModel& grads) override {
    dev.upload_grads(grads);
    opt.step();
    return opt.last_report();
  }
  HostModel buffers(const HostModel& like) override { return dev.download(like); }
};

}  // namespace

TEST_CASE("gpu 200-step trajectory with random overflows follows the reference", "[gpu]") {
  const HostModel h = poisoned_model(13, {3000, 1, kChunk + 11}, 32768.0f, DType::f16, DType::f16);
  StepConfig c = config_for(DType::f16, DType::f16, 32768.0f, 0.05f);
  c.scaler.growth_interval = 9;
  GpuSide side(h, c);
  free_running_trajectory(side, h, c, 14, reduced_sizes() ? 40 : 200);
}

namespace {

// Runs `steps` steps from the same seed and returns the final buffers and reports.
struct Run {
  HostModel buffers;
  std::vector<StepReport> reports;
  OptimizerState state;
};

Run run_steps(const StepConfig& c, int steps, std::uint64_t seed, float grad_scale_factor = 1.0f) {
  const std::vector<std::int64_t> sizes = {kChunk * 2 + 3, 555};
  HostModel h = poisoned_model(seed, sizes, c.scaler.init_scale, c.grad_dtype, c.model_dtype);
  DeviceModel dev(h);
  FusedAdamW opt(dev.views(), c);
  std::mt19937_64 g(seed + 1);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::uniform_real_distribution<double> log_mag(-10.0, 2.0);
  Run run;
  for (int step = 0; step < steps; ++step) {
    for (auto& t : h.tensors) {
      for (std::size_t i = 0; i < t.grad.size(); ++i) {
        // Unscaled gradients that are exact f16 values with magnitudes in [2^-10, 4]: normal at
        // scale 1 and representable at scale 2^12, so unscaling is exact at either scale.
        const double x = from_f16_bits(to_f16_bits(std::exp2(log_mag(g)))) * (i % 2 ? 1 : -1);
        t.grad[i] = to_f16_bits(x * grad_scale_factor);
      }
    }
    if (u(g) < 0.1) h.tensors[0].grad[static_cast<std::size_t>(step)] = 0x7C00;
    dev.upload_grads(h);
    opt.step();
    run.reports.push_back(opt.last_report());
  }
  run.buffers = dev.download(h);
  run.state = opt.state();
  return run;
}

// What must agree bitwise between two runs: every buffer, the outcomes and applied-step counts,
// and (unless the runs use different loss scales on purpose) the scales.
void require_bitwise_equal(const Run& a, const Run& b, bool same_scales = true) {
  REQUIRE(a.reports.size() == b.reports.size());
  for (std::size_t i = 0; i < a.reports.size(); ++i) {
    CAPTURE(i);
    REQUIRE(a.reports[i].outcome == b.reports[i].outcome);
    REQUIRE(a.reports[i].step == b.reports[i].step);
    if (same_scales) {
      REQUIRE(std::memcmp(&a.reports[i].scale_next, &b.reports[i].scale_next, sizeof(float)) == 0);
    } else if (a.reports[i].outcome != Outcome::skipped_overflow) {
      // The unscaled norm does not depend on the power-of-two scale either.
      REQUIRE(std::memcmp(&a.reports[i].grad_norm, &b.reports[i].grad_norm, sizeof(double)) == 0);
    }
  }
  for (std::size_t t = 0; t < a.buffers.tensors.size(); ++t) {
    const HostTensor& x = a.buffers.tensors[t];
    const HostTensor& y = b.buffers.tensors[t];
    REQUIRE(std::memcmp(x.master.data(), y.master.data(), x.master.size() * 4) == 0);
    REQUIRE(std::memcmp(x.exp_avg.data(), y.exp_avg.data(), x.exp_avg.size() * 4) == 0);
    REQUIRE(std::memcmp(x.exp_avg_sq.data(), y.exp_avg_sq.data(), x.exp_avg_sq.size() * 4) == 0);
    REQUIRE(x.model == y.model);
    if (same_scales) REQUIRE(x.grad == y.grad);  // scaled gradients differ with the scale
  }
}

}  // namespace

TEST_CASE("gpu runs are bitwise deterministic", "[gpu]") {
  StepConfig c = config_for(DType::f16, DType::f16, 65536.0f, 1.0f);
  c.scaler.growth_interval = 7;
  c.spike.enabled = true;
  c.spike.warmup_steps = 5;
  const Run a = run_steps(c, 60, 15);
  const Run b = run_steps(c, 60, 15);
  require_bitwise_equal(a, b);
  CHECK(a.state == b.state);
}

TEST_CASE("gpu device-resident and host-driven trajectories are bitwise equal", "[gpu]") {
  StepConfig c = config_for(DType::f16, DType::f16, 65536.0f, 1.0f);
  c.scaler.growth_interval = 5;
  c.scaler.hysteresis = 2;
  c.spike.enabled = true;
  c.spike.warmup_steps = 5;
  c.spike.action = SpikeConfig::Action::skip;
  c.scaler.headroom_growth = true;  // the host must see the same headroom the device measured
  StepConfig host = c;
  host.host_driven = true;
  const Run a = run_steps(c, 120, 16);
  const Run b = run_steps(host, 120, 16);
  require_bitwise_equal(a, b);
  CHECK(a.state == b.state);
  int overflows = 0;
  for (const auto& r : a.reports) overflows += r.outcome == Outcome::skipped_overflow;
  CHECK(overflows > 3);
}

TEST_CASE("gpu runs at S = 1 and S = 2^12 give bitwise equal masters", "[gpu]") {
  StepConfig one = config_for(DType::f16, DType::f16, 1.0f, 0.5f);
  one.scaler = ScalerConfig::constant(1.0f);
  StepConfig big = one;
  big.scaler = ScalerConfig::constant(4096.0f);
  const Run a = run_steps(one, 50, 17, 1.0f);
  const Run b = run_steps(big, 50, 17, 4096.0f);
  int applied = 0;
  for (const StepReport& r : a.reports) applied += r.outcome == Outcome::applied;
  CHECK(applied > 30);  // most steps update the masters compared below
  require_bitwise_equal(a, b, /*same_scales=*/false);
}

TEST_CASE("gpu graph replayed 20 times equals 20 eager steps", "[gpu]") {
  const std::vector<std::int64_t> sizes = {kChunk + 100, 900};
  HostModel h = poisoned_model(18, sizes, 8192.0f, DType::f16, DType::bf16);
  const StepConfig c = config_for(DType::f16, DType::bf16, 8192.0f, 1.0f);
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  DeviceModel eager(h);
  FusedAdamW eager_opt(eager.views(), c);
  DeviceModel graphed(h);
  FusedAdamW graph_opt(graphed.views(), c);

  cudaGraph_t graph;
  GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  graph_opt.step(stream);
  GPU_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  std::mt19937_64 g(19);
  for (int i = 0; i < 20; ++i) {
    for (auto& t : h.tensors) refill_grads(g, t, DType::f16, 8192.0f);
    if (i == 7) h.tensors[1].grad[3] = 0x7C00;  // one overflow inside the replays
    eager.upload_grads(h);
    graphed.upload_grads(h);
    if (i == 10) {  // a learning-rate change between replays, ordered on the stream
      eager_opt.set_lr(0, 3e-4f, stream);
      graph_opt.set_lr(0, 3e-4f, stream);
    }
    eager_opt.step(stream);
    GPU_CHECK(cudaGraphLaunch(exec, stream));
    GPU_CHECK(cudaStreamSynchronize(stream));
    const StepReport a = eager_opt.last_report(), b = graph_opt.last_report();
    CAPTURE(i);
    REQUIRE(a.attempt == i + 1);
    REQUIRE(b.attempt == i + 1);  // the report copy and event are part of the graph
    REQUIRE(a.outcome == b.outcome);
  }
  const HostModel x = eager.download(h), y = graphed.download(h);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    REQUIRE(std::memcmp(x.tensors[t].master.data(), y.tensors[t].master.data(), x.tensors[t].master.size() * 4) == 0);
    REQUIRE(x.tensors[t].model == y.tensors[t].model);
  }
  CHECK(eager_opt.state() == graph_opt.state());
  GPU_CHECK(cudaGraphExecDestroy(exec));
  GPU_CHECK(cudaGraphDestroy(graph));
  GPU_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("gpu host-driven steps refuse graph capture", "[gpu]") {
  HostModel h = poisoned_model(20, {100}, 1024.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 0.0f);
  c.host_driven = true;
  FusedAdamW opt(dev.views(), c);
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  CHECK_THROWS_WITH(opt.step(stream), Catch::Contains("cannot be captured"));
  cudaGraph_t graph = nullptr;
  (void)cudaStreamEndCapture(stream, &graph);
  if (graph) cudaGraphDestroy(graph);
  GPU_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("gpu state moves between the cuda and reference backends", "[gpu][checkpoint]") {
  HostModel h = poisoned_model(21, {2000, 10}, 65536.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  StepConfig c = config_for(DType::f16, DType::f16, 65536.0f, 1.0f);
  c.scaler.growth_interval = 3;
  FusedAdamW opt(dev.views(), c);
  std::mt19937_64 g(22);
  for (int i = 0; i < 8; ++i) {
    for (auto& t : h.tensors) refill_grads(g, t, DType::f16, opt.loss_scale());
    if (i == 2) h.tensors[0].grad[5] = 0x7E00;
    dev.upload_grads(h);
    opt.step();
  }
  opt.set_lr(0, 2e-4f);  // the learning rate is part of the checkpoint
  const std::string saved = opt.save_state();
  HostModel host = dev.download(h);
  FusedAdamW cpu(host.views(), c, Backend::reference);
  cpu.load_state(saved);
  CHECK(cpu.state() == opt.state());
  CHECK(cpu.learning_rates() == std::vector<float>{2e-4f});
  // And back: a corrupt checkpoint leaves the device state as it was.
  const OptimizerState before = opt.state();
  std::string bad = saved;
  bad[15] = static_cast<char>(bad[15] ^ 1);
  CHECK_THROWS_AS(opt.load_state(bad), Error);
  CHECK(opt.state() == before);
  cpu.step();
  cpu.set_lr(0, 7e-4f);
  opt.load_state(cpu.save_state());
  CHECK(opt.state() == cpu.state());
  CHECK(opt.learning_rates() == std::vector<float>{7e-4f});  // restored into device memory
  CHECK(opt.config().groups[0].lr == 7e-4f);
  float device_scale = 0.0f;
  GPU_CHECK(cudaMemcpy(&device_scale, opt.device_loss_scale(), sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(device_scale == cpu.loss_scale());
}

TEST_CASE("gpu full checkpoints move between the cuda and reference backends bit for bit", "[gpu][checkpoint]") {
  HostModel h = poisoned_model(25, {3000, 0, 41}, 4096.0f, DType::f16, DType::bf16);
  h.tensors[1].with_model = false;
  DeviceModel dev(h);
  StepConfig c = config_for(DType::f16, DType::bf16, 4096.0f, 1.0f);
  FusedAdamW opt(dev.views(), c);
  std::mt19937_64 g(26);
  for (int i = 0; i < 3; ++i) {
    for (auto& t : h.tensors) refill_grads(g, t, DType::f16, opt.loss_scale());
    dev.upload_grads(h);
    opt.step();
  }
  const std::vector<std::string> names = {"w", "empty", "b"};
  // One file per process: the emulated suite runs under several schedules at once, in one directory.
  const std::string path = "halfstep_gpu_checkpoint." + std::to_string(::getpid()) + ".safetensors";
  save_checkpoint(opt, names, path);
  // Into the reference backend: the device's buffers and state, exactly.
  HostModel host = poisoned_model(27, {3000, 0, 41}, 1.0f, DType::f16, DType::bf16);
  host.tensors[1].with_model = false;
  FusedAdamW cpu(host.views(), c, Backend::reference);
  load_checkpoint(cpu, names, path);
  const HostModel on_device = dev.download(h);
  for (std::size_t t = 0; t < h.tensors.size(); ++t) {
    CHECK(host.tensors[t].master == on_device.tensors[t].master);
    CHECK(host.tensors[t].exp_avg_sq == on_device.tensors[t].exp_avg_sq);
    CHECK(host.tensors[t].model == on_device.tensors[t].model);
  }
  CHECK(cpu.state() == opt.state());
  // And back onto the device from a reference checkpoint one step later.
  cpu.step();
  save_checkpoint(cpu, names, path);
  load_checkpoint(opt, names, path);
  const HostModel back = dev.download(h);
  for (std::size_t t = 0; t < h.tensors.size(); ++t) {
    CHECK(back.tensors[t].master == host.tensors[t].master);
    CHECK(back.tensors[t].exp_avg == host.tensors[t].exp_avg);
    CHECK(back.tensors[t].model == host.tensors[t].model);
  }
  CHECK(opt.state() == cpu.state());
  std::remove(path.c_str());
}

TEST_CASE("gpu set_lr and device_lr change the learning rate in stream order", "[gpu]") {
  HostModel h = poisoned_model(23, {1000}, 1024.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 0.0f);
  c.groups[0].weight_decay = 0.0f;
  FusedAdamW opt(dev.views(), c);
  opt.set_lr(0, 0.0f);
  const HostModel before = dev.download(h);
  opt.step();
  REQUIRE(opt.last_report().outcome == Outcome::applied);
  CHECK(dev.download(h).tensors[0].master == before.tensors[0].master);  // lr 0: weights stay
  const float lr = 5e-3f;
  GPU_CHECK(cudaMemcpy(opt.device_lr(0), &lr, sizeof lr, cudaMemcpyHostToDevice));
  c.groups[0].lr = lr;
  lockstep(opt, dev, h, c);
}

TEST_CASE("gpu setup rejects host memory with the buffer named", "[gpu][validate]") {
  HostModel h = poisoned_model(24, {16}, 1.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  auto v = dev.views();
  v[0].exp_avg = h.tensors[0].exp_avg.data();
  CHECK_THROWS_WITH(FusedAdamW(v, StepConfig{}), Catch::Contains("tensors[0].exp_avg must be device memory"));
}

TEST_CASE("gpu step over only empty tensors reports an empty applied step", "[gpu]") {
  std::vector<ParamTensor> none(3);
  FusedAdamW opt(none, StepConfig{});
  CHECK(opt.launches_per_step() == 1);
  opt.step();
  const StepReport r = opt.last_report();
  CHECK(r.outcome == Outcome::applied);
  CHECK(r.numel == 0);
  CHECK(r.grad_norm == 0.0);
  CHECK(opt.nonfinite_counts() == std::vector<std::int64_t>{0, 0, 0});
}

TEST_CASE("gpu one tensor of 2^31 + 7 elements steps correctly at both ends and across 2^31", "[gpu][large]") {
  const std::int64_t n = (std::int64_t{1} << 31) + 7;
  const std::size_t bytes = static_cast<std::size_t>(n) * (4 + 4 + 4 + 2 + 2);
  std::size_t free_bytes = 0, total = 0;
  GPU_CHECK(cudaMemGetInfo(&free_bytes, &total));
  if (free_bytes < bytes + (std::size_t{1} << 30)) {
    skip_test("the 2^31 + 7 element test needs " + std::to_string(bytes >> 30) + " GiB of free device memory");
    return;
  }
  DeviceArray<float> master(static_cast<std::size_t>(n), 0), m(static_cast<std::size_t>(n), 0),
      v(static_cast<std::size_t>(n), 0);
  DeviceArray<std::uint16_t> grad(static_cast<std::size_t>(n), 0), model(static_cast<std::size_t>(n), 0);
  // Every gradient 0x3C3C (1.05859375 in f16, a byte pattern cudaMemset can write), masters 0,
  // moments 0; a few distinct values at the probes, so a wrong index would mix them up.
  GPU_CHECK(cudaMemset(grad.ptr, 0x3C, static_cast<std::size_t>(n) * 2));
  GPU_CHECK(cudaMemset(master.ptr, 0, static_cast<std::size_t>(n) * 4));
  GPU_CHECK(cudaMemset(m.ptr, 0, static_cast<std::size_t>(n) * 4));
  GPU_CHECK(cudaMemset(v.ptr, 0, static_cast<std::size_t>(n) * 4));
  GPU_CHECK(cudaMemset(model.ptr, 0xFF, static_cast<std::size_t>(n) * 2));
  const std::int64_t two31 = std::int64_t{1} << 31;
  // Distinct places (n - 8 would be 2^31 - 1 again, and a probe written twice is counted once).
  const std::vector<std::int64_t> probes = {0, 1, 7, two31 - 9, two31 - 1, two31, two31 + 1, n - 3, n - 1};
  REQUIRE(std::set<std::int64_t>(probes.begin(), probes.end()).size() == probes.size());
  std::vector<std::uint16_t> probe_grad;
  for (std::size_t k = 0; k < probes.size(); ++k) {
    const std::uint16_t bits = to_f16_bits(-0.25 * static_cast<double>(k + 1));
    probe_grad.push_back(bits);
    GPU_CHECK(cudaMemcpy(grad.ptr + probes[k], &bits, 2, cudaMemcpyHostToDevice));
  }
  ParamTensor p{master.ptr, grad.ptr, m.ptr, v.ptr, model.ptr, n, 0};
  StepConfig c;
  c.scaler = ScalerConfig::constant(1.0f);
  FusedAdamW opt({p}, c);

  // First an overflow at 2^31 + 1: found, and nothing written.
  const std::uint16_t inf = 0x7C00;
  GPU_CHECK(cudaMemcpy(grad.ptr + two31 + 1, &inf, 2, cudaMemcpyHostToDevice));
  opt.step();
  StepReport r = opt.last_report();
  CHECK(r.outcome == Outcome::skipped_overflow);
  CHECK(r.nonfinite_count == 1);
  CHECK(r.numel == n);
  GPU_CHECK(cudaMemcpy(grad.ptr + two31 + 1, &probe_grad[6], 2, cudaMemcpyHostToDevice));
  std::uint16_t poison = 0;
  GPU_CHECK(cudaMemcpy(&poison, model.ptr + n - 1, 2, cudaMemcpyDeviceToHost));
  CHECK(poison == 0xFFFF);

  opt.step();
  r = opt.last_report();
  REQUIRE(r.outcome == Outcome::applied);
  // Norm: n - 9 elements of 1.05859375 and the probes.
  double sum_sq = static_cast<double>(n - static_cast<std::int64_t>(probes.size())) * std::pow(from_f16_bits(0x3C3C), 2);
  for (std::uint16_t b : probe_grad) sum_sq += std::pow(from_f16_bits(b), 2);
  // The device rounds the exact sum once; this double sum rounds a few times more.
  CHECK(std::fabs(r.grad_norm - std::sqrt(sum_sq)) <= 1e-15 * std::sqrt(sum_sq));

  // Every element's first step from zero moments: the reference on a one-element tensor.
  auto expect = [&](std::uint16_t g_bits) {
    HostModel one;
    HostTensor t;
    t.master = {0.0f};
    t.exp_avg = {0.0f};
    t.exp_avg_sq = {0.0f};
    t.grad = {g_bits};
    t.model = {0};
    one.tensors.push_back(t);
    OptimizerState s = OptimizerState::initial(c);
    reference::step(one.views(), c, s);
    return one.tensors[0];
  };
  // Tolerance: adam_bound for a first step from zero state (no clipping, scale 1).
  auto bound = [&](std::uint16_t g_bits) {
    return adam_bound(0.0f, 0.0f, 0.0f, from_f16_bits(g_bits), 1.0, 1.0, 0.0, c.groups[0], 1).p;
  };
  const HostTensor plain = expect(0x3C3C);
  for (std::int64_t at : {std::int64_t{2}, two31 - 2, two31 + 3, n - 2}) {
    float got = 0.0f;
    GPU_CHECK(cudaMemcpy(&got, master.ptr + at, 4, cudaMemcpyDeviceToHost));
    CAPTURE(at);
    CHECK(std::fabs(got - plain.master[0]) <= bound(0x3C3C));
  }
  for (std::size_t k = 0; k < probes.size(); ++k) {
    const HostTensor want = expect(probe_grad[k]);
    float got = 0.0f;
    std::uint16_t got_model = 0;
    GPU_CHECK(cudaMemcpy(&got, master.ptr + probes[k], 4, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(&got_model, model.ptr + probes[k], 2, cudaMemcpyDeviceToHost));
    CAPTURE(k, probes[k]);
    CHECK(std::fabs(got - want.master[0]) <= bound(probe_grad[k]));
    CHECK(got_model == to_f16_bits(got));
  }
}

namespace {

// The kernels `step` launches, counted where they run: by the emulated device's grid counter, or
// on a GPU as the kernel nodes of the step captured in a CUDA graph (device-resident steps only).
std::int64_t kernels_launched(FusedAdamW& opt, bool capturable) {
#if defined(HALFSTEP_EMULATED)
  (void)capturable;
  GPU_CHECK(cudaDeviceSynchronize());
  const std::uint64_t before = halfstep_emu::counters().launches;
  opt.step();
  GPU_CHECK(cudaDeviceSynchronize());
  return static_cast<std::int64_t>(halfstep_emu::counters().launches - before);
#else
  if (!capturable) {
    opt.step();
    return -1;  // a host-driven step waits for the device: it cannot be captured to count
  }
  cudaStream_t stream = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  opt.step(stream);
  GPU_CHECK(cudaStreamEndCapture(stream, &graph));
  std::size_t n = 0;
  GPU_CHECK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  GPU_CHECK(cudaGraphGetNodes(graph, nodes.data(), &n));
  std::int64_t kernels = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    GPU_CHECK(cudaGraphNodeGetType(node, &type));
    kernels += type == cudaGraphNodeTypeKernel ? 1 : 0;
  }
  GPU_CHECK(cudaGraphDestroy(graph));
  GPU_CHECK(cudaStreamDestroy(stream));
  return kernels;
#endif
}

}  // namespace

TEST_CASE("gpu launches_per_step is the number of kernels a step launches", "[gpu]") {
  HostModel h = poisoned_model(41, {5000, 0, 70000}, 1024.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  const StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 1.0f);
  FusedAdamW opt(dev.views(), c);
  CHECK(kernels_launched(opt, true) == opt.launches_per_step());
  CHECK(opt.launches_per_step() == 3);  // pass 1, finalize, pass 2

  std::vector<ParamTensor> none(2);
  FusedAdamW empty(none, StepConfig{});
  CHECK(kernels_launched(empty, true) == empty.launches_per_step());
  CHECK(empty.launches_per_step() == 1);  // finalize alone

  // Host-driven: pass 2 only on an applied step.
  StepConfig host = c;
  host.host_driven = true;
  DeviceModel dev2(h);
  FusedAdamW driven(dev2.views(), host);
  const std::int64_t applied = kernels_launched(driven, false);
  if (applied >= 0) CHECK(applied == driven.launches_per_step());
  h.tensors[2].grad[7] = 0x7C00;  // an overflow: no pass 2
  dev2.upload_grads(h);
  const std::int64_t skipped = kernels_launched(driven, false);
  if (skipped >= 0) CHECK(skipped == driven.launches_per_step() - 1);
}
