// GPU test support: device copies of host models, checked CUDA calls, skip reporting, and the
// comparison of a fused step against the CPU reference with derived tolerances.
#pragma once

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "halfstep/fused_adamw.hpp"
#include "halfstep/reference.hpp"
#include "host_buffers.hpp"
#include "step_check.hpp"

namespace halfstep_test {

inline constexpr int kSkipReturnCode = 77;
extern bool g_skipped;
/// Where the case matrix writes its digests (--digest-dir); empty: nowhere.
extern std::string g_digest_dir;

/// True when HALFSTEP_TEST_REDUCED is set (and not "0"): the largest cases shrink so the suite
/// fits under compute-sanitizer (bench/gpu_check.sh).
inline bool reduced_sizes() {
  const char* e = std::getenv("HALFSTEP_TEST_REDUCED");
  return e != nullptr && *e != '\0' && std::string(e) != "0";
}

/// Marks the running test as skipped (ctest shows it as Skipped); the caller returns at once.
void skip_test(const std::string& why);

#define GPU_CHECK(expr)                                                              \
  do {                                                                               \
    const cudaError_t gpu_check_status_ = (expr);                                    \
    INFO(#expr << ": " << cudaGetErrorString(gpu_check_status_));                    \
    REQUIRE(gpu_check_status_ == cudaSuccess);                                       \
  } while (0)

/// One device buffer of `n` elements starting `offset` elements into its allocation, so tests
/// can hand the step pointers that are not 16-byte aligned.
template <class T>
struct DeviceArray {
  T* base = nullptr;
  T* ptr = nullptr;
  std::size_t n = 0;
  DeviceArray() = default;
  DeviceArray(std::size_t count, std::size_t offset) : n(count) {
    void* raw = nullptr;
    GPU_CHECK(cudaMalloc(&raw, (count + offset) * sizeof(T) + 16));
    base = static_cast<T*>(raw);
    ptr = base + offset;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : base(o.base), ptr(o.ptr), n(o.n) { o.base = nullptr; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(base, o.base);
    std::swap(ptr, o.ptr);
    std::swap(n, o.n);
    return *this;
  }
  ~DeviceArray() {
    if (base) cudaFree(base);
  }
  void upload(const std::vector<T>& h) {
    REQUIRE(h.size() == n);
    if (n) GPU_CHECK(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    // A copy from pageable memory may return before it lands; steps on non-blocking streams do
    // not wait for it.
    GPU_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  }
  void download(std::vector<T>& h) const {
    h.resize(n);
    if (n) GPU_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
  }
};

/// Device copies of every buffer of a HostModel.
struct DeviceModel {
  struct Tensor {
    DeviceArray<float> master, exp_avg, exp_avg_sq;
    DeviceArray<std::uint16_t> grad, model;
    DeviceArray<std::uint32_t> grad32;  // fp32 gradients, as their bit patterns
    bool f32 = false;
    bool with_model = true;
    std::int32_t group = 0;
  };
  std::vector<Tensor> tensors;

  /// Copies `h` to the device; buffer i of tensor t starts (offset + t + i) % 4 elements into
  /// its allocation when `misalign` is set, else 16-byte aligned.
  explicit DeviceModel(const HostModel& h, bool misalign = false) {
    std::size_t k = 0;
    auto off = [&] { return misalign ? (k++ % 3) + 1 : 0; };
    for (const HostTensor& t : h.tensors) {
      Tensor d;
      d.master = DeviceArray<float>(t.master.size(), off());
      d.exp_avg = DeviceArray<float>(t.exp_avg.size(), off());
      d.exp_avg_sq = DeviceArray<float>(t.exp_avg_sq.size(), off());
      d.grad = DeviceArray<std::uint16_t>(t.grad.size(), off());
      d.grad32 = DeviceArray<std::uint32_t>(t.grad32.size(), off());
      d.f32 = t.grad_dtype == halfstep::DType::f32;
      d.model = DeviceArray<std::uint16_t>(t.model.size(), off());
      d.with_model = t.with_model;
      d.group = t.group;
      tensors.push_back(std::move(d));
    }
    upload(h);
  }
  void upload(const HostModel& h) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      tensors[t].master.upload(h.tensors[t].master);
      tensors[t].exp_avg.upload(h.tensors[t].exp_avg);
      tensors[t].exp_avg_sq.upload(h.tensors[t].exp_avg_sq);
      tensors[t].model.upload(h.tensors[t].model);
    }
    upload_grads(h);
  }
  void upload_grads(const HostModel& h) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      tensors[t].grad.upload(h.tensors[t].grad);
      tensors[t].grad32.upload(h.tensors[t].grad32);
    }
  }
  /// The device buffers, copied into a HostModel shaped like `like`.
  HostModel download(const HostModel& like) const {
    HostModel out = like;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      tensors[t].master.download(out.tensors[t].master);
      tensors[t].exp_avg.download(out.tensors[t].exp_avg);
      tensors[t].exp_avg_sq.download(out.tensors[t].exp_avg_sq);
      tensors[t].grad.download(out.tensors[t].grad);
      tensors[t].grad32.download(out.tensors[t].grad32);
      tensors[t].model.download(out.tensors[t].model);
    }
    return out;
  }
  std::vector<halfstep::ParamTensor> views() {
    std::vector<halfstep::ParamTensor> v;
    for (Tensor& t : tensors) {
      halfstep::ParamTensor p;
      p.master = t.master.ptr;
      p.grad = t.f32 ? static_cast<const void*>(t.grad32.ptr) : static_cast<const void*>(t.grad.ptr);
      p.exp_avg = t.exp_avg.ptr;
      p.exp_avg_sq = t.exp_avg_sq.ptr;
      p.model = t.with_model ? t.model.ptr : nullptr;
      p.numel = static_cast<std::int64_t>(t.master.n);
      p.group = t.group;
      v.push_back(p);
    }
    return v;
  }
};

}  // namespace halfstep_test
