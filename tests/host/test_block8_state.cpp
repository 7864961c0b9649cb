// MomentFormat::block8 as a state format: which tensors it quantizes and where their blocks lie,
// the rules a step's tensors must keep (by name), the reference backend's block step, and that a
// tensor stepped whole or as pieces cut where blocks start ends bitwise the same.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "block8_pieces.hpp"
#include "halfstep/distributed.hpp"
#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/safetensors.hpp"
#include "halfstep/state.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

StepConfig block8_config(MasterFormat master = MasterFormat::f32, Rounding rounding = Rounding::stochastic) {
  StepConfig c;
  c.grad_dtype = c.model_dtype = c.compute_dtype = DType::bf16;
  c.scaler.init_scale = 1024.0f;
  c.max_grad_norm = 1.0f;
  c.groups[0].lr = 1e-3f;
  c.groups[0].weight_decay = 0.01f;
  c.state.master = master;
  c.state.exp_avg = c.state.exp_avg_sq = MomentFormat::block8;
  c.state.rounding = rounding;
  c.state.seed = 5;
  return c;
}

ParamTensor shaped(std::int64_t whole, std::int64_t row, std::int64_t offset, std::int64_t numel) {
  ParamTensor t;
  t.whole_numel = whole;
  t.row = row;
  t.offset = offset;
  t.numel = numel;
  return t;
}

}  // namespace

TEST_CASE("block8 moments: which tensors are quantized, their blocks, slots and bytes", "[block8][state]") {
  const StepConfig c = block8_config();
  CHECK(std::string(moment_format_name(MomentFormat::block8)) == "block8");
  CHECK(std::string(storage_name(Storage::u8)) == "U8");
  struct Case {
    ParamTensor t;
    bool quantized;
    std::int64_t blocks, first;
  };
  for (const Case& k : {Case{shaped(0, 0, 0, 5000), true, 20, 0},            // one row: 19 of 256, one of 136
                        Case{shaped(0, 0, 0, 4095), false, 0, 0},            // too small
                        Case{shaped(9600, 100, 0, 9600), true, 96, 0},       // a block a row
                        Case{shaped(42000, 300, 15000, 18000), true, 120, 100},  // rows 50 .. 109, two blocks each
                        Case{shaped(42000, 300, 15256, 44), true, 1, 101},   // a row's last block alone
                        Case{shaped(8192, 16, 0, 8192), false, 0, 0},        // rows shorter than 32
                        Case{shaped(8192, 16, 4096, 4096), false, 0, 0},     // a shard of it: still wide
                        Case{shaped(1 << 20, 0, 0, 0), true, 0, 0}}) {       // an empty piece
    CAPTURE(k.t.whole_numel, k.t.row, k.t.offset, k.t.numel);
    const MomentBlocks b = moment_blocks(c, k.t);
    CHECK(b.quantized == k.quantized);
    CHECK(b.blocks == k.blocks);
    CHECK(b.first == k.first);
    const auto slots = slot_layouts(c, k.t);
    CHECK(slots[2].storage == (k.quantized ? Storage::u8 : Storage::f32));
    CHECK(slots[3].element_bytes == (k.quantized ? 1u : 4u));
  }
  // Every other format has no blocks; the small-tensor rule is the whole tensor's, not a shard's.
  CHECK_FALSE(moment_blocks(StepConfig{}, shaped(0, 0, 0, 1 << 20)).quantized);
  CHECK(moment_blocks(c, shaped(1 << 20, 0, 1 << 19, 256)).quantized);
  // fp32 masters and 8-bit moments: 4 + 2 bytes of state an element (and 8 bytes of scales a block).
  const StateBytes bytes = state_bytes(c, true);
  CHECK(bytes.state == 6);
  StepConfig lean = block8_config(MasterFormat::none);
  CHECK(state_bytes(lean, true).state == 2);
}

