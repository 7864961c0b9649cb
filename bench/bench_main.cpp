// halfstep-bench: the fused step against the hardware (a device-to-device copy measured in the
// same run) and against an unfused pipeline of separate kernels doing the same work.
//
// Timing: CUDA events around each step, after a warm-up, with L2 flushed before every timed
// step (a 256 MiB memset outside the events, so the 60 MB L2 of an H200 is not what is timed);
// the row reports the median. Gradients are random, finite and never zero.
//
// Bytes a step must move (docs/design.md): 30 per parameter with clipping (pass 1 reads the 2-byte
// gradient; pass 2 reads gradient, master, m, v and writes master, m, v and the 2-byte model
// copy), 28 without clipping. GB/s = those bytes / median time, for both implementations.
#include <CLI/CLI.hpp>
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <array>
#include <map>
#include <memory>
#include <tuple>
#include <string>
#include <vector>

#include "fused_impl.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/version.hpp"
#include "unfused.hpp"

namespace {

using halfstep::DType;

constexpr int kSkipReturnCode = 77;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "halfstep-bench: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}
#define CHECK_CUDA(expr) check((expr), #expr)

struct Options {
  bool quick = false;  // a short configuration (bench/gpu_check.sh)
  bool smoke = false;  // tiny sizes, a few iterations (the CTest smoke test)
};
Options g_options;
cudaStream_t g_stream = nullptr;
void* g_flush = nullptr;
constexpr std::size_t kFlushBytes = std::size_t{256} << 20;
double g_copy_gbps = 0.0;

struct Row {
  std::string name;
  double params, bytes_per_param, median_us, gbps, pct_copy, speedup;
  int launches;
};
std::vector<Row> g_rows;
std::map<std::string, double> g_unfused_median;  // by workload key

// A named list of tensor sizes with a gradient format, clipping on or off, and the state's formats.
struct Workload {
  std::string name;
  std::vector<std::int64_t> sizes;
  DType grad;
  bool clip;
  halfstep::StateFormat state{};
  std::int64_t row = 0;  // elements per row of every tensor (ParamTensor::row); 0: one row
  std::string key() const {
    std::string k = name + "/" + halfstep::dtype_name(grad) + (clip ? "/clip" : "/noclip");
    if (state.master != halfstep::MasterFormat::f32 || state.exp_avg != halfstep::MomentFormat::f32 ||
        state.exp_avg_sq != halfstep::MomentFormat::f32) {
      k += std::string("/") + halfstep::master_format_name(state.master) + "+" +
           halfstep::moment_format_name(state.exp_avg) + "/" + halfstep::moment_format_name(state.exp_avg_sq);
      if (state.exp_avg != halfstep::MomentFormat::f32 || state.exp_avg_sq != halfstep::MomentFormat::f32 ||
          state.master == halfstep::MasterFormat::none) {
        k += std::string("/") + halfstep::rounding_name(state.rounding);
      }
    }
    return k;
  }
  double params() const {
    double n = 0;
    for (auto s : sizes) n += static_cast<double>(s);
    return n;
  }
  halfstep::StepConfig config() const;
  // The bytes one applied step moves per parameter (halfstep::state_bytes; without clipping, the
  // norm is not needed but pass 1 still reads the gradients for the inf/NaN check: the same).
  double bytes_per_param() const { return static_cast<double>(halfstep::state_bytes(config()).moved); }
  // The bytes the buffers hold per parameter.
  double held_per_param() const {
    const halfstep::StateBytes b = halfstep::state_bytes(config());
    return static_cast<double>(b.state + b.gradient + b.model);
  }
};

// GPT-2 1.5B-like: token and position embeddings, 48 blocks of (ln_1, qkv, proj, ln_2, fc,
// fc_proj) weights and biases, a final layer norm: 580 tensors, about 1.56e9 parameters.
std::vector<std::int64_t> gpt2_xl() {
  const std::int64_t d = 1600, vocab = 50257, ctx = 1024;
  std::vector<std::int64_t> s = {vocab * d, ctx * d};
  for (int layer = 0; layer < 48; ++layer) {
    for (std::int64_t n : {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d}) s.push_back(n);
  }
  s.push_back(d);
  s.push_back(d);
  return s;
}

// Every buffer of a workload in one allocation per slot, each in its format (halfstep::slot_layouts),
// each tensor 16-byte aligned.
struct Buffers {
  std::vector<std::int64_t> offset;
  std::int64_t total = 0;
  void *master = nullptr, *m = nullptr, *v = nullptr;
  void *grad = nullptr, *model = nullptr;
  // block8 moments: each tensor's block scales, one after another (moment_blocks), for each moment.
  std::vector<std::int64_t> scale_offset;
  float *m_scale = nullptr, *v_scale = nullptr;
  std::array<halfstep::SlotLayout, halfstep::kSlotCount> slots;

