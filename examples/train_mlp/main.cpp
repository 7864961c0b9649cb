// halfstep-train: trains an MLP on a synthetic regression task in mixed precision and shows the
// loss-scale dynamics while it does. Runs on the GPU when one is present (cuBLAS + the fused CUDA
// step), otherwise on the CPU (OpenBLAS + the reference backend).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"

namespace {

using halfstep::Outcome;
using halfstep::StepReport;

const char* kUsage = R"(usage: halfstep-train [options]

Trains an MLP (fp16 weights and activations, fp32 masters) to fit a random teacher network,
with halfstep's dynamic loss scaler and fused AdamW step. Uses the GPU if one is present.

  --scenario NAME     default | overflow-storm | lr-decay | spike | fixed-scale
  --steps N           optimizer steps (default: 3000 on the CPU, 5000 on a GPU)
  --cpu               use the CPU engine even when a GPU is present
  --width N           hidden width (default 256 on the CPU, 1024 on a GPU)
  --layers N          hidden layers (default 3 on the CPU, 4 on a GPU)
  --batch N           samples per step (default 128 on the CPU, 1024 on a GPU)
  --lr X              base learning rate (default 1e-3)
  --seed N            seed of the task, the initial weights and the data (default 1)
  --print-every N     progress line every N steps (default: steps / 15)
  --trace FILE.csv    one row per step: the loss and every StepReport field
  --checkpoint FILE   save optimizer state and weights at the end
  --resume FILE       continue from a checkpoint (same shape and seed)
  --scale X           the constant loss scale of --scenario fixed-scale, a number or 2^k
                      (default 2^-16: most gradients underflow to zero)
  --spike-step N      the step whose gradient --scenario spike multiplies (default 3/4 in)
  --spike-factor X    how much it multiplies it by (default 100)
  --headroom-growth   let the scaler grow early when the measured headroom allows it
  --growth-interval N clean steps before the scale grows (default 100)
  --quiet             no progress lines, only the summary

Scenarios (see ../shared/reference/loss-scale-dynamics.txt for why each behaves as it does):
  default          the scale climbs, overflows, backs off and settles just below overflow
  overflow-storm   starts at 2^24: a burst of skipped steps and backoffs, then settling
  lr-decay         the learning rate decays by 10^3 and the gradients shrink with the error:
                   the subnormal share rises with no overflow; try --headroom-growth
  spike            a gradient spike at --spike-step is detected and the step skipped
  fixed-scale      a constant --scale: too small underflows (the loss stalls), too large
                   (try 2^24) overflows every step (nothing is applied)
)";

struct Options {
  std::string scenario = "default";
  std::int64_t steps = -1;
  bool cpu = false;
  int width = -1, layers = -1, batch = -1;
  float lr = 1e-3f;
  std::uint64_t seed = 1;
  std::int64_t print_every = -1;
  std::string trace, checkpoint, resume;
  float scale = std::exp2(-16.0f);
  std::int64_t spike_step = -1;
  float spike_factor = 100.0f;
  bool headroom_growth = false;
  int growth_interval = 100;
  bool quiet = false;
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fprintf(stderr, "halfstep-train: %s\n\n%s", what.c_str(), kUsage);
  std::exit(2);
}

