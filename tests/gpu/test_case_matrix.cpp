// The case matrix: the fused step over the shapes, formats, alignments and special values where
// kernels go wrong, each step checked in lockstep against the reference backend (derived bounds,
// exact verdicts and counters), with 8-byte canaries around every buffer. On the emulated device
// every step is also compared bitwise with a host mirror of pass 2 (the same fp32 arithmetic,
// element by element in a plain loop, compiled like the kernels without contraction), on the
// emulated device and on a GPU, and each case writes a digest of everything its steps wrote
// (--digest-dir), which every schedule must reproduce bit for bit.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gpu_support.hpp"
#include "halfstep/reference.hpp"
#include "step_math.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

constexpr std::int64_t kChunk = detail::kChunkElems;
constexpr unsigned char kCanary[8] = {'h', 's', 'c', 'a', 'n', 'a', 'r', 'y'};

/// A device buffer with 8-byte canaries right before and after it, starting `misalign` elements
/// past a 16-byte boundary.
template <class T>
struct Guarded {
  unsigned char* base = nullptr;
  T* ptr = nullptr;
  std::size_t n = 0;
  Guarded() = default;
  Guarded(std::size_t count, std::size_t misalign) : n(count) {
    const std::size_t front = 16 + misalign * sizeof(T);
    void* raw = nullptr;
    GPU_CHECK(cudaMalloc(&raw, front + n * sizeof(T) + 8));
    base = static_cast<unsigned char*>(raw);
    ptr = reinterpret_cast<T*>(base + front);
    GPU_CHECK(cudaMemcpy(base + front - 8, kCanary, 8, cudaMemcpyHostToDevice));
    GPU_CHECK(cudaMemcpy(base + front + n * sizeof(T), kCanary, 8, cudaMemcpyHostToDevice));
  }
  Guarded(const Guarded&) = delete;
  Guarded& operator=(const Guarded&) = delete;
  Guarded(Guarded&& o) noexcept : base(o.base), ptr(o.ptr), n(o.n) { o.base = nullptr; }
  Guarded& operator=(Guarded&& o) noexcept {
    std::swap(base, o.base);
    std::swap(ptr, o.ptr);
    std::swap(n, o.n);
    return *this;
  }
  ~Guarded() {
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
  bool canaries_intact() const {
    unsigned char before[8], after[8];
    GPU_CHECK(cudaMemcpy(before, reinterpret_cast<const unsigned char*>(ptr) - 8, 8, cudaMemcpyDeviceToHost));
    GPU_CHECK(cudaMemcpy(after, reinterpret_cast<const unsigned char*>(ptr + n), 8, cudaMemcpyDeviceToHost));
    return std::memcmp(before, kCanary, 8) == 0 && std::memcmp(after, kCanary, 8) == 0;
  }
};

/// Which buffer of every tensor is moved off 16-byte alignment by one element.
enum class Misalign { none, master, grad, exp_avg, exp_avg_sq, model };
const char* misalign_name(Misalign m) {
  static const char* names[] = {"aligned", "master+1", "grad+1", "exp_avg+1", "exp_avg_sq+1", "model+1"};
  return names[static_cast<int>(m)];
}

struct GuardedModel {
  struct Tensor {
    Guarded<float> master, exp_avg, exp_avg_sq;
    Guarded<std::uint16_t> grad, model;
    Guarded<std::uint32_t> grad32;  // fp32 gradients
    bool f32 = false;
    bool with_model = true;
    std::int32_t group = 0;
  };
  std::vector<Tensor> tensors;