  static std::int64_t padded_total(const std::vector<std::int64_t>& sizes) {
    std::int64_t t = 0;
    for (auto n : sizes) t += (n + 7) / 8 * 8;
    return t;
  }
  explicit Buffers(const Workload& w) : slots(halfstep::slot_layouts(w.config())) {
    for (auto n : w.sizes) {
      offset.push_back(total);
      total += (n + 7) / 8 * 8;
    }
    const auto n = static_cast<std::size_t>(total);
    auto bytes = [&](halfstep::Slot s) { return n * slots[static_cast<std::size_t>(s)].element_bytes; };
    if (slots[0].present) CHECK_CUDA(cudaMalloc(&master, bytes(halfstep::Slot::master)));  // none: no master
    CHECK_CUDA(cudaMalloc(&m, bytes(halfstep::Slot::exp_avg)));
    CHECK_CUDA(cudaMalloc(&v, bytes(halfstep::Slot::exp_avg_sq)));
    CHECK_CUDA(cudaMalloc(&grad, bytes(halfstep::Slot::grad)));
    CHECK_CUDA(cudaMalloc(&model, n * 2));
    // fp32 state: masters in [-1, 1], moments of a few earlier steps. Narrow formats: the model
    // copy is the master (bf16 values), the remainders and bf16 moments start at zero.
    if (w.state.master == halfstep::MasterFormat::f32) {
      bench::fill_uniform(static_cast<float*>(master), total, -1.0f, 1.0f, 1, g_stream);
    } else {
      if (master != nullptr) CHECK_CUDA(cudaMemsetAsync(master, 0, bytes(halfstep::Slot::master), g_stream));
      bench::fill_grads(model, DType::bf16, total, 0.5f, 1, g_stream);
    }
    if (w.state.exp_avg == halfstep::MomentFormat::f32) {
      bench::fill_uniform(static_cast<float*>(m), total, -1e-3f, 1e-3f, 2, g_stream);
    } else {
      CHECK_CUDA(cudaMemsetAsync(m, 0, bytes(halfstep::Slot::exp_avg), g_stream));
    }
    if (w.state.exp_avg_sq == halfstep::MomentFormat::f32) {
      bench::fill_uniform(static_cast<float*>(v), total, 1e-8f, 1e-6f, 3, g_stream);
    } else {
      CHECK_CUDA(cudaMemsetAsync(v, 0, bytes(halfstep::Slot::exp_avg_sq), g_stream));
    }
    bench::fill_grads(grad, w.grad, total, w.grad == DType::f16 ? 1024.0f : 1.0f, 4, g_stream);
    if (w.state.exp_avg == halfstep::MomentFormat::block8) {
      // Codes of 0 with scales of 0 are moments of 0, as a fresh optimizer holds them. Every
      // tensor of a block8 workload must hold codes: the buffers above hold one byte a moment.
      const halfstep::StepConfig config = w.config();
      std::int64_t blocks = 0;
      for (std::size_t t = 0; t < w.sizes.size(); ++t) {
        halfstep::ParamTensor p;
        p.numel = w.sizes[t];
        p.row = w.row;
        const halfstep::MomentBlocks b = halfstep::moment_blocks(config, p);
        if (!b.quantized) {
          std::fprintf(stderr, "halfstep-bench: workload %s has a tensor of %lld elements without blocks\n",
                       w.key().c_str(), static_cast<long long>(p.numel));
          std::exit(1);
        }
        scale_offset.push_back(blocks);
        blocks += b.blocks;
      }
      const auto scale_bytes = static_cast<std::size_t>(blocks) * sizeof(float);
      CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&m_scale), scale_bytes));
      CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&v_scale), scale_bytes));
      CHECK_CUDA(cudaMemsetAsync(m_scale, 0, scale_bytes, g_stream));
      CHECK_CUDA(cudaMemsetAsync(v_scale, 0, scale_bytes, g_stream));
    }
    CHECK_CUDA(cudaStreamSynchronize(g_stream));
  }
  ~Buffers() {
    cudaFree(m_scale);
    cudaFree(v_scale);
    cudaFree(master);
    cudaFree(m);
    cudaFree(v);
    cudaFree(grad);
    cudaFree(model);
  }
  std::vector<halfstep::ParamTensor> tensors(const Workload& w) const {
    std::vector<halfstep::ParamTensor> out;
    for (std::size_t t = 0; t < w.sizes.size(); ++t) {
      halfstep::ParamTensor p;
      for (const halfstep::SlotLayout& s : slots) {
        auto* base = static_cast<unsigned char*>(s.slot == halfstep::Slot::master       ? master
                                                 : s.slot == halfstep::Slot::exp_avg    ? m
                                                 : s.slot == halfstep::Slot::exp_avg_sq ? v
                                                 : s.slot == halfstep::Slot::grad       ? grad
                                                                                        : model);
        halfstep::set_slot_pointer(p, s.slot, s.present ? base + static_cast<std::size_t>(offset[t]) * s.element_bytes : nullptr);
      }
      p.numel = w.sizes[t];
      p.row = w.row;
      if (m_scale != nullptr) {
        p.exp_avg_scale = m_scale + scale_offset[t];
        p.exp_avg_sq_scale = v_scale + scale_offset[t];
      }
      out.push_back(p);
    }
    return out;
  }
};

