// halfstep-train's data parallelism on GPUs: one rank per visible GPU, all driven from this thread
// through NCCL (collectives of several ranks issued from one thread are grouped with
// ncclGroupStart / ncclGroupEnd). Per step: each engine's forward and backward on its slice of the
// batch; ncclReduceScatter averages the fp16 gradients into each rank's shard; each rank's
// FusedAdamW measures its shard (step_local), the StepTotals records are all-reduced (SUM and
// MAX), every rank decides and applies (step_finish); ncclAllGather brings every engine the whole
// model copy. Shards are ceil(numel / ranks) elements (the last shorter), as the collectives need
// equal counts; the engines' flat buffers have room for the padding.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <stdexcept>
#include <string>
#include <tuple>

#include "trainer.hpp"

namespace train {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void check(ncclResult_t e, const char* what) {
  if (e != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(e));
}

template <class T>
T* device_buffer(std::size_t n) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc");
  check(cudaMemset(p, 0, std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMemset");
  return static_cast<T*>(p);
}

struct DeviceShard {
  int device = 0;
  std::int64_t begin = 0, end = 0;
  float* master = nullptr;
  unsigned char *exp_avg = nullptr, *exp_avg_sq = nullptr;  // the moments in their format
  std::uint16_t *grad = nullptr, *model = nullptr;
  halfstep::Shard pieces;
  std::unique_ptr<halfstep::FusedAdamW> opt;
  ncclComm_t comm = nullptr;
  halfstep::ParamTensor flat() const {
    halfstep::ParamTensor p;
    p.master = master;
    p.grad = grad;
    p.exp_avg = exp_avg;
    p.exp_avg_sq = exp_avg_sq;
    p.model = model;
    p.numel = end - begin;
    return p;
  }
};

class NcclRanks final : public Trainer {
 public:
  NcclRanks(int n, const std::function<std::unique_ptr<Engine>(int)>& make_engine, const halfstep::StepConfig& config)
      : config_(config), shards_(static_cast<std::size_t>(n)) {
    int devices = 0;
    check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (n > devices) {
      throw std::runtime_error("--ranks " + std::to_string(n) + " needs a GPU per rank; " + std::to_string(devices) + " visible");
    }
    if (n > kFlatSlack) throw std::runtime_error("--ranks " + std::to_string(n) + ": at most " + std::to_string(kFlatSlack));
    std::vector<int> list(static_cast<std::size_t>(n));
    std::vector<ncclComm_t> comms(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) list[static_cast<std::size_t>(r)] = r;
    check(ncclCommInitAll(comms.data(), n, list.data()), "ncclCommInitAll");
    for (int r = 0; r < n; ++r) {
      check(cudaSetDevice(r), "cudaSetDevice");
      engines_.push_back(make_engine(r));
    }
    for (const halfstep::ParamTensor& t : engines_[0]->tensors()) {
      halfstep::ParamTensor shape;
      shape.numel = t.numel;
      shape.group = t.group;
      layout_.push_back(shape);
      total_ += t.numel;
    }
    per_rank_ = (total_ + n - 1) / n;
    for (int r = 0; r < n; ++r) {
      DeviceShard& s = shards_[static_cast<std::size_t>(r)];
      check(cudaSetDevice(r), "cudaSetDevice");
      s.device = r;
      s.comm = comms[static_cast<std::size_t>(r)];
      std::tie(s.begin, s.end) = halfstep::even_shard(total_, n, r);  // chunks of per_rank_
      const auto len = static_cast<std::size_t>(per_rank_);
      s.master = device_buffer<float>(len);
      s.exp_avg = device_buffer<unsigned char>(len * slot_bytes(config_, halfstep::Slot::exp_avg));  // zeroed
      s.exp_avg_sq = device_buffer<unsigned char>(len * slot_bytes(config_, halfstep::Slot::exp_avg_sq));
      s.grad = device_buffer<std::uint16_t>(len);
      s.model = device_buffer<std::uint16_t>(len);
      s.pieces = halfstep::shard(layout_, s.begin, s.end, s.flat(), config_);
      // The shard's masters and model copy, from this rank's engine (every engine starts alike).
      const std::vector<halfstep::ParamTensor> full = engines_[static_cast<std::size_t>(r)]->tensors();
      for (std::size_t k = 0; k < s.pieces.tensors.size(); ++k) {
        const halfstep::ParamTensor& piece = s.pieces.tensors[k];
        const halfstep::ParamTensor& from = full[static_cast<std::size_t>(s.pieces.source[k])];
        check(cudaMemcpy(piece.master, static_cast<const float*>(from.master) + s.pieces.offset[k],
                         static_cast<std::size_t>(piece.numel) * 4,
                         cudaMemcpyDeviceToDevice), "cudaMemcpy");
      }
      check(cudaMemcpy(s.model, engines_[static_cast<std::size_t>(r)]->flat_model() + s.begin,
                       static_cast<std::size_t>(s.end - s.begin) * 2, cudaMemcpyDeviceToDevice), "cudaMemcpy");
      // Device-to-device copies do not wait for the host; the engines' streams do not wait
      // for the legacy stream they used.
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      s.opt = std::make_unique<halfstep::FusedAdamW>(s.pieces.tensors, config_, halfstep::Distributed{r, {}});
    }
  }

  ~NcclRanks() override {
    for (DeviceShard& s : shards_) {
      cudaSetDevice(s.device);
      cudaDeviceSynchronize();
      s.opt.reset();
      cudaFree(s.master);
      cudaFree(s.exp_avg);
      cudaFree(s.exp_avg_sq);
      cudaFree(s.grad);
      cudaFree(s.model);
      if (s.comm) ncclCommDestroy(s.comm);
    }
  }

  int ranks() const override { return static_cast<int>(shards_.size()); }

  void set_lr(float lr) override {
    for (std::size_t r = 0; r < shards_.size(); ++r) {
      check(cudaSetDevice(shards_[r].device), "cudaSetDevice");
      shards_[r].opt->set_lr(0, lr, engines_[r]->stream());
      shards_[r].opt->set_lr(1, lr, engines_[r]->stream());
    }
  }

  void step(std::int64_t step, float grad_factor) override {
    const std::size_t n = shards_.size();
    for (std::size_t r = 0; r < n; ++r) {
      check(cudaSetDevice(shards_[r].device), "cudaSetDevice");
      engines_[r]->forward_backward(step, *shards_[r].opt, grad_factor);
    }
    group([&](std::size_t r) {
      check(ncclReduceScatter(engines_[r]->flat_grads(), shards_[r].grad, static_cast<std::size_t>(per_rank_),
                              ncclFloat16, ncclAvg, shards_[r].comm, stream(r)),
            "ncclReduceScatter");
    });
    for (std::size_t r = 0; r < n; ++r) {
      check(cudaSetDevice(shards_[r].device), "cudaSetDevice");
      shards_[r].opt->step_local(stream(r));
    }
    group([&](std::size_t r) {
      halfstep::StepTotals* t = shards_[r].opt->device_totals();
      check(ncclAllReduce(t->sum, t->sum, halfstep::StepTotals::kSumWords, ncclUint64, ncclSum, shards_[r].comm,
                          stream(r)), "ncclAllReduce");
      check(ncclAllReduce(t->max, t->max, halfstep::StepTotals::kMaxWords, ncclUint64, ncclMax, shards_[r].comm,
                          stream(r)), "ncclAllReduce");
    });
    for (std::size_t r = 0; r < n; ++r) {
      check(cudaSetDevice(shards_[r].device), "cudaSetDevice");
      shards_[r].opt->step_finish(stream(r));
    }
    all_gather();
  }

  // The report, its first inf/NaN named by the tensor's index in the whole model.
  halfstep::StepReport report(int rank) override {
    check(cudaSetDevice(shards_[static_cast<std::size_t>(rank)].device), "cudaSetDevice");
    halfstep::StepReport r = shards_[static_cast<std::size_t>(rank)].opt->last_report();
    if (r.first_nonfinite_tensor >= 0) {
      r.first_nonfinite_tensor = shards_[static_cast<std::size_t>(r.first_nonfinite_rank)]
                                     .pieces.source[static_cast<std::size_t>(r.first_nonfinite_tensor)];
    }
    return r;
  }

  float loss(std::int64_t step) override {
    double sum = 0.0;
    for (std::size_t r = 0; r < shards_.size(); ++r) {
      check(cudaSetDevice(shards_[r].device), "cudaSetDevice");
      sum += engines_[r]->loss(step);
    }
    return static_cast<float>(sum / static_cast<double>(shards_.size()));
  }

  halfstep::OptimizerState state() override {
    check(cudaSetDevice(shards_[0].device), "cudaSetDevice");
    return shards_[0].opt->state();
  }

  void save(const std::vector<std::string>& names, const std::string& path,
            const halfstep::CheckpointOptions& options) override {
    // The shards gathered to the host, saved by a reference-backend optimizer built on them with
    // the state every rank holds.
    const auto total = static_cast<std::size_t>(total_);
    const std::size_t m_bytes = slot_bytes(config_, halfstep::Slot::exp_avg);
    const std::size_t v_bytes = slot_bytes(config_, halfstep::Slot::exp_avg_sq);
    std::vector<float> master(total);
    std::vector<unsigned char> exp_avg(total * m_bytes), exp_avg_sq(total * v_bytes);
    std::vector<std::uint16_t> grad(total), model(total);
    for (DeviceShard& s : shards_) {
      check(cudaSetDevice(s.device), "cudaSetDevice");
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      const auto len = static_cast<std::size_t>(s.end - s.begin);
      const auto at = static_cast<std::size_t>(s.begin);
      check(cudaMemcpy(master.data() + at, s.master, len * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
      check(cudaMemcpy(exp_avg.data() + at * m_bytes, s.exp_avg, len * m_bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
      check(cudaMemcpy(exp_avg_sq.data() + at * v_bytes, s.exp_avg_sq, len * v_bytes, cudaMemcpyDeviceToHost),
            "cudaMemcpy");
      check(cudaMemcpy(model.data() + at, s.model, len * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    }
    halfstep::ParamTensor flat{master.data(), grad.data(), exp_avg.data(), exp_avg_sq.data(), model.data(), total_, 0};
    halfstep::FusedAdamW whole(halfstep::shard(layout_, 0, total_, flat, config_).tensors, config_,
                               halfstep::Backend::reference);
    check(cudaSetDevice(shards_[0].device), "cudaSetDevice");
    whole.load_state(shards_[0].opt->save_state());
    halfstep::save_checkpoint(whole, names, path, options);
  }

  void load(const std::vector<std::string>& names, const std::string& path) override {
    for (DeviceShard& s : shards_) {
      check(cudaSetDevice(s.device), "cudaSetDevice");
      halfstep::load_checkpoint(*s.opt, s.pieces, names, path);
    }
    all_gather();
    sync();
  }

  void sync() override {
    for (std::size_t r = 0; r < shards_.size(); ++r) {
      check(cudaSetDevice(shards_[r].device), "cudaSetDevice");
      engines_[r]->sync();
    }
  }

 private:
  cudaStream_t stream(std::size_t r) const { return engines_[r]->stream(); }

  // One collective per rank, issued from this thread as one NCCL group.
  template <class F>
  void group(F per_rank) {
    check(ncclGroupStart(), "ncclGroupStart");
    try {
      for (std::size_t r = 0; r < shards_.size(); ++r) per_rank(r);
    } catch (...) {
      ncclGroupEnd();
      throw;
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
  }

  void all_gather() {
    group([&](std::size_t r) {
      check(ncclAllGather(shards_[r].model, engines_[r]->flat_model(), static_cast<std::size_t>(per_rank_),
                          ncclFloat16, shards_[r].comm, stream(r)),
            "ncclAllGather");
    });
  }

  halfstep::StepConfig config_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<halfstep::ParamTensor> layout_;
  std::int64_t total_ = 0, per_rank_ = 0;
  std::vector<DeviceShard> shards_;
};

}  // namespace

std::unique_ptr<Trainer> make_nccl_ranks(int ranks, const std::function<std::unique_ptr<Engine>(int)>& make_engine,
                                         const halfstep::StepConfig& config) {
  return std::make_unique<NcclRanks>(ranks, make_engine, config);
}

}  // namespace train
