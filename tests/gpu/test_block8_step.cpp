// Pass 2 with block8 moments (8-bit codes, a scale per block) against the reference backend: every
// master format, both roundings, whole tensors and pieces of them, rows of every kind (longer and
// shorter than a block, a chunk boundary inside a block), tensors that keep fp32 moments, and a
// block held because one of its weights would overflow.
//
// Each step starts both backends from the same stored state (the reference's), so what is
// compared is one step's arithmetic and nothing accumulates. Tolerances, derived:
// - the weight: the reference computes in double and rounds once; the kernel computes in fp32
//   (about 10 roundings of relative 2^-24 each in the update's chain, a few of them fused). Both
//   decode the same codes and scales, so the difference is at most ~16 fp32 ulps of the update's
//   terms: |Δw| <= 2^-19 · (|w| + lr · |update ratio|) plus one ulp of the stored
//   format (bf16 weights without a master round the two values alike except where they straddle a
//   rounding point: one bf16 ulp).
// - a block's scale is the largest magnitude of its new moments: relative 2^-18.
// - a code: the kernel's and the reference's inputs to the encoder differ by a few fp32 ulps, so a
//   code differs only where its value lies within those ulps of a decision point (a midpoint to
//   nearest, the stochastic threshold): by one code, at a rate below 1 in 200 (the fraction of a
//   cell a few ulps cover is about 2^-17 of the value over a gap of at least 1/142 of it).
// - held elements and the report: exactly equal.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "block8_pieces.hpp"
#include "gpu_support.hpp"
#include "halfstep/distributed.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/state.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

struct Setup {
  DType grad;
  MasterFormat master;
  Rounding rounding;
};

StepConfig config_of(const Setup& s) {
  StepConfig c;
  c.grad_dtype = s.grad;
  c.model_dtype = DType::bf16;
  c.compute_dtype = DType::bf16;
  c.scaler.init_scale = 1024.0f;
  c.max_grad_norm = 1.0f;
  c.groups.resize(2);
  c.groups[0].lr = 1e-3f;
  c.groups[0].weight_decay = 0.01f;
  c.groups[1].lr = 1e37f;  // the held block's group: a weight of 3.38e38 moving up by ~1e37 overflows
  c.groups[1].weight_decay = 0.0f;
  c.state.master = s.master;
  c.state.exp_avg = c.state.exp_avg_sq = MomentFormat::block8;
  c.state.rounding = s.rounding;
  c.state.seed = 77;
  return c;
}

// The model's pieces: random weights, empty moments. Pieces 0, 6, 7 and 8 have rows of a multiple
// of 8 elements (their blocks start at multiples of 8: pass 2's vector block loop where the buffers
// are aligned), the others do not (its scalar loop).
std::vector<Piece> make_model(const StepConfig& c, std::mt19937_64& gen) {
  std::vector<Piece> out = make_pieces(c, {
      {5000, 0, 0, 5000, 0},          // one row: 19 blocks of 256 and one of 136
      {9600, 100, 0, 9600, 0},        // rows of 100: a block a row
      {42000, 300, 0, 42000, 0},      // the chunk boundary 32768 inside a block of row 109
      {42000, 300, 15000, 18000, 0},  // a piece of it: rows 50 .. 109
      {100, 0, 0, 100, 0},            // too small: fp32 moments
      {8192, 16, 0, 8192, 0},         // rows shorter than 32: fp32 moments
      {4096, 512, 0, 4096, 1},        // the held block's tensor
      {8448, 264, 0, 8448, 0},        // rows of 264: a block of 256 and one of 8 (one lane's)
      {48000, 1000, 8000, 32000, 0}}, gen); // a piece, rows 8 .. 39 of rows of 1000 (blocks of 232 end them)
  out[6].master[300] = 3.38e38f;  // in block 1 (elements 256 .. 511); its gradient is negative
  set_weights(out[6], c);
  return out;
}

// New scaled gradients for every piece; the held weight's is negative, so that it moves up.
void fill_model_grads(std::vector<Piece>& pieces, DType dtype, float scale, std::mt19937_64& gen) {
  fill_grads(pieces, dtype, scale, gen);
  const float x = -0.05f * scale;
  pieces[6].grad[300] = to_bits16(dtype == DType::f32 ? DType::bf16 : dtype, x);
  pieces[6].grad32[300] = bits_of(x);
}