halfstep::StepConfig Workload::config() const {
  halfstep::StepConfig c;
  c.grad_dtype = grad;
  c.model_dtype = grad;
  c.max_grad_norm = clip ? 1.0f : 0.0f;
  c.scaler = halfstep::ScalerConfig::constant(grad == DType::f16 ? 1024.0f : 1.0f);
  c.groups[0].weight_decay = 0.01f;
  c.state = state;
  return c;
}

bool fits(const Workload& w, double extra_bytes_per_param, benchmark::State& state) {
  std::size_t free_bytes = 0, total = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total));
  const double need =
      static_cast<double>(Buffers::padded_total(w.sizes)) * (w.held_per_param() + extra_bytes_per_param) + (64 << 20);
  if (need > static_cast<double>(free_bytes)) {
    state.SkipWithError(("needs " + std::to_string(static_cast<long long>(need / (1 << 30))) +
                         " GiB of device memory").c_str());
    return false;
  }
  return true;
}

// Times `enqueue` once per benchmark iteration (L2 flushed first) and returns the median.
double time_median(benchmark::State& state, const std::function<void()>& enqueue) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) enqueue();  // warm-up
  CHECK_CUDA(cudaStreamSynchronize(g_stream));
  std::vector<double> samples;
  int flip = 0;
  for (auto _ : state) {
    CHECK_CUDA(cudaMemsetAsync(g_flush, ++flip & 0xFF, kFlushBytes, g_stream));
    CHECK_CUDA(cudaEventRecord(start, g_stream));
    enqueue();
    CHECK_CUDA(cudaEventRecord(stop, g_stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
    samples.push_back(static_cast<double>(ms) * 1e-3);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(samples.begin(), samples.end());
  const std::size_t k = samples.size();
  return k % 2 ? samples[k / 2] : 0.5 * (samples[k / 2 - 1] + samples[k / 2]);
}

void record(benchmark::State& state, const std::string& name, double params, double bytes_per_param,
            double median_s, int launches, double speedup) {
  const double gbps = params * bytes_per_param / median_s / 1e9;
  const double pct = g_copy_gbps > 0 ? 100.0 * gbps / g_copy_gbps : 0.0;
  state.counters["params"] = params;
  state.counters["B_per_param"] = bytes_per_param;
  state.counters["median_us"] = median_s * 1e6;
  state.counters["GB_per_s"] = gbps;
  state.counters["pct_of_copy"] = pct;
  state.counters["launches"] = launches;
  if (speedup > 0) state.counters["speedup_vs_unfused"] = speedup;
  g_rows.push_back({name, params, bytes_per_param, median_s * 1e6, gbps, pct, speedup, launches});
}

void bench_copy(benchmark::State& state) {
  const std::size_t bytes = g_options.smoke ? (std::size_t{64} << 20) : (std::size_t{1} << 31);
  void *a = nullptr, *b = nullptr;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  const double median = time_median(state, [&] {
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, g_stream));
  });
  g_copy_gbps = 2.0 * static_cast<double>(bytes) / median / 1e9;  // bytes read + written
  state.counters["GB_per_s"] = g_copy_gbps;
  state.counters["median_us"] = median * 1e6;
  g_rows.push_back({"device-to-device copy (ceiling)", static_cast<double>(bytes), 2.0, median * 1e6,
                    g_copy_gbps, 100.0, 0.0, 1});
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
}

