// halfstep-plan: what one training step's optimizer-side buffers cost in device memory, and how
// many parameters fit in a given amount of it. Everything is computed in closed form, so any
// parameter count answers at once.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <halfstep/error.hpp>
#include <halfstep/fused_adamw.hpp>
#include <halfstep/version.hpp>

namespace {

const char* kDescription = R"(halfstep-plan: prints the device memory of halfstep's per-parameter buffers — the master
weights (fp32, 4 B; or with a bf16 model copy an int16 remainder, 2 B: --master bf16_remainder;
or none, the bf16 model copy rounded stochastically is the weight: --master none),
the Adam moments (fp32, 8 B; bf16, 4 B: --moments bf16; block-wise 8-bit codes, 2 B and an fp32
scale per block of 256 elements of a row: --moments block8), the gradients (2 B for f16 and bf16, 4 B
for f32), the 16-bit model copy (2 B, or none; with f32 gradients the parameters are fp32, the
masters themselves, so by default there is none) — and the step's workspace, then how many
parameters fit in --memory, and the bytes one step moves. With --ranks N (ZeRO-1 data
parallelism) it prints one rank's share: the masters and moments sharded over the ranks, the
gradients and the model copy whole on every rank. --formats prints every state format's bytes
and largest model side by side.)";

const char* kFooter = R"(
Activations, the forward and backward passes' workspace and the framework's own buffers are not
counted. One FusedAdamW step holds at most 2^31 - 1 chunks of 32768 parameters (7.0e13); a larger
model is sharded across ranks (ZeRO, --ranks), each holding its own shard. With --ranks, each holds
ceil(params / N) parameters' masters and moments (the last ranks fewer) and the gradient and
model-copy buffers padded to N times that, what the collectives move; the slices its step reads
and writes are views into them (in-place reduce-scatter and all-gather). ZeRO-2 and ZeRO-3, which
shard the gradients and the model as well, hold less. Under block8 a rank's range is cut where blocks
start: up to 255 parameters past ceil(params / N), counted so. With --moments block8 the tensors' moments
are counted by the library's rule (halfstep::moment_blocks): tensors of --tensors' average size with
rows of --row elements; a tensor under 4096 elements, or with rows under 32, keeps fp32 moments.
)";
using Units = std::vector<std::pair<std::string, double>>;

// A positive number with an optional unit suffix; CLI11 transforms the text into the number.
CLI::Validator amount(const Units& units, const std::string& name) {
  return CLI::Validator(
      [units](std::string& text) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(text.c_str(), &end);
        if (end == text.c_str()) return "needs a number, got '" + text + "'";
        const std::string suffix(end);
        double mult = 1.0;
        if (!suffix.empty()) {
          bool known = false;
          for (const auto& [unit, m] : units) {
            if (suffix == unit) {
              mult = m;
              known = true;
            }
          }
          if (!known) return "unknown unit '" + suffix + "' in '" + text + "'";
        }
        const double x = v * mult;
        if (!std::isfinite(x) || !(x > 0)) return "must be a positive number, got '" + text + "'";
        char buf[64];
        std::snprintf(buf, sizeof buf, "%.17g", x);
        text = buf;
        return "";
      },
      name);
}

// Bytes in binary units up to YiB, and past 1024 YiB (2^90 bytes) as a plain power of ten. In long
// double: any parameter count answers, and 16 bytes each of 10^308 parameters are past a double.
std::string bytes_text(long double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"};
  constexpr int kLast = 8;
  long double x = b;
  int u = 0;
  while (x >= 1024.0L && u < kLast) {
    x /= 1024.0L;
    ++u;
  }
  char buf[48];
  if (x >= 1024.0L) {
    std::snprintf(buf, sizeof buf, "%.2Le B", b);
  } else {
    std::snprintf(buf, sizeof buf, "%.2Lf %s", x, units[u]);
  }
  return buf;
}

// Parameters split as evenly as possible over `tensors` tensors: how many chunks in all.
double chunks_for(double params, double tensors) {
  const double q = std::floor(params / tensors), r = params - q * tensors;
  const double c = static_cast<double>(halfstep::chunk_elements());
  return r * std::ceil((q + 1) / c) + (tensors - r) * std::ceil(q / c);
}

