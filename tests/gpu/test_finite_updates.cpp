// The invariant that an applied step writes only finite values, on the kernels: the seeded search
// over extreme inputs of tests/host/test_finite_updates.cpp, with the verdicts compared against
// the reference backend where they must agree bit for bit (no clipping: the rule then reads only
// pass 1's exact max|g|).
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>
#include <random>

#include "extreme_inputs.hpp"
#include "gpu_support.hpp"
#include "halfstep/reference.hpp"

using namespace halfstep;
using namespace halfstep_test;

TEST_CASE("gpu applied steps write only finite values: seeded search over extreme inputs", "[gpu][invariant]") {
  int applied = 0, range_skips = 0, invalid_lr = 0, held = 0;
  const std::uint64_t cases = reduced_sizes() ? 60 : 200;
  for (std::uint64_t seed = 0; seed < cases; ++seed) {
    ExtremeCase x = extreme_case(seed);
    CAPTURE(x.what);
    DeviceModel dev(x.model);
    FusedAdamW opt(dev.views(), x.config);
    HostModel ref = x.model;
    FusedAdamW ref_opt(ref.views(), x.config, Backend::reference);
    if (x.write_lr) {
      GPU_CHECK(cudaMemcpy(opt.device_lr(0), &x.device_lr, sizeof(float), cudaMemcpyHostToDevice));
      *ref_opt.device_lr(0) = x.device_lr;
    }
    std::mt19937_64 rng(seed + 1000);
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      const HostModel before = dev.download(x.model);
      opt.step();
      const StepReport r = opt.last_report();
      const HostModel after = dev.download(x.model);
      require_finite_or_untouched(r, before, after, x.config.model_dtype);
      ref_opt.step();
      const StepReport want = ref_opt.last_report();
      if (x.config.max_grad_norm == 0.0f) {
        REQUIRE(r.outcome == want.outcome);
        REQUIRE(r.reason == want.reason);
      }
      applied += r.outcome == Outcome::applied;
      range_skips += r.outcome == Outcome::skipped_nonfinite_update && r.reason != SkipReason::invalid_learning_rate;
      invalid_lr += r.reason == SkipReason::invalid_learning_rate;
      held += r.held_elements > 0;
      // Both continue from the device's buffers with the same new gradients (copied into the
      // reference's own vectors, which its views point into).
      x.model = after;
      extreme_grads(rng, x.model, x.config.grad_dtype, opt.loss_scale(), true);
      dev.upload(x.model);
      for (std::size_t t = 0; t < ref.tensors.size(); ++t) {
        HostTensor& dst = ref.tensors[t];
        const HostTensor& src = x.model.tensors[t];
        std::copy(src.master.begin(), src.master.end(), dst.master.begin());
        std::copy(src.exp_avg.begin(), src.exp_avg.end(), dst.exp_avg.begin());
        std::copy(src.exp_avg_sq.begin(), src.exp_avg_sq.end(), dst.exp_avg_sq.begin());
        std::copy(src.grad.begin(), src.grad.end(), dst.grad.begin());
        std::copy(src.model.begin(), src.model.end(), dst.model.begin());
      }
    }
  }
  INFO("applied " << applied << ", range skips " << range_skips << ", invalid lr " << invalid_lr
                  << ", steps with held elements " << held);
  CHECK(applied > 20);
  CHECK(range_skips > 5);
  CHECK(invalid_lr > 1);
  CHECK(held > 5);
}

TEST_CASE("gpu a NaN learning rate written through device_lr skips the step with its reason", "[gpu][invariant]") {
  HostModel h = poisoned_model(61, {3000, 5}, 1024.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  const StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 0.0f);
  FusedAdamW opt(dev.views(), c);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  GPU_CHECK(cudaMemcpy(opt.device_lr(0), &nan, sizeof nan, cudaMemcpyHostToDevice));
  const HostModel before = dev.download(h);
  opt.step();
  const StepReport r = opt.last_report();
  CHECK(r.outcome == Outcome::skipped_nonfinite_update);
  CHECK(r.reason == SkipReason::invalid_learning_rate);
  CHECK(r.step == 0);
  const HostModel after = dev.download(h);
  for (std::size_t t = 0; t < h.tensors.size(); ++t) CHECK(after.tensors[t] == before.tensors[t]);
  opt.set_lr(0, 1e-3f);
  opt.step();
  CHECK(opt.last_report().outcome == Outcome::applied);
}

TEST_CASE("gpu last_report refers to the last executed step, not one captured and never replayed", "[gpu]") {
  HostModel h = poisoned_model(62, {2000}, 1024.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  const StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 0.0f);
  cudaStream_t stream;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  FusedAdamW opt(dev.views(), c);
  cudaGraph_t graph;
  GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  opt.step(stream);
  GPU_CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK_THROWS_WITH(opt.last_report(), Catch::Contains("no step has run yet") &&
                                            Catch::Contains("runs when the graph is launched"));
  CHECK_THROWS_WITH(opt.nonfinite_counts(), Catch::Contains("no step has run yet"));
  cudaGraphExec_t exec;
  GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  GPU_CHECK(cudaGraphLaunch(exec, stream));
  GPU_CHECK(cudaGraphLaunch(exec, stream));
  CHECK(opt.last_report().attempt == 2);
  opt.step(stream);  // an eager step after the replays
  CHECK(opt.last_report().attempt == 3);
  GPU_CHECK(cudaGraphExecDestroy(exec));
  GPU_CHECK(cudaGraphDestroy(graph));
  GPU_CHECK(cudaStreamDestroy(stream));
}