  GuardedModel(const HostModel& h, Misalign m) {
    auto off = [m](Misalign which) -> std::size_t { return m == which ? 1 : 0; };
    for (const HostTensor& t : h.tensors) {
      Tensor d;
      d.master = Guarded<float>(t.master.size(), off(Misalign::master));
      d.exp_avg = Guarded<float>(t.exp_avg.size(), off(Misalign::exp_avg));
      d.exp_avg_sq = Guarded<float>(t.exp_avg_sq.size(), off(Misalign::exp_avg_sq));
      d.grad = Guarded<std::uint16_t>(t.grad.size(), off(Misalign::grad));
      d.grad32 = Guarded<std::uint32_t>(t.grad32.size(), off(Misalign::grad));
      d.f32 = t.grad_dtype == DType::f32;
      d.model = Guarded<std::uint16_t>(t.model.size(), off(Misalign::model));
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
      tensors[t].grad32.upload(h.tensors[t].grad32);
      tensors[t].model.upload(h.tensors[t].model);
    }
    GPU_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  }
  void upload_grads(const HostModel& h) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      tensors[t].grad.upload(h.tensors[t].grad);
      tensors[t].grad32.upload(h.tensors[t].grad32);
    }
    GPU_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  }
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
  bool canaries_intact() const {
    for (const Tensor& t : tensors) {
      if (!t.master.canaries_intact() || !t.exp_avg.canaries_intact() || !t.exp_avg_sq.canaries_intact() ||
          !t.grad.canaries_intact() || !t.grad32.canaries_intact() || !t.model.canaries_intact()) {
        return false;
      }
    }
    return true;
  }
  std::vector<ParamTensor> views() {
    std::vector<ParamTensor> v;
    for (Tensor& t : tensors) {
      ParamTensor p;
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

/// Gradients S·N(0, sigma²) in `dtype`, with one element in eight an exact ±0 and one in eight a
/// subnormal of the format the gradients were computed in (f16 for fp32 gradients: the underflow
/// the telemetry counts).
void fill_grads(std::mt19937_64& rng, HostTensor& t, DType dtype, float scale, double sigma = 1e-2) {
  std::normal_distribution<double> g(0.0, sigma);
  const DType measured = dtype == DType::f32 ? DType::f16 : dtype;
  const double min_sub = format_info(measured).min_subnormal, min_normal = format_info(measured).min_normal;
  std::uniform_real_distribution<double> sub(min_sub, min_normal * 0.99);
  for (std::size_t i = 0; i < t.size(); ++i) {
    const auto kind = rng() % 8;
    const double sign = rng() % 2 ? 1.0 : -1.0;
    if (kind == 0) {
      t.set_grad(i, sign * 0.0);
    } else if (kind == 1) {
      t.set_grad(i, sign * sub(rng));
    } else {
      t.set_grad(i, g(rng) * scale);
    }
  }
}

/// 64-bit FNV-1a over everything a step wrote and reported.
struct Digest {
  std::uint64_t h = 0xcbf29ce484222325ull;
  void bytes(const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 0x100000001b3ull;
  }
  template <class T>
  void vec(const std::vector<T>& v) {
    if (!v.empty()) bytes(v.data(), v.size() * sizeof(T));
  }
  void model(const HostModel& m) {
    for (const HostTensor& t : m.tensors) {
      vec(t.master);
      vec(t.exp_avg);
      vec(t.exp_avg_sq);
      vec(t.grad);
      vec(t.grad32);
      vec(t.model);
    }
  }
  void report(const StepReport& r) {
    bytes(&r.attempt, sizeof r.attempt);
    bytes(&r.step, sizeof r.step);
    bytes(&r.outcome, sizeof r.outcome);
    bytes(&r.scale_next, sizeof r.scale_next);
    bytes(&r.grad_norm, sizeof r.grad_norm);
    bytes(&r.nonfinite_count, sizeof r.nonfinite_count);
    bytes(&r.first_nonfinite_tensor, sizeof r.first_nonfinite_tensor);
    bytes(&r.max_abs_scaled, sizeof r.max_abs_scaled);
    bytes(&r.subnormal_count, sizeof r.subnormal_count);
    bytes(&r.zero_count, sizeof r.zero_count);
  }
};

/// Writes `lines` as the digest file of the running case, if --digest-dir was given.
void write_digest(const std::string& name, const std::vector<std::uint64_t>& lines) {
  if (g_digest_dir.empty()) return;
  std::string cmd = "mkdir -p '" + g_digest_dir + "'";
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::ofstream out(g_digest_dir + "/" + name + ".txt");
  for (std::uint64_t d : lines) {
    char buf[20];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(d));
    out << buf << "\n";
  }
  REQUIRE(out.good());
}

/// Pass 2 on the host: what every thread of the apply kernel computes for its elements, from the
/// device's own report, in a plain loop. Bitwise equal to the kernels (emulated or on a GPU: they
/// and this file compile without contraction, the multiply-adds fmaf in the source) unless their
/// indexing, vector paths, tails or group lookup are wrong.
HostModel mirror_pass2(const HostModel& before, const StepReport& r, const StepConfig& c) {
  HostModel out = before;
  if (r.outcome != Outcome::applied) return out;
  double clip = 1.0;
  if (c.max_grad_norm > 0.0f) {
    clip = static_cast<double>(c.max_grad_norm) / (r.grad_norm + 1e-6);
    if (clip > 1.0) clip = 1.0;
  }
  detail::Decision d{};
  detail::set_coefficient(d, clip / static_cast<double>(r.scale_used));
  for (HostTensor& t : out.tensors) {
    const AdamWConfig& h = c.groups[static_cast<std::size_t>(t.group)];
    const detail::GroupConsts k = detail::group_consts(detail::group_params(h), h.lr, r.step);
    for (std::size_t i = 0; i < t.master.size(); ++i) {
      const float g = detail::unscale(static_cast<float>(t.grad_value(i)), d);
      float p = t.master[i], m = t.exp_avg[i], v = t.exp_avg_sq[i];
      detail::adamw_update(p, m, v, g, k);
      // A bf16 model copy's master is stored canonical (the one fp32 value per even bf16 pattern
      // that an int16 remainder cannot hold moves one ulp towards zero: halfstep/state.hpp).
      if (t.with_model && c.model_dtype == DType::bf16 && detail::finite32(p)) {
        std::uint32_t b;
        std::memcpy(&b, &p, sizeof b);
        b = canonical_master(b);
        std::memcpy(&p, &b, sizeof p);
      }
      const std::uint16_t model = to_bits16(c.model_dtype, p);
      const BitClass mc = classify_bits16(c.model_dtype, model);
      const bool model_ok = !t.with_model || (mc != BitClass::infinite && mc != BitClass::nan);
      if (!(detail::finite32(p) && detail::finite32(m) && detail::finite32(v) && model_ok)) continue;  // held
      t.master[i] = p;
      t.exp_avg[i] = m;
      t.exp_avg_sq[i] = v;
      if (t.with_model) t.model[i] = model;
    }
  }
  return out;
}

/// One step of the device and of the reference from the same buffers and state, compared.
StepReport matrix_step(FusedAdamW& opt, GuardedModel& dev, const HostModel& like, const StepConfig& c,
                       Digest& digest) {
  const HostModel before = dev.download(like);
  OptimizerState ref_state = opt.state();
  opt.step();
  const StepReport got = opt.last_report();
  HostModel ref = before;
  const StepReport want = reference::step(ref.views(), c, ref_state);
  const HostModel after = dev.download(like);
  check_step(got, want, before, after, ref, c, ref_state.step);
  const OptimizerState now = opt.state();
  REQUIRE(now.scaler == ref_state.scaler);
  REQUIRE(now.step == ref_state.step);
  REQUIRE(now.attempts == ref_state.attempts);
  REQUIRE(dev.canaries_intact());
  const HostModel mirror = mirror_pass2(before, got, c);
  for (std::size_t t = 0; t < after.tensors.size(); ++t) {
    CAPTURE(t);
    REQUIRE(after.tensors[t] == mirror.tensors[t]);
  }
  digest.model(after);
  digest.report(got);
  return got;
}

StepConfig matrix_config(DType grad, DType model, float scale, bool clip, bool two_groups) {
  StepConfig c = config_for(grad, model, scale, clip ? 0.25f : 0.0f);
  c.scaler.growth_interval = 3;
  if (two_groups) {  // group 1: classic L2 decay, no bias correction, its own lr
    AdamWConfig l2;
    l2.lr = 3e-3f;
    l2.weight_decay = 0.02f;
    l2.decoupled_weight_decay = false;
    l2.bias_correction = false;
    c.groups.push_back(l2);
  }
  return c;
}

}  // namespace

