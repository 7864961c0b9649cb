// Test helper: one flat parameter space, stepped unsharded on one rank and sharded over N ranks,
// with the gradients of every step drawn in advance (so ranks that run as threads only read them).
// Shared by the host tests (reference backend, records reduced by HostAllReduce) and the GPU
// suite (cuda backend, records reduced by NCCL).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "halfstep/distributed.hpp"
#include "halfstep/formats.hpp"
#include "halfstep/state.hpp"
#include "halfstep/step.hpp"

namespace halfstep_test {

/// The five buffers of a flat range of the parameter space, on the host, the state in `format`:
/// fp32 masters and moments in master, exp_avg, exp_avg_sq; a remainder master's int16 bits in
/// remainder (beside the bf16 model); no master (MasterFormat::none): master empty, the bf16 model
/// is the weight; bf16 moments' bits in exp_avg16, exp_avg_sq16.
struct FlatBuffers {
  std::vector<float> master, exp_avg, exp_avg_sq;
  std::vector<std::uint16_t> grad, model;
  std::vector<std::uint16_t> remainder, exp_avg16, exp_avg_sq16;
  halfstep::StateFormat format{};

  std::int64_t numel() const { return static_cast<std::int64_t>(grad.size()); }
  halfstep::ParamTensor view() {
    using halfstep::MasterFormat;
    using halfstep::MomentFormat;
    halfstep::ParamTensor p;
    p.master = format.master == MasterFormat::f32              ? static_cast<void*>(master.data())
               : format.master == MasterFormat::bf16_remainder ? static_cast<void*>(remainder.data())
                                                               : nullptr;
    p.grad = grad.data();
    p.exp_avg = format.exp_avg == MomentFormat::f32 ? static_cast<void*>(exp_avg.data()) : exp_avg16.data();
    p.exp_avg_sq = format.exp_avg_sq == MomentFormat::f32 ? static_cast<void*>(exp_avg_sq.data()) : exp_avg_sq16.data();
    p.model = model.data();
    p.numel = numel();
    return p;
  }
  /// `more`'s elements after these (shards joined in rank order).
  void append(const FlatBuffers& more) {
    auto join = [](auto& to, const auto& from) { to.insert(to.end(), from.begin(), from.end()); };
    join(master, more.master);
    join(exp_avg, more.exp_avg);
    join(exp_avg_sq, more.exp_avg_sq);
    join(grad, more.grad);
    join(model, more.model);
    join(remainder, more.remainder);
    join(exp_avg16, more.exp_avg16);
    join(exp_avg_sq16, more.exp_avg_sq16);
    format = more.format;
  }
  /// Elements [begin, end).
  FlatBuffers slice(std::int64_t begin, std::int64_t end) const {
    auto cut = [&](const auto& v) {
      return v.empty() ? v : std::decay_t<decltype(v)>(v.begin() + begin, v.begin() + end);
    };
    return FlatBuffers{cut(master),    cut(exp_avg),   cut(exp_avg_sq),   cut(grad), cut(model),
                       cut(remainder), cut(exp_avg16), cut(exp_avg_sq16), format};
  }
  bool operator==(const FlatBuffers& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
    };
    return same(master, o.master) && same(exp_avg, o.exp_avg) && same(exp_avg_sq, o.exp_avg_sq) &&
           same(grad, o.grad) && same(model, o.model) && same(remainder, o.remainder) &&
           same(exp_avg16, o.exp_avg16) && same(exp_avg_sq16, o.exp_avg_sq16);
  }

