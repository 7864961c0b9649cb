// halfstep-train's data parallelism on GPUs: one rank per visible GPU, all driven from this thread
// through NCCL (collectives of several ranks issued from one thread are grouped with
// ncclGroupStart / ncclGroupEnd). Per step: each engine's forward and backward on its slice of the
// batch; the 16-bit gradients of each rank's range averaged to that rank (one ncclReduce per rank,
// rooted at it: together a reduce-scatter whose ranges may differ in length); each rank's
// FusedAdamW measures its shard (step_local), the StepTotals records are all-reduced (SUM and
// MAX), every rank decides and applies (step_finish); each rank's range of the model copy
// broadcast from it to every engine (together an all-gather). The ranges are
// halfstep::even_shard's for the layout: even, with each cut moved to where a block starts under
// block8 moments, so ranges may differ by up to a block and a collective of equal counts
// (ncclReduceScatter, ncclAllGather) would need padding in the engines' flat buffers.
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
  unsigned char* master = nullptr;                          // in its format; null without a master
  unsigned char *exp_avg = nullptr, *exp_avg_sq = nullptr;  // the moments in their format (shard_state)
  float *exp_avg_scale = nullptr, *exp_avg_sq_scale = nullptr;  // block8: the pieces' block scales
  halfstep::ShardState sizes;
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
    p.exp_avg_scale = exp_avg_scale;
    p.exp_avg_sq_scale = exp_avg_sq_scale;
    return p;
  }
};

// The NCCL type of the 16-bit gradients and model copy.
ncclDataType_t nccl_type(halfstep::DType dtype) {
  if (dtype == halfstep::DType::f32) throw std::invalid_argument("halfstep-train's ranks exchange 16-bit buffers only");
  return dtype == halfstep::DType::bf16 ? ncclBfloat16 : ncclFloat16;
}

