// halfstep-plan: what one training step's optimizer-side buffers cost in device memory, and how
// many parameters fit in a given amount of it.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <halfstep/fused_adamw.hpp>

namespace {

const char* kUsage = R"(usage: halfstep-plan --params N [--grad f16|bf16] [--model f16|bf16|none]
                     [--memory SIZE] [--tensors N] [--groups N]

Prints the device memory of halfstep's per-parameter buffers — fp32 master weights (4 B),
fp32 Adam moments (8 B), the 16-bit gradients (2 B), the 16-bit model copy (2 B, or none) — and
the step's workspace, then how many parameters fit in --memory.

  --params N     parameters: a number (7e9, 1500000) or with K, M, B or T (350M, 7B)
  --grad         gradient format (default f16)
  --model        model copy format (default f16; none: no copy is written)
  --memory SIZE  device memory: bytes, or with KB MB GB TB (10^3) or KiB MiB GiB TiB (2^10)
                 (default 141GiB, an H200)
  --tensors N    parameter tensors, for the workspace (default: one per 4M parameters)
  --groups N     parameter groups (default 2)
Activations, the forward and backward passes' workspace and the framework's own buffers are
not counted.
)";

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "halfstep-plan: %s\n\n%s", what.c_str(), kUsage);
  std::exit(2);
}

// A positive number with an optional unit suffix from `units` (suffix, multiplier).
double parse_amount(const std::string& flag, const std::string& text,
                    const std::vector<std::pair<std::string, double>>& units) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str()) fail(flag + " needs a number, got '" + text + "'");
  const std::string suffix(end);
  double mult = 1.0;
  if (!suffix.empty()) {
    bool known = false;
    for (const auto& [name, m] : units) {
      if (suffix == name) {
        mult = m;
        known = true;
      }
    }
    if (!known) fail(flag + ": unknown unit '" + suffix + "' in '" + text + "'");
  }
  const double x = v * mult;
  if (!std::isfinite(x) || !(x > 0)) fail(flag + " must be a positive number, got '" + text + "'");
  return x;
}

std::string bytes_text(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024.0 && u < 5) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", b, units[u]);
  return buf;
}

double workspace(double params, double tensors, double groups) {
  const auto t = static_cast<std::int64_t>(tensors);
  const auto per = static_cast<std::int64_t>(std::ceil(params / tensors));
  return static_cast<double>(halfstep::workspace_bytes(std::vector<std::int64_t>(static_cast<std::size_t>(t), per),
                                                       static_cast<std::size_t>(groups)));
}

}  // namespace

int main(int argc, char** argv) {
  double params = -1, memory = 141.0 * 1024 * 1024 * 1024, tensors = -1, groups = 2;
  std::string grad = "f16", model = "f16";
  const std::vector<std::pair<std::string, double>> counts = {{"K", 1e3}, {"M", 1e6}, {"B", 1e9}, {"G", 1e9}, {"T", 1e12}};
  const std::vector<std::pair<std::string, double>> sizes = {
      {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
      {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (i + 1 >= argc) fail(a + (a.rfind("--", 0) == 0 ? " needs a value" : ": unexpected argument"));
    const std::string v = argv[++i];
    if (a == "--params") params = parse_amount(a, v, counts);
    else if (a == "--memory") memory = parse_amount(a, v, sizes);
    else if (a == "--tensors") tensors = parse_amount(a, v, counts);
    else if (a == "--groups") groups = parse_amount(a, v, counts);
    else if (a == "--grad") grad = v;
    else if (a == "--model") model = v;
    else fail("unknown option '" + a + "'");
  }
  if (params < 0) fail("--params is required");
  if (params != std::floor(params)) fail("--params must be a whole number of parameters");
  if (grad != "f16" && grad != "bf16") fail("--grad must be f16 or bf16, got '" + grad + "'");
  if (model != "f16" && model != "bf16" && model != "none") fail("--model must be f16, bf16 or none, got '" + model + "'");
  if (tensors < 0) tensors = std::max(1.0, std::ceil(params / 4e6));
  if (tensors != std::floor(tensors) || tensors > params) fail("--tensors must be a whole number no larger than --params");

  const double model_bytes = model == "none" ? 0.0 : 2.0;
  const double per_param = 4.0 + 8.0 + 2.0 + model_bytes;
  const double ws = workspace(params, tensors, groups);
  const double total = per_param * params + ws;

  std::printf("halfstep-plan: %.4g parameters in %.0f tensors, %s gradients, %s model copy\n\n", params,
              tensors, grad.c_str(), model == "none" ? "no" : model.c_str());
  std::printf("  %-26s %11s  %12s\n", "component", "bytes/param", "total");
  auto row = [&](const char* name, double bpp, double bytes) {
    std::printf("  %-26s %11.4g  %12s\n", name, bpp, bytes_text(bytes).c_str());
  };
  row("fp32 master weights", 4, 4 * params);
  row("fp32 Adam moments (m, v)", 8, 8 * params);
  row((grad + " gradients").c_str(), 2, 2 * params);
  if (model_bytes > 0) row((model + " model copy").c_str(), 2, 2 * params);
  row("step workspace", ws / params, ws);
  row("total", total / params, total);

  // The largest parameter count that fits, by bisection on the same accounting.
  double lo = 0, hi = memory / per_param + 1;
  for (int i = 0; i < 200 && hi - lo > 0.5; ++i) {
    const double mid = std::floor((lo + hi) / 2);
    const double t = std::max(1.0, std::ceil(mid / (params / tensors)));
    (mid > 0 && per_param * mid + workspace(mid, t, groups) <= memory ? lo : hi) = mid;
  }
  std::printf("\n  in %s: %s; at most %.4g parameters fit\n", bytes_text(memory).c_str(),
              total <= memory ? "fits" : "does NOT fit", lo);
  std::printf("  (activations, the forward and backward passes' buffers and the framework's own are not counted)\n");
  return 0;
}
