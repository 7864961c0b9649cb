// The host backend of FusedAdamW (Backend::host): the fused step's own arithmetic on host memory,
// vectorised (src/host_passes.cpp) and spread over threads by chunks of the tensor table. It runs
// what the kernels run — pass 1 per chunk, the finalize stages (rank_record, decide_record,
// group_consts), pass 2 per chunk — so it writes the bits the CUDA backend writes, on any number of
// threads: every chunk is computed alone and every sum is of integers.
#include <algorithm>
#include <cstring>

#include "check.hpp"
#include "distributed_impl.hpp"
#include "fused_impl.hpp"
#include "halfstep/checkpoint.hpp"
#include "host_passes.hpp"
#include "host_pool.hpp"
#include "launch.hpp"
#include "tensor_table.hpp"

namespace halfstep::detail {
namespace {

class HostImpl final : public FusedAdamW::Impl {
 public:
  HostImpl(const std::vector<ParamTensor>& tensors, const StepConfig& config, const Distributed& dist)
      : config_(config), tensors_(tensors), rank_(dist.rank), passes_(host_passes()), pool_(1) {
    validate(tensors_, config_);
    validate_distributed(dist);
    require(dist.comms.empty(), "Backend::host takes no NCCL communicators (Distributed.comms has ",
            dist.comms.size(), "): reduce its totals between step_local and step_finish");
    if (config_.host_driven) scaler_ = DynamicLossScaler(config_.scaler);
    TensorTable table = build_tensor_table(tensors_, config_);
    table_ = std::move(table.tensors);
    chunks_ = std::move(table.chunks);
    partials_.assign(chunks_.size(), ChunkPartial{});
    inputs_ = StepInputs{table.numel_in_norm, 0, ScaleInputs{}};
    state_ = OptimizerState::initial(config_);
    window_hint_ = initial_window_hint(config_);
    consts_.resize(config_.groups.size());
    load_groups();
    finalize_ = FinalizeArgs{partials_.data(), chunks_.data(), static_cast<std::int64_t>(chunks_.size()),
                             &window_hint_, spill_, &totals_, &inputs_, rank_, config_.grad_dtype, &state_, &report_,
                             &decision_, params_.data(), lr_.data(), consts_.data(),
                             static_cast<std::int32_t>(config_.groups.size()), decide_params(config_)};
  }

  void step(Stream stream) override {
    step_local(stream);
    step_finish(stream);
  }

  void step_local(Stream) override {
    begin_local("step_local");
    measure();
    local_pending_ = true;
  }

  void step_local_refused(Stream) override {
    begin_local("step_local_refused");
    std::fill(partials_.begin(), partials_.end(), ChunkPartial{});
    totals_ = refused_record();
    local_pending_ = true;
  }

  void step_refused(Stream) override {
    throw Error(ErrorKind::usage, "step_refused: Backend::host has no communicators; call "
                                  "step_local_refused, reduce the record and call step_finish");
  }

  void step_finish(Stream) override {
    if (!local_pending_) throw Error(ErrorKind::usage, "step_finish: no step_local since the last step finished");
    local_pending_ = false;
    const bool external = external_pending_;
    external_pending_ = false;
    std::int64_t applied_step = 0;
    const bool apply = decide_record(finalize_, applied_step);
    if (apply) {
      for (std::size_t g = 0; g < consts_.size(); ++g) consts_[g] = group_consts(params_[g], lr_[g], applied_step);
    }
    if (config_.host_driven) {
      // The scaler moves on applied and overflow steps only (as the CUDA backend's host-driven
      // step): a spike or a non-finite update says nothing about the loss scale.
      StepReport report = report_;
      if (!external && (report.outcome == Outcome::applied || report.outcome == Outcome::skipped_overflow)) {
        scaler_.update(report.outcome == Outcome::skipped_overflow, report.headroom_log2);
      }
      state_.scaler = scaler_.state();
      if (!external) report.scale_next = scaler_.scale();
      host_report_ = report;
    }
    if (apply) report_.held_elements = static_cast<std::int64_t>(apply_pass());
    has_report_ = true;
  }

  StepTotals* device_totals() override { return &totals_; }

  StepReport last_report() override {
    require_step("last_report");
    if (config_.host_driven) {
      StepReport r = host_report_;
      r.held_elements = r.outcome == Outcome::applied ? report_.held_elements : 0;
      return r;
    }
    return report_;
  }

  std::vector<std::int64_t> nonfinite_counts() override {
    require_step("nonfinite_counts");
    std::vector<std::uint32_t> counts(partials_.size());
    for (std::size_t c = 0; c < partials_.size(); ++c) counts[c] = partials_[c].nonfinite;
    return per_tensor_counts(chunks_, counts, table_.size());
  }

