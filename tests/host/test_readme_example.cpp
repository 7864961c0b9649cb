// The README's usage example, compiled and run. tests/check_readme_example.cmake keeps the
// README's copy identical to the lines between the markers.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include <halfstep/halfstep.hpp>

namespace {

struct ExampleResult {
  halfstep::StepReport report;
  std::vector<float> master;
  std::vector<std::uint16_t> model;
};

ExampleResult readme_example() {
  // example:begin
  // One tensor of 4 weights. Backend::cuda takes device pointers; Backend::host runs the same
  // step (the kernels' arithmetic, bit for bit) on host memory, so this example runs anywhere.
  std::vector<float> master = {0.5f, -0.25f, 1.0f, 0.0f}, m(4), v(4);
  std::vector<std::uint16_t> grad(4), model(4);

  halfstep::StepConfig config;     // fp16 grads and model copy, AdamW lr 1e-3, dynamic loss scale
  config.max_grad_norm = 1.0f;     // clip the unscaled global norm
  halfstep::FusedAdamW opt({{master.data(), grad.data(), m.data(), v.data(), model.data(), 4}},
                           config, halfstep::Backend::host);

  const float S = opt.loss_scale();  // the backward pass of loss × S writes scaled fp16 grads
  for (int i = 0; i < 4; ++i) grad[i] = halfstep::to_f16_bits(0.01 * (i + 1) * S);
  opt.step();                        // check, unscale, clip, AdamW, fp16 model copy
  halfstep::StepReport r = opt.last_report();
  // r.outcome == Outcome::applied, r.grad_norm ≈ 0.0548 (unscaled), r.headroom_log2 ≈ 4.6:
  // the scale could grow 2^4.6 times before the largest gradient overflows fp16. Each weight
  // moved by lr against its gradient, and model[i] == master[i] rounded to fp16.
  // example:end
  return {r, master, model};
}

}  // namespace

TEST_CASE("the README example runs and does what its comments say", "[readme]") {
  const ExampleResult r = readme_example();
  CHECK(r.report.outcome == halfstep::Outcome::applied);
  CHECK(r.report.grad_norm == Approx(0.0548).epsilon(1e-3));
  CHECK(r.report.headroom_log2 == Approx(4.6).margin(0.05));
  const float before[4] = {0.5f, -0.25f, 1.0f, 0.0f};
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(r.master[i] == Approx(before[i] - 1e-3f).margin(1e-6));
    CHECK(r.model[i] == halfstep::to_f16_bits(r.master[i]));
  }
}