// The step's device workspace, or -1 when one step cannot hold the tensors.
double workspace(double params, double tensors, double groups) {
  const double chunks = chunks_for(params, tensors);
  if (tensors > 2147483647.0 || chunks > 2147483647.0) return -1;
  return static_cast<double>(halfstep::workspace_bytes(static_cast<std::uint64_t>(tensors),
                                                       static_cast<std::uint64_t>(chunks),
                                                       static_cast<std::size_t>(groups)));
}

// One rank's buffers for a model of `params` parameters in `tensors` tensors of equal size,
// trained on `ranks` ranks with ZeRO-1 (one rank: the whole model).
struct RankPlan {
  double shard = 0;      // parameters whose masters and moments the rank holds: ceil(params / ranks)
  double padded = 0;     // elements of its gradient and model-copy buffers: ranks · shard >= params
  double workspace = 0;  // bytes of its step's workspace, or -1 when one step cannot hold the shard
  long double total = 0;
};

RankPlan plan_rank(double params, double tensors, double groups, double ranks, double grad_bytes,
                   double model_bytes, double state_bytes, double slack) {
  RankPlan p;
  // Ranges cut where blocks start (block8) may each run up to `slack` elements past the even share.
  p.shard = ranks == 1 ? params : std::min(params, std::ceil(params / ranks) + slack);
  p.padded = p.shard * ranks;
  // A shard cut out of the flat parameter space anywhere holds parts of at most this many tensors.
  const double pieces =
      ranks == 1 ? tensors : std::min({tensors, p.shard, std::ceil(p.shard / (params / tensors)) + 1});
  p.workspace = workspace(p.shard, pieces, groups);
  p.total = static_cast<long double>(state_bytes) * p.shard + (static_cast<long double>(grad_bytes) + model_bytes) * p.padded +
            std::max(p.workspace, 0.0);
  return p;
}

// The most parameters that fit in `memory` on each of `ranks` ranks, by bisection on the same
// accounting (tensors of `per_tensor` parameters on average), within what one step can hold.
double most_that_fit(double memory, double per_tensor, double groups, double ranks, double grad_bytes,
                     double model_bytes, double state_bytes, double slack) {
  const double most_per_step = 2147483647.0 * static_cast<double>(halfstep::chunk_elements());
  double lo = 0, hi = std::min(memory / (state_bytes / ranks + grad_bytes + model_bytes), most_per_step * ranks) + 1;
  for (int i = 0; i < 200 && hi - lo > 0.5; ++i) {
    const double mid = std::floor((lo + hi) / 2);
    const RankPlan p = plan_rank(mid, std::max(1.0, std::ceil(mid / per_tensor)), groups, std::min(ranks, mid),
                                 grad_bytes, model_bytes, state_bytes, slack);
    (mid > 0 && p.workspace >= 0 && p.total <= memory ? lo : hi) = mid;
  }
  return lo;
}

// What one parameter costs under a state format, in bytes (fractional with block8's scales).
struct Accounting {
  double gradient = 0, model = 0, master = 0, moments = 0, moved = 0;
  bool wide = false;  // block8 asked for, but tensors of this shape keep fp32 moments
  double slack = 0;   // how far past ceil(params / ranks) a ZeRO range may run: cut where blocks start
  double state() const { return master + moments; }
};

halfstep::DType dtype_of(const std::string& name) {
  return name == "f32" ? halfstep::DType::f32 : name == "bf16" ? halfstep::DType::bf16 : halfstep::DType::f16;
}

// The step configuration of these formats (the library's own accounting: halfstep::state_bytes).
halfstep::StepConfig config_of(const std::string& grad, const std::string& model, const std::string& master,
                               const std::string& moments) {
  halfstep::StepConfig c;
  c.grad_dtype = dtype_of(grad);
  c.model_dtype = model == "bf16" ? halfstep::DType::bf16 : halfstep::DType::f16;
  c.state.master = master == "bf16_remainder" ? halfstep::MasterFormat::bf16_remainder
                   : master == "none"         ? halfstep::MasterFormat::none
                                              : halfstep::MasterFormat::f32;
  c.state.exp_avg = c.state.exp_avg_sq = moments == "bf16"     ? halfstep::MomentFormat::bf16
                                         : moments == "block8" ? halfstep::MomentFormat::block8
                                                               : halfstep::MomentFormat::f32;
  return c;
}