// A number, or a power of two written 2^k.
double parse_number(const std::string& flag, const char* text) {
  char* end = nullptr;
  const bool power = std::strncmp(text, "2^", 2) == 0;
  double v = std::strtod(power ? text + 2 : text, &end);
  if (power) v = std::exp2(v);
  if (end == text || *end != '\0' || !std::isfinite(v)) usage_error(flag + " needs a number, got '" + text + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    auto integer = [&](long long lo) {
      const double v = parse_number(a, value());
      if (v != std::floor(v) || v < static_cast<double>(lo)) usage_error(a + " needs an integer >= " + std::to_string(lo));
      return static_cast<long long>(v);
    };
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    } else if (a == "--scenario") {
      o.scenario = value();
    } else if (a == "--steps") {
      o.steps = integer(1);
    } else if (a == "--cpu") {
      o.cpu = true;
    } else if (a == "--width") {
      o.width = static_cast<int>(integer(1));
    } else if (a == "--layers") {
      o.layers = static_cast<int>(integer(1));
    } else if (a == "--batch") {
      o.batch = static_cast<int>(integer(1));
    } else if (a == "--lr") {
      o.lr = static_cast<float>(parse_number(a, value()));
    } else if (a == "--seed") {
      o.seed = static_cast<std::uint64_t>(integer(0));
    } else if (a == "--print-every") {
      o.print_every = integer(1);
    } else if (a == "--trace") {
      o.trace = value();
    } else if (a == "--checkpoint") {
      o.checkpoint = value();
    } else if (a == "--resume") {
      o.resume = value();
    } else if (a == "--scale") {
      o.scale = static_cast<float>(parse_number(a, value()));
    } else if (a == "--spike-step") {
      o.spike_step = integer(0);
    } else if (a == "--spike-factor") {
      o.spike_factor = static_cast<float>(parse_number(a, value()));
    } else if (a == "--headroom-growth") {
      o.headroom_growth = true;
    } else if (a == "--growth-interval") {
      o.growth_interval = static_cast<int>(integer(1));
    } else if (a == "--quiet") {
      o.quiet = true;
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  const std::vector<std::string> known = {"default", "overflow-storm", "lr-decay", "spike", "fixed-scale"};
  if (std::find(known.begin(), known.end(), o.scenario) == known.end()) {
    usage_error("unknown scenario '" + o.scenario + "'");
  }
  if (!(o.lr > 0.0f)) usage_error("--lr must be > 0");
  if (!(o.scale > 0.0f)) usage_error("--scale must be > 0");
  if (!(o.spike_factor > 0.0f)) usage_error("--spike-factor must be > 0");
  return o;
}

// What a scenario changes: the step configuration, the learning-rate schedule, the spike.
struct Scenario {
  halfstep::StepConfig config;
  std::function<float(std::int64_t)> lr;
  std::int64_t spike_step = -1;
  float spike_factor = 1.0f;
};

Scenario make_scenario(const Options& o, std::int64_t steps) {
  Scenario s;
  halfstep::StepConfig& c = s.config;
  c.groups.resize(2);
  c.groups[0].lr = o.lr;            // weights, with decoupled weight decay
  c.groups[0].weight_decay = 0.01f;
  c.groups[1].lr = o.lr;            // biases, without
  c.max_grad_norm = 1.0f;
  c.scaler.growth_interval = o.growth_interval;
  c.scaler.headroom_growth = o.headroom_growth;
  const float base = o.lr;
  s.lr = [base](std::int64_t) { return base; };
  if (o.scenario == "overflow-storm") {
    c.scaler.init_scale = c.scaler.max_scale;  // 2^24: far above what the gradients allow
  } else if (o.scenario == "lr-decay") {
    // The rate falls by 10^3 over the run while the scaler keeps its classic 2000-step window
    // (longer than the run), so the scale cannot follow the shrinking gradients.
    c.scaler.init_scale = 256.0f;
    if (o.growth_interval == 100) c.scaler.growth_interval = 2000;
    const double n = static_cast<double>(steps);
    s.lr = [base, n](std::int64_t t) { return static_cast<float>(base * std::pow(1e-3, static_cast<double>(t) / n)); };
  } else if (o.scenario == "spike") {
    // A constant scale with room for the spike: at a scale that sits just below overflow, a 100x
    // gradient overflows and is handled as an overflow, not as a spike.
    c.scaler = halfstep::ScalerConfig::constant(1024.0f);
    c.spike.enabled = true;
    c.spike.action = halfstep::SpikeConfig::Action::skip;
    c.spike.warmup_steps = 100;
    // Three quarters in: while the norm is still falling fast its variance stays inflated and
    // the detector is insensitive (an EMA variance remembers the early descent).
    s.spike_step = o.spike_step >= 0 ? o.spike_step : steps * 3 / 4;
    s.spike_factor = o.spike_factor;
  } else if (o.scenario == "fixed-scale") {
    c.scaler = halfstep::ScalerConfig::constant(o.scale);
  }
  return s;
}

std::string log2_text(float x) {
  const double l = std::log2(static_cast<double>(x));
  char buf[32];
  if (l == std::floor(l)) {
    std::snprintf(buf, sizeof buf, "2^%d", static_cast<int>(l));
  } else {
    std::snprintf(buf, sizeof buf, "2^%.2f", l);
  }
  return buf;
}

// --- checkpoints: optimizer state (halfstep's format) plus the weights and moments ---------
constexpr char kMagic[8] = {'H', 'S', 'T', 'R', 'A', 'I', 'N', '1'};

template <class T>
void put(std::ofstream& f, const T& v) { f.write(reinterpret_cast<const char*>(&v), sizeof v); }
template <class T>
T get(std::ifstream& f) {
  T v{};
  f.read(reinterpret_cast<char*>(&v), sizeof v);
  if (!f) throw std::runtime_error("checkpoint is truncated");
  return v;
}

std::vector<std::int32_t> shape_key(const train::Dims& d, std::uint64_t seed) {
  return {d.d_in, d.width, d.hidden_layers, d.d_out, d.batch, d.samples, static_cast<std::int32_t>(seed)};
}

void save_checkpoint(const std::string& path, std::int64_t next_step, const train::Dims& dims,
                     std::uint64_t seed, halfstep::FusedAdamW& opt, train::Engine& engine) {
  std::vector<std::vector<float>> master, m, v;
  engine.read_state(master, m, v);
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot write " + path);
  f.write(kMagic, 8);
  for (std::int32_t k : shape_key(dims, seed)) put(f, k);
  put(f, next_step);
  const std::string state = opt.save_state();
  put(f, static_cast<std::uint32_t>(state.size()));
  f.write(state.data(), static_cast<std::streamsize>(state.size()));
  put(f, static_cast<std::uint32_t>(master.size()));
  for (std::size_t t = 0; t < master.size(); ++t) {
    put(f, static_cast<std::int64_t>(master[t].size()));
    for (const auto* buf : {&master[t], &m[t], &v[t]}) {
      f.write(reinterpret_cast<const char*>(buf->data()), static_cast<std::streamsize>(buf->size() * 4));
    }
  }
  if (!f) throw std::runtime_error("writing " + path + " failed");
}

std::int64_t load_checkpoint(const std::string& path, const train::Dims& dims, std::uint64_t seed,
                             halfstep::FusedAdamW& opt, train::Engine& engine) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + path);
  char magic[8];
  f.read(magic, 8);
  if (!f || std::memcmp(magic, kMagic, 8) != 0) throw std::runtime_error(path + " is not a halfstep-train checkpoint");
  for (std::int32_t k : shape_key(dims, seed)) {
    if (get<std::int32_t>(f) != k) throw std::runtime_error(path + " was written for another shape or seed");
  }
  const auto next_step = get<std::int64_t>(f);
  std::string state(get<std::uint32_t>(f), '\0');
  f.read(state.data(), static_cast<std::streamsize>(state.size()));
  const auto shapes = train::tensor_shapes(dims);
  if (get<std::uint32_t>(f) != shapes.size()) throw std::runtime_error(path + ": wrong tensor count");
  std::vector<std::vector<float>> master(shapes.size()), m(shapes.size()), v(shapes.size());
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    if (get<std::int64_t>(f) != shapes[t].numel) throw std::runtime_error(path + ": wrong tensor size");
    for (auto* buf : {&master[t], &m[t], &v[t]}) {
      buf->resize(static_cast<std::size_t>(shapes[t].numel));
      f.read(reinterpret_cast<char*>(buf->data()), static_cast<std::streamsize>(buf->size() * 4));
    }
  }
  if (!f) throw std::runtime_error(path + " is truncated");
  opt.load_state(state);  // halfstep checks the state itself
  engine.write_state(master, m, v);
  return next_step;
}

