// Uses the installed headers and library from a plain C++ translation unit.
#include <halfstep/halfstep.hpp>

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> master(3, 1.0f), m(3), v(3);
  std::vector<std::uint16_t> grad(3, halfstep::to_f16_bits(64.0)), model(3);
  halfstep::StepConfig config;
  config.scaler.init_scale = 128.0f;
  halfstep::ParamTensor t{master.data(), grad.data(), m.data(), v.data(), model.data(), 3};
  halfstep::OptimizerState state = halfstep::OptimizerState::initial(config);
  const halfstep::StepReport r = halfstep::reference::step({t}, config, state);
  std::printf("halfstep %s: outcome %s, grad_norm %.6f, master[0] %.6f\n", halfstep::version(),
              halfstep::outcome_name(r.outcome), r.grad_norm, static_cast<double>(master[0]));
  const bool ok = r.outcome == halfstep::Outcome::applied && state.step == 1 && master[0] < 1.0f;
  return ok ? 0 : 1;
}
