// What a step reads besides its gradients' values, changed between steps on the stream: new
// gradient buffers (and none: a tensor without a gradient is left alone), a group's betas, eps and
// weight decay, the loss scale, gradients already unscaled, and the optimizer state carried to a
// new optimizer. Each against the reference step, in lockstep.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cmath>
#include <random>

#include "gpu_support.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

// The gradients of `from` in `m`.
void take_grads(HostModel& m, const HostModel& from) {
  for (std::size_t t = 0; t < m.tensors.size(); ++t) {
    m.tensors[t].grad = from.tensors[t].grad;
    m.tensors[t].grad32 = from.tensors[t].grad32;
  }
}

// One fused step and one reference step from the same inputs, compared: the tensors in `no_grad`
// have none (the reference sees null gradients there), and the gradients are `grads`' when the
// step was pointed at other buffers (set_gradients), else dev's.
StepReport lockstep_views(FusedAdamW& opt, DeviceModel& dev, const HostModel& like, const StepConfig& config,
                          OptimizerState& ref_state, const std::vector<std::size_t>& no_grad = {},
                          const HostModel* grads = nullptr) {
  HostModel before = dev.download(like);
  if (grads != nullptr) take_grads(before, *grads);
  opt.step();
  const StepReport got = opt.last_report();
  HostModel ref = before;
  std::vector<ParamTensor> views = ref.views();
  for (std::size_t t : no_grad) views[t].grad = nullptr;
  const StepReport want = reference::step(views, config, ref_state);
  HostModel after = dev.download(like);
  if (grads != nullptr) take_grads(after, *grads);
  for (std::size_t t : no_grad) {
    REQUIRE(after.tensors[t] == before.tensors[t]);  // left alone
    for (HostModel* m : {&before, &after}) {  // for check_step's bounds: a tensor that moves not at all
      for (std::size_t i = 0; i < m->tensors[t].size(); ++i) m->tensors[t].set_grad(i, 0.0);
    }
  }
  check_step(got, want, before, after, ref, config, ref_state.step);
  REQUIRE(opt.state().scaler == ref_state.scaler);
  REQUIRE(opt.state().step == ref_state.step);
  return got;
}

}  // namespace

TEST_CASE("gpu set_gradients moves the step to new buffers, and a tensor without a gradient is left alone", "[gpu][inputs]") {
  for (DType grad : {DType::f16, DType::f32}) {
    const std::vector<std::int64_t> sizes = {3000, 40001, 17};
    const float scale = 1024.0f;
    HostModel h = poisoned_model(31, sizes, scale, grad, DType::bf16);
    DeviceModel dev(h);
    const StepConfig c = config_for(grad, DType::bf16, scale, 1.0f);
    FusedAdamW opt(dev.views(), c);
    OptimizerState ref_state = OptimizerState::initial(c);
    CAPTURE(dtype_name(grad));
    lockstep_views(opt, dev, h, c, ref_state);

    // Other buffers with other gradients: the step reads them, not the old ones (which hold an inf).
    HostModel other = random_model(32, sizes, scale, grad, DType::bf16);
    DeviceModel second(other);
    h.tensors[1].set_grad_bits(7, special_bits(grad).inf);
    dev.upload_grads(h);
    std::vector<const void*> grads;
    for (const ParamTensor& p : second.views()) grads.push_back(p.grad);
    opt.set_gradients(grads);
    const StepReport r = lockstep_views(opt, dev, h, c, ref_state, {}, &other);
    CHECK(r.outcome == Outcome::applied);

    // No gradient for tensor 1: it is not measured, not counted, not written.
    grads[1] = nullptr;
    opt.set_gradients(grads);
    const StepReport n = lockstep_views(opt, dev, h, c, ref_state, {1}, &other);
    CHECK(n.outcome == Outcome::applied);
    CHECK(n.numel == 3000 + 17);
    // An inf in a tensor without a gradient is nobody's: the step applies.
    other.tensors[1].set_grad_bits(0, special_bits(grad).inf);
    second.upload_grads(other);
    CHECK(lockstep_views(opt, dev, h, c, ref_state, {1}, &other).outcome == Outcome::applied);

    // Refused, with nothing changed: a count that is not one per tensor, a misaligned pointer, a
    // gradient over a buffer the step writes, and host memory.
    CHECK_THROWS_WITH(opt.set_gradients({grads[0]}), Catch::Contains("one pointer per tensor"));
    auto bad = grads;
    bad[0] = static_cast<const char*>(grads[0]) + 1;
    CHECK_THROWS_WITH(opt.set_gradients(bad), Catch::Contains("must be aligned"));
    bad = grads;
    bad[2] = opt.tensors()[0].exp_avg;
    CHECK_THROWS_WITH(opt.set_gradients(bad), Catch::Contains("overlap"));
    std::vector<std::uint32_t> host(sizes[2]);
    bad = grads;
    bad[2] = host.data();
    CHECK_THROWS_WITH(opt.set_gradients(bad), Catch::Contains("tensors[2].grad"));
    CHECK(lockstep_views(opt, dev, h, c, ref_state, {1}, &other).outcome == Outcome::applied);
  }
}

