// halfstep-train's trainers on the host: the plain single-engine one, and data parallelism with
// ranks simulated in one process on the CPU engine.
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "trainer.hpp"

namespace train {
namespace {

class SingleTrainer final : public Trainer {
 public:
  SingleTrainer(Engine& engine, const halfstep::StepConfig& config)
      : engine_(engine), opt_(engine.tensors(), config, engine.backend()) {}
  int ranks() const override { return 1; }
  void set_lr(float lr) override {
    opt_.set_lr(0, lr, engine_.stream());
    opt_.set_lr(1, lr, engine_.stream());
  }
  void step(std::int64_t step, float grad_factor) override {
    engine_.forward_backward(step, opt_, grad_factor);
    engine_.step(opt_);
  }
  halfstep::StepReport report(int) override { return opt_.last_report(); }
  float loss(std::int64_t step) override { return engine_.loss(step); }
  halfstep::OptimizerState state() override { return opt_.state(); }
  void save(const std::vector<std::string>& names, const std::string& path,
            const halfstep::CheckpointOptions& options) override {
    halfstep::save_checkpoint(opt_, names, path, options);
  }
  void load(const std::vector<std::string>& names, const std::string& path) override {
    halfstep::load_checkpoint(opt_, names, path);
  }
  void sync() override { engine_.sync(); }

 private:
  Engine& engine_;
  halfstep::FusedAdamW opt_;
};

// One rank's shard of the optimizer state: its range of the flat parameter space in five flat
// buffers, and the optimizer over them.
struct HostShard : HostBuffers {
  halfstep::Shard pieces;
  std::unique_ptr<halfstep::FusedAdamW> opt;
};

class HostRanks final : public Trainer {
 public:
  HostRanks(std::vector<std::unique_ptr<Engine>> engines, const halfstep::StepConfig& config)
      : engines_(std::move(engines)), config_(config) {
    const int n = static_cast<int>(engines_.size());
    // The layout and the initial masters in their format, from rank 0's engine (every engine
    // starts alike).
    const std::size_t master_bytes = slot_bytes(config_, halfstep::Slot::master);
    std::vector<unsigned char> masters;
    for (const halfstep::ParamTensor& t : engines_[0]->tensors()) {
      halfstep::ParamTensor shape;
      shape.numel = t.numel;
      shape.group = t.group;
      shape.row = t.row;  // where block8's blocks lie
      layout_.push_back(shape);
      total_ += t.numel;
      const auto* m = static_cast<const unsigned char*>(t.master);
      if (m != nullptr) masters.insert(masters.end(), m, m + static_cast<std::size_t>(t.numel) * master_bytes);
    }
    shards_.resize(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      HostShard& s = shards_[static_cast<std::size_t>(r)];
      // Even ranges, their cuts moved to block starts under block8; the moments zero in every
      // format (block8: scales of 0 decode every code to 0).
      const auto [begin, end] = halfstep::even_shard(layout_, config_, n, r);
      static_cast<HostBuffers&>(s) = HostBuffers(layout_, begin, end, config_);
      std::copy(masters.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(begin) * master_bytes),
                masters.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(end) * master_bytes),
                s.master.begin());
      std::copy(engines_[0]->flat_model() + begin, engines_[0]->flat_model() + end, s.model.begin());
      s.pieces = halfstep::shard(layout_, s.begin, s.end, s.flat(), config_);
      s.opt = std::make_unique<halfstep::FusedAdamW>(s.pieces.tensors, config_, halfstep::Distributed{r, {}},
                                                     halfstep::Backend::host);
    }
  }

  int ranks() const override { return static_cast<int>(engines_.size()); }

  void set_lr(float lr) override {
    for (HostShard& s : shards_) {
      s.opt->set_lr(0, lr);
      s.opt->set_lr(1, lr);
    }
  }