  /// These buffers with their state in `to` (from fp32 state: masters split into a bf16 model and
  /// remainders, or dropped for the bf16 model rounded from them, which needs a bf16 model copy;
  /// moments rounded to bf16, to nearest even).
  FlatBuffers in_format(const halfstep::StateFormat& to) const {
    using halfstep::MasterFormat;
    using halfstep::MomentFormat;
    FlatBuffers out = as_f32();
    out.format = to;
    const auto n = static_cast<std::size_t>(numel());
    if (to.master == MasterFormat::bf16_remainder) {
      out.remainder.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        std::uint32_t b;
        std::memcpy(&b, &out.master[i], sizeof b);
        std::int16_t r = 0;
        halfstep::split_master(halfstep::canonical_master(b), out.model[i], r);
        out.remainder[i] = static_cast<std::uint16_t>(r);
      }
      out.master.clear();
    }
    if (to.master == MasterFormat::none) {
      for (std::size_t i = 0; i < n; ++i) out.model[i] = halfstep::to_bits16(halfstep::DType::bf16, out.master[i]);
      out.master.clear();
    }
    auto narrow = [n](std::vector<float>& wide, std::vector<std::uint16_t>& bits) {
      bits.resize(n);
      for (std::size_t i = 0; i < n; ++i) bits[i] = halfstep::to_bits16(halfstep::DType::bf16, wide[i]);
      wide.clear();
    };
    if (to.exp_avg == MomentFormat::bf16) narrow(out.exp_avg, out.exp_avg16);
    if (to.exp_avg_sq == MomentFormat::bf16) narrow(out.exp_avg_sq, out.exp_avg_sq16);
    return out;
  }
  /// These buffers with fp32 state (exact: remainders joined, a master-free weight widened, bf16
  /// moments widened).
  FlatBuffers as_f32() const {
    using halfstep::MasterFormat;
    using halfstep::MomentFormat;
    FlatBuffers out = *this;
    const auto n = static_cast<std::size_t>(numel());
    if (format.master == MasterFormat::bf16_remainder) {
      out.master.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint32_t b = halfstep::join_master(model[i], static_cast<std::int16_t>(remainder[i]));
        std::memcpy(&out.master[i], &b, sizeof b);
      }
      out.remainder.clear();
    }
    if (format.master == MasterFormat::none) {
      out.master.resize(n);
      for (std::size_t i = 0; i < n; ++i) out.master[i] = static_cast<float>(halfstep::from_bits16(halfstep::DType::bf16, model[i]));
    }
    auto widen = [n](std::vector<std::uint16_t>& bits, std::vector<float>& wide) {
      wide.resize(n);
      for (std::size_t i = 0; i < n; ++i) wide[i] = static_cast<float>(halfstep::from_bits16(halfstep::DType::bf16, bits[i]));
      bits.clear();
    };
    if (format.exp_avg == MomentFormat::bf16) widen(out.exp_avg16, out.exp_avg);
    if (format.exp_avg_sq == MomentFormat::bf16) widen(out.exp_avg_sq16, out.exp_avg_sq);
    out.format = halfstep::StateFormat{};
    return out;
  }
};

/// A parameter space: tensor sizes and groups, the initial buffers, and the gradients of every
/// step (inf on one element now and then, a 100x spike now and then).
struct ShardedCase {
  std::vector<halfstep::ParamTensor> layout;  // numel, group and duplicate only
  FlatBuffers initial;
  std::vector<std::vector<std::uint16_t>> grads;  // per step, the whole flat space
  halfstep::StepConfig config;

  std::int64_t numel() const { return initial.numel(); }

  /// A case with its state held in `format`: the same values in every format (the initial moments
  /// are zero, and with a bf16 model the masters are canonical, as a step stores them).
  static ShardedCase make(std::uint64_t seed, halfstep::DType dtype, int steps, std::int64_t max_tensor,
                          const halfstep::StateFormat& format) {
    ShardedCase c = make(seed, dtype, steps, max_tensor);
    c.config.state = format;
    if (dtype == halfstep::DType::bf16) {
      for (float& m : c.initial.master) {
        std::uint32_t b;
        std::memcpy(&b, &m, sizeof b);
        b = halfstep::canonical_master(b);
        std::memcpy(&m, &b, sizeof b);
      }
    }
    c.initial = c.initial.in_format(format);
    return c;
  }