void bench_unfused(benchmark::State& state, const Workload& w) {
  if (!fits(w, 4.0, state)) return;
  Buffers buf(w);
  bench::UnfusedPipeline pipe(buf.total, w.grad, w.grad, w.clip ? 1.0f : 0.0f,
                              w.grad == DType::f16 ? 1024.0f : 1.0f, buf.grad, static_cast<float*>(buf.master),
                              static_cast<float*>(buf.m), static_cast<float*>(buf.v), buf.model);
  const double median = time_median(state, [&] { pipe.step(g_stream); });
  g_unfused_median[w.key()] = median;
  record(state, "unfused " + w.key(), w.params(), w.bytes_per_param(), median, pipe.launches(), 0.0);
}

void bench_fused(benchmark::State& state, const Workload& w) {
  if (!fits(w, 0.0, state)) return;
  Buffers buf(w);
  halfstep::FusedAdamW opt(buf.tensors(w), w.config());
  const double median = time_median(state, [&] { opt.step(g_stream); });
  if (opt.last_report().outcome != halfstep::Outcome::applied) {
    state.SkipWithError("the fused step did not apply (overflow in the benchmark data?)");
  }
  const auto it = g_unfused_median.find(w.key());
  record(state, "fused " + w.key(), w.params(), w.bytes_per_param(), median, opt.launches_per_step(),
         it == g_unfused_median.end() ? 0.0 : it->second / median);
}

// One pass of the fused step alone; bytes are that pass's own.
void bench_pass(benchmark::State& state, const Workload& w, int pass) {
  if (!fits(w, 0.0, state)) return;
  Buffers buf(w);
  halfstep::FusedAdamW opt(buf.tensors(w), w.config());
  opt.step(g_stream);  // a decision to apply, for pass 2 alone
  CHECK_CUDA(cudaStreamSynchronize(g_stream));
  auto& impl = halfstep::detail::FusedAccess::impl(opt);
  const double median = time_median(state, [&] { impl.enqueue_pass(pass, g_stream); });
  const char* names[] = {"pass 1 check_and_norm", "finalize", "pass 2 apply"};
  const double grad_bytes = static_cast<double>(halfstep::state_bytes(w.config()).gradient);
  const double bytes[] = {grad_bytes, 0.0, w.bytes_per_param() - grad_bytes};
  record(state, std::string(names[pass]) + " " + w.key(), w.params(), bytes[pass], median, 1, 0.0);
}

