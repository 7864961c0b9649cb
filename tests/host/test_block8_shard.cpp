// block8 moments under ZeRO sharding on the CPU: the flat parameter space cut where blocks start
// (even_shard with the layout, block_cut), each rank a FusedAdamW on the reference backend over
// its shard (shard(): codes or fp32 moments per piece, the pieces' block scales one after another),
// the ranks' records reduced in a random order. Every rank's report, and the union of their
// weights, codes and scales, must be bitwise what one unsharded rank holds, on 1, 2, 3 and 5 ranks.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <random>
#include <tuple>
#include <vector>

#include "block8_pieces.hpp"
#include "halfstep/distributed.hpp"
#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "ranks.hpp"
#include "sharded_run.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

StepConfig block8_config(MasterFormat master) {
  StepConfig c;
  c.grad_dtype = c.model_dtype = c.compute_dtype = DType::bf16;
  c.scaler.init_scale = 1024.0f;
  c.max_grad_norm = 1.0f;
  c.groups.resize(2);
  c.groups[0].lr = 1e-3f;
  c.groups[0].weight_decay = 0.01f;
  c.groups[1].lr = 3e-3f;
  c.state.master = master;
  c.state.exp_avg = c.state.exp_avg_sq = MomentFormat::block8;
  c.state.seed = 9;
  return c;
}

// Whole tensors: rows of 300 (two blocks a row, the second of 44), wide (too small), one row of
// 42000 (a last block of 16), rows of 50 (a block a row), wide (rows of 20), wide (100 elements).
const std::vector<PieceShape> kShapes = {{9000, 300, 0, 9000, 0},  {1000, 0, 0, 1000, 1}, {42000, 0, 0, 42000, 1},
                                         {5000, 50, 0, 5000, 0},   {6000, 20, 0, 6000, 1}, {100, 0, 0, 100, 0}};

std::vector<ParamTensor> layout_of(const std::vector<Piece>& whole) {
  std::vector<ParamTensor> out;
  for (const Piece& p : whole) out.push_back(shape_of(p));
  return out;
}

// One rank's flat buffers with the whole tensors' initial weights and zero moments in each
// piece's format, and its reports.
struct RankBuffers : HostFlat {
  std::vector<StepReport> reports;
  RankBuffers(const std::vector<Piece>& whole, const std::vector<ParamTensor>& layout, const StepConfig& c,
              std::int64_t b, std::int64_t e)
      : HostFlat(layout, c, b, e) {
    fill(whole, c);
  }
  void fill(const std::vector<Piece>& whole, const StepConfig& c);
};

void RankBuffers::fill(const std::vector<Piece>& whole, const StepConfig& c) {
  // The initial state: the whole tensors' weights, and moments at zero in each piece's format.
  std::int64_t into = 0;
  for (std::size_t k = 0; k < shard.tensors.size(); ++k) {
    const ParamTensor& p = shard.tensors[k];
    const Piece& w = whole[static_cast<std::size_t>(shard.source[k])];
    const auto at = static_cast<std::size_t>(p.offset), cnt = static_cast<std::size_t>(p.numel);
    std::memcpy(&master[static_cast<std::size_t>(into)], &w.master[at], cnt * sizeof(float));
    std::memcpy(&rest[static_cast<std::size_t>(into)], &w.rest[at], cnt * sizeof(std::int16_t));
    std::memcpy(&model[static_cast<std::size_t>(into)], &w.model[at], cnt * sizeof(std::uint16_t));
    if (moment_blocks(c, p).quantized) {
      std::memcpy(p.exp_avg, &w.m8[at], cnt);
      std::memcpy(p.exp_avg_sq, &w.v8[at], cnt);
    }
    into += p.numel;
  }
}

}  // namespace