// Device copies of a piece's buffers.
struct DevicePiece {
  DeviceArray<float> master, m32, v32, ms, vs;
  DeviceArray<std::int16_t> rest;
  DeviceArray<std::uint16_t> grad, model;
  DeviceArray<std::uint32_t> grad32;
  DeviceArray<std::uint8_t> m8, v8;

  // `misaligned`: codes not 16-byte aligned (pass 2's scalar block loop for every piece).
  DevicePiece(const Piece& p, bool misaligned)
      : master(p.master.size(), 0), m32(p.m32.size(), 0), v32(p.v32.size(), 0), ms(p.ms.size(), 0),
        vs(p.vs.size(), 0), rest(p.rest.size(), 0), grad(p.grad.size(), 0), model(p.model.size(), 0),
        grad32(p.grad32.size(), 0), m8(p.m8.size(), misaligned ? 1 : 0), v8(p.v8.size(), misaligned ? 3 : 0) {}
  void upload(const Piece& p) {
    master.upload(p.master);
    m32.upload(p.m32);
    v32.upload(p.v32);
    ms.upload(p.ms);
    vs.upload(p.vs);
    rest.upload(p.rest);
    grad.upload(p.grad);
    model.upload(p.model);
    grad32.upload(p.grad32);
    m8.upload(p.m8);
    v8.upload(p.v8);
  }
  void download(Piece& p) const {
    master.download(p.master);
    m32.download(p.m32);
    v32.download(p.v32);
    ms.download(p.ms);
    vs.download(p.vs);
    rest.download(p.rest);
    model.download(p.model);
    m8.download(p.m8);
    v8.download(p.v8);
  }
  ParamTensor view(const Piece& p, const StepConfig& c) {
    ParamTensor t = shape_of(p);
    t.master = c.state.master == MasterFormat::f32 ? static_cast<void*>(master.ptr)
               : c.state.master == MasterFormat::bf16_remainder ? static_cast<void*>(rest.ptr) : nullptr;
    t.grad = c.grad_dtype == DType::f32 ? static_cast<const void*>(grad32.ptr) : static_cast<const void*>(grad.ptr);
    t.model = model.ptr;
    if (!p.m8.empty()) {
      t.exp_avg = m8.ptr;
      t.exp_avg_sq = v8.ptr;
      t.exp_avg_scale = ms.ptr;
      t.exp_avg_sq_scale = vs.ptr;
    } else {
      t.exp_avg = m32.ptr;
      t.exp_avg_sq = v32.ptr;
    }
    return t;
  }
};

}  // namespace