TEST_CASE("matrix: every size, format pair and misaligned buffer steps like the reference", "[gpu][matrix]") {
  const std::vector<std::int64_t> sizes = {0, 1, 7, 8, 9, 255, 4099, kChunk - 1, kChunk, kChunk + 1,
                                           3 * kChunk + 123};
  std::vector<std::uint64_t> digests;
  int index = 0;
  for (DType grad : {DType::f16, DType::bf16, DType::f32}) {
    for (int model_kind = 0; model_kind < 3; ++model_kind) {  // f16, bf16, no model copy
      const DType model = model_kind == 1 ? DType::bf16 : DType::f16;
      for (int m = 0; m <= static_cast<int>(Misalign::model); ++m) {
        const auto misalign = static_cast<Misalign>(m);
        if (model_kind == 2 && misalign == Misalign::model) continue;
        ++index;
        const bool clip = index % 2 == 0;
        const float scale = grad == DType::bf16 ? 1.0f : 1024.0f;  // f32: as if computed in fp16
        const StepConfig c = matrix_config(grad, model, scale, clip, /*two_groups=*/true);
        std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(index));
        HostModel h = poisoned_model(rng(), sizes, scale, grad, model);
        for (std::size_t t = 0; t < h.tensors.size(); ++t) {
          h.tensors[t].group = static_cast<std::int32_t>(t % 2);
          h.tensors[t].with_model = model_kind != 2;
          fill_grads(rng, h.tensors[t], grad, scale);
        }
        GuardedModel dev(h, misalign);
        FusedAdamW opt(dev.views(), c);
        Digest digest;
        CAPTURE(index, dtype_name(grad), model_kind, misalign_name(misalign), clip);
        for (int step = 0; step < 2; ++step) {
          CAPTURE(step);
          if (step > 0) {
            for (auto& t : h.tensors) fill_grads(rng, t, grad, opt.loss_scale());
            dev.upload_grads(h);
          }
          const StepReport r = matrix_step(opt, dev, h, c, digest);
          REQUIRE(r.outcome == Outcome::applied);
          REQUIRE(r.subnormal_count > 0);
          REQUIRE(r.zero_count > 0);
        }
        digests.push_back(digest.h);
      }
    }
  }
  CHECK(digests.size() == 51);
  write_digest("sizes_formats_alignment", digests);
}