TEST_CASE("gpu set_group changes betas, eps and weight decay between steps, as the reference", "[gpu][inputs]") {
  const std::vector<std::int64_t> sizes = {5000, 33};
  HostModel h = poisoned_model(33, sizes, 1.0f, DType::bf16, DType::bf16);
  DeviceModel dev(h);
  StepConfig c = config_for(DType::bf16, DType::bf16, 1.0f, 0.0f);
  FusedAdamW opt(dev.views(), c);
  OptimizerState ref_state = OptimizerState::initial(c);
  std::mt19937_64 rng(34);
  for (int step = 0; step < 6; ++step) {
    if (step == 2 || step == 4) {  // OneCycleLR-style momentum cycling: beta1 and the rate move
      AdamWConfig g = c.groups[0];
      g.beta1 = step == 2 ? 0.85f : 0.95f;
      g.beta2 = step == 2 ? 0.99f : 0.999f;
      g.lr = step == 2 ? 3e-3f : 1e-4f;
      g.eps = step == 2 ? 1e-6f : 1e-8f;
      g.weight_decay = step == 2 ? 0.1f : 0.0f;
      opt.set_group(0, g);
      c.groups[0] = g;
    }
    for (auto& t : h.tensors) refill_grads(rng, t, DType::bf16, 1.0f);
    dev.upload_grads(h);
    CAPTURE(step);
    REQUIRE(lockstep_views(opt, dev, h, c, ref_state).outcome == Outcome::applied);
  }
  // The flags are fixed; a value the rules refuse changes nothing.
  AdamWConfig g = c.groups[0];
  g.decoupled_weight_decay = false;
  CHECK_THROWS_WITH(opt.set_group(0, g), Catch::Contains("fixed at construction"));
  g = c.groups[0];
  g.beta1 = 1.0f;
  CHECK_THROWS_WITH(opt.set_group(0, g), Catch::Contains("beta1"));
  CHECK_THROWS_WITH(opt.set_group(3, c.groups[0]), Catch::Contains("group"));
  CHECK(opt.config().groups[0].beta1 == c.groups[0].beta1);
  // A checkpoint holds the hyperparameters in force and restores them.
  const std::string saved = opt.save_state();
  AdamWConfig back = c.groups[0];
  back.beta1 = 0.5f;
  opt.set_group(0, back);
  opt.load_state(saved);
  CHECK(opt.config().groups[0].beta1 == c.groups[0].beta1);
  CHECK(opt.config().groups[0].beta2 == c.groups[0].beta2);
}

