// Test tool for full checkpoints: `write DIR` runs a small model five steps on the reference
// backend and saves DIR/halfstep.safetensors with DIR/expected.txt (name, dtype, elements and an
// FNV-1a hash of each stored tensor's bytes, and the caller's metadata); `resume FILE` loads FILE
// into a fresh optimizer and checks that three more steps match, bit for bit, three more steps of
// the original run. Exits non-zero with a message otherwise.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/safetensors.hpp"
#include "host_buffers.hpp"

using namespace halfstep;
using halfstep_test::HostModel;

namespace {

const std::vector<std::string> kNames = {"encoder.weight", "encoder.bias", "head.weight"};

StepConfig config() {
  StepConfig c;
  c.groups.resize(2);
  c.groups[0].weight_decay = 0.01f;
  c.max_grad_norm = 1.0f;
  c.scaler.growth_interval = 2;
  c.spike.enabled = true;
  c.spike.warmup_steps = 2;
  return c;
}

HostModel initial(bool zero) {
  HostModel m = halfstep_test::random_model(11, {100, 7, 33}, 65536.0f, DType::f16, DType::f16);
  m.tensors[1].group = 1;
  m.tensors[2].with_model = false;
  if (zero) {
    for (auto& t : m.tensors) {
      std::fill(t.master.begin(), t.master.end(), 0.0f);
      std::fill(t.exp_avg.begin(), t.exp_avg.end(), 0.0f);
      std::fill(t.exp_avg_sq.begin(), t.exp_avg_sq.end(), 0.0f);
      std::fill(t.model.begin(), t.model.end(), std::uint16_t{0});
    }
  }
  return m;
}

// Steps [from, to) of the run: seeded gradients, an overflow at step 2, an lr change at step 1.
void run(FusedAdamW& opt, HostModel& m, int from, int to) {
  for (int step = from; step < to; ++step) {
    std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(step));
    for (auto& t : m.tensors) halfstep_test::refill_grads(rng, t, DType::f16, opt.loss_scale());
    if (step == 2) m.tensors[0].grad[3] = 0x7C00;
    if (step == 1) opt.set_lr(1, 5e-4f);
    opt.step();
  }
}

std::uint64_t fnv(const void* p, std::size_t n) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 0x100000001b3ull;
  return h;
}

int write(const std::string& dir) {
  HostModel m = initial(false);
  FusedAdamW opt(m.views(), config(), Backend::reference);
  run(opt, m, 0, 5);
  CheckpointOptions options;
  options.metadata["epoch"] = "3";
  options.metadata["note"] = "written by halfstep's checkpoint test";
  save_checkpoint(opt, kNames, dir + "/halfstep.safetensors", options);
  std::ofstream out(dir + "/expected.txt");
  for (std::size_t t = 0; t < m.tensors.size(); ++t) {
    const auto& x = m.tensors[t];
    auto line = [&](const std::string& name, const char* dtype, const void* p, std::size_t bytes, std::size_t n) {
      out << name << " " << dtype << " " << n << " " << fnv(p, bytes) << "\n";
    };
    line(kNames[t], "F32", x.master.data(), x.master.size() * 4, x.master.size());
    line(kNames[t] + ".exp_avg", "F32", x.exp_avg.data(), x.exp_avg.size() * 4, x.master.size());
    line(kNames[t] + ".exp_avg_sq", "F32", x.exp_avg_sq.data(), x.exp_avg_sq.size() * 4, x.master.size());
    if (x.with_model) line(kNames[t] + ".model", "F16", x.model.data(), x.model.size() * 2, x.master.size());
  }
  out << "meta epoch 3\n";
  return out.good() ? 0 : 1;
}

int resume(const std::string& file) {
  HostModel original = initial(false);
  FusedAdamW a(original.views(), config(), Backend::reference);
  run(a, original, 0, 8);

  HostModel fresh = initial(true);
  FusedAdamW b(fresh.views(), config(), Backend::reference);
  const auto meta = load_checkpoint(b, kNames, file);
  if (meta.count("epoch") == 0 || meta.at("epoch") != "3") {
    std::fprintf(stderr, "the caller's metadata did not come back\n");
    return 1;
  }
  run(b, fresh, 5, 8);
  for (std::size_t t = 0; t < fresh.tensors.size(); ++t) {
    halfstep_test::HostTensor x = fresh.tensors[t];
    if (!x.with_model) x.model = original.tensors[t].model;  // a buffer the optimizer does not own
    if (!(x == original.tensors[t])) {
      std::fprintf(stderr, "tensor %zu differs after resuming from %s\n", t, file.c_str());
      return 1;
    }
  }
  if (!(a.state() == b.state()) || a.learning_rates() != b.learning_rates()) {
    std::fprintf(stderr, "the optimizer state differs after resuming from %s\n", file.c_str());
    return 1;
  }
  std::printf("resumed from %s: 3 more steps bitwise equal to the uninterrupted run\n", file.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s write DIR | resume FILE\n", argv[0]);
    return 2;
  }
  try {
    if (std::strcmp(argv[1], "write") == 0) return write(argv[2]);
    if (std::strcmp(argv[1], "resume") == 0) return resume(argv[2]);
  } catch (const Error& e) {
    std::fprintf(stderr, "halfstep::Error: %s\n", e.what());
    return 1;
  }
  return 2;
}