TEST_CASE("matrix: inf and NaN at the ends and middle of the first, middle and last tensors skip everything", "[gpu][matrix]") {
  const std::vector<std::int64_t> sizes = {kChunk + 5, 40, 3 * kChunk + 1};
  std::vector<std::uint64_t> digests;
  for (DType grad : {DType::f16, DType::bf16, DType::f32}) {
    const SpecialBits sp = special_bits(grad);
    const std::uint32_t sign = grad == DType::f32 ? 0x80000000u : 0x8000u;
    const std::uint32_t specials[] = {sp.inf, sp.inf | sign, sp.quiet_nan, sp.signalling_nan};
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (int where = 0; where < 3; ++where) {
        for (std::uint32_t bad : specials) {
          const float scale = grad == DType::bf16 ? 1.0f : 2048.0f;
          const StepConfig c = matrix_config(grad, DType::f16, scale, true, false);
          std::mt19937_64 rng(77);
          HostModel h = poisoned_model(rng(), sizes, scale, grad, DType::f16);
          for (auto& x : h.tensors) fill_grads(rng, x, grad, scale);
          const std::size_t n = h.tensors[t].size();
          const std::size_t i = where == 0 ? 0 : where == 1 ? n / 2 : n - 1;
          h.tensors[t].set_grad_bits(i, bad);
          GuardedModel dev(h, Misalign::none);
          FusedAdamW opt(dev.views(), c);
          Digest digest;
          CAPTURE(dtype_name(grad), t, i, bad);
          const StepReport r = matrix_step(opt, dev, h, c, digest);
          REQUIRE(r.outcome == Outcome::skipped_overflow);
          REQUIRE(r.nonfinite_count == 1);
          REQUIRE(r.first_nonfinite_tensor == static_cast<std::int32_t>(t));
          std::vector<std::int64_t> counts(sizes.size(), 0);
          counts[t] = 1;
          REQUIRE(opt.nonfinite_counts() == counts);
          digests.push_back(digest.h);
        }
      }
    }
  }
  write_digest("inf_nan_injection", digests);
}

TEST_CASE("matrix: 1000 tensors of 1 to 40 elements in two groups, and the first of several bad tensors", "[gpu][matrix]") {
  std::mt19937_64 rng(4242);
  std::uniform_int_distribution<std::int64_t> size(1, 40);
  std::vector<std::int64_t> sizes(1000);
  for (auto& n : sizes) n = size(rng);
  std::vector<std::uint64_t> digests;
  for (DType grad : {DType::f16, DType::bf16, DType::f32}) {
    const float scale = grad == DType::bf16 ? 1.0f : 512.0f;
    const StepConfig c = matrix_config(grad, DType::bf16, scale, grad != DType::bf16, true);
    HostModel h = poisoned_model(rng(), sizes, scale, grad, DType::bf16);
    for (std::size_t t = 0; t < h.tensors.size(); ++t) {
      h.tensors[t].group = static_cast<std::int32_t>(t % 3 == 0);
      fill_grads(rng, h.tensors[t], grad, scale);
    }
    GuardedModel dev(h, Misalign::none);
    FusedAdamW opt(dev.views(), c);
    REQUIRE(opt.chunk_count() == 1000);
    Digest digest;
    CAPTURE(dtype_name(grad));
    for (int step = 0; step < 3; ++step) {
      if (step > 0) {
        for (auto& t : h.tensors) fill_grads(rng, t, grad, opt.loss_scale());
        dev.upload_grads(h);
      }
      REQUIRE(matrix_step(opt, dev, h, c, digest).outcome == Outcome::applied);
    }
    // Bad values in tensors 5, 517 (finalize's thread 5 folds chunks 5 and 517) and 999: the
    // report names the first.
    const SpecialBits sp = special_bits(grad);
    h.tensors[5].set_grad_bits(0, sp.inf);
    h.tensors[517].set_grad_bits(h.tensors[517].size() - 1, sp.quiet_nan);
    h.tensors[999].set_grad_bits(0, sp.inf | (grad == DType::f32 ? 0x80000000u : 0x8000u));
    dev.upload_grads(h);
    const StepReport r = matrix_step(opt, dev, h, c, digest);
    REQUIRE(r.outcome == Outcome::skipped_overflow);
    REQUIRE(r.first_nonfinite_tensor == 5);
    REQUIRE(r.nonfinite_count == 3);
    digests.push_back(digest.h);
  }
  write_digest("tiny_tensors", digests);
}
