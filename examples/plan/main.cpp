// halfstep-plan: what one training step's optimizer-side buffers cost in device memory, and how
// many parameters fit in a given amount of it. Everything is computed in closed form, so any
// parameter count answers at once.
#include <CLI/CLI.hpp>

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

const char* kDescription = R"(halfstep-plan: prints the device memory of halfstep's per-parameter buffers — fp32 master
weights (4 B), fp32 Adam moments (8 B), the 16-bit gradients (2 B), the 16-bit model copy (2 B,
or none) — and the step's workspace, then how many parameters fit in --memory.)";

const char* kFooter = R"(
Activations, the forward and backward passes' workspace and the framework's own buffers are not
counted. One FusedAdamW step holds at most 2^31 - 1 chunks of 32768 parameters (7.0e13); a larger
model is sharded across ranks (ZeRO), each planning its own shard.
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

std::string bytes_text(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (b >= 1024.0 && u < 6) {
    b /= 1024.0;
    ++u;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.2f %s", b, units[u]);
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

}  // namespace

int main(int argc, char** argv) {
  double params = 0, memory = 141.0 * 1024 * 1024 * 1024, tensors = 0, groups = 2;
  std::string grad = "f16", model = "f16";
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
  app.add_option("--grad", grad, "gradient format (default f16)")->check(CLI::IsMember({"f16", "bf16"}));
  app.add_option("--model", model, "model copy format (default f16; none: no copy is written)")
      ->check(CLI::IsMember({"f16", "bf16", "none"}));
  app.add_option("--memory", memory,
                 "device memory: bytes, or with KB MB GB TB (10^3) or KiB MiB GiB TiB (2^10)\n"
                 "(default 141GiB, an H200)")
      ->transform(amount(sizes, "SIZE"));
  app.add_option("--tensors", tensors, "parameter tensors, for the workspace (default: one per 4M parameters)")
      ->transform(amount(counts, "N"));
  app.add_option("--groups", groups, "parameter groups (default 2)")->transform(amount(counts, "N"));
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

  const double model_bytes = model == "none" ? 0.0 : 2.0;
  const double per_param = 4.0 + 8.0 + 2.0 + model_bytes;
  const double ws = workspace(params, tensors, groups);
  const double total = per_param * params + std::max(ws, 0.0);

  std::printf("halfstep-plan: %.4g parameters in %.*g tensors, %s gradients, %s model copy\n\n", params,
              tensors < 1e9 ? 9 : 4, tensors, grad.c_str(), model == "none" ? "no" : model.c_str());
  std::printf("  %-26s %11s  %12s\n", "component", "bytes/param", "total");
  auto row = [&](const char* name, double bpp, double bytes) {
    std::printf("  %-26s %11.4g  %12s\n", name, bpp, bytes_text(bytes).c_str());
  };
  row("fp32 master weights", 4, 4 * params);
  row("fp32 Adam moments (m, v)", 8, 8 * params);
  row((grad + " gradients").c_str(), 2, 2 * params);
  if (model_bytes > 0) row((model + " model copy").c_str(), 2, 2 * params);
  if (ws >= 0) {
    row("step workspace", ws / params, ws);
  } else {
    std::printf("  %-26s %11s  %12s\n", "step workspace", "-", "-");
  }
  row("total", total / params, total);

  // The most parameters that fit, by bisection on the same accounting (tensors of the same
  // average size), within what one step can hold.
  const double per_tensor = params / tensors;
  const double most_per_step = 2147483647.0 * static_cast<double>(halfstep::chunk_elements());
  double lo = 0, hi = std::min(memory / per_param, most_per_step) + 1;
  for (int i = 0; i < 200 && hi - lo > 0.5; ++i) {
    const double mid = std::floor((lo + hi) / 2);
    const double t = std::max(1.0, std::ceil(mid / per_tensor));
    const double w = workspace(mid, t, groups);
    (mid > 0 && w >= 0 && per_param * mid + w <= memory ? lo : hi) = mid;
  }
  if (ws < 0) {
    std::printf("\n  one step holds at most 2^31 - 1 chunks of %lld parameters (%.4g): this does NOT fit one\n"
                "  FusedAdamW; shard it across ranks\n",
                static_cast<long long>(halfstep::chunk_elements()), most_per_step);
  }
  std::printf("\n  in %s: %s; at most %.4g parameters fit\n", bytes_text(memory).c_str(),
              ws >= 0 && total <= memory ? "fits" : "does NOT fit", lo);
  std::printf("  (activations, the forward and backward passes' buffers and the framework's own are not counted)\n");
  return 0;
}