  static ShardedCase make(std::uint64_t seed, halfstep::DType dtype, int steps, std::int64_t max_tensor) {
    std::mt19937_64 rng(seed);
    ShardedCase c;
    c.config.grad_dtype = dtype;
    c.config.model_dtype = dtype;
    c.config.groups.resize(2);
    c.config.groups[1].lr = 3e-3f;
    c.config.groups[1].weight_decay = 0.1f;
    c.config.max_grad_norm = 0.3f;
    c.config.scaler.init_scale = dtype == halfstep::DType::f16 ? 1024.0f : 1.0f;
    c.config.scaler.growth_interval = 60;
    c.config.scaler.hysteresis = 2;
    c.config.spike.enabled = true;
    c.config.spike.warmup_steps = 10;
    c.config.spike.z_threshold = 4.0f;
    c.config.spike.action = halfstep::SpikeConfig::Action::skip;
    const int n_tensors = 3 + static_cast<int>(rng() % 8);
    std::int64_t total = 0;
    for (int t = 0; t < n_tensors; ++t) {
      halfstep::ParamTensor p;
      p.numel = t == 2 ? 0 : static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(max_tensor)) + 1;
      p.group = static_cast<std::int32_t>(rng() % 2);
      c.layout.push_back(p);
      total += p.numel;
    }
    std::uniform_real_distribution<float> w(-1.0f, 1.0f);
    std::normal_distribution<double> g(0.0, 1e-2);
    const auto n = static_cast<std::size_t>(total);
    c.initial.master.resize(n);
    c.initial.exp_avg.assign(n, 0.0f);
    c.initial.exp_avg_sq.assign(n, 0.0f);
    c.initial.grad.assign(n, 0);
    c.initial.model.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      c.initial.master[i] = w(rng);
      c.initial.model[i] = halfstep::to_bits16(dtype, c.initial.master[i]);
    }
    // Gradients as a scaled loss at the initial scale would give them (the scale the run then
    // has differs by a few powers of two, which the spike statistics absorb).
    for (int s = 0; s < steps; ++s) {
      std::vector<std::uint16_t> step(n);
      const double spike = s >= 20 && s % 25 == 5 ? 100.0 : 1.0;  // after the warm-up
      const double scale = c.config.scaler.init_scale;
      for (auto& x : step) x = halfstep::to_bits16(dtype, g(rng) * spike * scale);
      if (n > 0 && rng() % 17 == 0) step[rng() % n] = dtype == halfstep::DType::f16 ? 0x7C00 : 0xFF80;
      c.grads.push_back(std::move(step));
    }
    return c;
  }

  /// The whole space as tensors pointing into `flat`, one per layout entry (empty ones too, so
  /// tensor indices are the layout's).
  std::vector<halfstep::ParamTensor> whole(FlatBuffers& flat) const { return whole(flat.view()); }
  /// The same over the whole space's buffers `all` (host or device memory), in config's formats.
  std::vector<halfstep::ParamTensor> whole(const halfstep::ParamTensor& all) const {
    std::vector<halfstep::ParamTensor> out;
    std::int64_t at = 0;
    for (const halfstep::ParamTensor& t : layout) {
      halfstep::ParamTensor p = t;
      for (const halfstep::SlotLayout& slot : halfstep::slot_layouts(config)) {
        auto* base = static_cast<unsigned char*>(const_cast<void*>(halfstep::slot_pointer(all, slot.slot)));
        halfstep::set_slot_pointer(p, slot.slot, base != nullptr ? base + at * static_cast<std::int64_t>(slot.element_bytes) : nullptr);
      }
      out.push_back(p);
      at += t.numel;
    }
    return out;
  }

  /// N ranges that cut the space anywhere (some empty when N is large), from `seed`.
  std::vector<std::pair<std::int64_t, std::int64_t>> random_cuts(int ranks, std::uint64_t seed) const {
    std::mt19937_64 rng(seed);
    std::vector<std::int64_t> cuts(static_cast<std::size_t>(ranks - 1));
    for (auto& x : cuts) x = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(numel() + 1));
    std::sort(cuts.begin(), cuts.end());
    std::vector<std::pair<std::int64_t, std::int64_t>> out;
    std::int64_t at = 0;
    for (std::int64_t c : cuts) {
      out.emplace_back(at, c);
      at = c;
    }
    out.emplace_back(at, numel());
    return out;
  }
};

/// Field-by-field, bitwise equality of two reports of the same step, the first inf/NaN compared
/// as (global tensor) through `map` (rank, local tensor) -> global tensor. held_elements is each
/// rank's own count (pass 2 is local), so it is not compared here.
template <class Map>
bool same_report(const halfstep::StepReport& a, const halfstep::StepReport& unsharded, Map map) {
  auto bits = [](const auto& x, const auto& y) { return std::memcmp(&x, &y, sizeof x) == 0; };
  const std::int32_t first = a.first_nonfinite_tensor < 0 ? -1 : map(a.first_nonfinite_rank, a.first_nonfinite_tensor);
  return a.attempt == unsharded.attempt && a.step == unsharded.step && a.outcome == unsharded.outcome &&
         a.reason == unsharded.reason && a.spike == unsharded.spike && bits(a.scale_used, unsharded.scale_used) &&
         bits(a.scale_next, unsharded.scale_next) && bits(a.grad_norm, unsharded.grad_norm) &&
         bits(a.clip_coef, unsharded.clip_coef) && a.nonfinite_count == unsharded.nonfinite_count &&
         first == unsharded.first_nonfinite_tensor && bits(a.max_abs_scaled, unsharded.max_abs_scaled) &&
         bits(a.headroom_log2, unsharded.headroom_log2) && a.subnormal_count == unsharded.subnormal_count &&
         a.zero_count == unsharded.zero_count && a.numel == unsharded.numel;
}

}  // namespace halfstep_test