TEST_CASE("gpu gradients already unscaled step bitwise like the scaled ones, for one step", "[gpu][inputs]") {
  // Power-of-two scales make unscaling exact: gradients divided by S before the step (what
  // GradScaler.unscale_ does in place) with mark_unscaled give the masters of the scaled run.
  for (DType grad : {DType::f32, DType::bf16}) {
    const std::vector<std::int64_t> sizes = {4099, 65};
    const float scale = 4096.0f;
    HostModel a = poisoned_model(35, sizes, scale, grad, DType::f16);
    HostModel b = a;
    for (auto& t : b.tensors) {
      for (std::size_t i = 0; i < t.size(); ++i) t.set_grad(i, t.grad_value(i) / scale);
    }
    DeviceModel da(a), db(b);
    const StepConfig c = config_for(grad, DType::f16, scale, 0.5f);
    FusedAdamW scaled(da.views(), c), unscaled(db.views(), c);
    scaled.step();
    unscaled.mark_unscaled();
    unscaled.step();
    const StepReport ra = scaled.last_report(), rb = unscaled.last_report();
    CAPTURE(dtype_name(grad));
    CHECK(rb.outcome == Outcome::applied);
    CHECK(same_bits(ra.grad_norm, rb.grad_norm));
    CHECK(ra.clip_coef == rb.clip_coef);
    CHECK(rb.scale_used == scale);
    CHECK(ra.max_abs_scaled == rb.max_abs_scaled);  // the headroom is the scaled gradients'
    CHECK(ra.headroom_log2 == rb.headroom_log2);
    const HostModel xa = da.download(a), xb = db.download(b);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      CHECK(xa.tensors[t].master == xb.tensors[t].master);
      CHECK(xa.tensors[t].model == xb.tensors[t].model);
    }
    // The next step divides by the scale again.
    unscaled.step();
    CHECK(unscaled.last_report().grad_norm < rb.grad_norm / 1000);
  }
}

TEST_CASE("gpu set_loss_scale sets the next step's scale, and set_state carries a run to a new optimizer", "[gpu][inputs]") {
  const std::vector<std::int64_t> sizes = {2000, 9};
  HostModel h = poisoned_model(36, sizes, 1024.0f, DType::f16, DType::f16);
  DeviceModel dev(h);
  StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 0.0f);
  c.scaler.growth_interval = 2;
  FusedAdamW opt(dev.views(), c);
  opt.step();
  opt.set_loss_scale(256.0f);
  CHECK(opt.loss_scale() == 256.0f);
  opt.step();
  CHECK(opt.last_report().scale_used == 256.0f);
  CHECK(opt.last_report().scale_next == 512.0f);  // the growth window still counts
  CHECK_THROWS_WITH(opt.set_loss_scale(0.5f), Catch::Contains("[min_scale, max_scale]"));
  CHECK_THROWS_WITH(opt.set_loss_scale(NAN), Catch::Contains("finite"));

  // A new optimizer on the same buffers continues from the state: bitwise the same next steps.
  const OptimizerState s = opt.state();
  FusedAdamW next(dev.views(), c);
  next.set_state(s);
  CHECK(next.state() == s);
  OptimizerState bad = s;
  bad.step = bad.attempts + 1;
  CHECK_THROWS_WITH(next.set_state(bad), Catch::Contains("OptimizerState.step"));
  CHECK(next.state() == s);
  DeviceModel copy(dev.download(h));
  FusedAdamW same(copy.views(), c);
  same.set_state(s);
  for (int k = 0; k < 3; ++k) {
    next.step();
    same.step();
    CHECK(next.last_report().attempt == same.last_report().attempt);
    CHECK(same_bits(next.last_report().grad_norm, same.last_report().grad_norm));
  }
  CHECK(dev.download(h).tensors[0] == copy.download(h).tensors[0]);
}

