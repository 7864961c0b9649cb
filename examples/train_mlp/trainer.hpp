// halfstep-train: what the training loop drives — one engine with one optimizer, or N ranks of
// data parallelism, each an engine computing its part of the batch and a FusedAdamW holding its
// shard of the optimizer state (ZeRO-1/2 shape): gradients reduce-scattered, one verdict for all
// ranks (the StepTotals all-reduce), model copies all-gathered.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <halfstep/halfstep.hpp>
#include <halfstep/safetensors.hpp>

#include "model.hpp"

namespace train {

class Trainer {
 public:
  virtual ~Trainer() = default;
  /// Ranks taking part (1 for the plain run).
  virtual int ranks() const = 0;
  /// The learning rate of both groups from the next step on, on every rank.
  virtual void set_lr(float lr) = 0;
  /// Forward and backward on batch `step` (gradients times `grad_factor`), then the step.
  virtual void step(std::int64_t step, float grad_factor) = 0;
  /// The last step's report on rank `rank` (first_nonfinite_tensor indexes the whole model).
  virtual halfstep::StepReport report(int rank) = 0;
  /// The loss of batch `step`, over the whole batch (waits for it).
  virtual float loss(std::int64_t step) = 0;
  /// The optimizer state (the same on every rank).
  virtual halfstep::OptimizerState state() = 0;
  /// A full checkpoint of whole tensors named `names` (a sharded run gathers its shards first).
  virtual void save(const std::vector<std::string>& names, const std::string& path,
                    const halfstep::CheckpointOptions& options) = 0;
  /// Restores one; a sharded run reads each rank's slices of it, whatever the ranks that wrote it.
  virtual void load(const std::vector<std::string>& names, const std::string& path) = 0;
  /// Waits for everything enqueued.
  virtual void sync() = 0;
};

/// One engine, one optimizer over its tensors.
std::unique_ptr<Trainer> make_single_trainer(Engine& engine, const halfstep::StepConfig& config);

/// Ranks as one process on the host: CPU engines (each with its slice of the batch, or the whole
/// batch when replicated), the gradients reduce-scattered in fp32 and averaged, each rank's
/// optimizer on the host backend over its shard, records all-reduced in rank order.
std::unique_ptr<Trainer> make_host_ranks(std::vector<std::unique_ptr<Engine>> engines,
                                         const halfstep::StepConfig& config);

/// Ranks on the visible GPUs, one each, driven from one thread through NCCL (ncclCommInitAll):
/// each rank's range of the 16-bit gradients averaged to it (ncclReduce), each rank's FusedAdamW
/// over its shard reducing its record over its communicator, each rank's range of the model copy
/// broadcast from it (ncclBroadcast). `make_engine` is called with the device current.
std::unique_ptr<Trainer> make_nccl_ranks(int ranks, const std::function<std::unique_ptr<Engine>(int rank)>& make_engine,
                                         const halfstep::StepConfig& config);

/// One rank's five flat buffers for the range [begin, end) of `layout`, in host memory, each in its
/// format under `config` and zeroed (halfstep::shard_state's sizes; block8 scales beside the
/// moments; no master buffer without a master): what halfstep::shard cuts into pieces.
struct HostBuffers {
  std::int64_t begin = 0, end = 0;
  std::vector<unsigned char> master, exp_avg, exp_avg_sq;
  std::vector<float> exp_avg_scale, exp_avg_sq_scale;
  std::vector<std::uint16_t> grad, model;
  HostBuffers() = default;
  HostBuffers(const std::vector<halfstep::ParamTensor>& layout, std::int64_t begin, std::int64_t end,
              const halfstep::StepConfig& config);
  /// The buffers as the flat tensor of halfstep::shard.
  halfstep::ParamTensor flat();
};

/// Saves a checkpoint of whole tensors gathered from the ranks' shards (every piece of every
/// shard in host memory, laid out as halfstep::shard lays them out), with the optimizer state
/// (step, scaler, groups) that `state`, any rank's optimizer, holds.
void save_gathered(const std::vector<halfstep::ParamTensor>& layout, const halfstep::StepConfig& config,
                   const std::vector<const halfstep::Shard*>& shards, halfstep::FusedAdamW& state,
                   const std::vector<std::string>& names, const std::string& path,
                   const halfstep::CheckpointOptions& options);

}  // namespace train