TEST_CASE("block8 moments: tensors that break a rule are refused by name before anything runs", "[block8][validate]") {
  StepConfig c = block8_config();
  c.state.exp_avg_sq = MomentFormat::bf16;
  CHECK_THROWS_WITH(c.validate(), Catch::Contains("exp_avg and exp_avg_sq must both be block8 or neither"));
  c = block8_config();
  std::mt19937_64 gen(3);
  std::vector<Piece> pieces = make_pieces(c, {{42000, 300, 15000, 18000, 0}, {100, 0, 0, 100, 0}}, gen);
  auto views = [&] { return std::vector<ParamTensor>{host_view(pieces[0], c), host_view(pieces[1], c)}; };
  CHECK_NOTHROW(validate(views(), c));
  auto refused = [&](std::vector<ParamTensor> v, const char* what) {
    CHECK_THROWS_WITH(validate(v, c), Catch::Contains(what));
    CHECK_THROWS_AS(FusedAdamW(v, c, Backend::reference), Error);
  };
  {
    auto v = views();
    v[0].offset += 100;  // inside a block
    refused(v, "must start and end where blocks do");
  }
  {
    auto v = views();
    v[0].numel -= 1;
    refused(v, "must start and end where blocks do");
  }
  {
    auto v = views();
    v[0].whole_numel = 0;  // a piece must say its whole tensor's size
    refused(v, "tensors[0].whole_numel must be set for a piece");
  }
  {
    auto v = views();
    v[0].row = 301;
    refused(v, "tensors[0].row = 301 must divide");
  }
  {
    auto v = views();
    v[0].whole_numel = 20000;
    refused(v, "must be <= whole_numel");
  }
  {
    auto v = views();
    v[0].exp_avg_sq_scale = nullptr;
    refused(v, "tensors[0].exp_avg_sq_scale is null");
  }
  {
    auto v = views();
    v[1].exp_avg_scale = pieces[0].ms.data() + 200;  // a wide tensor has no scales
    refused(v, "tensors[1].exp_avg_scale must be null");
  }
  {
    auto v = views();
    v[0].exp_avg_sq_scale = v[0].exp_avg_scale + 1;  // overlapping scales
    refused(v, "overlap");
  }
  {
    StepConfig f32 = c;  // scales under a format without blocks
    f32.state.exp_avg = f32.state.exp_avg_sq = MomentFormat::f32;
    std::vector<Piece> wide = make_pieces(f32, {{5000, 0, 0, 5000, 0}}, gen);
    std::vector<ParamTensor> v{host_view(wide[0], f32)};
    v[0].exp_avg_scale = pieces[0].ms.data();
    CHECK_THROWS_WITH(validate(v, f32), Catch::Contains("only block8 moments have block scales"));
  }
}