TEST_CASE("gpu block8 moments: pass 2 matches the reference for every master format and rounding", "[gpu][block8]") {
  for (const Setup s : {Setup{DType::bf16, MasterFormat::f32, Rounding::stochastic},
                        Setup{DType::f16, MasterFormat::f32, Rounding::nearest},
                        Setup{DType::f32, MasterFormat::bf16_remainder, Rounding::stochastic},
                        Setup{DType::bf16, MasterFormat::none, Rounding::stochastic},
                        Setup{DType::bf16, MasterFormat::none, Rounding::nearest}}) {
   for (const bool misaligned : {false, true}) {
    CAPTURE(dtype_name(s.grad), master_format_name(s.master), rounding_name(s.rounding), misaligned);
    const StepConfig c = config_of(s);
    std::mt19937_64 gen(1234);
    std::vector<Piece> ref = make_model(c, gen);
    const double held_weight = weight(ref[6], c, 300);
    std::vector<DevicePiece> dev;
    std::vector<ParamTensor> host_views, dev_views;
    for (Piece& p : ref) {
      dev.emplace_back(p, misaligned);
      host_views.push_back(host_view(p, c));
    }
    for (std::size_t t = 0; t < ref.size(); ++t) dev_views.push_back(dev[t].view(ref[t], c));
    // The piece of the 42000-element tensor keys its elements as the whole tensor's: same id.
    host_views[3].tensor_id = dev_views[3].tensor_id = 3;
    host_views[2].tensor_id = dev_views[2].tensor_id = 3;
    FusedAdamW cpu(host_views, c, Backend::reference);
    FusedAdamW gpu(dev_views, c);
    std::size_t codes = 0, codes_off = 0;
    for (int step = 0; step < 3; ++step) {
      fill_model_grads(ref, c.grad_dtype, cpu.loss_scale(), gen);
      for (std::size_t t = 0; t < ref.size(); ++t) dev[t].upload(ref[t]);  // the same state and gradients
      gpu.load_state(cpu.save_state());
      cpu.step();
      gpu.step();
      const StepReport want = cpu.last_report();
      const StepReport got = gpu.last_report();
      GPU_CHECK(cudaDeviceSynchronize());
      REQUIRE(got.outcome == Outcome::applied);
      REQUIRE(want.outcome == Outcome::applied);
      // Block 1 of the held tensor (256 elements) is held: its weight 3e38 would overflow.
      CHECK(want.held_elements == 256);
      CHECK(got.held_elements == want.held_elements);
      for (std::size_t t = 0; t < ref.size(); ++t) {
        CAPTURE(step, t);
        Piece g = ref[t];
        dev[t].download(g);
        const double lr = c.groups[static_cast<std::size_t>(ref[t].group)].lr;
        for (std::size_t i = 0; i < g.model.size(); ++i) {
          const double a = weight(g, c, i), b = weight(ref[t], c, i);
          const double ulp = c.state.master == MasterFormat::none ? std::ldexp(std::fabs(b), -7) : 0.0;
          const double tol = std::ldexp(std::fabs(b) + lr * 4.0, -19) + ulp;
          if (!(std::fabs(a - b) <= tol)) {
            CAPTURE(i, a, b, tol);
            FAIL("weight differs");
          }
          if (c.state.master != MasterFormat::none && g.model[i] != ref[t].model[i]) {
            // the model copy is the stored master rounded once: equal where the masters are
            REQUIRE(std::fabs(from_bits16(DType::bf16, g.model[i]) - from_bits16(DType::bf16, ref[t].model[i])) <=
                    std::ldexp(std::fabs(b), -7));
          }
        }
        if (g.m32.size() > 0) {  // fp32 moments: a few fp32 roundings of terms no larger than the tensor's largest
          float m_max = 0.0f, v_max = 0.0f;
          for (std::size_t i = 0; i < g.m32.size(); ++i) {
            m_max = std::max(m_max, std::fabs(ref[t].m32[i]));
            v_max = std::max(v_max, ref[t].v32[i]);
          }
          for (std::size_t i = 0; i < g.m32.size(); ++i) {
            REQUIRE(std::fabs(g.m32[i] - ref[t].m32[i]) <= std::ldexp(m_max, -20));
            REQUIRE(std::fabs(g.v32[i] - ref[t].v32[i]) <= std::ldexp(v_max, -20));
          }
          continue;
        }
        for (std::size_t k = 0; k < g.ms.size(); ++k) {
          CAPTURE(k);
          REQUIRE(std::fabs(g.ms[k] - ref[t].ms[k]) <= std::ldexp(ref[t].ms[k], -18));
          REQUIRE(std::fabs(g.vs[k] - ref[t].vs[k]) <= std::ldexp(ref[t].vs[k], -18));
        }
        for (std::size_t i = 0; i < g.m8.size(); ++i) {
          CAPTURE(i);
          REQUIRE(std::abs(int{g.m8[i]} - int{ref[t].m8[i]}) <= 1);
          REQUIRE(std::abs(int{g.v8[i]} - int{ref[t].v8[i]}) <= 1);
          codes += 2;
          codes_off += (g.m8[i] != ref[t].m8[i]) + (g.v8[i] != ref[t].v8[i]);
        }
      }
    }
    CAPTURE(codes, codes_off);
    CHECK(codes_off * 200 <= codes);
    // The held block kept its weight of 3.38e38 through every step.
    CHECK(weight(ref[6], c, 300) == held_weight);
   }
  }
}

