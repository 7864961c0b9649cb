// halfstep-train: trains an MLP on a synthetic regression task in mixed precision and shows the
// loss-scale dynamics while it does. Runs on the GPU when one is present (cuBLAS + the fused CUDA
// step), otherwise on the CPU (its own fixed-order products + the host backend).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>
#include <halfstep/safetensors.hpp>
#include <nlohmann/json.hpp>

#include "model.hpp"
#include "trainer.hpp"

namespace {

using halfstep::Outcome;
using halfstep::StepReport;

const char* kDescription = R"(halfstep-train: trains an MLP (fp16 weights and activations, fp32 masters; or bf16, with
or without masters) to fit a random teacher network, with halfstep's dynamic loss scaler and fused
AdamW step, and prints what the scaler does. Uses the GPU if one is present (cuBLAS + the fused CUDA step), otherwise the CPU
(products of its own, summed in the same order on any CPU, + halfstep's host backend).)";

const char* kScenarios = R"(
Scenarios (docs/loss-scaling.md explains why each behaves as it does):
  default          the scale climbs, overflows, backs off and settles just below overflow
  overflow-storm   starts at 2^24: a burst of skipped steps and backoffs, then settling
  lr-decay         the learning rate decays by 10^3 and the gradients shrink with the error:
                   the subnormal share rises with no overflow; try --headroom-growth
  spike            a gradient spike at --spike-step is detected and the step skipped
  fixed-scale      a constant --scale: too small underflows (the loss stalls), too large
                   (try 2^24) overflows every step (nothing is applied)

The library's own default growth interval is 2000 clean steps; this program uses 100 so the
dynamics show within a short run (lr-decay uses 2000 unless --growth-interval is given).
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
  bool growth_interval_given = false;
  bool quiet = false;
  int ranks = 0;               // 0: no data parallelism
  bool replicate_batch = false;
  std::string moments = "f32", rounding = "stochastic";  // the Adam moments' format and its rounding
  std::string precision = "f16", master = "f32";        // the model copy's format; the masters'
  std::string command_line;  // as given, for the trace's description
};

[[noreturn]] void usage_error(const std::string& what) {
  std::fflush(stdout);  // what the run printed first (the device line) comes before the error
  std::fprintf(stderr, "halfstep-train: %s\nRun with --help for the options.\n", what.c_str());
  std::exit(2);
}

// Empty if everything written to the standard output so far (through stdio, or std::cout, which
// writes through stdio) reached it; otherwise why not. The progress lines and the summary are the
// run's output too: a full disk or /dev/full must fail the run, not let it end "done".
std::string stdout_error() {
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return "";
  return std::string("writing the standard output failed: ") + std::strerror(errno);
}

// Reads `text` as a decimal integer of at most `max` into `value`; returns what is wrong with it,
// or "". Digits only: CLI11's own conversion (strtoull/strtoll, base 0) takes "-1" for an
// unsigned option and wraps it around (--seed -1 was seed 2^64 - 1), saturates on overflow, and
// reads "010" as octal and "0x10" as hexadecimal.
std::string read_decimal(const std::string& text, std::uint64_t max, std::uint64_t& value) {
  if (!text.empty() && text[0] == '-') return "'" + text + "' is negative";
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) {
    return "'" + text + "' is not a decimal integer";
  }
  value = 0;
  for (const char c : text) {
    const auto digit = static_cast<std::uint64_t>(c - '0');
    if (value > (max - digit) / 10) return text + " is more than " + std::to_string(max);
    value = value * 10 + digit;
  }
  return "";
}

// A CLI11 validator for an integer option in [min, max], by read_decimal's rules. It hands CLI11
// the number rewritten without leading zeros, which its base-0 conversion would read as octal.
CLI::Validator decimal_in(std::uint64_t min, std::uint64_t max) {
  const std::string range = "a decimal integer from " + std::to_string(min) + " to " + std::to_string(max);
  return CLI::Validator(
      [min, max, range](std::string& text) -> std::string {
        std::uint64_t value = 0;
        std::string wrong = read_decimal(text, max, value);
        if (wrong.empty() && value < min) wrong = text + " is less than " + std::to_string(min);
        if (!wrong.empty()) return wrong + " (give " + range + ")";
        text = std::to_string(value);
        return "";
      },
      "[" + std::to_string(min) + ", " + std::to_string(max) + "]");
}

constexpr std::int64_t kMaxSteps = std::int64_t{1} << 40;

// The checkpoint replaces its target with a complete file at the end of the run (written next to
// it, then renamed), so a path that cannot take it is refused before the run, not after it: its
// directory must exist and be writable, and an existing target must be a regular file (renaming
// over /dev/null would replace the device; over a directory it fails).
void check_checkpoint_path(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string dir = p.has_parent_path() ? p.parent_path().string() : ".";
  const std::string what = "--checkpoint " + path + ": ";
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) usage_error(what + "its directory " + dir + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) usage_error(what + dir + " is not a directory");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    usage_error(what + "cannot write in its directory " + dir + ": " + std::strerror(errno));
  }
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      usage_error(what + (S_ISDIR(st.st_mode) ? "is a directory" : "exists and is not a regular file") +
                  " (the checkpoint replaces its target with a file)");
    }
  } else if (errno != ENOENT) {
    usage_error(what + std::strerror(errno));
  }
}

