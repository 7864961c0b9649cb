// Test helper: tensors with block8 moments (8-bit codes and block scales) on the host, whole or
// as pieces of a whole tensor, with seeded random weights and gradients.
#pragma once

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

using halfstep::DType;
using halfstep::MasterFormat;
using halfstep::ParamTensor;
using halfstep::StepConfig;

inline std::uint32_t bits_of(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
inline float float_of(std::uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// One tensor, or a piece [offset, offset + numel) of a whole tensor of `whole` elements in rows of
// `row`, with every buffer on the host.
struct Piece {
  std::int64_t whole = 0, row = 0, offset = 0, numel = 0;
  std::int32_t group = 0;
  std::vector<float> master;            // f32 masters
  std::vector<std::int16_t> rest;       // remainders
  std::vector<std::uint16_t> grad, model;
  std::vector<std::uint32_t> grad32;
  std::vector<std::uint8_t> m8, v8;     // codes of a quantized tensor
  std::vector<float> m32, v32;          // moments of a wide one
  std::vector<float> ms, vs;            // scales
};

/// The shape of a piece of a whole tensor.
struct PieceShape {
  std::int64_t whole, row, offset, numel;
  std::int32_t group;
};

inline ParamTensor shape_of(const Piece& p) {
  ParamTensor t;
  t.numel = p.numel;
  t.offset = p.offset;
  t.whole_numel = p.whole;
  t.row = p.row;
  t.group = p.group;
  t.tensor_id = 0;
  return t;
}

/// Sets the model copy (and remainders) from p.master: under remainders p.master becomes the
/// master the pair holds (canonical_master).
inline void set_weights(Piece& p, const StepConfig& c) {
  for (std::size_t i = 0; i < p.master.size(); ++i) {
    if (c.state.master == MasterFormat::bf16_remainder) {
      p.master[i] = float_of(halfstep::canonical_master(bits_of(p.master[i])));
      halfstep::split_master(bits_of(p.master[i]), p.model[i], p.rest[i]);
    } else {
      p.model[i] = halfstep::to_bits16(DType::bf16, p.master[i]);
    }
  }
}

/// Pieces of the given shapes with weights from N(0, 0.5) (a master the bf16 pair holds exactly
/// under remainders), moments at zero (codes of 0, scales 0; fp32 zeros where a tensor keeps wide
/// moments) and gradients of zero.
inline std::vector<Piece> make_pieces(const StepConfig& c, const std::vector<PieceShape>& shapes, std::mt19937_64& gen) {
  std::vector<Piece> out;
  std::normal_distribution<float> w(0.0f, 0.5f);
  for (const PieceShape& s : shapes) {
    Piece p;
    p.whole = s.whole, p.row = s.row, p.offset = s.offset, p.numel = s.numel, p.group = s.group;
    const auto n = static_cast<std::size_t>(s.numel);
    p.master.resize(n);
    for (float& x : p.master) x = w(gen);
    p.model.resize(n);
    p.rest.resize(n);
    p.grad.resize(n);
    p.grad32.resize(n);
    const halfstep::MomentBlocks b = halfstep::moment_blocks(c, shape_of(p));
    if (b.quantized) {
      p.m8.assign(n, 127);
      p.v8.assign(n, 0);
      p.ms.assign(static_cast<std::size_t>(b.blocks), 0.0f);
      p.vs.assign(static_cast<std::size_t>(b.blocks), 0.0f);
    } else {
      p.m32.assign(n, 0.0f);
      p.v32.assign(n, 0.0f);
    }
    out.push_back(std::move(p));
  }
  for (Piece& p : out) set_weights(p, c);
  return out;
}

/// New gradients for every piece: N(0, 0.01) times the loss scale, one in 97 thirty times larger.
inline void fill_grads(std::vector<Piece>& pieces, DType dtype, float scale, std::mt19937_64& gen) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  for (Piece& p : pieces) {
    for (std::size_t i = 0; i < p.grad.size(); ++i) {
      const float x = g(gen) * 0.01f * scale * (i % 97 == 0 ? 30.0f : 1.0f);
      p.grad[i] = halfstep::to_bits16(dtype == DType::f32 ? DType::bf16 : dtype, x);
      p.grad32[i] = bits_of(x);
    }
  }
}

/// The piece's host buffers as a ParamTensor under `c`.
inline ParamTensor host_view(Piece& p, const StepConfig& c) {
  ParamTensor t = shape_of(p);
  t.master = c.state.master == MasterFormat::f32 ? static_cast<void*>(p.master.data())
             : c.state.master == MasterFormat::bf16_remainder ? static_cast<void*>(p.rest.data()) : nullptr;
  t.grad = c.grad_dtype == DType::f32 ? static_cast<const void*>(p.grad32.data()) : static_cast<const void*>(p.grad.data());
  t.model = p.model.data();
  if (!p.m8.empty()) {
    t.exp_avg = p.m8.data();
    t.exp_avg_sq = p.v8.data();
    t.exp_avg_scale = p.ms.data();
    t.exp_avg_sq_scale = p.vs.data();
  } else {
    t.exp_avg = p.m32.data();
    t.exp_avg_sq = p.v32.data();
  }
  return t;
}

/// The weight of element i as stored.
inline double weight(const Piece& p, const StepConfig& c, std::size_t i) {
  if (c.state.master == MasterFormat::f32) return p.master[i];
  if (c.state.master == MasterFormat::none) return halfstep::from_bits16(DType::bf16, p.model[i]);
  return float_of(halfstep::join_master(p.model[i], p.rest[i]));
}

/// One rank's flat host buffers for [begin, end) of `layout` under `c` (the moments and scales
/// sized by shard_state, every byte zero) and the shard cut out of them. Not copyable: the shard
/// points into the buffers.
struct HostFlat {
  std::int64_t begin = 0, end = 0;
  std::vector<float> master;
  std::vector<std::int16_t> rest;
  std::vector<std::uint16_t> grad, model;
  std::vector<unsigned char> m, v;  // each piece's codes or fp32 moments, at 16-byte starts
  std::vector<float> ms, vs;
  halfstep::Shard shard;

  HostFlat(const std::vector<ParamTensor>& layout, const StepConfig& c, std::int64_t b, std::int64_t e)
      : begin(b), end(e) {
    const halfstep::ShardState sizes = halfstep::shard_state(layout, b, e, c);
    const auto n = static_cast<std::size_t>(e - b);
    master.assign(n, 0.0f);
    rest.assign(n, 0);
    grad.assign(n, 0);
    model.assign(n, 0);
    m.assign(static_cast<std::size_t>(sizes.exp_avg_bytes), 0);
    v.assign(static_cast<std::size_t>(sizes.exp_avg_sq_bytes), 0);
    ms.assign(static_cast<std::size_t>(sizes.scales), 0.0f);
    vs.assign(static_cast<std::size_t>(sizes.scales), 0.0f);
    ParamTensor flat;
    flat.numel = e - b;
    flat.master = c.state.master == MasterFormat::f32              ? static_cast<void*>(master.data())
                  : c.state.master == MasterFormat::bf16_remainder ? static_cast<void*>(rest.data())
                                                                   : nullptr;
    flat.grad = grad.data();
    flat.model = model.data();
    flat.exp_avg = m.data();
    flat.exp_avg_sq = v.data();
    flat.exp_avg_scale = ms.data();
    flat.exp_avg_sq_scale = vs.data();
    shard = halfstep::shard(layout, b, e, flat, c);
  }
  HostFlat(const HostFlat&) = delete;
  HostFlat& operator=(const HostFlat&) = delete;
};

}  // namespace halfstep_test