TEST_CASE("gpu an external scale is divided by for one step, its found_inf skips, and the own scaler stays", "[gpu][inputs]") {
  // torch.amp.GradScaler driving the step: its scale (device memory) unscales the gradients, its
  // found_inf skips the step, and the optimizer's own scaler (a constant 1 here, as for bf16
  // parameters) neither moves nor takes the external scale. Power-of-two scales make the run with
  // the external scale bitwise the run whose own scale is the same. The reference backend, fed
  // the same calls with host memory, must agree to the bit on every report (its masters are
  // computed in double: the other tests bound them).
  for (const bool host_driven : {false, true}) {
    for (DType grad : {DType::f16, DType::f32}) {
      CAPTURE(host_driven, dtype_name(grad));
      const std::vector<std::int64_t> sizes = {3000, 70, 33000};
      const float S = 4096.0f;
      HostModel a = poisoned_model(37, sizes, S, grad, DType::bf16);
      DeviceModel da(a), db(a);
      HostModel hr = a;  // the reference backend's buffers
      StepConfig own = config_for(grad, DType::bf16, S, 0.5f);
      own.host_driven = host_driven;
      own.scaler.growth_interval = 1000;
      StepConfig ext = own;
      ext.scaler = ScalerConfig::constant(1.0f);
      FusedAdamW by_own(da.views(), own), by_ext(db.views(), ext);
      FusedAdamW ref(hr.views(), ext, Backend::reference);
      DeviceArray<float> d_scale(1, 0), d_found(1, 0);
      auto external = [&](float scale, float found) {
        d_scale.upload({scale});
        d_found.upload({found});
        by_ext.use_external_scale(d_scale.ptr, d_found.ptr);
        ref.use_external_scale(&scale, &found);
      };
      auto same_reports = [&](const StepReport& x, const StepReport& y) {
        CHECK(x.outcome == y.outcome);
        CHECK(x.reason == y.reason);
        CHECK(same_bits(x.grad_norm, y.grad_norm));
        CHECK(same_bits(x.clip_coef, y.clip_coef));
        CHECK(x.scale_used == y.scale_used);
        CHECK(x.scale_next == y.scale_next);
        CHECK(x.headroom_log2 == y.headroom_log2);
        CHECK(x.step == y.step);
        CHECK(x.attempt == y.attempt);
      };
      // Step 1: divided by the external scale, as the own-scale run divides by its own.
      external(S, 0.0f);
      by_ext.step();
      ref.step();
      by_own.step();
      const StepReport r1 = by_ext.last_report();
      CHECK(r1.outcome == Outcome::applied);
      CHECK(r1.scale_used == S);
      CHECK(r1.scale_next == S);  // the external scaler moves its own scale
      same_reports(r1, by_own.last_report());
      same_reports(r1, ref.last_report());
      CHECK(by_ext.state().scaler == ScalerState::initial(ext.scaler));  // untouched
      CHECK(by_ext.loss_scale() == 1.0f);
      HostModel xa = da.download(a), xb = db.download(a);
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        CHECK(xa.tensors[t].master == xb.tensors[t].master);
        CHECK(xa.tensors[t].model == xb.tensors[t].model);
      }
      // Step 2: the external found_inf skips finite gradients; nothing is written, the own scaler stays.
      external(S, 1.0f);
      by_ext.step();
      ref.step();
      const StepReport r2 = by_ext.last_report();
      CHECK(r2.outcome == Outcome::skipped_overflow);
      CHECK(r2.reason == SkipReason::external_found_inf);
      CHECK(r2.nonfinite_count == 0);
      CHECK(r2.step == 1);
      same_reports(r2, ref.last_report());
      CHECK(by_ext.state().scaler == ScalerState::initial(ext.scaler));
      CHECK(db.download(a).tensors[0].master == xb.tensors[0].master);
      // A NaN found_inf is a finding too; a scale that is not a finite positive number skips.
      for (const float bad : {0.0f, -2.0f, INFINITY, NAN}) {
        CAPTURE(bad);
        external(bad, 0.0f);
        by_ext.step();
        ref.step();
        CHECK(by_ext.last_report().outcome == Outcome::skipped_nonfinite_update);
        CHECK(by_ext.last_report().reason == SkipReason::invalid_loss_scale);
        CHECK(ref.last_report().reason == SkipReason::invalid_loss_scale);
      }
      external(S, NAN);
      by_ext.step();
      ref.step();
      CHECK(by_ext.last_report().reason == SkipReason::external_found_inf);
      CHECK(ref.last_report().reason == SkipReason::external_found_inf);
      // It held for one step: the next step divides by the own scale (1) again.
      by_ext.step();
      ref.step();
      CHECK(by_ext.last_report().scale_used == 1.0f);
      CHECK(by_ext.last_report().outcome == Outcome::applied);
      same_reports(by_ext.last_report(), ref.last_report());
      // Gradients the external scaler already unscaled: a null scale divides by 1.
      const ScalerState own_state = by_ext.state().scaler;
      by_ext.use_external_scale(nullptr, d_found.ptr);  // d_found holds NaN: found
      by_ext.step();
      CHECK(by_ext.last_report().reason == SkipReason::external_found_inf);
      d_found.upload({0.0f});
      by_ext.use_external_scale(nullptr, nullptr);
      by_ext.step();
      CHECK(by_ext.last_report().outcome == Outcome::applied);
      CHECK(by_ext.last_report().scale_used == 1.0f);
      CHECK(same_bits(by_ext.last_report().grad_norm, r1.grad_norm * S));  // divided by 1, not S
      CHECK(by_ext.state().scaler == own_state);
    }
  }
}
