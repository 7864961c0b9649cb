// The CUDA backend of FusedAdamW: setup (validation, the tensor table, the workspace) and the
// orchestration of one step — pass 1, finalize, pass 2 and the asynchronous report copy.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "block8.hpp"
#include "check.hpp"
#include "cuda_check.hpp"
#include "fused_impl.hpp"
#include "halfstep/checkpoint.hpp"
#include "launch.hpp"
#include "tensor_table.hpp"
#include "distributed_impl.hpp"

namespace halfstep::detail {
namespace {

// Owners of CUDA resources; release never throws.
struct DeviceMemory {
  void* ptr = nullptr;
  DeviceMemory() = default;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  ~DeviceMemory() { if (ptr) cudaFree(ptr); }
};
struct PinnedMemory {
  void* ptr = nullptr;
  PinnedMemory() = default;
  PinnedMemory(const PinnedMemory&) = delete;
  PinnedMemory& operator=(const PinnedMemory&) = delete;
  ~PinnedMemory() { if (ptr) cudaFreeHost(ptr); }
};
struct Event {
  cudaEvent_t event = nullptr;
  Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() { if (event) cudaEventDestroy(event); }
};

void require_device_buffer(const void* ptr, std::int64_t numel, std::size_t t, const char* field,
                           int device) {
  if (ptr == nullptr || numel == 0) return;
  cudaPointerAttributes attr{};
  const cudaError_t status = cudaPointerGetAttributes(&attr, ptr);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it so later calls do not report it
    throw Error(ErrorKind::invalid_argument,
                concat("tensors[", t, "].", field, " is not memory CUDA knows (", ptr, "): ",
                       cudaGetErrorString(status)));
  }
  require(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged, "tensors[", t,
          "].", field, " must be device memory for Backend::cuda, got ",
          attr.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory", " at ", ptr);
  require(attr.device == device, "tensors[", t, "].", field, " lives on device ", attr.device,
          " but the current device is ", device);
}

class CudaImpl final : public FusedAdamW::Impl {
 public:
  CudaImpl(const std::vector<ParamTensor>& tensors, const StepConfig& config, const Distributed& dist)
      : config_(config), tensors_(tensors), dist_(dist) {
    validate(tensors, config_);
    validate_distributed(dist_);
    check_device();
    if (config_.host_driven) scaler_ = DynamicLossScaler(config_.scaler);
    const TensorTable table = build_tensor_table(tensors, config_);
    n_tensors_ = table.tensors.size();
    n_chunks_ = static_cast<std::int64_t>(table.chunks.size());
    chunks_ = table.chunks;
    make_workspace(table);
    bind_kernel_args();
    HALFSTEP_CUDA_CHECK(cudaMallocHost(&pinned_.ptr, sizeof(StepReport) + sizeof(ScalerState)));
    // attempt = 0 marks "no step has run": every step's report has attempt >= 1.
    std::memset(pinned_.ptr, 0, sizeof(StepReport) + sizeof(ScalerState));
    h_report_ = static_cast<StepReport*>(pinned_.ptr);
    h_scaler_ = static_cast<ScalerState*>(static_cast<void*>(h_report_ + 1));
    HALFSTEP_CUDA_CHECK(cudaEventCreateWithFlags(&done_.event, cudaEventDisableTiming));
    settle_uploads();
  }

  void step(Stream stream) override {
    const bool capturing = begin_step(stream, "step", true);
    launch_check_and_norm(config_.grad_dtype, pass1_, n_chunks_, stream);
    if (dist_.comms.empty()) {
      launch_finalize(finalize_, kReduceStage | kDecideStage, stream);
    } else {
      launch_finalize(finalize_, kReduceStage, stream);
      allreduce_totals(ws_.totals, dist_.comms, stream);
      launch_finalize(finalize_, kDecideStage, stream);
    }
    end_step(stream, capturing);
  }

  void step_local(Stream stream) override {
    begin_step(stream, "step_local", false);
    launch_check_and_norm(config_.grad_dtype, pass1_, n_chunks_, stream);
    launch_finalize(finalize_, kReduceStage, stream);
    local_pending_ = true;
  }

  void step_local_refused(Stream stream) override {
    begin_step(stream, "step_local_refused", false);
    launch_finalize(finalize_, kRefuseStage, stream);
    local_pending_ = true;
  }

