// halfstep-train: the network, the synthetic task and the engines that run them.
//
// The task: regression onto a fixed random "teacher" network, y = T(x) with x ~ N(0, I). The
// student is an MLP (ReLU hidden layers) trained with mean squared error. Mixed precision as the
// field does it: 16-bit weights (the model copy halfstep writes, StepConfig::model_dtype: fp16,
// or bf16 with --precision bf16) and activations in the same format feed the matrix products,
// which accumulate in fp32; the loss and its gradient are fp32; the backward pass is seeded with
// the loss scale and writes 16-bit gradients; halfstep steps the masters (fp32; with a bf16 model
// copy also int16 remainders, or none: the bf16 weights themselves).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include <halfstep/halfstep.hpp>

namespace train {

/// Shape of the student network and of one batch.
struct Dims {
  int d_in = 64;          // input features
  int width = 256;        // hidden width
  int hidden_layers = 3;  // ReLU layers; the network has hidden_layers + 1 linear layers
  int d_out = 16;         // outputs
  int batch = 128;        // samples per step (on each rank)
  int samples = 8192;     // dataset size (a multiple of global_batch)
  // Data parallelism: a step's batch is global_batch samples, of which this engine takes `batch`
  // starting at batch_offset (0 and 0: the whole batch).
  int global_batch = 0;
  int batch_offset = 0;