// The trace file of rank `rank`: the given path for rank 0, "NAME.rankR.EXT" for the others.
std::string rank_trace(const std::string& path, int rank) {
  if (rank == 0) return path;
  const std::size_t slash = path.find_last_of('/');
  const std::size_t dot = path.find_last_of('.');
  const bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  const std::string tag = ".rank" + std::to_string(rank);
  return has_ext ? path.substr(0, dot) + tag + path.substr(dot) : path + tag;
}

// The description of trace `path`, next to it: what wrote its rows. It is kept out of the trace
// itself so that the trace is plain CSV, a header line and rows, which any CSV reader loads with
// its defaults (a comment line above the header broke pandas.read_csv and numpy.genfromtxt).
std::string description_path(const std::string& path) { return path + ".json"; }

// Whether two paths name the same file, existing or not (through symbolic links and "..").
bool same_file(const std::string& a, const std::string& b) {
  std::error_code ea, eb;
  const auto ca = std::filesystem::weakly_canonical(a, ea), cb = std::filesystem::weakly_canonical(b, eb);
  return ea || eb ? a == b : ca == cb;
}

// A positive number, or a power of two written 2^k.
std::string positive_or_power(std::string& text) {
  const bool power = text.rfind("2^", 0) == 0;
  char* end = nullptr;
  const double v = std::strtod(power ? text.c_str() + 2 : text.c_str(), &end);
  const double x = power ? std::exp2(v) : v;
  if (end == text.c_str() + (power ? 2 : 0) || *end != '\0' || !std::isfinite(x) || !(x > 0)) {
    return "a positive number or 2^k, got '" + text + "'";
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  text = buf;
  return "";
}

Options parse(int argc, char** argv) {
  Options o;
  CLI::App app(kDescription, "halfstep-train");
  app.footer(kScenarios);
  app.set_version_flag("--version", std::string("halfstep-train ") + halfstep::version());
  app.add_option("--scenario", o.scenario, "default | overflow-storm | lr-decay | spike | fixed-scale")
      ->check(CLI::IsMember({"default", "overflow-storm", "lr-decay", "spike", "fixed-scale"}));
  app.add_option("--steps", o.steps,
                 "total optimizer steps of the run, counting those before --resume\n"
                 "(default: 3000 on the CPU, 5000 on a GPU)")
      ->transform(decimal_in(1, kMaxSteps));
  app.add_flag("--cpu", o.cpu, "use the CPU engine even when a GPU is present");
  app.add_option("--width", o.width, "hidden width (default 256 on the CPU, 1024 on a GPU)")->transform(decimal_in(1, 1 << 16));
  app.add_option("--layers", o.layers, "hidden layers (default 3 on the CPU, 4 on a GPU)")->transform(decimal_in(1, 64));
  app.add_option("--batch", o.batch, "samples per step (default 128 on the CPU, 1024 on a GPU)")->transform(decimal_in(1, 1 << 20));
  app.add_option("--lr", o.lr, "base learning rate (default 1e-3)")->check(CLI::Range(1e-12, 1.0));
  app.add_option("--seed", o.seed, "seed of the task, the initial weights and the data (default 1)")
      ->transform(decimal_in(0, std::numeric_limits<std::uint64_t>::max()));
  app.add_option("--print-every", o.print_every, "progress line every N steps (default: steps / 15)")
      ->transform(decimal_in(1, static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())));
  app.add_option("--trace", o.trace,
                 "FILE.csv: one row per step, the loss and every StepReport field, under a header\n"
                 "line of column names (plain CSV: pandas.read_csv(FILE) reads it). With --resume\n"
                 "the rows are appended to FILE, with the header first if FILE is new or empty.\n"
                 "What wrote the rows (command line, halfstep version, engine; each resumed run\n"
                 "added) goes to FILE.json next to it. A write that fails ends the run");
  app.add_option("--checkpoint", o.checkpoint,
                 "FILE.safetensors: save weights, moments, model copies and optimizer state at the\n"
                 "end. FILE is replaced once the new file is complete: its directory must exist\n"
                 "and be writable, and FILE, if it exists, be a regular file");
  app.add_option("--resume", o.resume,
                 "FILE.safetensors: continue a run saved with --checkpoint, with its shape, seed,\n"
                 "--scenario and the settings that scenario uses (--lr, --growth-interval,\n"
                 "--headroom-growth, --scale, --spike-step, --spike-factor); --steps, the total,\n"
                 "may grow (lr-decay's schedule then spans the new total)")
      ->check(CLI::ExistingFile);
  app.add_option("--scale", o.scale,
                 "the constant loss scale of --scenario fixed-scale, a number or 2^k\n"
                 "(default 2^-16: most gradients underflow to zero)")
      ->transform(CLI::Validator(positive_or_power, "NUMBER|2^K"));
  app.add_option("--spike-step", o.spike_step, "the step whose gradient --scenario spike multiplies (default 3/4 in)")
      ->transform(decimal_in(0, kMaxSteps));
  app.add_option("--spike-factor", o.spike_factor, "how much it multiplies it by (default 100)")
      ->check(CLI::Range(1.0, 1e30));
  app.add_flag("--headroom-growth", o.headroom_growth, "let the scaler grow early when the measured headroom allows it");
  auto* growth = app.add_option("--growth-interval", o.growth_interval, "clean steps before the scale grows (default 100)")
                     ->transform(decimal_in(1, 1 << 30));
  app.add_flag("--quiet", o.quiet, "no progress lines, only the summary");
  app.add_option("--ranks", o.ranks,
                 "data parallelism over N ranks: the batch split over them, gradients\n"
                 "reduce-scattered, optimizer state sharded, one verdict for all, model\n"
                 "copies all-gathered. On a GPU machine one rank per GPU over NCCL; on the\n"
                 "CPU, N ranks simulated in this process. --trace writes one file per rank")
      ->transform(decimal_in(1, train::kMaxRanks));
  app.add_option("--moments", o.moments,
                 "the Adam moments' format: f32 (default), bf16 (decoded and encoded inside the\n"
                 "fused step, 2 B each instead of 4) or block8 (8-bit codes with an fp32 scale per\n"
                 "block of 256 elements of a row, 1 B each; tensors under 4096 elements stay fp32)")
      ->check(CLI::IsMember({"f32", "bf16", "block8"}));
  app.add_option("--precision", o.precision,
                 "the model copy's, the activations' and the gradients' format: f16 (default) or bf16")
      ->check(CLI::IsMember({"f16", "bf16"}));
  app.add_option("--master", o.master,
                 "the master weights: f32 (default), remainder (the bf16 model copy and an int16\n"
                 "remainder: the fp32 master exactly, in 2 B) or none (the bf16 weights are the\n"
                 "parameters, updated with --rounding); remainder and none need --precision bf16")
      ->check(CLI::IsMember({"f32", "remainder", "none"}));
  app.add_option("--rounding", o.rounding,
                 "how bf16 moments (block8: sqrt(exp_avg_sq)), and with --master none the weights,\n"
                 "are stored: stochastic (default; its bits keyed by --seed, the step, the tensor\n"
                 "and the element) or nearest")
      ->check(CLI::IsMember({"stochastic", "nearest"}));
  app.add_flag("--replicate-batch", o.replicate_batch,
               "with --ranks: every rank computes the whole batch (so the sharded step must\n"
               "reproduce the unsharded one exactly)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() != 0) usage_error(e.what());
    app.exit(e);  // --help or --version
    if (const std::string error = stdout_error(); !error.empty()) {
      std::fprintf(stderr, "halfstep-train: %s\n", error.c_str());
      std::exit(1);
    }
    std::exit(0);
  }
  o.growth_interval_given = growth->count() > 0;
  if (o.replicate_batch && o.ranks == 0) usage_error("--replicate-batch needs --ranks");
  if (o.master != "f32" && o.precision != "bf16") {
    usage_error("--master " + o.master + " needs --precision bf16: " +
                (o.master == "none" ? "without a master the weights are the bf16 model copy"
                                    : "remainders rebuild fp32 masters from a bf16 model copy"));
  }
  if (!o.checkpoint.empty()) check_checkpoint_path(o.checkpoint);
  // A trace, or its description, on the file another option reads or writes would corrupt that
  // checkpoint, or be replaced by it at the end.
  for (int r = 0; !o.trace.empty() && r < std::max(o.ranks, 1); ++r) {
    const std::string trace = rank_trace(o.trace, r);
    for (const auto& [option, path] : {std::pair{"--checkpoint", &o.checkpoint}, std::pair{"--resume", &o.resume}}) {
      if (!path->empty() && same_file(trace, *path)) {
        usage_error("--trace " + trace + " names the same file as " + option + " " + *path);
      }
      if (!path->empty() && same_file(description_path(trace), *path)) {
        usage_error("--trace " + trace + ": its description " + description_path(trace) + " names the same file as " +
                    option + " " + *path);
      }
    }
  }
  o.command_line = "halfstep-train";
  for (int i = 1; i < argc; ++i) o.command_line += std::string(" ") + argv[i];
  return o;
}