  void step_refused(Stream stream) override {
    if (dist_.comms.empty()) {
      throw Error(ErrorKind::usage, "step_refused: this FusedAdamW has no communicators; call "
                                    "step_local_refused, reduce the record and call step_finish");
    }
    const bool capturing = begin_step(stream, "step_refused", true);
    launch_finalize(finalize_, kRefuseStage, stream);
    allreduce_totals(ws_.totals, dist_.comms, stream);
    launch_finalize(finalize_, kDecideStage, stream);
    end_step(stream, capturing);
  }

  void step_finish(Stream stream) override {
    if (!local_pending_) {
      throw Error(ErrorKind::usage, "step_finish: no step_local since the last step finished");
    }
    const bool capturing = check_stream(stream, "step_finish", true);
    local_pending_ = false;
    launch_finalize(finalize_, kDecideStage, stream);
    end_step(stream, capturing);
  }

  StepTotals* device_totals() override { return ws_.totals; }

  // The report of the last step that ran (eager, or a replay of a captured step), after pass 2.
  StepReport last_report() override {
    require_executed_step("last_report");
    if (config_.host_driven) {
      StepReport r = host_report_;
      r.held_elements = r.outcome == Outcome::applied ? h_report_->held_elements : 0;
      return r;
    }
    return *h_report_;
  }

  std::vector<std::int64_t> nonfinite_counts() override {
    require_executed_step("nonfinite_counts");
    std::vector<ChunkPartial> partials(static_cast<std::size_t>(n_chunks_));
    if (n_chunks_ > 0) {
      HALFSTEP_CUDA_CHECK(cudaMemcpy(partials.data(), ws_.partials,
                                     partials.size() * sizeof(ChunkPartial),
                                     cudaMemcpyDeviceToHost));
    }
    std::vector<std::uint32_t> counts(partials.size());
    for (std::size_t c = 0; c < partials.size(); ++c) counts[c] = partials[c].nonfinite;
    return per_tensor_counts(chunks_, counts, n_tensors_);
  }

  void set_lr(std::int32_t group, float lr, Stream stream) override {
    check_lr(config_, group, lr);
    launch_store(ws_.lr + group, lr, stream);
    config_.groups[static_cast<std::size_t>(group)].lr = lr;
  }

  float* device_lr(std::int32_t group) override {
    check_group(config_, group);
    return ws_.lr + group;
  }

  const float* device_loss_scale() const override { return &ws_.state->scaler.scale; }
  const std::int64_t* device_step_count() const override { return &ws_.state->step; }

  OptimizerState state() override {
    wait_last_step();
    OptimizerState s;
    HALFSTEP_CUDA_CHECK(cudaMemcpy(&s, ws_.state, sizeof(s), cudaMemcpyDeviceToHost));
    return s;
  }