void register_all() {
  std::vector<Workload> steps;
  std::vector<Workload> passes;
  auto single = [](std::int64_t n, const std::string& label, DType g, bool clip) {
    return Workload{"1 tensor " + label, {n}, g, clip};
  };
  if (g_options.smoke) {
    steps.push_back(single(1 << 12, "2^12", DType::f16, true));
    std::vector<std::int64_t> tiny(100, 7);
    steps.push_back({"100 tiny tensors", tiny, DType::f16, true});
    passes.push_back(single(1 << 12, "2^12", DType::bf16, true));
    Workload lean = single(1 << 12, "2^12", DType::bf16, true);  // remainders and bf16 moments
    lean.state.master = halfstep::MasterFormat::bf16_remainder;
    lean.state.exp_avg = lean.state.exp_avg_sq = halfstep::MomentFormat::bf16;
    steps.push_back(lean);
    passes.push_back(lean);
    Workload block8 = single(1 << 12, "2^12", DType::bf16, true);  // no master, 8-bit moments
    block8.state.master = halfstep::MasterFormat::none;
    block8.state.exp_avg = block8.state.exp_avg_sq = halfstep::MomentFormat::block8;
    steps.push_back(block8);
    passes.push_back(block8);
  } else {
    std::vector<std::pair<std::int64_t, std::string>> sizes;
    if (g_options.quick) {
      sizes = {{1 << 24, "2^24"}, {1 << 26, "2^26"}, {(1 << 26) + 1, "2^26+1"}};
    } else {
      sizes = {{1 << 20, "2^20"}, {(1 << 20) + 1, "2^20+1"}, {1 << 22, "2^22"}, {1 << 24, "2^24"},
               {1 << 26, "2^26"}, {(1 << 26) + 1, "2^26+1"}, {1 << 28, "2^28"}, {std::int64_t{1} << 30, "2^30"}};
    }
    for (DType g : {DType::f16, DType::bf16}) {
      for (bool clip : {true, false}) {
        if (g_options.quick && (g == DType::bf16) && !clip) continue;
        for (const auto& [n, label] : sizes) {
          if (g_options.quick && g == DType::bf16 && n != (1 << 26)) continue;
          steps.push_back(single(n, label, g, clip));
        }
        if (!(g_options.quick && g == DType::bf16)) {
          steps.push_back({"GPT-2 1.5B (580 tensors)", gpt2_xl(), g, clip});
          steps.push_back({"10000 tiny tensors", std::vector<std::int64_t>(10000, 100), g, clip});
        }
      }
    }
    passes.push_back(single(1 << 26, "2^26", DType::f16, true));
    passes.push_back({"GPT-2 1.5B (580 tensors)", gpt2_xl(), DType::f16, true});
    passes.push_back({"10000 tiny tensors", std::vector<std::int64_t>(10000, 100), DType::f16, true});
    // The state formats (bf16 gradients and model copy): the step and pass 2 alone, per format.
    for (const auto& [master, moments, rounding] :
         std::vector<std::tuple<halfstep::MasterFormat, halfstep::MomentFormat, halfstep::Rounding>>{
             {halfstep::MasterFormat::f32, halfstep::MomentFormat::bf16, halfstep::Rounding::stochastic},
             {halfstep::MasterFormat::f32, halfstep::MomentFormat::bf16, halfstep::Rounding::nearest},
             {halfstep::MasterFormat::bf16_remainder, halfstep::MomentFormat::f32, halfstep::Rounding::stochastic},
             {halfstep::MasterFormat::bf16_remainder, halfstep::MomentFormat::bf16, halfstep::Rounding::stochastic},
             {halfstep::MasterFormat::none, halfstep::MomentFormat::bf16, halfstep::Rounding::stochastic},
             {halfstep::MasterFormat::f32, halfstep::MomentFormat::block8, halfstep::Rounding::stochastic},
             {halfstep::MasterFormat::bf16_remainder, halfstep::MomentFormat::block8, halfstep::Rounding::stochastic},
             {halfstep::MasterFormat::none, halfstep::MomentFormat::block8, halfstep::Rounding::stochastic},
             {halfstep::MasterFormat::none, halfstep::MomentFormat::block8, halfstep::Rounding::nearest}}) {
      Workload w = single(1 << 26, "2^26", DType::bf16, true);
      w.state.master = master;
      w.state.exp_avg = w.state.exp_avg_sq = moments;
      w.state.rounding = rounding;
      // block8: a 16384 x 4096 matrix, 16 blocks of 256 a row (every other format ignores rows).
      if (moments == halfstep::MomentFormat::block8) w.row = 4096;
      steps.push_back(w);
      passes.push_back(w);
      if (!g_options.quick && moments != halfstep::MomentFormat::block8) {
        w.name = "GPT-2 1.5B (580 tensors)";
        w.sizes = gpt2_xl();
        steps.push_back(w);
      }
    }
  }
  const int iterations = g_options.smoke ? 3 : 20;
  benchmark::RegisterBenchmark("copy", bench_copy)->UseManualTime()->Iterations(iterations)->Unit(benchmark::kMicrosecond);
  for (const Workload& w : steps) {
    if (w.key().find('+') == std::string::npos) {  // the unfused pipeline holds fp32 state only
      benchmark::RegisterBenchmark(("step/unfused/" + w.key()).c_str(), [w](benchmark::State& s) { bench_unfused(s, w); })
          ->UseManualTime()->Iterations(iterations)->Unit(benchmark::kMicrosecond);
    }
    benchmark::RegisterBenchmark(("step/fused/" + w.key()).c_str(), [w](benchmark::State& s) { bench_fused(s, w); })
        ->UseManualTime()->Iterations(iterations)->Unit(benchmark::kMicrosecond);
  }
  for (const Workload& w : passes) {
    for (int p = 0; p < 3; ++p) {
      benchmark::RegisterBenchmark(("pass" + std::to_string(p) + "/" + w.key()).c_str(),
                                   [w, p](benchmark::State& s) { bench_pass(s, w, p); })
          ->UseManualTime()->Iterations(iterations)->Unit(benchmark::kMicrosecond);
    }
  }
}