  void set_lr(std::int32_t group, float lr, Stream) override {
    check_lr(config_, group, lr);
    lr_[static_cast<std::size_t>(group)] = lr;
    config_.groups[static_cast<std::size_t>(group)].lr = lr;
  }

  float* device_lr(std::int32_t group) override {
    check_group(config_, group);
    return &lr_[static_cast<std::size_t>(group)];
  }

  const float* device_loss_scale() const override { return &state_.scaler.scale; }
  const std::int64_t* device_step_count() const override { return &state_.step; }
  OptimizerState state() override { return state_; }
  std::vector<float> learning_rates() override { return lr_; }

  void restore(const OptimizerState& s, const std::vector<AdamWConfig>& groups, Rounding rounding,
               std::uint64_t seed) override {
    if (config_.host_driven) scaler_.set_state(s.scaler);  // validated already: cannot throw here
    state_ = s;
    config_.groups = groups;
    config_.state.rounding = rounding;
    config_.state.seed = seed;
    finalize_.decide.seed = seed;
    load_groups();
  }

  void set_group(std::int32_t group, const AdamWConfig& h, Stream) override {
    const auto g = static_cast<std::size_t>(group);
    params_[g] = group_params(h);
    lr_[g] = h.lr;
    config_.groups[g] = h;
  }

  void set_gradients(const std::vector<const void*>& grads, Stream, std::uint64_t key) override {
    std::vector<ParamTensor> next = tensors_;
    for (std::size_t t = 0; t < next.size(); ++t) next[t].grad = grads[t];
    for (std::size_t t = 0; t < next.size(); ++t) {
      TensorDesc& d = table_[t];
      d.grad = next[t].numel > 0 ? next[t].grad : nullptr;
      d.grad_vec = next[t].grad != nullptr && reinterpret_cast<std::uintptr_t>(next[t].grad) % 16 == 0 ? 1 : 0;
      d.all_vec = all_aligned(next[t], config_) ? 1 : 0;
    }
    inputs_.numel = numel_in_norm(next);
    inputs_.grads_key = key;
    tensors_ = std::move(next);
  }

  void mark_unscaled(Stream) override { inputs_.scale.unscaled = 1; }

  void use_external_scale(const float* scale, const float* found_inf, Stream) override {
    ScaleInputs& in = inputs_.scale;
    in.external = 1;
    in.external_scale = scale != nullptr ? *scale : 1.0f;
    if (scale == nullptr) in.unscaled = 1;
    in.found_inf = found_inf != nullptr ? *found_inf : 0.0f;
    external_pending_ = true;  // a host-driven step leaves the host's scaler alone too
  }

  void set_loss_scale(float scale, Stream) override {
    if (config_.host_driven) {
      ScalerState s = scaler_.state();
      s.scale = scale;
      scaler_.set_state(s);
    }
    state_.scaler.scale = scale;
  }

  const StepConfig& config() const override { return config_; }
  const std::vector<ParamTensor>& tensors() const override { return tensors_; }
  std::int64_t chunk_count() const override { return static_cast<std::int64_t>(chunks_.size()); }
  int launches_per_step() const override { return 0; }

  void enqueue_pass(int, Stream) override {
    throw Error(ErrorKind::usage, "enqueue_pass: the host backend has no device passes");
  }

  // memcpy's pointers must not be null even for zero bytes (an empty tensor's buffers may be).
  void copy_out(void* host, const void* buffer, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(host, buffer, bytes);
  }
  void copy_in(void* buffer, const void* host, std::size_t bytes) override {
    if (bytes != 0) std::memcpy(buffer, host, bytes);
  }

  int threads() const override { return pool_.threads(); }
  void set_threads(int threads) override { pool_.set_threads(threads); }

 private:
  void load_groups() {
    params_.clear();
    lr_.clear();
    for (const AdamWConfig& h : config_.groups) {
      params_.push_back(group_params(h));
      lr_.push_back(h.lr);
    }
    finalize_.params = params_.data();
    finalize_.lr = lr_.data();
  }

  void begin_local(const char* what) const {
    if (local_pending_) {
      throw Error(ErrorKind::usage, concat(what, ": step_local has run; step_finish must end that step first"));
    }
    if (state_.attempts >= kCounterLimit) {
      throw Error(ErrorKind::usage, concat(what, ": this optimizer has attempted ", kCounterLimit,
                                           " steps (kCounterLimit); its counters are full"));
    }
  }

  void require_step(const char* what) const {
    if (!has_report_) throw Error(ErrorKind::usage, concat(what, ": no step has run yet"));
  }

