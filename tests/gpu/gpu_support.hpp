// GPU test support: device copies of host models, checked CUDA calls, skip reporting, and the
// comparison of a fused step against the CPU reference with derived tolerances.
#pragma once

#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "adam_bound.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/reference.hpp"
#include "host_buffers.hpp"

namespace halfstep_test {

inline constexpr int kSkipReturnCode = 77;
extern bool g_skipped;

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
      tensors[t].grad.upload(h.tensors[t].grad);
      tensors[t].model.upload(h.tensors[t].model);
    }
  }
  void upload_grads(const HostModel& h) {
    for (std::size_t t = 0; t < tensors.size(); ++t) tensors[t].grad.upload(h.tensors[t].grad);
  }
  /// The device buffers, copied into a HostModel shaped like `like`.
  HostModel download(const HostModel& like) const {
    HostModel out = like;
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      tensors[t].master.download(out.tensors[t].master);
      tensors[t].exp_avg.download(out.tensors[t].exp_avg);
      tensors[t].exp_avg_sq.download(out.tensors[t].exp_avg_sq);
      tensors[t].grad.download(out.tensors[t].grad);
      tensors[t].model.download(out.tensors[t].model);
    }
    return out;
  }
  std::vector<halfstep::ParamTensor> views() {
    std::vector<halfstep::ParamTensor> v;
    for (Tensor& t : tensors) {
      halfstep::ParamTensor p;
      p.master = t.master.ptr;
      p.grad = t.grad.ptr;
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

/// Relative error the fused step's norm may have against the reference's. Pass 1 sums the
/// squares of at most K = kChunkElems / kPassThreads = 128 f16 gradients per thread in fp32
/// (each square and each addition rounds: at most K·u relative for positive terms) and
/// everything after in fp64; the square root halves the relative error. bf16 squares are summed
/// in fp64 throughout (a few ulps of fp64).
inline double norm_rel_tolerance(halfstep::DType grad_dtype) {
  const double u = std::ldexp(1.0, -24);
  return grad_dtype == halfstep::DType::f16 ? (128.0 / 2 + 2) * u : 1e-12;
}

/// Checks one fused step's report and buffers against the reference step taken from the same
/// inputs: verdicts, counters and scales exactly; the norm and the clip coefficient within
/// norm_rel_tolerance; masters and moments within adam_bound; the model copy bitwise equal to
/// the fused step's own master rounded to nearest even; untouched buffers bitwise unchanged.
inline void check_step(const halfstep::StepReport& got, const halfstep::StepReport& want,
                       const HostModel& before, const HostModel& gpu_after,
                       const HostModel& ref_after, const halfstep::StepConfig& config,
                       std::int64_t applied_step) {
  using namespace halfstep;
  REQUIRE(got.outcome == want.outcome);
  REQUIRE(got.attempt == want.attempt);
  REQUIRE(got.step == want.step);
  REQUIRE(got.spike == want.spike);
  REQUIRE(got.scale_used == want.scale_used);
  REQUIRE(got.scale_next == want.scale_next);
  REQUIRE(got.nonfinite_count == want.nonfinite_count);
  REQUIRE(got.first_nonfinite_tensor == want.first_nonfinite_tensor);
  REQUIRE(got.max_abs_scaled == want.max_abs_scaled);  // a max of exact values: exact
  REQUIRE(got.subnormal_count == want.subnormal_count);
  REQUIRE(got.zero_count == want.zero_count);
  REQUIRE(got.numel == want.numel);
  if (std::isinf(want.headroom_log2)) {
    REQUIRE(got.headroom_log2 == want.headroom_log2);
  } else {  // log2 of the same double on host and device: within one fp32 ulp
    REQUIRE(std::fabs(got.headroom_log2 - want.headroom_log2) <=
            std::fabs(want.headroom_log2) * 1.2e-7 + 1e-30);
  }
  const double tol = norm_rel_tolerance(config.grad_dtype);
  if (want.outcome == Outcome::skipped_overflow) {
    REQUIRE(std::isnan(got.grad_norm));
  } else {
    REQUIRE(std::fabs(got.grad_norm - want.grad_norm) <= tol * want.grad_norm);
    REQUIRE(std::fabs(got.clip_coef - want.clip_coef) <= (tol + 1.2e-7) * want.clip_coef);
  }
  const double clip = config.max_grad_norm > 0.0f && want.outcome == Outcome::applied
                          ? std::min(1.0, static_cast<double>(config.max_grad_norm) /
                                              (want.grad_norm + 1e-6))
                          : 1.0;
  for (std::size_t t = 0; t < before.tensors.size(); ++t) {
    const HostTensor& b = before.tensors[t];
    const HostTensor& g = gpu_after.tensors[t];
    const HostTensor& r = ref_after.tensors[t];
    REQUIRE(g.grad == b.grad);  // gradients are read, never written
    if (want.outcome != Outcome::applied) {
      REQUIRE(g == b);  // a skipped step writes nothing
      continue;
    }
    const AdamWConfig& h = config.groups[static_cast<std::size_t>(b.group)];
    for (std::size_t i = 0; i < b.master.size(); ++i) {
      const double x = from_bits16(config.grad_dtype, b.grad[i]);
      const AdamBound bound = adam_bound(b.master[i], b.exp_avg[i], b.exp_avg_sq[i], x,
                                         want.scale_used, clip, tol + 1.2e-7, h, applied_step);
      CAPTURE(t, i, x, b.master[i], g.master[i], r.master[i]);
      REQUIRE(std::fabs(static_cast<double>(g.master[i]) - r.master[i]) <= bound.p);
      REQUIRE(std::fabs(static_cast<double>(g.exp_avg[i]) - r.exp_avg[i]) <= bound.m);
      REQUIRE(std::fabs(static_cast<double>(g.exp_avg_sq[i]) - r.exp_avg_sq[i]) <= bound.v);
      if (b.with_model) {
        REQUIRE(g.model[i] == to_bits16(config.model_dtype, g.master[i]));
      } else {
        REQUIRE(g.model[i] == b.model[i]);
      }
    }
  }
}

}  // namespace halfstep_test