  std::vector<float> learning_rates() override {
    wait_last_step();
    std::vector<float> lr(config_.groups.size());
    HALFSTEP_CUDA_CHECK(cudaMemcpy(lr.data(), ws_.lr, lr.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return lr;
  }

  void restore(const OptimizerState& s, const std::vector<AdamWConfig>& groups, Rounding rounding,
               std::uint64_t seed) override {
    if (config_.host_driven) scaler_.set_state(s.scaler);  // validated already: cannot throw here
    wait_last_step();
    write_state(s);
    config_.groups = groups;
    config_.state.rounding = rounding;  // the kernels' arguments: the next launch takes them
    config_.state.seed = seed;
    finalize_.decide.seed = seed;
    apply_.state = config_.state;
    upload_groups();
    settle_uploads();
    attempts_ = s.attempts;
  }

  void set_group(std::int32_t group, const AdamWConfig& h, Stream stream) override {
    const auto g = static_cast<std::size_t>(group);
    launch_store_group(ws_.params + g, group_params(h), ws_.lr + g, h.lr, stream);
    config_.groups[g] = h;
  }

  void set_gradients(const std::vector<const void*>& grads, Stream stream, std::uint64_t key) override {
    std::vector<ParamTensor> next = tensors_;
    for (std::size_t t = 0; t < grads.size(); ++t) {
      if (grads[t] != tensors_[t].grad) require_device_buffer(grads[t], tensors_[t].numel, t, "grad", device_);
      next[t].grad = grads[t];
    }
    const std::int64_t numel = numel_in_norm(next);
    // Every batch goes, also the unchanged: one call leaves the table as `grads` say.
    GradBatch batch{};
    batch.numel = numel;
    batch.key = key;
    for (std::size_t first = 0; first < next.size() || first == 0; first += kGradBatch) {
      batch.first = static_cast<std::int32_t>(first);
      batch.count = static_cast<std::int32_t>(std::min<std::size_t>(kGradBatch, next.size() - first));
      for (int i = 0; i < batch.count; ++i) {
        const ParamTensor& p = next[first + static_cast<std::size_t>(i)];
        batch.grad[i] = p.numel > 0 ? p.grad : nullptr;
        batch.flags[i] = static_cast<std::uint8_t>((p.grad != nullptr && reinterpret_cast<std::uintptr_t>(p.grad) % 16 == 0 ? 1 : 0) |
                                                   (all_aligned(p, config_) ? 2 : 0));
      }
      launch_set_grads(ws_.tensors, ws_.inputs, batch, stream);
      if (next.empty()) break;
    }
    tensors_ = std::move(next);
  }

  void mark_unscaled(Stream stream) override { launch_mark_unscaled(ws_.inputs, stream); }

  void use_external_scale(const float* scale, const float* found_inf, Stream stream) override {
    launch_external_scale(ws_.inputs, scale, found_inf, stream);
    external_pending_ = true;  // a host-driven step leaves the host's scaler alone too
  }

  void set_loss_scale(float scale, Stream stream) override {
    if (config_.host_driven) {
      ScalerState s = scaler_.state();
      s.scale = scale;
      scaler_.set_state(s);
    }
    launch_store(&ws_.state->scaler.scale, scale, stream);
  }

  const StepConfig& config() const override { return config_; }
  const std::vector<ParamTensor>& tensors() const override { return tensors_; }
  std::int64_t chunk_count() const override { return n_chunks_; }
  // The step's plan: pass 1 and pass 2 where there are chunks, finalize once (or on both sides of
  // the all-reduce). The GPU suite counts the launches a step makes against it.
  int launches_per_step() const override { return (n_chunks_ > 0 ? 2 : 0) + (dist_.comms.empty() ? 1 : 2); }

  void enqueue_pass(int pass, Stream stream) override {
    switch (pass) {
      case kCheckAndNorm:
        launch_check_and_norm(config_.grad_dtype, pass1_, n_chunks_, stream);
        return;
      case kFinalize:
        launch_finalize(finalize_, kReduceStage | kDecideStage, stream);
        return;
      case kApply:
        launch_apply(apply_, stream);
        return;
    }
    throw Error(ErrorKind::invalid_argument, concat("enqueue_pass: no pass ", pass));
  }

  void copy_out(void* host, const void* buffer, std::size_t bytes) override {
    if (bytes == 0) return;
    wait_last_step();
    HALFSTEP_CUDA_CHECK(cudaMemcpy(host, buffer, bytes, cudaMemcpyDeviceToHost));
  }

  void copy_in(void* buffer, const void* host, std::size_t bytes) override {
    if (bytes == 0) return;
    wait_last_step();
    HALFSTEP_CUDA_CHECK(cudaMemcpy(buffer, host, bytes, cudaMemcpyHostToDevice));
    settle_uploads();
  }

 private:
  // A device, the caller's communicators on it, and every buffer device memory on it.
  void check_device() {
    int devices = 0;
    const cudaError_t status = cudaGetDeviceCount(&devices);
    if (status != cudaSuccess || devices == 0) {
      (void)cudaGetLastError();
      throw Error(ErrorKind::cuda, concat("Backend::cuda needs a CUDA device; cudaGetDeviceCount: ",
                                          status == cudaSuccess ? "no devices"
                                                                : cudaGetErrorString(status),
                                          " (Backend::reference runs without one)"));
    }
    HALFSTEP_CUDA_CHECK(cudaGetDevice(&device_));
    for (std::size_t c = 0; c < dist_.comms.size(); ++c) check_communicator(dist_.comms[c], c, device_);
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      const ParamTensor& p = tensors_[t];
      for (const SlotLayout& s : slot_layouts(config_, p)) require_device_buffer(slot_pointer(p, s.slot), p.numel, t, s.name, device_);
      const std::int64_t blocks = moment_blocks(config_, p).blocks;
      require_device_buffer(p.exp_avg_scale, blocks, t, "exp_avg_scale", device_);
      require_device_buffer(p.exp_avg_sq_scale, blocks, t, "exp_avg_sq_scale", device_);
    }
  }

  // One device allocation for everything the step reads and writes besides the tensors, filled:
  // the tensor table, the groups' hyperparameters and rates, the initial state.
  void make_workspace(const TensorTable& table) {
    const std::size_t n_groups = config_.groups.size();
    const WorkspaceLayout layout = WorkspaceLayout::make(n_tensors_, table.chunks.size(), n_groups);
    HALFSTEP_CUDA_CHECK(cudaMalloc(&workspace_.ptr, layout.bytes));
    HALFSTEP_CUDA_CHECK(cudaMemset(workspace_.ptr, 0, layout.bytes));
    ws_ = Workspace::in(workspace_.ptr, layout);
    upload(ws_.tensors, table.tensors.data(), n_tensors_);
    upload(ws_.chunks, table.chunks.data(), table.chunks.size());
    upload_groups();
    const StepInputs inputs{table.numel_in_norm, 0, ScaleInputs{}};
    upload(ws_.inputs, &inputs, 1);
    write_state(OptimizerState::initial(config_));
    const std::uint32_t hint = initial_window_hint(config_);
    upload(ws_.window_hint, &hint, 1);
    if (config_.state.exp_avg == MomentFormat::block8) {  // the two codecs (maps and guess tables), read by pass 2
      HALFSTEP_CUDA_CHECK(cudaMalloc(&codecs_.ptr, 2 * sizeof(Codec8)));
      upload(static_cast<Codec8*>(codecs_.ptr), &kSignedCodec8, 1);
      upload(static_cast<Codec8*>(codecs_.ptr) + 1, &kUnsignedCodec8, 1);
    }
  }

  // Every group's hyperparameters and learning rate, as config_ holds them.
  void upload_groups() {
    std::vector<GroupParams> params;
    std::vector<float> lr;
    for (const AdamWConfig& h : config_.groups) {
      params.push_back(group_params(h));
      lr.push_back(h.lr);
    }
    upload(ws_.params, params.data(), params.size());
    upload(ws_.lr, lr.data(), lr.size());
  }

  // The three passes' arguments, over the workspace.
  void bind_kernel_args() {
    pass1_ = Pass1Args{ws_.tensors, ws_.chunks, ws_.partials, ws_.window_hint, ws_.spill,
                       f32_pattern(format_info(measured_dtype(config_)).min_normal)};
    finalize_ = FinalizeArgs{ws_.partials, ws_.chunks, n_chunks_, ws_.window_hint, ws_.spill, ws_.totals,
                             ws_.inputs, dist_.rank, config_.grad_dtype,
                             ws_.state, ws_.report, ws_.decision, ws_.params, ws_.lr, ws_.consts,
                             static_cast<std::int32_t>(config_.groups.size()), decide_params(config_)};
    apply_ = ApplyArgs{config_.grad_dtype, config_.model_dtype, config_.state, ws_.tensors, ws_.chunks, n_chunks_,
                       ws_.decision, ws_.consts, ws_.report, static_cast<const Codec8*>(codecs_.ptr)};
  }

  template <class T>
  void upload(T* dst, const T* src, std::size_t count) {
    if (count == 0) return;
    HALFSTEP_CUDA_CHECK(cudaMemcpy(dst, src, count * sizeof(T), cudaMemcpyHostToDevice));
  }

  // Checks the device and the stream; true when the stream is being captured. `decides`: the call
  // runs the decision, which a host-driven step waits for.
  bool check_stream(Stream stream, const char* what, bool decides) {
    int current = -1;
    HALFSTEP_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device_) {
      throw Error(ErrorKind::usage, concat(what, ": this FusedAdamW lives on device ", device_,
                                           " but the current device is ", current));
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    HALFSTEP_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    if (config_.host_driven && capturing && decides) {
      throw Error(ErrorKind::usage,
                  concat(what, ": a host-driven step waits for the device and cannot be captured in "
                               "a CUDA graph (use the default device-resident mode)"));
    }
    return capturing;
  }

  // What every step does before pass 1: the checks, and the attempt bound.
  bool begin_step(Stream stream, const char* what, bool decides) {
    if (local_pending_) {
      throw Error(ErrorKind::usage, concat(what, ": step_local has run; step_finish must end that step first"));
    }
    const bool capturing = check_stream(stream, what, decides);
    if (attempts_ >= kCounterLimit) {
      throw Error(ErrorKind::usage, concat(what, ": this optimizer has attempted ", kCounterLimit,
                                           " steps (kCounterLimit); its counters are full"));
    }
    ++attempts_;  // every step counts once, eager or captured and replayed (a bound, not a count)
    return capturing;
  }

  // After the decision: pass 2 and the report (device-resident), or the host's scaler and pass 2
  // only when the step is applied (host-driven: one synchronisation).
  void end_step(Stream stream, bool capturing) {
    const bool external = external_pending_;
    external_pending_ = false;
    if (!config_.host_driven) {
      launch_apply(apply_, stream);
      HALFSTEP_CUDA_CHECK(cudaMemcpyAsync(h_report_, ws_.report, sizeof(StepReport),
                                          cudaMemcpyDeviceToHost, stream));
      record_done(stream, capturing);
      has_step_ = true;
      return;
    }
    HALFSTEP_CUDA_CHECK(cudaMemcpyAsync(h_report_, ws_.report, sizeof(StepReport),
                                        cudaMemcpyDeviceToHost, stream));
    record_done(stream, false);
    HALFSTEP_CUDA_CHECK(cudaEventSynchronize(done_.event));
    StepReport report = *h_report_;
    // The scaler moves on applied and overflow steps only: a spike or a non-finite update says
    // nothing about the loss scale.
    if (!external && (report.outcome == Outcome::applied || report.outcome == Outcome::skipped_overflow)) {
      scaler_.update(report.outcome == Outcome::skipped_overflow, report.headroom_log2);
    }
    *h_scaler_ = scaler_.state();  // the device's copy feeds the next backward pass
    HALFSTEP_CUDA_CHECK(cudaMemcpyAsync(&ws_.state->scaler, h_scaler_, sizeof(ScalerState),
                                        cudaMemcpyHostToDevice, stream));
    if (report.outcome == Outcome::applied) {
      launch_apply(apply_, stream);
      // Pass 2's count of held elements, for last_report (which waits for it).
      HALFSTEP_CUDA_CHECK(cudaMemcpyAsync(h_report_, ws_.report, sizeof(StepReport),
                                          cudaMemcpyDeviceToHost, stream));
    }
    record_done(stream, false);
    if (!external) report.scale_next = scaler_.scale();
    host_report_ = report;
    has_step_ = true;
  }

  void write_state(const OptimizerState& s) {
    upload(ws_.state, &s, 1);
  }

  // Copies from pageable host memory may return before they land, and steps may run on streams
  // that do not wait for the legacy stream those copies used: wait for them here.
  void settle_uploads() { HALFSTEP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy)); }