// The library's accounting (halfstep::state_bytes) of these formats, with block8's moments as
// halfstep::moment_blocks holds them in a tensor of `per_tensor` elements (rounded down to whole
// rows) with rows of `row` elements (0: one row): the codes, a byte a moment, and the scales.
Accounting account(const std::string& grad, const std::string& model, const std::string& master,
                   const std::string& moments, double per_tensor, double row) {
  const halfstep::StepConfig config = config_of(grad, model, master, moments);
  const halfstep::StateBytes held = halfstep::state_bytes(config, model != "none");
  Accounting a;
  a.gradient = static_cast<double>(held.gradient);
  a.model = static_cast<double>(held.model);
  a.master = master == "bf16_remainder" ? 2.0 : master == "none" ? 0.0 : 4.0;
  a.moments = static_cast<double>(held.state) - a.master;
  a.moved = static_cast<double>(held.moved);
  if (moments == "block8") {
    // One tensor of this shape, as large as an int64 holds (past that its blocks per element no
    // longer change): what it holds per element.
    const double most = 4611686018427387904.0;  // 2^62
    const double r = row == 0 ? std::min(per_tensor, most) : row;
    halfstep::ParamTensor t;
    t.numel = static_cast<std::int64_t>(std::max(r, std::floor(std::min(per_tensor, most) / r) * r));
    t.whole_numel = t.numel;
    t.row = row == 0 ? 0 : static_cast<std::int64_t>(row);
    const halfstep::MomentBlocks b = halfstep::moment_blocks(config, t);
    const double codes = a.moments;  // a byte per moment; the step reads and writes each once
    if (b.quantized) {
      const double scales = 2.0 * 4.0 * static_cast<double>(b.blocks) / static_cast<double>(t.numel);
      a.moments = codes + scales;
      a.moved += 2.0 * scales;
      a.slack = 255;  // a cut moves to the next block start (halfstep::even_shard with the layout)
    } else {
      a.wide = true;
      a.moments = 8.0;
      a.moved += 2.0 * (8.0 - codes);
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  // An H200 has 141 GB (10^9 bytes) of HBM3e on its datasheet; CUDA reports 143156 MiB, 139.8 GiB,
  // as its total memory (totalGlobalMem; nvidia-smi shows 143771 MiB, counting what the driver
  // keeps). The default was 141 GiB, 1.2 GiB more than the device has.
  double params = 0, memory = 143156.0 * 1024 * 1024, tensors = 0, groups = 2, ranks = 1, row = 0;
  std::string grad = "f16", model, master = "f32", moments = "f32";
  bool formats = false;
  const Units counts = {{"K", 1e3}, {"M", 1e6}, {"B", 1e9}, {"G", 1e9}, {"T", 1e12}};
  const Units sizes = {{"B", 1},         {"KB", 1e3},          {"MB", 1e6},
                       {"GB", 1e9},      {"TB", 1e12},         {"KiB", 1024.0},
                       {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  CLI::App app(kDescription, "halfstep-plan");
  app.footer(kFooter);
  app.set_version_flag("--version", std::string("halfstep-plan ") + halfstep::version());
  app.add_option("--params", params, "parameters: a number (7e9, 1500000) or with K, M, B or T (350M, 7B)")
      ->required()
      ->transform(amount(counts, "N"));
  app.add_option("--grad", grad,
                 "gradient format (default f16; f32: fp32 parameters, trained under autocast)")
      ->check(CLI::IsMember({"f16", "bf16", "f32"}));
  app.add_option("--model", model,
                 "model copy format (default: the gradients' for f16 and bf16, none for f32; none: no\n"
                 "copy is written)")
      ->check(CLI::IsMember({"f16", "bf16", "none"}));
  app.add_option("--master", master,
                 "master format: f32 (default), bf16_remainder (a bf16 model copy and an int16\n"
                 "remainder rebuild the fp32 master exactly), or none (no master: the bf16 model\n"
                 "copy is the weight, updated with stochastic rounding); the last two need --model bf16")
      ->check(CLI::IsMember({"f32", "bf16_remainder", "none"}));
  app.add_option("--moments", moments,
                 "Adam moments' format (both moments): f32 (default), bf16, or block8 (8-bit codes and\n"
                 "an fp32 scale per block of 256 elements of a row)")
      ->check(CLI::IsMember({"f32", "bf16", "block8"}));
  app.add_option("--row", row,
                 "elements per row of the tensors, for block8's blocks (default: each tensor one row;\n"
                 "a weight's fan-in, e.g. 4096)")
      ->transform(amount(counts, "N"));
  app.add_flag("--formats", formats, "also print every state format's bytes and the largest model that fits");
  app.add_option("--memory", memory,
                 "device memory: bytes, or with KB MB GB TB (10^3) or KiB MiB GiB TiB (2^10)\n"
                 "(default 143156MiB, 139.8 GiB: an H200's as CUDA reports it)")
      ->transform(amount(sizes, "SIZE"));
  app.add_option("--tensors", tensors, "parameter tensors, for the workspace (default: one per 4M parameters)")
      ->transform(amount(counts, "N"));
  app.add_option("--groups", groups, "parameter groups (default 2)")->transform(amount(counts, "N"));
  app.add_option("--ranks", ranks,
                 "data-parallel ranks, one GPU each, with ZeRO-1: the masters and moments\n"
                 "sharded, the gradients and model copy on every rank (default 1)")
      ->transform(amount(counts, "N"));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto fail = [](const std::string& what) {
    std::fprintf(stderr, "halfstep-plan: %s\nRun with --help for the options.\n", what.c_str());
    return 2;
  };
  if (params != std::floor(params)) return fail("--params must be a whole number of parameters");
  if (tensors == 0) tensors = std::max(1.0, std::ceil(params / 4e6));
  if (tensors != std::floor(tensors) || tensors > params) {
    return fail("--tensors must be a whole number no larger than --params");
  }
  if (groups != std::floor(groups) || groups > 1e6) return fail("--groups must be a whole number up to 10^6");
  // Ranks are numbered by std::int32_t (halfstep::Distributed), and each must hold a parameter.
  if (ranks != std::floor(ranks) || ranks > 2147483647.0 || ranks > params) {
    return fail("--ranks must be a whole number up to 2^31 - 1 and no larger than --params");
  }

  if (row != 0 && moments != "block8" && !formats) {
    return fail("--row says where block8's blocks lie: give it with --moments block8 or --formats");
  }
  if (row != std::floor(row)) return fail("--row must be a whole number of elements");
  if (row > params / tensors) return fail("--row must be no longer than a tensor (--params / --tensors)");

  if (model.empty()) model = grad == "f32" ? "none" : grad;
  if (master != "f32" && model != "bf16") {
    return fail("--master " + master +
                (master == "none" ? ": the bf16 model copy is the weight" : ": the master is a bf16 model copy and an int16 remainder") +
                "; the model copy is " + (model == "none" ? std::string("none") : model) + " (give --model bf16, or --grad bf16)");
  }
  const double per_tensor = params / tensors;
  const Accounting held = account(grad, model, master, moments, per_tensor, row);
  const double grad_bytes = held.gradient;
  const double model_bytes = held.model;
  const double state_bytes = held.state();
  const bool sharded = ranks > 1;
  const RankPlan mine = plan_rank(params, tensors, groups, ranks, grad_bytes, model_bytes, state_bytes, held.slack);

  std::printf("halfstep-plan: %.4g parameters in %.*g tensors, %s gradients, %s model copy", params,
              tensors < 1e9 ? 9 : 4, tensors, grad.c_str(), model == "none" ? "no" : model.c_str());
  if (sharded) std::printf(", ZeRO-1 over %.10g ranks", ranks);
  std::printf("\n\n  %-34s %11s  %12s\n", "component", "bytes/param", sharded ? "per rank" : "total");
  // bytes/param: what the rank holds per parameter of the whole model.
  auto line = [&](const std::string& name, long double bytes) {
    std::printf("  %-34s %11.4Lg  %12s\n", name.c_str(), bytes / params, bytes_text(bytes).c_str());
  };
  const std::string share = sharded ? ", sharded" : "", whole = sharded ? ", on every rank" : "";
  if (master == "bf16_remainder") {
    line("int16 master remainders" + share, 2.0L * mine.shard);
  } else if (master == "none") {
    line("no master (the model copy is it)", 0.0L);
  } else {
    line(std::string(grad == "f32" && model == "none" && !sharded ? "fp32 masters (the parameters)" : "fp32 master weights") +
            share,
        4.0L * mine.shard);
  }
  const std::string moment_name = moments == "block8"
                                      ? (held.wide ? "fp32 moments (small for block8)"
                                                   : "8-bit moments and scales")
                                      : (moments == "f32" ? "fp32" : "bf16") + std::string(" Adam moments (m, v)");
  line(moment_name + share, static_cast<long double>(held.moments) * mine.shard);
  line(grad + " gradients" + whole, static_cast<long double>(grad_bytes) * mine.padded);
  if (model_bytes > 0) line(model + " model copy" + whole, 2.0L * mine.padded);
  if (mine.workspace >= 0) {
    line("step workspace", mine.workspace);
  } else {
    std::printf("  %-34s %11s  %12s\n", "step workspace", "-", "-");
  }
  line("total", mine.total);

  // The most parameters that fit, by bisection on the same accounting (tensors of the same
  // average size, the same ranks), within what one step can hold on each rank.
  const double most_per_step = 2147483647.0 * static_cast<double>(halfstep::chunk_elements());
  const double lo = most_that_fit(memory, per_tensor, groups, ranks, grad_bytes, model_bytes, state_bytes, held.slack);
  if (mine.workspace < 0) {
    std::printf("\n  one step holds at most 2^31 - 1 chunks of %lld parameters (%.4g): %s\n",
                static_cast<long long>(halfstep::chunk_elements()), most_per_step,
                sharded ? "a rank's shard does\n  NOT fit one FusedAdamW; shard it across more ranks"
                        : "this does NOT fit one\n  FusedAdamW; shard it across ranks");
  }
  const bool fits = mine.workspace >= 0 && mine.total <= memory;
  if (sharded) {
    std::printf("\n  in %s per GPU: %s; at most %.4g parameters fit on %.10g GPUs (a shard of %.4g on each)\n",
                bytes_text(memory).c_str(), fits ? "fits" : "does NOT fit", lo, ranks, std::ceil(lo / ranks));
  } else {
    std::printf("\n  in %s: %s; at most %.4g parameters fit\n", bytes_text(memory).c_str(),
                fits ? "fits" : "does NOT fit", lo);
  }
  std::printf("  (activations, the forward and backward passes' buffers and the framework's own are not counted)\n");
  std::printf("\n  one applied step moves %.4g bytes per parameter (pass 1 reads the gradients; pass 2 reads them,\n"
              "  reads and writes the masters and moments, %s the model copy)\n",
              held.moved, master == "f32" ? "writes" : "reads and writes");
  if (formats) {
    // Every state format of these gradients and model copy, the same accounting.
    std::printf("\n  %-34s %9s %9s  %s\n", "state format (master, moments)", "held B/p", "moved B/p",
                sharded ? "largest model on these GPUs" : "largest model that fits");
    for (const char* m : {"f32", "bf16_remainder", "none"}) {
      if (std::string(m) != "f32" && model != "bf16") continue;
      for (const char* v : {"f32", "bf16", "block8"}) {
        const Accounting b = account(grad, model, m, v, per_tensor, row);
        const double most = most_that_fit(memory, per_tensor, groups, ranks, b.gradient, b.model, b.state(), b.slack);
        std::printf("  %-34s %9.4g %9.4g  %.4g parameters%s\n", (std::string(m) + ", " + v).c_str(),
                    b.state() / ranks + b.gradient + b.model, b.moved, most,
                    std::string(m) == master && std::string(v) == moments ? "  (this plan)" : "");
      }
    }
  }
  return 0;
}