  void step(std::int64_t step, float grad_factor) override {
    const std::size_t n = engines_.size();
    for (std::size_t r = 0; r < n; ++r) engines_[r]->forward_backward(step, *shards_[r].opt, grad_factor);
    // Reduce-scatter: each rank's range of the average of every rank's gradients, summed in fp32
    // in rank order and rounded once to the gradients' format.
    const halfstep::DType dtype = config_.grad_dtype;
    for (HostShard& s : shards_) {
      for (std::int64_t i = s.begin; i < s.end; ++i) {
        float sum = 0.0f;
        for (const auto& e : engines_) sum += static_cast<float>(halfstep::from_bits16(dtype, e->flat_grads()[i]));
        s.grad[static_cast<std::size_t>(i - s.begin)] = halfstep::to_bits16(dtype, sum / static_cast<float>(n));
      }
    }
    // One verdict: every rank's record reduced, every rank decides from the result.
    halfstep::StepTotals total{};
    for (HostShard& s : shards_) {
      s.opt->step_local();
      halfstep::combine(total, *s.opt->device_totals());
    }
    for (HostShard& s : shards_) {
      *s.opt->device_totals() = total;
      s.opt->step_finish();
    }
    all_gather();
  }

  // The report, its first inf/NaN named by the tensor's index in the whole model.
  halfstep::StepReport report(int rank) override {
    halfstep::StepReport r = shards_[static_cast<std::size_t>(rank)].opt->last_report();
    if (r.first_nonfinite_tensor >= 0) {
      r.first_nonfinite_tensor = shards_[static_cast<std::size_t>(r.first_nonfinite_rank)]
                                     .pieces.source[static_cast<std::size_t>(r.first_nonfinite_tensor)];
    }
    return r;
  }

  float loss(std::int64_t step) override {  // the mean of the ranks' equal slices
    double sum = 0.0;
    for (const auto& e : engines_) sum += e->loss(step);
    return static_cast<float>(sum / static_cast<double>(engines_.size()));
  }

  halfstep::OptimizerState state() override { return shards_[0].opt->state(); }

  void save(const std::vector<std::string>& names, const std::string& path,
            const halfstep::CheckpointOptions& options) override {
    std::vector<const halfstep::Shard*> pieces;
    for (const HostShard& s : shards_) pieces.push_back(&s.pieces);
    save_gathered(layout_, config_, pieces, *shards_[0].opt, names, path, options);
  }

  void load(const std::vector<std::string>& names, const std::string& path) override {
    for (HostShard& s : shards_) halfstep::load_checkpoint(*s.opt, s.pieces, names, path);
    all_gather();
  }

  void sync() override {}

 private:
  // Every engine's model copy from every rank's shard.
  void all_gather() {
    for (const HostShard& s : shards_) {
      for (const auto& e : engines_) std::copy(s.model.begin(), s.model.end(), e->flat_model() + s.begin);
    }
  }

  std::vector<std::unique_ptr<Engine>> engines_;
  halfstep::StepConfig config_;
  std::vector<halfstep::ParamTensor> layout_;
  std::int64_t total_ = 0;
  std::vector<HostShard> shards_;
};

}  // namespace

HostBuffers::HostBuffers(const std::vector<halfstep::ParamTensor>& layout, std::int64_t first, std::int64_t last,
                         const halfstep::StepConfig& config)
    : begin(first), end(last) {
  const auto len = static_cast<std::size_t>(end - begin);
  const halfstep::ShardState sizes = halfstep::shard_state(layout, begin, end, config);
  master.assign(len * slot_bytes(config, halfstep::Slot::master), 0);
  exp_avg.assign(static_cast<std::size_t>(sizes.exp_avg_bytes), 0);
  exp_avg_sq.assign(static_cast<std::size_t>(sizes.exp_avg_sq_bytes), 0);
  exp_avg_scale.assign(static_cast<std::size_t>(sizes.scales), 0.0f);
  exp_avg_sq_scale.assign(static_cast<std::size_t>(sizes.scales), 0.0f);
  grad.assign(len, 0);
  model.assign(len, 0);
}