  // Pass 1 over every chunk, then the reduce stage: this rank's record in totals_.
  void measure() {
    const HostPass1 args{config_.grad_dtype, square_split(config_.grad_dtype, window_hint_),
                         f32_pattern(format_info(measured_dtype(config_)).min_normal)};
    const int threads = pool_.threads();
    worker_spill_.assign(static_cast<std::size_t>(threads), Limbs{});
    std::vector<unsigned char> spilled(static_cast<std::size_t>(threads), 0);
    pool_.run(static_cast<std::int64_t>(chunks_.size()), [&](std::int64_t begin, std::int64_t end, int w) {
      auto& spill = worker_spill_[static_cast<std::size_t>(w)].limbs;
      bool any = false;
      for (std::int64_t c = begin; c < end; ++c) {
        const ChunkDesc& chunk = chunks_[static_cast<std::size_t>(c)];
        passes_.measure(args, table_[static_cast<std::size_t>(chunk.tensor)], chunk, partials_[static_cast<std::size_t>(c)],
                        spill, any);
      }
      if (any) spilled[static_cast<std::size_t>(w)] = 1;
    });
    // The reduce stage: integers only, so neither the threads nor the order change a bit.
    unsigned long long digit[kPartialDigits] = {};
    unsigned long long nonfinite = 0, subnormal = 0, zero = 0;
    std::uint32_t max_bits = 0;
    std::int32_t first_bad = -1;
    for (std::size_t c = 0; c < partials_.size(); ++c) {
      const ChunkPartial& q = partials_[c];
      for (int k = 0; k < kPartialDigits; ++k) digit[k] += q.digit[k];
      nonfinite += q.nonfinite;
      subnormal += q.subnormal;
      zero += q.zero;
      max_bits = std::max(max_bits, q.max_bits);
      if (q.nonfinite != 0 && first_bad < 0) first_bad = chunks_[c].tensor;
    }
    for (int i = 0; i < kSumLimbs; ++i) spill_[i] = 0;
    for (int w = 0; w < threads; ++w) {
      if (spilled[static_cast<std::size_t>(w)] == 0) continue;
      for (int i = 0; i < kSumLimbs; ++i) spill_[i] += worker_spill_[static_cast<std::size_t>(w)].limbs[i];
    }
    totals_ = rank_record(finalize_, digit, nonfinite, subnormal, zero, max_bits, first_bad);
  }

  // Pass 2 over every chunk (the decision applies); returns the elements held.
  std::uint64_t apply_pass() {
    const HostPass2 args{config_.grad_dtype, config_.model_dtype, config_.state, decision_, consts_.data(),
                         &kSignedCodec8, &kUnsignedCodec8};
    const int threads = pool_.threads();
    std::vector<std::uint64_t> held(static_cast<std::size_t>(threads), 0);
    pool_.run(static_cast<std::int64_t>(chunks_.size()), [&](std::int64_t begin, std::int64_t end, int w) {
      std::uint64_t h = 0;
      for (std::int64_t c = begin; c < end; ++c) {
        const ChunkDesc& chunk = chunks_[static_cast<std::size_t>(c)];
        const TensorDesc& tensor = table_[static_cast<std::size_t>(chunk.tensor)];
        if (tensor.grad == nullptr) continue;  // no gradient for this tensor in this step: left alone
        h += passes_.apply(args, tensor, chunk);
      }
      held[static_cast<std::size_t>(w)] += h;
    });
    std::uint64_t total = 0;
    for (std::uint64_t h : held) total += h;
    return total;
  }

  StepConfig config_;
  std::vector<ParamTensor> tensors_;
  std::int32_t rank_;
  const HostPasses& passes_;
  HostPool pool_;
  DynamicLossScaler scaler_;
  // What the kernels read and write in device memory, here in host memory.
  std::vector<TensorDesc> table_;
  std::vector<ChunkDesc> chunks_;
  std::vector<ChunkPartial> partials_;
  std::vector<GroupParams> params_;
  std::vector<float> lr_;
  std::vector<GroupConsts> consts_;
  OptimizerState state_{};
  StepReport report_{};
  StepReport host_report_{};
  Decision decision_{};
  StepTotals totals_{};
  StepInputs inputs_{};
  std::uint32_t window_hint_ = 0;
  unsigned long long spill_[kSumLimbs] = {};
  struct Limbs {
    std::uint64_t limbs[kSumLimbs] = {};
  };
  std::vector<Limbs> worker_spill_;  // each thread's squares outside the window
  FinalizeArgs finalize_{};
  bool has_report_ = false;
  bool local_pending_ = false;
  bool external_pending_ = false;
};

}  // namespace

std::unique_ptr<FusedAdamW::Impl> make_host_impl(const std::vector<ParamTensor>& tensors, const StepConfig& config,
                                                 const Distributed& dist) {
  return std::make_unique<HostImpl>(tensors, config, dist);
}

}  // namespace halfstep::detail