// What a scenario changes: the step configuration, the learning-rate schedule, the spike.
struct Scenario {
  halfstep::StepConfig config;
  std::function<float(std::int64_t)> lr;
  std::int64_t spike_step = -1;
  float spike_factor = 1.0f;
  // The options that made this configuration, each with the value the run uses, in the order a
  // resume checks them: a checkpoint records them and a resumed run must repeat them.
  std::vector<std::pair<std::string, std::string>> settings;
};

// The shortest decimal that reads back as x (9 digits always do).
std::string number_text(float x) {
  char buf[32];
  for (int digits = 6;; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, static_cast<double>(x));
    if (digits == 9 || std::strtof(buf, nullptr) == x) return buf;
  }
}

// The spike scenario's limits, measured on this task (see make_scenario).
constexpr std::int64_t kSpikeSettled = 400;
constexpr float kSpikeFactorMin = 20.0f;

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
  if (o.precision == "bf16") c.grad_dtype = c.model_dtype = halfstep::DType::bf16;
  if (o.master == "remainder") c.state.master = halfstep::MasterFormat::bf16_remainder;
  if (o.master == "none") c.state.master = halfstep::MasterFormat::none;
  if (o.moments == "bf16") c.state.exp_avg = c.state.exp_avg_sq = halfstep::MomentFormat::bf16;
  if (o.moments == "block8") c.state.exp_avg = c.state.exp_avg_sq = halfstep::MomentFormat::block8;
  c.state.rounding = o.rounding == "nearest" ? halfstep::Rounding::nearest : halfstep::Rounding::stochastic;
  c.state.seed = o.seed;
  const float base = o.lr;
  s.lr = [base](std::int64_t) { return base; };
  if (o.scenario == "overflow-storm") {
    c.scaler.init_scale = c.scaler.max_scale;  // 2^24: far above what the gradients allow
  } else if (o.scenario == "lr-decay") {
    // The rate falls by 10^3 over the run while the scaler keeps its classic 2000-step window
    // (longer than the run), so the scale cannot follow the shrinking gradients.
    c.scaler.init_scale = 256.0f;
    if (o.growth_interval_given) {
      std::printf("note: --scenario lr-decay runs with your --growth-interval %d; its point shows with the\n"
                  "      library's default 2000, a window longer than the run\n", o.growth_interval);
    } else {
      c.scaler.growth_interval = 2000;
    }
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
    // Measured on this task: before ~310 steps the detector's variance still holds the early
    // descent and a 100x spike is not flagged; below ~20x a spike stays within 6 deviations.
    if (s.spike_step < kSpikeSettled) {
      usage_error("--scenario spike: the spike would come at step " + std::to_string(s.spike_step) +
                  ", before the detector can tell it apart (its statistics need about " +
                  std::to_string(kSpikeSettled) + " steps of this run's history); give --steps " +
                  std::to_string(kSpikeSettled * 4 / 3 + 1) + " or more, or --spike-step " +
                  std::to_string(kSpikeSettled) + " or later");
    }
    if (s.spike_step >= steps) {
      usage_error("--scenario spike: --spike-step " + std::to_string(s.spike_step) + " is not inside the run of " +
                  std::to_string(steps) + " steps");
    }
    if (o.spike_factor < kSpikeFactorMin) {
      usage_error("--scenario spike: --spike-factor " + std::to_string(o.spike_factor) +
                  " is too small for the detector to flag on this task (it needs " +
                  std::to_string(static_cast<int>(kSpikeFactorMin)) + " or more)");
    }
  } else if (o.scenario == "fixed-scale") {
    c.scaler = halfstep::ScalerConfig::constant(o.scale);
  }
  // The library refuses a checkpoint whose StepConfig differs, but by its own field names, and
  // not one from another initial scale (default and overflow-storm) or learning rate. The spike's
  // step is the one this run uses (3/4 of --steps unless given), so a resume to a longer total
  // must name the first run's. lr-decay's schedule is not a setting: it spans --steps, the total
  // a resume extends.
  s.settings = {{"--scenario", o.scenario}, {"--precision", o.precision}, {"--lr", number_text(o.lr)}};
  if (o.scenario == "spike") {
    s.settings.emplace_back("--spike-step", std::to_string(s.spike_step));
    s.settings.emplace_back("--spike-factor", number_text(s.spike_factor));
  } else if (o.scenario == "fixed-scale") {
    s.settings.emplace_back("--scale", number_text(o.scale));
  } else {  // the dynamic scaler's
    s.settings.emplace_back("--growth-interval", std::to_string(c.scaler.growth_interval));
    s.settings.emplace_back("--headroom-growth", c.scaler.headroom_growth ? "on" : "off");
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

// --- checkpoints: halfstep's full checkpoint (safetensors) with this program's own metadata --
std::vector<std::string> tensor_names(const train::Dims& dims) {
  std::vector<std::string> names;
  for (int l = 0; l < dims.layers(); ++l) {
    names.push_back("layers." + std::to_string(l) + ".weight");
    names.push_back("layers." + std::to_string(l) + ".bias");
  }
  return names;
}

// What a checkpoint's shape key records, in its order, each by the option that sets it or in
// words: a resumed run must repeat all of them.
struct ShapeField {
  const char* name;
  std::string value;
};
std::vector<ShapeField> shape_fields(const train::Dims& d, std::uint64_t seed) {
  return {{"input features", std::to_string(d.d_in)}, {"--width", std::to_string(d.width)},
          {"--layers", std::to_string(d.hidden_layers)}, {"outputs", std::to_string(d.d_out)},
          {"--batch", std::to_string(d.batch)}, {"dataset samples", std::to_string(d.samples)},
          {"--seed", std::to_string(seed)}};
}

// The key: "64,256,3,16,128,8192,seed 1" (the fields in order; the seed's tagged).
std::string shape_key(const train::Dims& d, std::uint64_t seed) {
  std::string key;
  for (const ShapeField& f : shape_fields(d, seed)) {
    key += (key.empty() ? "" : ",") + (f.name == std::string("--seed") ? "seed " + f.value : f.value);
  }
  return key;
}

// Why a checkpoint whose shape key is `saved` cannot continue this run, in words: each field that
// differs, the checkpoint's value and this run's.
std::string shape_difference(const std::string& saved, const train::Dims& dims, std::uint64_t seed) {
  const std::vector<ShapeField> mine = shape_fields(dims, seed);
  std::vector<std::string> theirs;
  for (std::size_t at = 0;;) {
    const std::size_t comma = saved.find(',', at);
    theirs.push_back(saved.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  if (theirs.size() != mine.size() || theirs.back().rfind("seed ", 0) != 0) {
    return "its halfstep-train.shape '" + saved + "' is not one halfstep-train writes";
  }
  theirs.back().erase(0, 5);
  std::string differ;
  bool engine = false;  // the input and output widths differ between the engines, never by an option
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (theirs[i] == mine[i].value) continue;
    differ += std::string(differ.empty() ? "" : "; ") + mine[i].name + " " + theirs[i] + " there, " + mine[i].value +
              " in this run";
    engine = engine || mine[i].name == std::string("input features") || mine[i].name == std::string("outputs");
  }
  return "it was written by a run of another network, batch or seed: " + differ +
         (engine ? " (the CPU and GPU engines train networks of different sizes: resume on the engine that wrote it)"
                 : " (a resumed run must repeat them)");
}

// The metadata key of a setting: "halfstep-train.scenario" for --scenario.
std::string setting_key(const std::string& option) { return "halfstep-train." + option.substr(2); }

void save_checkpoint(const std::string& path, std::int64_t next_step, const train::Dims& dims,
                     std::uint64_t seed, const Scenario& scenario, train::Trainer& trainer) {
  halfstep::CheckpointOptions options;
  options.metadata["halfstep-train.next_step"] = std::to_string(next_step);
  options.metadata["halfstep-train.shape"] = shape_key(dims, seed);
  for (const auto& [option, value] : scenario.settings) options.metadata[setting_key(option)] = value;
  trainer.save(tensor_names(dims), path, options);
}

// Checks this program's own metadata of a checkpoint to resume against this run, before anything
// is built or written; returns the step it continues at. halfstep then checks and restores the
// rest when the trainer loads it.
std::int64_t resume_step(const std::string& path, const train::Dims& dims, std::uint64_t seed, std::int64_t steps,
                         const Scenario& scenario) {
  const auto meta = halfstep::checkpoint_metadata(path);
  const auto shape = meta.find("halfstep-train.shape");
  const auto next = meta.find("halfstep-train.next_step");
  if (shape == meta.end() || next == meta.end()) {
    throw std::runtime_error(path + " is a halfstep checkpoint but not one halfstep-train wrote");
  }
  if (shape->second != shape_key(dims, seed)) {
    throw std::runtime_error("--resume " + path + ": " + shape_difference(shape->second, dims, seed));
  }
  for (const auto& [option, value] : scenario.settings) {
    const auto saved = meta.find(setting_key(option));
    if (saved == meta.end() && option == "--precision" && value == "f16") continue;  // before bf16 runs existed
    if (saved == meta.end()) {
      throw std::runtime_error(path + " does not record its " + option +
                               " (an older halfstep-train wrote it), so this run cannot be checked against it");
    }
    if (saved->second != value) {
      throw std::runtime_error(option + ": " + path + " was written by a run with " + option + " " + saved->second +
                               ", this run has " + option + " " + value +
                               " (a resumed run must continue the same configuration)");
    }
  }
  std::uint64_t next_step = 0;
  const std::string wrong = read_decimal(next->second, static_cast<std::uint64_t>(kMaxSteps), next_step);
  if (!wrong.empty() || next_step == 0) {
    throw std::runtime_error(path + ": its halfstep-train.next_step " +
                             (wrong.empty() ? std::string("is 0") : wrong) + ", not a step a run ended at");
  }
  if (static_cast<std::int64_t>(next_step) >= steps) {
    throw std::runtime_error(path + " is already at step " + std::to_string(next_step) + " and --steps " +
                             std::to_string(steps) + " is the total: nothing to run (give --steps " +
                             std::to_string(next_step + 1) + " or more)");
  }
  return static_cast<std::int64_t>(next_step);
}

// --- output ---------------------------------------------------------------------------------
void trace_header(std::FILE* f) {
  std::fprintf(f, "attempt,step,outcome,reason,spike,loss,lr,scale_used,scale_next,grad_norm,clip_coef,"
                  "nonfinite_count,first_nonfinite_tensor,max_abs_scaled,headroom_log2,"
                  "subnormal_count,zero_count,numel,held_elements\n");
}

// One trace file. stdio reports a failed write (a full disk, /dev/full) only through the stream's
// error flag and the results of fflush and fclose; every row checks them, so a trace that cannot
// be written ends the run at once, naming the file, rather than one that ends "done" without it.
class Trace {
 public:
  // Opens `path` from the start, or to append to when a resumed run continues the first run's
  // rows. A path that cannot be opened is refused like a bad option, before the run.
  Trace(std::string path, bool append) : path_(std::move(path)), file_(std::fopen(path_.c_str(), append ? "a" : "w")) {
    if (file_ == nullptr) usage_error("--trace " + path_ + ": " + std::strerror(errno));
    struct stat st {};
    regular_ = ::fstat(::fileno(file_), &st) == 0 && S_ISREG(st.st_mode);
    // A resumed run may trace to a new file (or an empty one): its rows need the header as much
    // as a first run's. Only rows that continue an existing trace go without one.
    fresh_ = !append || !regular_ || st.st_size == 0;
  }
  Trace(Trace&& other) noexcept
      : path_(std::move(other.path_)),
        file_(std::exchange(other.file_, nullptr)),
        regular_(other.regular_),
        fresh_(other.fresh_) {}
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;
  Trace& operator=(Trace&&) = delete;
  ~Trace() {
    if (file_ != nullptr) std::fclose(file_);  // after a failure, which was already reported
  }
  std::FILE* file() const { return file_; }
  // Before the first row: the header, if the file is fresh, flushed (a file that takes nothing,
  // /dev/full, fails here, before the first step), then `run` added to the trace's description,
  // which names the runs that wrote its rows. A trace that is not a regular file (a pipe, a
  // device) has no place next to it for one.
  void start(const nlohmann::ordered_json& run) const {
    if (fresh_) trace_header(file_);
    flush();
    if (!regular_) return;
    const std::string path = description_path(path_);
    nlohmann::ordered_json description;
    std::error_code error;
    if (!fresh_ && std::filesystem::exists(path, error)) {  // the runs before this one stay in it
      std::ifstream in(path);
      description = nlohmann::ordered_json::parse(in, nullptr, false);
      if (description.is_discarded() || !description.is_object() || !description.contains("runs") ||
          !description["runs"].is_array()) {
        throw std::runtime_error("--trace " + path_ + ": its description " + path +
                                 " is not one halfstep-train wrote (move it away, and this run starts a new one)");
      }
    } else {
      description["trace"] = std::filesystem::path(path_).filename().string();
      description["runs"] = nlohmann::ordered_json::array();
    }
    description["runs"].push_back(run);
    // Replaced whole; invalid UTF-8 in a command line is written as U+FFFD rather than refused.
    const std::string text = description.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr) fail("writing the trace description " + path, errno);
    const bool written = std::fputs(text.c_str(), f) >= 0 && std::fflush(f) == 0;
    const int why = errno;
    if (std::fclose(f) != 0 || !written) fail("writing the trace description " + path, written ? errno : why);
  }
  // After each write, while errno still says why it failed.
  void check() const {
    if (std::ferror(file_)) fail(errno);
  }
  void flush() const {
    if (std::fflush(file_) != 0 || std::ferror(file_)) fail(errno);
  }
  void close() {
    flush();
    if (std::fclose(std::exchange(file_, nullptr)) != 0) fail(errno);
  }

 private:
  [[noreturn]] void fail(int error) const { fail("writing the trace " + path_, error); }
  [[noreturn]] static void fail(const std::string& what, int error) {
    throw std::runtime_error(what + " failed: " + std::strerror(error));
  }
  std::string path_;
  std::FILE* file_;
  bool regular_ = false;  // a regular file, not a pipe or a device
  bool fresh_ = true;     // new or empty: the header comes first
};

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
  if (!gpu) {  // first: a refusal below then reads after the engine it refers to
    std::printf("%s: running on the CPU (fixed-order products, halfstep host backend)\n",
                o.cpu ? "--cpu" : "no CUDA device found");
  }
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
  // Data parallelism splits each batch evenly over the ranks: the default batch is rounded up to a
  // multiple of them (128 on 3 ranks: 129, 43 each); a --batch given must be one.
  const int ranks = o.ranks > 0 ? o.ranks : 1;
  const bool split = o.ranks > 0 && !o.replicate_batch;
  const int default_batch = dims.batch;
  if (o.batch > 0) {
    dims.batch = o.batch;
  } else if (split) {
    dims.batch = (dims.batch + ranks - 1) / ranks * ranks;
  }
  if (split && dims.batch % ranks != 0) {
    const int below = dims.batch / ranks * ranks, above = below + ranks;
    usage_error("--ranks " + std::to_string(ranks) + " must divide --batch " + std::to_string(dims.batch) +
                ", each rank computing an equal part of it (give --batch " +
                (below > 0 ? std::to_string(below) + " or " : std::string()) + std::to_string(above) +
                ", or --replicate-batch)");
  }
  dims.samples = std::max(dims.samples / dims.batch, 1) * dims.batch;  // whole batches
  const std::int64_t steps = o.steps > 0 ? o.steps : (gpu ? 5000 : 3000);
  const std::int64_t print_every = o.print_every > 0 ? o.print_every : std::max<std::int64_t>(steps / 15, 1);
  Scenario scenario = make_scenario(o, steps);
  // What the run reads and writes, before anything is computed: the checkpoint to resume (this
  // program's metadata; halfstep checks the rest as it loads it), then the traces, opened.
  const std::int64_t start = o.resume.empty() ? 0 : resume_step(o.resume, dims, o.seed, steps, scenario);
  std::vector<Trace> traces;
  for (int r = 0; !o.trace.empty() && r < ranks; ++r) traces.emplace_back(rank_trace(o.trace, r), start > 0);

  const auto teacher = train::teacher_masters(dims, o.seed);
  const train::Dataset data = train::make_dataset(dims, teacher, o.seed, scenario.config.model_dtype);
  auto masters = train::initial_masters(dims, o.seed);
  if (o.scenario == "lr-decay") {  // fine-tuning: start near the teacher, every unit alive
    for (std::size_t t = 0; t < masters.size(); ++t) {
      for (std::size_t i = 0; i < masters[t].size(); ++i) masters[t][i] = teacher[t][i] + kFineTune * masters[t][i];
    }
  }
  // The engines: one, or one per rank with its slice of the batch (or all of it, replicated).
  auto rank_dims = [&](int r) {
    train::Dims d = dims;
    if (split) {
      d.global_batch = dims.batch;
      d.batch = dims.batch / ranks;
      d.batch_offset = r * d.batch;
    }
    return d;
  };
  auto make_engine = [&](int r) -> std::unique_ptr<train::Engine> {
    if (!gpu) return train::make_cpu_engine(rank_dims(r), data, masters, steps, scenario.config);
    return train::make_cuda_engine(rank_dims(r), data, masters, steps, scenario.config);
  };
  std::unique_ptr<train::Engine> engine;  // the plain run's
  std::unique_ptr<train::Trainer> trainer;
  std::string engine_name;
  if (o.ranks == 0) {
    engine = make_engine(0);
    engine_name = engine->name();
    trainer = train::make_single_trainer(*engine, scenario.config);
  } else if (gpu) {
    trainer = train::make_nccl_ranks(ranks, make_engine, scenario.config);
    engine_name = std::to_string(ranks) + " ranks over NCCL, one GPU each";
  } else {
    std::vector<std::unique_ptr<train::Engine>> engines;
    for (int r = 0; r < ranks; ++r) engines.push_back(make_engine(r));
    engine_name = engines[0]->name() + ", " + std::to_string(ranks) + " ranks in this process";
    trainer = train::make_host_ranks(std::move(engines), scenario.config);
  }
  std::printf("halfstep-train: scenario %s on %s\n", o.scenario.c_str(), engine_name.c_str());
  std::printf("  MLP %d -> %d x %d (ReLU) -> %d, %lld parameters in %zu tensors, batch %d, %lld steps\n",
              dims.d_in, dims.hidden_layers, dims.width, dims.d_out,
              static_cast<long long>(dims.parameters()), train::tensor_shapes(dims).size(), dims.batch,
              static_cast<long long>(steps));
  if (o.ranks > 0) {
    std::string part = "every rank computes the whole batch";
    if (split) {
      part = "each rank computes " + std::to_string(dims.batch / ranks) + " samples";
      if (dims.batch != default_batch && o.batch <= 0) {
        part += " (the default batch of " + std::to_string(default_batch) + " rounded up to a multiple of " +
                std::to_string(ranks) + ")";
      }
    }
    std::printf("  data parallel over %d ranks: %s, optimizer state sharded\n", ranks, part.c_str());
  }
  {
    const halfstep::StateFormat& f = scenario.config.state;
    const halfstep::StateBytes b = halfstep::state_bytes(scenario.config);
    const std::string rounding = std::string(" (") + halfstep::rounding_name(f.rounding) + " rounding)";
    const bool rounded = f.exp_avg != halfstep::MomentFormat::f32;
    std::string master = "fp32 masters";
    if (f.master == halfstep::MasterFormat::bf16_remainder) master = "int16 remainders (exact fp32 masters)";
    if (f.master == halfstep::MasterFormat::none) {
      master = std::string("no master (the bf16 weights, ") + halfstep::rounding_name(f.rounding) + " rounding)";
    }
    std::printf("  optimizer state: %s%s, %s moments%s; %zu B a parameter held, %zu B moved a step\n",
                scenario.config.model_dtype == halfstep::DType::bf16 ? "bf16 weights and gradients, " : "",
                master.c_str(), f.exp_avg == halfstep::MomentFormat::f32 ? "fp32" : halfstep::moment_format_name(f.exp_avg),
                rounded ? rounding.c_str() : "",
                b.state + b.gradient + b.model, b.moved);
  }

  if (start > 0) {
    trainer->load(tensor_names(dims), o.resume);
    std::printf("  resumed from %s at step %lld (loss scale %s)\n", o.resume.c_str(),
                static_cast<long long>(start), log2_text(trainer->state().scaler.scale).c_str());
  }
  for (std::size_t r = 0; r < traces.size(); ++r) {
    nlohmann::ordered_json run;
    run["command"] = o.command_line;
    run["halfstep"] = halfstep::version();
    run["engine"] = engine_name;
    run["rank"] = r;
    run["ranks"] = ranks;
    const halfstep::StateFormat& f = scenario.config.state;
    run["state"] = {{"precision", halfstep::dtype_name(scenario.config.model_dtype)},
                    {"master", halfstep::master_format_name(f.master)},
                    {"exp_avg", halfstep::moment_format_name(f.exp_avg)},
                    {"exp_avg_sq", halfstep::moment_format_name(f.exp_avg_sq)},
                    {"rounding", halfstep::rounding_name(f.rounding)}};
    run["first_attempt"] = start + 1;  // the attempt column of this run's first row
    traces[r].start(run);
  }

  const auto t0 = std::chrono::steady_clock::now();
  auto t_last = t0;
  std::int64_t last_print = start;
  float last_lr = NAN;
  for (std::int64_t step = start; step < steps; ++step) {
    const float lr = scenario.lr(step);
    if (lr != last_lr) {  // ordered before this step's update, on the engines' streams
      trainer->set_lr(lr);
      last_lr = lr;
    }
    const float factor = step == scenario.spike_step ? scenario.spike_factor : 1.0f;
    trainer->step(step, factor);
    const bool print = !o.quiet && ((step + 1) % print_every == 0 || step + 1 == steps);
    if (!traces.empty() || print) {
      const StepReport r = trainer->report(0);
      const float loss = trainer->loss(step);
      for (std::size_t k = 0; k < traces.size(); ++k) {
        trace_row(traces[k].file(), k == 0 ? r : trainer->report(static_cast<int>(k)), loss, lr);
        traces[k].check();
      }
      if (print) {
        const auto now = std::chrono::steady_clock::now();
        const double rate = static_cast<double>(step + 1 - last_print) /
                            std::chrono::duration<double>(now - t_last).count();
        t_last = now;
        last_print = step + 1;
        const halfstep::OptimizerState s = trainer->state();
        const double numel = static_cast<double>(std::max<std::int64_t>(r.numel, 1));
        std::printf("step %6lld  loss %.3e  scale %-7s skipped %4lld  |g| %.2e  headroom %5.1f  "
                    "subnormal %6.3f%%  zero %5.1f%%  %6.1f steps/s\n",
                    static_cast<long long>(step + 1), static_cast<double>(loss),
                    log2_text(r.scale_next).c_str(), static_cast<long long>(s.attempts - s.step),
                    r.grad_norm, static_cast<double>(r.headroom_log2),
                    100.0 * static_cast<double>(r.subnormal_count) / numel,
                    100.0 * static_cast<double>(r.zero_count) / numel, rate);
        if (const std::string error = stdout_error(); !error.empty()) throw std::runtime_error(error);
      }
    }
  }
  trainer->sync();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (Trace& t : traces) t.close();

  // Summary: the loss at the start and the end of this run, and what the scaler did.
  const std::int64_t window = std::max<std::int64_t>(std::min<std::int64_t>(100, (steps - start) / 5), 1);
  auto mean_loss = [&](std::int64_t from) {
    double sum = 0.0;
    for (std::int64_t s = from; s < from + window; ++s) sum += trainer->loss(s);
    return sum / static_cast<double>(window);
  };
  const halfstep::OptimizerState s = trainer->state();
  std::printf("done: %lld steps in %.1f s (%.1f steps/s)\n", static_cast<long long>(steps - start),
              seconds, static_cast<double>(steps - start) / seconds);
  std::printf("  loss %.3e over the first %lld steps, %.3e over the last %lld\n", mean_loss(start),
              static_cast<long long>(window), mean_loss(steps - window), static_cast<long long>(window));
  std::printf("  applied %lld, skipped %lld (overflow %lld, spike or non-finite update %lld); spikes flagged %lld\n",
              static_cast<long long>(s.step), static_cast<long long>(s.attempts - s.step),
              static_cast<long long>(s.scaler.overflows),
              static_cast<long long>(s.attempts - s.step - s.scaler.overflows),
              static_cast<long long>(s.spike.spikes));
  std::printf("  loss scale %s: %lld growths, %lld backoffs\n", log2_text(s.scaler.scale).c_str(),
              static_cast<long long>(s.scaler.growths), static_cast<long long>(s.scaler.backoffs));
  if (!o.checkpoint.empty()) {
    save_checkpoint(o.checkpoint, steps, dims, o.seed, scenario, *trainer);
    std::printf("  checkpoint written to %s\n", o.checkpoint.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    const int rc = run(o);
    if (const std::string error = stdout_error(); !error.empty()) throw std::runtime_error(error);
    return rc;
  } catch (const std::exception& e) {
    std::fflush(stdout);  // the lines printed before it, then the error
    std::fprintf(stderr, "halfstep-train: %s\n", e.what());
    return 1;
  }
}