halfstep::ParamTensor HostBuffers::flat() {
  halfstep::ParamTensor p;
  p.master = master.empty() ? nullptr : master.data();
  p.grad = grad.data();
  p.exp_avg = exp_avg.data();
  p.exp_avg_sq = exp_avg_sq.data();
  p.model = model.data();
  p.numel = end - begin;
  p.exp_avg_scale = exp_avg_scale.data();
  p.exp_avg_sq_scale = exp_avg_sq_scale.data();
  return p;
}

void save_gathered(const std::vector<halfstep::ParamTensor>& layout, const halfstep::StepConfig& config,
                   const std::vector<const halfstep::Shard*>& shards, halfstep::FusedAdamW& state,
                   const std::vector<std::string>& names, const std::string& path,
                   const halfstep::CheckpointOptions& options) {
  // The shards gathered into whole tensors, saved by an optimizer built on them with the state
  // every rank holds. Each piece's buffers go to its place in its tensor: elements at its offset
  // (at each slot's element size: block8 codes, or fp32 moments where a tensor keeps them),
  // block scales at its first block.
  struct Whole {
    std::vector<unsigned char> slot[halfstep::kSlotCount];
    std::vector<float> exp_avg_scale, exp_avg_sq_scale;
  };
  std::vector<Whole> whole(layout.size());
  std::vector<halfstep::ParamTensor> tensors;
  for (std::size_t t = 0; t < layout.size(); ++t) {
    halfstep::ParamTensor w = layout[t];
    for (const halfstep::SlotLayout& slot : halfstep::slot_layouts(config, w)) {
      auto& bytes = whole[t].slot[static_cast<int>(slot.slot)];
      bytes.assign(static_cast<std::size_t>(w.numel) * slot.element_bytes, 0);
      if (slot.present) halfstep::set_slot_pointer(w, slot.slot, bytes.data());
    }
    const halfstep::MomentBlocks b = halfstep::moment_blocks(config, w);
    whole[t].exp_avg_scale.assign(static_cast<std::size_t>(b.blocks), 0.0f);
    whole[t].exp_avg_sq_scale.assign(static_cast<std::size_t>(b.blocks), 0.0f);
    if (b.quantized) {
      w.exp_avg_scale = whole[t].exp_avg_scale.data();
      w.exp_avg_sq_scale = whole[t].exp_avg_sq_scale.data();
    }
    tensors.push_back(w);
  }
  for (const halfstep::Shard* s : shards) {
    for (std::size_t k = 0; k < s->tensors.size(); ++k) {
      const halfstep::ParamTensor& p = s->tensors[k];
      const auto t = static_cast<std::size_t>(s->source[k]);
      const auto at = static_cast<std::size_t>(s->offset[k]);
      for (const halfstep::SlotLayout& slot : halfstep::slot_layouts(config, p)) {
        const void* from = halfstep::slot_pointer(p, slot.slot);
        if (from == nullptr) continue;
        std::memcpy(whole[t].slot[static_cast<int>(slot.slot)].data() + at * slot.element_bytes, from,
                    static_cast<std::size_t>(p.numel) * slot.element_bytes);
      }
      const halfstep::MomentBlocks b = halfstep::moment_blocks(config, p);
      if (b.quantized) {
        const auto n = static_cast<std::size_t>(b.blocks) * sizeof(float);
        std::memcpy(whole[t].exp_avg_scale.data() + b.first, p.exp_avg_scale, n);
        std::memcpy(whole[t].exp_avg_sq_scale.data() + b.first, p.exp_avg_sq_scale, n);
      }
    }
  }
  halfstep::FusedAdamW gathered(tensors, config, halfstep::Backend::host);
  gathered.load_state(state.save_state());
  halfstep::save_checkpoint(gathered, names, path, options);
}

std::unique_ptr<Trainer> make_single_trainer(Engine& engine, const halfstep::StepConfig& config) {
  return std::make_unique<SingleTrainer>(engine, config);
}

std::unique_ptr<Trainer> make_host_ranks(std::vector<std::unique_ptr<Engine>> engines,
                                         const halfstep::StepConfig& config) {
  if (engines.empty()) throw std::invalid_argument("make_host_ranks: no engines");
  return std::make_unique<HostRanks>(std::move(engines), config);
}

}  // namespace train