TEST_CASE("gpu block8 moments: a skipped step writes nothing", "[gpu][block8]") {
  const StepConfig c = config_of(Setup{DType::bf16, MasterFormat::f32, Rounding::stochastic});
  std::mt19937_64 gen(99);
  std::vector<Piece> ref = make_model(c, gen);
  std::vector<DevicePiece> dev;
  std::vector<ParamTensor> views;
  for (Piece& p : ref) dev.emplace_back(p, false);
  for (std::size_t t = 0; t < ref.size(); ++t) views.push_back(dev[t].view(ref[t], c));
  FusedAdamW gpu(views, c);
  fill_model_grads(ref, c.grad_dtype, gpu.loss_scale(), gen);
  for (std::size_t t = 0; t < ref.size(); ++t) dev[t].upload(ref[t]);
  gpu.step();
  REQUIRE(gpu.last_report().outcome == Outcome::applied);
  std::vector<Piece> before = ref;
  for (std::size_t t = 0; t < ref.size(); ++t) dev[t].download(before[t]);
  // inf at the first, middle and last element of the first, middle and last quantized tensor
  for (const std::size_t t : {std::size_t{0}, std::size_t{2}, std::size_t{6}}) {
    for (const std::size_t i : {std::size_t{0}, ref[t].grad.size() / 2, ref[t].grad.size() - 1}) {
      CAPTURE(t, i);
      fill_model_grads(before, c.grad_dtype, gpu.loss_scale(), gen);
      before[t].grad[i] = 0x7F80;  // +inf
      for (std::size_t u = 0; u < ref.size(); ++u) {
        dev[u].grad.upload(before[u].grad);
      }
      gpu.step();
      const StepReport r = gpu.last_report();
      GPU_CHECK(cudaDeviceSynchronize());
      REQUIRE(r.outcome == Outcome::skipped_overflow);
      for (std::size_t u = 0; u < ref.size(); ++u) {
        Piece now = before[u];
        dev[u].download(now);
        CHECK(now.m8 == before[u].m8);
        CHECK(now.v8 == before[u].v8);
        CHECK(now.ms == before[u].ms);
        CHECK(now.vs == before[u].vs);
        CHECK(now.master == before[u].master);
        CHECK(now.model == before[u].model);
      }
    }
  }
}

namespace {

// One rank's flat device buffers for [begin, end) of a block8 layout, and its shard.
struct DeviceRank {
  std::int64_t begin = 0, end = 0;
  DeviceArray<float> master, ms, vs;
  DeviceArray<std::int16_t> rest;
  DeviceArray<std::uint16_t> grad, model;
  DeviceArray<std::uint8_t> m, v;
  Shard shard;

  DeviceRank(const std::vector<ParamTensor>& layout, const StepConfig& c, std::int64_t b, std::int64_t e)
      : begin(b), end(e), master(static_cast<std::size_t>(e - b), 0), ms(scales(layout, c, b, e), 0),
        vs(scales(layout, c, b, e), 0), rest(static_cast<std::size_t>(e - b), 0),
        grad(static_cast<std::size_t>(e - b), 0), model(static_cast<std::size_t>(e - b), 0),
        m(static_cast<std::size_t>(shard_state(layout, b, e, c).exp_avg_bytes), 0),
        v(static_cast<std::size_t>(shard_state(layout, b, e, c).exp_avg_sq_bytes), 0) {
    ParamTensor flat;
    flat.numel = e - b;
    flat.master = c.state.master == MasterFormat::f32 ? static_cast<void*>(master.ptr)
                  : c.state.master == MasterFormat::bf16_remainder ? static_cast<void*>(rest.ptr) : nullptr;
    flat.grad = grad.ptr;
    flat.model = model.ptr;
    flat.exp_avg = m.ptr;
    flat.exp_avg_sq = v.ptr;
    flat.exp_avg_scale = ms.ptr;
    flat.exp_avg_sq_scale = vs.ptr;
    shard = halfstep::shard(layout, b, e, flat, c);
  }
  static std::size_t scales(const std::vector<ParamTensor>& layout, const StepConfig& c, std::int64_t b, std::int64_t e) {
    return static_cast<std::size_t>(shard_state(layout, b, e, c).scales);
  }
  // Where piece k's moments start in the flat moment buffers.
  std::size_t moment_at(std::size_t k) const {
    return static_cast<std::size_t>(static_cast<const std::uint8_t*>(shard.tensors[k].exp_avg) - m.ptr);
  }
  std::size_t scale_at(std::size_t k) const {
    return static_cast<std::size_t>(shard.tensors[k].exp_avg_scale - ms.ptr);
  }
};

}  // namespace

