// The README's usage example, compiled and run. tests/check_readme_example.cmake keeps the
// README's copy identical to the lines between the markers.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include <halfstep/halfstep.hpp>

namespace {

struct ExampleResult {
  halfstep::StepReport report;
  halfstep::OptimizerState state;
  std::vector<float> master;
  std::vector<std::uint16_t> model;
};

ExampleResult readme_example() {
  // example:begin
  // One tensor of 4 weights; its fp16 gradients were computed with the loss scaled by 1024.
  std::vector<float> master = {0.5f, -0.25f, 1.0f, 0.0f}, m(4), v(4);
  std::vector<std::uint16_t> grad(4), model(4);
  for (int i = 0; i < 4; ++i) grad[i] = halfstep::to_f16_bits(0.01 * (i + 1) * 1024);

  halfstep::StepConfig config;           // fp16 grads, fp16 model copy, AdamW lr 1e-3
  config.scaler.init_scale = 1024.0f;    // dynamic loss scale, PyTorch-style rules
  config.max_grad_norm = 1.0f;           // clip the unscaled global norm
  halfstep::ParamTensor tensor{master.data(), grad.data(), m.data(), v.data(), model.data(), 4};

  halfstep::OptimizerState state = halfstep::OptimizerState::initial(config);
  halfstep::StepReport report = halfstep::reference::step({tensor}, config, state);
  // report.outcome == Outcome::applied, report.grad_norm ≈ 0.0548 (unscaled), state.step == 1,
  // each weight moved by lr against its gradient, model[i] == round_to_f16(master[i]).
  // example:end
  return {report, state, master, model};
}

}  // namespace

TEST_CASE("the README example runs and does what its comments say", "[readme]") {
  const ExampleResult r = readme_example();
  CHECK(r.report.outcome == halfstep::Outcome::applied);
  CHECK(r.report.grad_norm == Approx(0.0548).epsilon(1e-3));
  CHECK(r.state.step == 1);
  const float before[4] = {0.5f, -0.25f, 1.0f, 0.0f};
  for (int i = 0; i < 4; ++i) {
    CHECK(r.master[i] == Approx(before[i] - 1e-3f).margin(1e-6));
    CHECK(r.model[static_cast<std::size_t>(i)] == halfstep::to_f16_bits(r.master[static_cast<std::size_t>(i)]));
  }
}