void print_table() {
  cudaDeviceProp prop{};
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf("\n## halfstep-bench on %s (copy ceiling %.0f GB/s)\n\n", prop.name, g_copy_gbps);
  std::printf("| row | params | B/param | median µs | GB/s | %% of copy | × unfused | launches |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : g_rows) {
    char speed[32] = "";
    if (r.speedup > 0) std::snprintf(speed, sizeof speed, "%.2f", r.speedup);
    std::printf("| %s | %.4g | %.0f | %.1f | %.0f | %.1f | %s | %d |\n", r.name.c_str(), r.params,
                r.bytes_per_param, r.median_us, r.gbps, r.pct_copy, speed, r.launches);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // halfstep's own options; everything else goes to Google Benchmark (--benchmark_filter, ...),
  // which refuses what it does not know.
  CLI::App app("halfstep-bench: the fused step against a device-to-device copy and an unfused pipeline, "
               "timed with CUDA events (Google Benchmark options such as --benchmark_filter pass through)",
               "halfstep-bench");
  app.set_version_flag("--version", std::string("halfstep-bench ") + halfstep::version());
  app.add_flag("--halfstep_quick", g_options.quick, "fewer sizes and iterations (bench/gpu_check.sh)");
  app.add_flag("--halfstep_smoke", g_options.smoke, "tiny sizes, a few iterations: checks that it runs");
  app.allow_extras();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  std::vector<std::string> extras = app.remaining();
  std::vector<char*> args = {argv[0]};
  for (std::string& a : extras) args.push_back(a.data());
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return kSkipReturnCode;
  }
  CHECK_CUDA(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaMalloc(&g_flush, kFlushBytes));
  register_all();
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  print_table();
  CHECK_CUDA(cudaFree(g_flush));
  CHECK_CUDA(cudaStreamDestroy(g_stream));
  return 0;
}