// --- the trace ------------------------------------------------------------------------------
void trace_header(std::FILE* f) {
  std::fprintf(f, "attempt,step,outcome,reason,spike,loss,lr,scale_used,scale_next,grad_norm,clip_coef,"
                  "nonfinite_count,first_nonfinite_tensor,max_abs_scaled,headroom_log2,"
                  "subnormal_count,zero_count,numel,held_elements\n");
}

void trace_row(std::FILE* f, const StepReport& r, float loss, float lr) {
  std::fprintf(f, "%lld,%lld,%s,%s,%d,%.9g,%.9g,%.9g,%.9g,%.17g,%.9g,%lld,%d,%.9g,%.9g,%lld,%lld,%lld,%lld\n",
               static_cast<long long>(r.attempt), static_cast<long long>(r.step),
               halfstep::outcome_name(r.outcome), halfstep::skip_reason_name(r.reason),
               r.spike ? 1 : 0, static_cast<double>(loss),
               static_cast<double>(lr), static_cast<double>(r.scale_used),
               static_cast<double>(r.scale_next), r.grad_norm, static_cast<double>(r.clip_coef),
               static_cast<long long>(r.nonfinite_count), r.first_nonfinite_tensor,
               static_cast<double>(r.max_abs_scaled), static_cast<double>(r.headroom_log2),
               static_cast<long long>(r.subnormal_count), static_cast<long long>(r.zero_count),
               static_cast<long long>(r.numel), static_cast<long long>(r.held_elements));
}