TEST_CASE("block8 moments: ranks sharded where blocks start step bitwise like one rank", "[block8][distributed]") {
  for (const MasterFormat master : {MasterFormat::f32, MasterFormat::bf16_remainder, MasterFormat::none}) {
    CAPTURE(master_format_name(master));
    const StepConfig c = block8_config(master);
    std::mt19937_64 gen(31);
    std::vector<Piece> whole = make_pieces(c, kShapes, gen);
    const std::vector<Piece> initial = whole;
    const std::vector<ParamTensor> layout = layout_of(whole);
    // The gradients of every step, drawn once; step 3 overflows in the middle of the third tensor.
    constexpr int kSteps = 6;
    std::vector<std::vector<std::vector<std::uint16_t>>> grads;
    for (int s = 0; s < kSteps; ++s) {
      fill_grads(whole, c.grad_dtype, c.scaler.init_scale, gen);
      if (s == 3) whole[2].grad[21000] = 0x7F80;
      std::vector<std::vector<std::uint16_t>> step;
      for (const Piece& p : whole) step.push_back(p.grad);
      grads.push_back(step);
    }
    // One rank, unsharded.
    std::vector<ParamTensor> views;
    for (Piece& p : whole) views.push_back(host_view(p, c));
    FusedAdamW one(views, c, Backend::reference);
    std::vector<StepReport> reports;
    for (int s = 0; s < kSteps; ++s) {
      for (std::size_t t = 0; t < whole.size(); ++t) whole[t].grad = grads[static_cast<std::size_t>(s)][t];
      one.step();
      reports.push_back(one.last_report());
    }
    CHECK(reports[3].outcome == Outcome::skipped_overflow);
    CHECK(reports[5].outcome == Outcome::applied);

    for (const int n : {1, 2, 3, 5}) {
      CAPTURE(n);
      std::vector<std::unique_ptr<RankBuffers>> owned;
      for (int r = 0; r < n; ++r) {
        const auto [b, e] = even_shard(layout, c, n, r);
        owned.push_back(std::make_unique<RankBuffers>(initial, layout, c, b, e));
      }
      auto rank = [&](int r) -> RankBuffers& { return *owned[static_cast<std::size_t>(r)]; };
      HostAllReduce reduce(n, 77 + static_cast<std::uint64_t>(n));
      run_ranks(n, [&](int r) {
        RankBuffers& me = rank(r);
        FusedAdamW opt(me.shard.tensors, c, Distributed{r, {}}, Backend::reference);
        for (int s = 0; s < kSteps; ++s) {
          std::int64_t into = 0;
          for (std::size_t k = 0; k < me.shard.tensors.size(); ++k) {
            const auto& g = grads[static_cast<std::size_t>(s)][static_cast<std::size_t>(me.shard.source[k])];
            const ParamTensor& p = me.shard.tensors[k];
            std::memcpy(&me.grad[static_cast<std::size_t>(into)], &g[static_cast<std::size_t>(p.offset)],
                        static_cast<std::size_t>(p.numel) * sizeof(std::uint16_t));
            into += p.numel;
          }
          opt.step_local();
          reduce.all_reduce(r, *opt.device_totals());
          opt.step_finish();
          me.reports.push_back(opt.last_report());
        }
      });
      // The ranges cover the space in order, every cut where a block starts.
      CHECK(rank(0).begin == 0);
      for (int r = 1; r < n; ++r) CHECK(rank(r).begin == rank(r - 1).end);
      std::int64_t total = 0;
      for (const Piece& p : whole) total += p.numel;
      CHECK(rank(n - 1).end == total);
      // Every report, and every piece's weights, codes and scales, as the unsharded rank's.
      for (int r = 0; r < n; ++r) {
        const RankBuffers& me = rank(r);
        auto map = [&](std::int32_t on, std::int32_t local) {
          return rank(on).shard.source[static_cast<std::size_t>(local)];
        };
        for (int s = 0; s < kSteps; ++s) {
          CAPTURE(r, s);
          CHECK(same_report(me.reports[static_cast<std::size_t>(s)], reports[static_cast<std::size_t>(s)], map));
        }
        std::int64_t into = 0;
        for (std::size_t k = 0; k < me.shard.tensors.size(); ++k) {
          const ParamTensor& p = me.shard.tensors[k];
          const Piece& w = whole[static_cast<std::size_t>(me.shard.source[k])];
          CAPTURE(r, k, p.offset, p.numel);
          const auto at = static_cast<std::size_t>(p.offset), cnt = static_cast<std::size_t>(p.numel);
          const auto in = static_cast<std::size_t>(into);
          CHECK(std::memcmp(&me.model[in], &w.model[at], cnt * 2) == 0);
          if (master == MasterFormat::f32) CHECK(std::memcmp(&me.master[in], &w.master[at], cnt * 4) == 0);
          if (master == MasterFormat::bf16_remainder) CHECK(std::memcmp(&me.rest[in], &w.rest[at], cnt * 2) == 0);
          const MomentBlocks b = moment_blocks(c, p);
          if (b.quantized) {
            CHECK(std::memcmp(p.exp_avg, &w.m8[at], cnt) == 0);
            CHECK(std::memcmp(p.exp_avg_sq, &w.v8[at], cnt) == 0);
            const auto first = static_cast<std::size_t>(b.first), blocks = static_cast<std::size_t>(b.blocks);
            CHECK(std::memcmp(p.exp_avg_scale, &w.ms[first], blocks * 4) == 0);
            CHECK(std::memcmp(p.exp_avg_sq_scale, &w.vs[first], blocks * 4) == 0);
          } else {
            CHECK(std::memcmp(p.exp_avg, &w.m32[at], cnt * 4) == 0);
            CHECK(std::memcmp(p.exp_avg_sq, &w.v32[at], cnt * 4) == 0);
          }
          into += p.numel;
        }
      }
    }
    // The steps moved the state: the comparison above is not of untouched buffers.
    CHECK(whole[0].ms[0] != 0.0f);
    CHECK(whole[0].model != initial[0].model);
  }
}