class NcclRanks final : public Trainer {
 public:
  NcclRanks(int n, const std::function<std::unique_ptr<Engine>(int)>& make_engine, const halfstep::StepConfig& config)
      : config_(config), shards_(static_cast<std::size_t>(n)) {
    int devices = 0;
    check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (n > devices) {
      throw std::runtime_error("--ranks " + std::to_string(n) + " needs a GPU per rank; " + std::to_string(devices) + " visible");
    }
    if (n > kMaxRanks) throw std::runtime_error("--ranks " + std::to_string(n) + ": at most " + std::to_string(kMaxRanks));
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
      shape.row = t.row;  // where block8's blocks lie
      layout_.push_back(shape);
      total_ += t.numel;
    }
    const std::size_t master_bytes = slot_bytes(config_, halfstep::Slot::master);
    for (int r = 0; r < n; ++r) {
      DeviceShard& s = shards_[static_cast<std::size_t>(r)];
      check(cudaSetDevice(r), "cudaSetDevice");
      s.device = r;
      s.comm = comms[static_cast<std::size_t>(r)];
      std::tie(s.begin, s.end) = halfstep::even_shard(layout_, config_, n, r);
      const auto len = static_cast<std::size_t>(s.end - s.begin);
      s.sizes = halfstep::shard_state(layout_, s.begin, s.end, config_);
      if (master_bytes > 0) s.master = device_buffer<unsigned char>(len * master_bytes);
      // Zero in every format (block8: scales of 0 decode every code to 0).
      s.exp_avg = device_buffer<unsigned char>(static_cast<std::size_t>(s.sizes.exp_avg_bytes));
      s.exp_avg_sq = device_buffer<unsigned char>(static_cast<std::size_t>(s.sizes.exp_avg_sq_bytes));
      if (s.sizes.scales > 0) {
        s.exp_avg_scale = device_buffer<float>(static_cast<std::size_t>(s.sizes.scales));
        s.exp_avg_sq_scale = device_buffer<float>(static_cast<std::size_t>(s.sizes.scales));
      }
      s.grad = device_buffer<std::uint16_t>(len);
      s.model = device_buffer<std::uint16_t>(len);
      s.pieces = halfstep::shard(layout_, s.begin, s.end, s.flat(), config_);
      // The shard's masters and model copy, from this rank's engine (every engine starts alike).
      const std::vector<halfstep::ParamTensor> full = engines_[static_cast<std::size_t>(r)]->tensors();
      for (std::size_t k = 0; master_bytes > 0 && k < s.pieces.tensors.size(); ++k) {
        const halfstep::ParamTensor& piece = s.pieces.tensors[k];
        const halfstep::ParamTensor& from = full[static_cast<std::size_t>(s.pieces.source[k])];
        check(cudaMemcpy(piece.master,
                         static_cast<const unsigned char*>(from.master) +
                             static_cast<std::size_t>(s.pieces.offset[k]) * master_bytes,
                         static_cast<std::size_t>(piece.numel) * master_bytes, cudaMemcpyDeviceToDevice),
              "cudaMemcpy");
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
      cudaFree(s.exp_avg_scale);
      cudaFree(s.exp_avg_sq_scale);
      cudaFree(s.grad);
      cudaFree(s.model);
      if (s.comm) ncclCommDestroy(s.comm);
    }
    for (std::size_t r = 0; r < engines_.size(); ++r) {  // each engine's handles on its own device
      cudaSetDevice(shards_[r].device);
      engines_[r].reset();
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
      for (std::size_t root = 0; root < n; ++root) {  // recvbuff is written on the root only
        const DeviceShard& to = shards_[root];
        check(ncclReduce(engines_[r]->flat_grads() + to.begin, shards_[r].grad,
                         static_cast<std::size_t>(to.end - to.begin), nccl_type(config_.grad_dtype), ncclAvg,
                         static_cast<int>(root), shards_[r].comm, stream(r)),
              "ncclReduce");
      }
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
    // Each rank's flat buffers copied to the host and cut as on the device, then gathered into
    // whole tensors and saved with the state every rank holds (save_gathered).
    std::vector<HostBuffers> host(shards_.size());
    std::vector<halfstep::Shard> host_pieces(shards_.size());
    std::vector<const halfstep::Shard*> pieces;
    for (std::size_t r = 0; r < shards_.size(); ++r) {
      const DeviceShard& s = shards_[r];
      HostBuffers& h = host[r];
      check(cudaSetDevice(s.device), "cudaSetDevice");
      check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      h = HostBuffers(layout_, s.begin, s.end, config_);
      const auto copy = [](void* to, const void* from, std::size_t bytes) {
        if (bytes > 0) check(cudaMemcpy(to, from, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
      };
      copy(h.master.data(), s.master, h.master.size());
      copy(h.exp_avg.data(), s.exp_avg, h.exp_avg.size());
      copy(h.exp_avg_sq.data(), s.exp_avg_sq, h.exp_avg_sq.size());
      copy(h.exp_avg_scale.data(), s.exp_avg_scale, h.exp_avg_scale.size() * sizeof(float));
      copy(h.exp_avg_sq_scale.data(), s.exp_avg_sq_scale, h.exp_avg_sq_scale.size() * sizeof(float));
      copy(h.model.data(), s.model, h.model.size() * 2);
      host_pieces[r] = halfstep::shard(layout_, s.begin, s.end, h.flat(), config_);
      pieces.push_back(&host_pieces[r]);
    }
    check(cudaSetDevice(shards_[0].device), "cudaSetDevice");
    save_gathered(layout_, config_, pieces, *shards_[0].opt, names, path, options);
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

  // Every engine's model copy from every rank's range: one broadcast rooted at each rank.
  void all_gather() {
    group([&](std::size_t r) {
      for (std::size_t root = 0; root < shards_.size(); ++root) {
        const DeviceShard& from = shards_[root];
        std::uint16_t* to = engines_[r]->flat_model() + from.begin;
        // sendbuff is read on the root only; elsewhere it is this device's own receive buffer
        check(ncclBroadcast(r == root ? from.model : to, to,
                            static_cast<std::size_t>(from.end - from.begin), nccl_type(config_.model_dtype),
                            static_cast<int>(root), shards_[r].comm, stream(r)),
              "ncclBroadcast");
      }
    });
  }

  halfstep::StepConfig config_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<halfstep::ParamTensor> layout_;
  std::int64_t total_ = 0;
  std::vector<DeviceShard> shards_;
};

}  // namespace

std::unique_ptr<Trainer> make_nccl_ranks(int ranks, const std::function<std::unique_ptr<Engine>(int)>& make_engine,
                                         const halfstep::StepConfig& config) {
  return std::make_unique<NcclRanks>(ranks, make_engine, config);
}

}  // namespace train