  void record_done(Stream stream, bool capturing) {
    if (capturing) {  // an event node in the graph: every replay records it
      HALFSTEP_CUDA_CHECK(cudaEventRecordWithFlags(done_.event, stream, cudaEventRecordExternal));
    } else {
      HALFSTEP_CUDA_CHECK(cudaEventRecord(done_.event, stream));
    }
  }

  void wait_last_step() {
    if (has_step_) HALFSTEP_CUDA_CHECK(cudaEventSynchronize(done_.event));
  }

  // Waits for the last step and throws unless one has run. A step captured in a CUDA graph runs
  // only when the graph is launched; until then the report holds attempt 0.
  void require_executed_step(const char* what) {
    wait_last_step();
    if (!has_step_ || h_report_->attempt == 0) {
      throw Error(ErrorKind::usage,
                  concat(what, ": no step has run yet", has_step_
                                                            ? " (a step captured in a CUDA graph runs when the graph is launched)"
                                                            : ""));
    }
  }

  StepConfig config_;
  std::vector<ParamTensor> tensors_;
  Distributed dist_;
  int device_ = -1;
  std::size_t n_tensors_ = 0;
  std::int64_t n_chunks_ = 0;
  std::vector<ChunkDesc> chunks_;
  DynamicLossScaler scaler_;
  DeviceMemory workspace_;
  DeviceMemory codecs_;  // block8 moments: the signed and unsigned Codec8, in that order
  PinnedMemory pinned_;
  Event done_;
  Workspace ws_{};
  StepReport* h_report_ = nullptr;
  ScalerState* h_scaler_ = nullptr;
  StepReport host_report_{};
  Pass1Args pass1_{};
  FinalizeArgs finalize_{};
  ApplyArgs apply_{};
  bool has_step_ = false;
  bool local_pending_ = false;  // step_local ran; step_finish has not
  bool external_pending_ = false;  // use_external_scale ran for the next step
  std::int64_t attempts_ = 0;  // the state's attempts plus the eager steps enqueued since (a graph
                               // replay is not counted here; the device saturates its counters)
};

}  // namespace

std::unique_ptr<FusedAdamW::Impl> make_cuda_impl(const std::vector<ParamTensor>& tensors,
                                                 const StepConfig& config, const Distributed& dist) {
  return std::make_unique<CudaImpl>(tensors, config, dist);
}

}  // namespace halfstep::detail