TEST_CASE("block8 moments: a tensor stepped whole or as pieces cut where blocks start is bitwise the same",
          "[block8][reference]") {
  for (const MasterFormat master : {MasterFormat::f32, MasterFormat::bf16_remainder, MasterFormat::none}) {
    for (const Rounding rounding : {Rounding::stochastic, Rounding::nearest}) {
      CAPTURE(master_format_name(master), rounding_name(rounding));
      const StepConfig c = block8_config(master, rounding);
      std::mt19937_64 gen(11);
      // One tensor of 140 rows of 300 whole, and the same as pieces: rows 0 .. 49, a piece that ends
      // after row 50's first block, and the rest.
      std::vector<Piece> whole = make_pieces(c, {{42000, 300, 0, 42000, 0}}, gen);
      std::vector<Piece> parts = make_pieces(c, {{42000, 300, 0, 15000, 0}, {42000, 300, 15000, 256, 0},
                                                 {42000, 300, 15256, 26744, 0}}, gen);
      auto cut = [&](const Piece& from) {  // the whole tensor's buffers copied into the pieces
        for (Piece& p : parts) {
          const auto at = static_cast<std::size_t>(p.offset), n = static_cast<std::size_t>(p.numel);
          auto slice = [&](auto& into, const auto& src) {
            into.assign(src.begin() + static_cast<std::ptrdiff_t>(at), src.begin() + static_cast<std::ptrdiff_t>(at + n));
          };
          slice(p.master, from.master);
          slice(p.rest, from.rest);
          slice(p.model, from.model);
          slice(p.grad, from.grad);
          slice(p.grad32, from.grad32);
          slice(p.m8, from.m8);
          slice(p.v8, from.v8);
        }
      };
      cut(whole[0]);
      std::vector<ParamTensor> one{host_view(whole[0], c)};
      std::vector<ParamTensor> three;
      for (Piece& p : parts) {
        three.push_back(host_view(p, c));
        three.back().tensor_id = 1;  // the same tensor
      }
      FusedAdamW a(one, c, Backend::reference);
      FusedAdamW b(three, c, Backend::reference);
      for (int step = 0; step < 4; ++step) {
        fill_grads(whole, c.grad_dtype, a.loss_scale(), gen);
        for (Piece& p : parts) {
          const auto at = static_cast<std::ptrdiff_t>(p.offset);
          std::copy(whole[0].grad.begin() + at, whole[0].grad.begin() + at + p.numel, p.grad.begin());
        }
        if (step == 2) {  // an inf skips the step on both and writes nothing
          whole[0].grad[20000] = 0x7F80;
          parts[2].grad[20000 - 15256] = 0x7F80;
        }
        const Piece before = whole[0];
        a.step();
        b.step();
        REQUIRE(a.last_report().outcome == b.last_report().outcome);
        REQUIRE(a.last_report().held_elements == b.last_report().held_elements);
        if (step == 2) {
          REQUIRE(a.last_report().outcome == Outcome::skipped_overflow);
          CHECK(whole[0].m8 == before.m8);
          CHECK(whole[0].v8 == before.v8);
          CHECK(whole[0].ms == before.ms);
          CHECK(whole[0].vs == before.vs);
          CHECK(whole[0].model == before.model);
        } else {
          REQUIRE(a.last_report().outcome == Outcome::applied);
        }
        // The pieces' buffers, laid end to end, are the whole tensor's, bit for bit.
        Piece joined = whole[0];
        joined.ms.clear();
        joined.vs.clear();
        std::size_t at = 0;
        for (const Piece& p : parts) {
          std::copy(p.master.begin(), p.master.end(), joined.master.begin() + static_cast<std::ptrdiff_t>(at));
          std::copy(p.rest.begin(), p.rest.end(), joined.rest.begin() + static_cast<std::ptrdiff_t>(at));
          std::copy(p.model.begin(), p.model.end(), joined.model.begin() + static_cast<std::ptrdiff_t>(at));
          std::copy(p.m8.begin(), p.m8.end(), joined.m8.begin() + static_cast<std::ptrdiff_t>(at));
          std::copy(p.v8.begin(), p.v8.end(), joined.v8.begin() + static_cast<std::ptrdiff_t>(at));
          joined.ms.insert(joined.ms.end(), p.ms.begin(), p.ms.end());
          joined.vs.insert(joined.vs.end(), p.vs.begin(), p.vs.end());
          at += p.master.size();
        }
        CHECK(joined.master == whole[0].master);
        CHECK(joined.rest == whole[0].rest);
        CHECK(joined.model == whole[0].model);
        CHECK(joined.m8 == whole[0].m8);
        CHECK(joined.v8 == whole[0].v8);
        CHECK(joined.ms == whole[0].ms);
        CHECK(joined.vs == whole[0].vs);
      }
      // The moments moved: codes other than 0's and positive scales.
      CHECK(std::count(whole[0].v8.begin(), whole[0].v8.end(), std::uint8_t{0}) == 0);
      CHECK(*std::min_element(whole[0].vs.begin(), whole[0].vs.end()) > 0.0f);
    }
  }
}

TEST_CASE("block8 moments: save_state writes the format's code and load_state reads it back", "[block8][checkpoint]") {
  const StepConfig c = block8_config();
  std::mt19937_64 gen(8);
  std::vector<Piece> pieces = make_pieces(c, {{5000, 0, 0, 5000, 0}}, gen);
  std::vector<ParamTensor> v{host_view(pieces[0], c)};
  FusedAdamW a(v, c, Backend::reference);
  fill_grads(pieces, c.grad_dtype, a.loss_scale(), gen);
  a.step();
  const std::string saved = a.save_state();
  FusedAdamW b(v, c, Backend::reference);
  b.load_state(saved);
  CHECK(b.state() == a.state());
}