  int layers() const { return hidden_layers + 1; }
  int step_batch() const { return global_batch > 0 ? global_batch : batch; }
  /// The first dataset row of this engine's part of batch `step`.
  std::int64_t first_row(std::int64_t step) const {
    return (step % (samples / step_batch())) * step_batch() + batch_offset;
  }
  int fan_in(int l) const { return l == 0 ? d_in : width; }
  int fan_out(int l) const { return l == layers() - 1 ? d_out : width; }
  std::int64_t parameters() const;
};

/// The dataset: x ~ N(0, I) (samples × d_in, already rounded to the network's 16-bit format
/// `precision`, f16 or bf16, as it sees them) and y = teacher(x) computed in double (samples ×
/// d_out, fp32). Row-major.
struct Dataset {
  std::vector<float> x, y;
};
Dataset make_dataset(const Dims& dims, const std::vector<std::vector<float>>& teacher,
                     std::uint64_t seed, halfstep::DType precision = halfstep::DType::f16);

/// Hidden units the teacher uses in each hidden layer.
inline int teacher_width(const Dims& dims) { return dims.width < 64 ? dims.width : 64; }

/// The teacher: weights of the student's shape (tensor_shapes order) in which only the first
/// teacher_width units of each hidden layer are connected, He-normal over the connected inputs.
/// The student can represent it exactly, so the loss can keep falling for as long as the
/// learning rate lets it, and its forward pass stays cheap at any width.
std::vector<std::vector<float>> teacher_masters(const Dims& dims, std::uint64_t seed);

/// The teacher applied to one input, in double, over its connected units only.
std::vector<float> teacher_forward(const Dims& dims, const std::vector<std::vector<float>>& w,
                                   const float* x);

/// Parameter tensor t: 2l is layer l's weight (fan_out × fan_in, row-major), 2l + 1 its bias.
struct TensorShape {
  std::int64_t numel;
  std::int32_t group;  // 0: weights (weight decay), 1: biases (none)
  std::int64_t row;    // elements per row: a weight's fan-in (rows are its outputs); 0 for a bias
};
std::vector<TensorShape> tensor_shapes(const Dims& dims);

/// Initial fp32 masters: He-normal weights, zero biases.
std::vector<std::vector<float>> initial_masters(const Dims& dims, std::uint64_t seed);

/// A tensor's initial state under `config`, from its fp32 values `master`: the master slot's
/// bytes in StateFormat::master's format (fp32 values; int16 remainders, halfstep::split_master;
/// none) and the model copy's bits in config.model_dtype (the values rounded to nearest). With
/// a bf16 model copy every master is first made canonical (halfstep::canonical_master), as a
/// step stores it, so that the three master formats start from the same weights.
struct InitialState {
  std::vector<unsigned char> master;
  std::vector<std::uint16_t> model;
};
InitialState initial_state(const halfstep::StepConfig& config, const std::vector<float>& master);

/// The most ranks data parallelism takes.
inline constexpr int kMaxRanks = 1024;

/// Runs the network's forward and backward passes and owns the buffers halfstep updates.
class Engine {
 public:
  virtual ~Engine() = default;
  /// "cuda" or "cpu (host backend)".
  virtual std::string name() const = 0;
  /// Where FusedAdamW runs for this engine.
  virtual halfstep::Backend backend() const = 0;
  /// The parameter tensors, in tensor_shapes order.
  virtual std::vector<halfstep::ParamTensor> tensors() = 0;
  /// The gradients and the model copies of all tensors, end to end in tensor_shapes order: one
  /// flat buffer each (device memory for the CUDA engine), what a data-parallel step
  /// reduce-scatters and all-gathers.
  virtual std::uint16_t* flat_grads() = 0;
  virtual std::uint16_t* flat_model() = 0;
  /// Forward, loss and backward on batch `step`, seeded with the loss scale `opt` holds (read
  /// on the device, no synchronisation) times `grad_factor` (1 except for injected spikes).
  virtual void forward_backward(std::int64_t step, const halfstep::FusedAdamW& opt, float grad_factor) = 0;
  /// The stream the engine's work runs on (null: the default stream); set_lr goes there too.
  virtual halfstep::Stream stream() const = 0;
  /// Enqueues the optimizer step after forward_backward.
  virtual void step(halfstep::FusedAdamW& opt) = 0;
  /// The loss of batch `step` (waits for it).
  virtual float loss(std::int64_t step) = 0;
  /// Waits for everything enqueued.
  virtual void sync() = 0;
};

/// The CPU engine: products on operands rounded to config.model_dtype (fp16 or bf16) with fp32
/// accumulation, summed in a fixed order whatever the CPU, and halfstep's host backend.
/// The engines write their gradients in the model copy's format: config.grad_dtype must equal
/// config.model_dtype (both throw std::invalid_argument otherwise).
std::unique_ptr<Engine> make_cpu_engine(const Dims& dims, const Dataset& data,
                                        const std::vector<std::vector<float>>& masters,
                                        std::int64_t steps, const halfstep::StepConfig& config);

/// The CUDA engine: cuBLAS products (cublasGemmEx, fp16 or bf16 operands, CUBLAS_COMPUTE_32F) and
/// halfstep's fused CUDA step. Throws if no device is present.
std::unique_ptr<Engine> make_cuda_engine(const Dims& dims, const Dataset& data,
                                         const std::vector<std::vector<float>>& masters,
                                         std::int64_t steps, const halfstep::StepConfig& config);

/// Bytes of one element of `slot` under `config` (the moments' format: halfstep::slot_layouts).
inline std::size_t slot_bytes(const halfstep::StepConfig& config, halfstep::Slot slot) {
  return halfstep::slot_layouts(config)[static_cast<std::size_t>(slot)].element_bytes;
}

/// A whole tensor of shape `s`, as the step reads its shape (block8 moments follow its rows).
inline halfstep::ParamTensor shaped(const TensorShape& s) {
  halfstep::ParamTensor t;
  t.numel = s.numel;
  t.row = s.row;
  return t;
}
/// Bytes per element of a slot of a tensor of shape `s` (block8 moments: 1, or 4 where the tensor
/// keeps fp32 moments).
inline std::size_t slot_bytes(const halfstep::StepConfig& config, halfstep::Slot slot, const TensorShape& s) {
  return halfstep::slot_layouts(config, shaped(s))[static_cast<std::size_t>(slot)].element_bytes;
}
/// Scales per moment of a tensor of shape `s` (block8 moments; 0 otherwise).
inline std::size_t scale_count(const halfstep::StepConfig& config, const TensorShape& s) {
  return static_cast<std::size_t>(halfstep::moment_blocks(config, shaped(s)).blocks);
}

/// Throws std::invalid_argument unless `config`'s gradients and model copy share one 16-bit
/// format (the engines' buffers hold both in it).
void check_engine_formats(const halfstep::StepConfig& config);

/// True when a CUDA device is present.
bool cuda_available();

}  // namespace train