// How far from the teacher the lr-decay scenario starts: this fraction of a fresh initialisation.
constexpr float kFineTune = 0.05f;

int run(const Options& o) {
  const bool gpu = !o.cpu && train::cuda_available();
#if !HALFSTEP_TRAIN_CPU
  if (!gpu) {
    throw std::runtime_error(std::string(o.cpu ? "--cpu was given" : "no CUDA device found") +
                             ", and this build has no CPU engine (OpenBLAS was not found)");
  }
#endif
  train::Dims dims;
  if (gpu) {
    dims.d_in = 256;
    dims.width = 1024;
    dims.hidden_layers = 4;
    dims.d_out = 64;
    dims.batch = 1024;
    dims.samples = 65536;
  }
  if (o.width > 0) dims.width = o.width;
  if (o.layers > 0) dims.hidden_layers = o.layers;
  if (o.batch > 0) dims.batch = o.batch;
  dims.samples = std::max(dims.samples / dims.batch, 1) * dims.batch;
  const std::int64_t steps = o.steps > 0 ? o.steps : (gpu ? 5000 : 3000);
  const std::int64_t print_every = o.print_every > 0 ? o.print_every : std::max<std::int64_t>(steps / 15, 1);
  Scenario scenario = make_scenario(o, steps);

  if (!gpu) {
    std::printf("%s: running on the CPU (OpenBLAS products, halfstep reference backend)\n",
                o.cpu ? "--cpu" : "no CUDA device found");
  }
  const auto teacher = train::teacher_masters(dims, o.seed);
  const train::Dataset data = train::make_dataset(dims, teacher, o.seed);
  auto masters = train::initial_masters(dims, o.seed);
  if (o.scenario == "lr-decay") {  // fine-tuning: start near the teacher, every unit alive
    for (std::size_t t = 0; t < masters.size(); ++t) {
      for (std::size_t i = 0; i < masters[t].size(); ++i) masters[t][i] = teacher[t][i] + kFineTune * masters[t][i];
    }
  }
#if HALFSTEP_TRAIN_CPU
  std::unique_ptr<train::Engine> engine =
      gpu ? train::make_cuda_engine(dims, data, masters, steps) : train::make_cpu_engine(dims, data, masters, steps);
#else
  std::unique_ptr<train::Engine> engine = train::make_cuda_engine(dims, data, masters, steps);
#endif
  halfstep::FusedAdamW opt(engine->tensors(), scenario.config, engine->backend());
  std::printf("halfstep-train: scenario %s on %s\n", o.scenario.c_str(), engine->name().c_str());
  std::printf("  MLP %d -> %d x %d (ReLU) -> %d, %lld parameters in %zu tensors, batch %d, %lld steps\n",
              dims.d_in, dims.hidden_layers, dims.width, dims.d_out,
              static_cast<long long>(dims.parameters()), train::tensor_shapes(dims).size(), dims.batch,
              static_cast<long long>(steps));

  std::int64_t start = 0;
  if (!o.resume.empty()) {
    start = load_checkpoint(o.resume, dims, o.seed, opt, *engine);
    std::printf("  resumed from %s at step %lld (loss scale %s)\n", o.resume.c_str(),
                static_cast<long long>(start), log2_text(opt.loss_scale()).c_str());
  }
  std::FILE* trace = nullptr;
  if (!o.trace.empty()) {
    trace = std::fopen(o.trace.c_str(), start > 0 ? "a" : "w");
    if (!trace) throw std::runtime_error("cannot write " + o.trace);
    if (start == 0) trace_header(trace);
  }

  const auto t0 = std::chrono::steady_clock::now();
  auto t_last = t0;
  std::int64_t last_print = start;
  float last_lr = NAN;
  for (std::int64_t step = start; step < steps; ++step) {
    const float lr = scenario.lr(step);
    if (lr != last_lr) {  // ordered before this step's update, on the engine's stream
      opt.set_lr(0, lr, engine->stream());
      opt.set_lr(1, lr, engine->stream());
      last_lr = lr;
    }
    const float factor = step == scenario.spike_step ? scenario.spike_factor : 1.0f;
    engine->forward_backward(step, opt, factor);
    engine->step(opt);
    const bool print = !o.quiet && ((step + 1) % print_every == 0 || step + 1 == steps);
    if (trace || print) {
      const StepReport r = opt.last_report();
      const float loss = engine->loss(step);
      if (trace) trace_row(trace, r, loss, lr);
      if (print) {
        const auto now = std::chrono::steady_clock::now();
        const double rate = static_cast<double>(step + 1 - last_print) /
                            std::chrono::duration<double>(now - t_last).count();
        t_last = now;
        last_print = step + 1;
        const halfstep::OptimizerState s = opt.state();
        const double numel = static_cast<double>(std::max<std::int64_t>(r.numel, 1));
        std::printf("step %6lld  loss %.5f  scale %-7s skipped %4lld  |g| %.2e  headroom %5.1f  "
                    "subnormal %6.3f%%  zero %5.1f%%  %6.1f steps/s\n",
                    static_cast<long long>(step + 1), static_cast<double>(loss),
                    log2_text(r.scale_next).c_str(), static_cast<long long>(s.attempts - s.step),
                    r.grad_norm, static_cast<double>(r.headroom_log2),
                    100.0 * static_cast<double>(r.subnormal_count) / numel,
                    100.0 * static_cast<double>(r.zero_count) / numel, rate);
        std::fflush(stdout);
      }
    }
  }
  engine->sync();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (trace) std::fclose(trace);

  // Summary: the loss at the start and the end of this run, and what the scaler did.
  const std::int64_t window = std::max<std::int64_t>(std::min<std::int64_t>(100, (steps - start) / 5), 1);
  auto mean_loss = [&](std::int64_t from) {
    double sum = 0.0;
    for (std::int64_t s = from; s < from + window; ++s) sum += engine->loss(s);
    return sum / static_cast<double>(window);
  };
  const halfstep::OptimizerState s = opt.state();
  std::printf("done: %lld steps in %.1f s (%.1f steps/s)\n", static_cast<long long>(steps - start),
              seconds, static_cast<double>(steps - start) / seconds);
  std::printf("  loss %.5f over the first %lld steps, %.5f over the last %lld\n", mean_loss(start),
              static_cast<long long>(window), mean_loss(steps - window), static_cast<long long>(window));
  std::printf("  applied %lld, skipped %lld (overflow %lld, spike or non-finite update %lld); spikes flagged %lld\n",
              static_cast<long long>(s.step), static_cast<long long>(s.attempts - s.step),
              static_cast<long long>(s.scaler.overflows),
              static_cast<long long>(s.attempts - s.step - s.scaler.overflows),
              static_cast<long long>(s.spike.spikes));
  std::printf("  loss scale %s: %lld growths, %lld backoffs\n", log2_text(s.scaler.scale).c_str(),
              static_cast<long long>(s.scaler.growths), static_cast<long long>(s.scaler.backoffs));
  if (!o.checkpoint.empty()) {
    save_checkpoint(o.checkpoint, steps, dims, o.seed, opt, *engine);
    std::printf("  checkpoint written to %s\n", o.checkpoint.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "halfstep-train: %s\n", e.what());
    return 1;
  }
}