TEST_CASE("block8 moments: where a shard may be cut, what its flat buffers hold, and cuts inside a block refused",
          "[block8][distributed][validate]") {
  const StepConfig c = block8_config(MasterFormat::f32);
  std::mt19937_64 gen(3);
  const std::vector<ParamTensor> layout = layout_of(make_pieces(c, kShapes, gen));
  // Tensors start at 0, 9000, 10000, 52000, 57000, 63000; the space ends at 63100.
  CHECK(block_cut(layout, c, 0) == 0);
  CHECK(block_cut(layout, c, 1) == 256);        // rows of 300: blocks at 0, 256, 300, 556, ...
  CHECK(block_cut(layout, c, 257) == 300);
  CHECK(block_cut(layout, c, 300) == 300);
  CHECK(block_cut(layout, c, 8957) == 9000);    // past the last block's start: the tensor's end
  CHECK(block_cut(layout, c, 9001) == 9001);    // a wide tensor: anywhere
  CHECK(block_cut(layout, c, 10001) == 10256);  // one row: every 256
  CHECK(block_cut(layout, c, 51999) == 52000);  // the last block (41984 .. 42000) runs to the end
  CHECK(block_cut(layout, c, 52001) == 52050);  // rows of 50: a block a row
  CHECK(block_cut(layout, c, 57003) == 57003);  // rows of 20: wide
  CHECK(block_cut(layout, c, 63100) == 63100);
  CHECK_THROWS_WITH(block_cut(layout, c, 63101), Catch::Contains("index must lie in the parameter space"));
  StepConfig f32 = c;  // formats without blocks cut anywhere, and even_shard is the plain one
  f32.state.exp_avg = f32.state.exp_avg_sq = MomentFormat::f32;
  CHECK(block_cut(layout, f32, 1) == 1);
  for (int r = 0; r < 7; ++r) CHECK(even_shard(layout, f32, 7, r) == even_shard(63100, 7, r));
  // Even cuts every 9015 elements: 9015 lies in the wide tensor; 18030 (element 8030 of the one-row
  // tensor) moves to its block at 8192.
  CHECK(even_shard(layout, c, 7, 1) == std::make_pair(std::int64_t{9015}, std::int64_t{18192}));
  // The flat buffers of [256, 10256): 3 pieces. Codes of 8744 elements (59 blocks), then at the
  // next multiple of 16 (8752) the wide tensor's 1000 fp32 moments (to 12752), then 256 codes of
  // the one-row tensor at 12752 (its first block).
  const ShardState sizes = shard_state(layout, 256, 10256, c);
  CHECK(sizes.exp_avg_bytes == 8752 + 4000 + 256);
  CHECK(sizes.exp_avg_sq_bytes == sizes.exp_avg_bytes);
  CHECK(sizes.scales == 59 + 1);
  const ShardState plain = shard_state(layout, 256, 10256, f32);
  CHECK(plain.exp_avg_bytes == 40000);
  CHECK(plain.scales == 0);
  // shard() places each piece there.
  std::vector<unsigned char> m(static_cast<std::size_t>(sizes.exp_avg_bytes) + 16), v(m.size());
  std::vector<float> ms(60), vs(60);
  ParamTensor flat;
  flat.numel = 10000;
  flat.exp_avg = m.data();
  flat.exp_avg_sq = v.data();
  flat.exp_avg_scale = ms.data();
  flat.exp_avg_sq_scale = vs.data();
  const Shard s = shard(layout, 256, 10256, flat, c);
  REQUIRE(s.tensors.size() == 3);
  CHECK(s.tensors[0].exp_avg == m.data());
  CHECK(s.tensors[0].exp_avg_scale == ms.data());
  CHECK(s.tensors[0].whole_numel == 9000);
  CHECK(s.tensors[0].row == 300);
  CHECK(s.tensors[1].exp_avg == m.data() + 8752);
  CHECK(s.tensors[1].exp_avg_scale == nullptr);
  CHECK(s.tensors[2].exp_avg_sq == v.data() + 12752);
  CHECK(s.tensors[2].exp_avg_sq_scale == vs.data() + 59);
  CHECK(moment_blocks(c, s.tensors[0]).blocks == 59);
  CHECK(moment_blocks(c, s.tensors[0]).first == 1);
  // Cuts inside a block, and missing scales, refused by name.
  CHECK_THROWS_WITH(shard(layout, 255, 10255, flat, c),
                    Catch::Contains("cuts layout[0] (elements [255, 9000) of 9000 in rows of 300) inside a block"));
  CHECK_THROWS_WITH(shard(layout, 256, 10255, flat, c), Catch::Contains("cuts layout[2]"));
  ParamTensor bare = flat;
  bare.exp_avg_sq_scale = nullptr;
  CHECK_THROWS_WITH(shard(layout, 256, 10256, bare, c), Catch::Contains("flat.exp_avg_scale and flat.exp_avg_sq_scale"));
  CHECK_THROWS_WITH(shard_state(layout, 256, 70000, c), Catch::Contains("must lie in the parameter space"));
}