TEST_CASE("gpu block8 moments: ranks on shard()'s layout step bitwise like one unsharded step", "[gpu][block8][distributed]") {
  for (const Setup s : {Setup{DType::bf16, MasterFormat::f32, Rounding::stochastic},
                        Setup{DType::bf16, MasterFormat::none, Rounding::nearest}}) {
    CAPTURE(master_format_name(s.master), rounding_name(s.rounding));
    StepConfig c = config_of(s);
    c.groups.resize(1);
    std::mt19937_64 gen(4321);
    // Rows of 300 (two blocks a row), a wide tensor, one row, rows of 50, rows of 20 (wide).
    std::vector<Piece> whole = make_pieces(c, {{9000, 300, 0, 9000, 0}, {1000, 0, 0, 1000, 0}, {42000, 0, 0, 42000, 0},
                                               {5000, 50, 0, 5000, 0}, {6000, 20, 0, 6000, 0}}, gen);
    const std::vector<Piece> initial = whole;
    std::vector<ParamTensor> layout;
    for (const Piece& p : whole) layout.push_back(shape_of(p));
    std::vector<DevicePiece> dev;
    std::vector<ParamTensor> views;
    for (const Piece& p : whole) dev.emplace_back(p, true);
    for (std::size_t t = 0; t < whole.size(); ++t) {
      dev[t].upload(whole[t]);
      views.push_back(dev[t].view(whole[t], c));
    }
    FusedAdamW one(views, c);
    constexpr int kRanks = 3;
    std::vector<std::unique_ptr<DeviceRank>> ranks;
    std::vector<std::unique_ptr<FusedAdamW>> opts;
    for (int r = 0; r < kRanks; ++r) {
      const auto [b, e] = even_shard(layout, c, kRanks, r);
      ranks.push_back(std::make_unique<DeviceRank>(layout, c, b, e));
      DeviceRank& me = *ranks.back();
      // The initial state: the whole tensors' weights, moments at zero in each piece's format.
      std::vector<float> master(static_cast<std::size_t>(e - b));
      std::vector<std::int16_t> rest(master.size());
      std::vector<std::uint16_t> model(master.size());
      std::vector<std::uint8_t> m(me.m.n, 0), v(me.v.n, 0);
      std::size_t into = 0;
      for (std::size_t k = 0; k < me.shard.tensors.size(); ++k) {
        const ParamTensor& p = me.shard.tensors[k];
        const Piece& w = initial[static_cast<std::size_t>(me.shard.source[k])];
        const auto at = static_cast<std::size_t>(p.offset), n = static_cast<std::size_t>(p.numel);
        std::copy_n(&w.master[at], n, &master[into]);
        std::copy_n(&w.rest[at], n, &rest[into]);
        std::copy_n(&w.model[at], n, &model[into]);
        if (moment_blocks(c, p).quantized) {
          std::copy_n(&w.m8[at], n, &m[me.moment_at(k)]);
          std::copy_n(&w.v8[at], n, &v[me.moment_at(k)]);
        }
        into += n;
      }
      me.master.upload(master);
      me.rest.upload(rest);
      me.model.upload(model);
      me.m.upload(m);
      me.v.upload(v);
      me.ms.upload(std::vector<float>(me.ms.n, 0.0f));
      me.vs.upload(std::vector<float>(me.vs.n, 0.0f));
      opts.push_back(std::make_unique<FusedAdamW>(me.shard.tensors, c, Distributed{r, {}}));
    }
    for (int step = 0; step < 3; ++step) {
      fill_grads(whole, c.grad_dtype, one.loss_scale(), gen);
      for (std::size_t t = 0; t < whole.size(); ++t) dev[t].grad.upload(whole[t].grad);
      one.step();
      StepTotals total{};
      for (int r = 0; r < kRanks; ++r) {
        DeviceRank& me = *ranks[static_cast<std::size_t>(r)];
        std::vector<std::uint16_t> g(static_cast<std::size_t>(me.end - me.begin));
        std::size_t into = 0;
        for (std::size_t k = 0; k < me.shard.tensors.size(); ++k) {
          const ParamTensor& p = me.shard.tensors[k];
          std::copy_n(&whole[static_cast<std::size_t>(me.shard.source[k])].grad[static_cast<std::size_t>(p.offset)],
                      static_cast<std::size_t>(p.numel), &g[into]);
          into += static_cast<std::size_t>(p.numel);
        }
        me.grad.upload(g);
        opts[static_cast<std::size_t>(r)]->step_local();
        StepTotals record{};
        GPU_CHECK(cudaMemcpy(&record, opts[static_cast<std::size_t>(r)]->device_totals(), sizeof record,
                             cudaMemcpyDeviceToHost));
        combine(total, record);
      }
      for (int r = 0; r < kRanks; ++r) {
        GPU_CHECK(cudaMemcpy(opts[static_cast<std::size_t>(r)]->device_totals(), &total, sizeof total,
                             cudaMemcpyHostToDevice));
        GPU_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
        opts[static_cast<std::size_t>(r)]->step_finish();
      }
      GPU_CHECK(cudaDeviceSynchronize());
      const StepReport want = one.last_report();
      REQUIRE(want.outcome == Outcome::applied);
      for (int r = 0; r < kRanks; ++r) {
        const StepReport got = opts[static_cast<std::size_t>(r)]->last_report();
        CHECK(got.outcome == want.outcome);
        CHECK(got.grad_norm == want.grad_norm);
        CHECK(got.clip_coef == want.clip_coef);
      }
    }
    // Every piece's weights, codes and scales (or fp32 moments) as the unsharded step's, bit for bit.
    for (std::size_t t = 0; t < whole.size(); ++t) dev[t].download(whole[t]);
    for (int r = 0; r < kRanks; ++r) {
      DeviceRank& me = *ranks[static_cast<std::size_t>(r)];
      std::vector<float> master, ms, vs;
      std::vector<std::int16_t> rest;
      std::vector<std::uint16_t> model;
      std::vector<std::uint8_t> m, v;
      me.master.download(master);
      me.rest.download(rest);
      me.model.download(model);
      me.m.download(m);
      me.v.download(v);
      me.ms.download(ms);
      me.vs.download(vs);
      std::size_t into = 0;
      for (std::size_t k = 0; k < me.shard.tensors.size(); ++k) {
        const ParamTensor& p = me.shard.tensors[k];
        const Piece& w = whole[static_cast<std::size_t>(me.shard.source[k])];
        const auto at = static_cast<std::size_t>(p.offset), n = static_cast<std::size_t>(p.numel);
        CAPTURE(r, k, p.offset, p.numel);
        CHECK(std::memcmp(&model[into], &w.model[at], 2 * n) == 0);
        if (s.master == MasterFormat::f32) CHECK(std::memcmp(&master[into], &w.master[at], 4 * n) == 0);
        const MomentBlocks b = moment_blocks(c, p);
        const std::size_t mat = me.moment_at(k);
        if (b.quantized) {
          CHECK(std::memcmp(&m[mat], &w.m8[at], n) == 0);
          CHECK(std::memcmp(&v[mat], &w.v8[at], n) == 0);
          const auto first = static_cast<std::size_t>(b.first), blocks = static_cast<std::size_t>(b.blocks);
          CHECK(std::memcmp(&ms[me.scale_at(k)], &w.ms[first], 4 * blocks) == 0);
          CHECK(std::memcmp(&vs[me.scale_at(k)], &w.vs[first], 4 * blocks) == 0);
        } else {
          CHECK(std::memcmp(&m[mat], &w.m32[at], 4 * n) == 0);
          CHECK(std::memcmp(&v[mat], &w.v32[at], 4 * n) == 0);
        }
        into += n;
      }
    }
    CHECK(whole[0].ms[0] != 0.0f);  // the steps wrote the state
  }
}
