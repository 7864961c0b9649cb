// Safetensors checkpoints of block8 moments on the reference backend: codes stored as U8 in their
// tensor's rows beside F32 block scales, an exact resume (whole and on each rank's shard),
// conversions to and from fp32 moments on load (decoded exactly; encoded to nearest as a step
// encodes), and bad codes files refused by name with nothing changed.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "block8.hpp"
#include "block8_pieces.hpp"
#include "halfstep/distributed.hpp"
#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/safetensors.hpp"
#include "safetensors_file.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

// Removes a test's checkpoint file when the test case ends, passed or failed.
struct RemovedAtEnd {
  std::string path;
  ~RemovedAtEnd() { std::remove(path.c_str()); }
};

StepConfig config_with(MomentFormat moments, MasterFormat master = MasterFormat::f32) {
  StepConfig c;
  c.grad_dtype = c.model_dtype = c.compute_dtype = DType::bf16;
  c.scaler.init_scale = 1024.0f;
  c.max_grad_norm = 1.0f;
  c.groups[0].lr = 1e-3f;
  c.state.master = master;
  c.state.exp_avg = c.state.exp_avg_sq = moments;
  c.state.seed = 4;
  return c;
}

// A quantized tensor in rows of 300, a wide one (1000 elements), a quantized one-row tensor.
const std::vector<PieceShape> kShapes = {{9000, 300, 0, 9000, 0}, {1000, 0, 0, 1000, 0}, {42000, 0, 0, 42000, 0}};
const std::vector<std::string> kNames = {"w", "b", "u"};

std::vector<ParamTensor> views_of(std::vector<Piece>& pieces, const StepConfig& c) {
  std::vector<ParamTensor> v;
  for (Piece& p : pieces) v.push_back(host_view(p, c));
  return v;
}

// Steps `opt` over `pieces` `steps` times with fresh gradients.
void train(FusedAdamW& opt, std::vector<Piece>& pieces, int steps, std::mt19937_64& gen) {
  for (int s = 0; s < steps; ++s) {
    fill_grads(pieces, DType::bf16, opt.loss_scale(), gen);
    opt.step();
  }
}

bool same_state(const Piece& a, const Piece& b) {
  return a.master == b.master && a.model == b.model && a.m8 == b.m8 && a.v8 == b.v8 && a.ms == b.ms && a.vs == b.vs &&
         a.m32 == b.m32 && a.v32 == b.v32;
}

}  // namespace

TEST_CASE("block8 checkpoints: codes and scales stored in their rows resume bit for bit", "[block8][safetensors]") {
  const StepConfig c = config_with(MomentFormat::block8);
  std::mt19937_64 gen(5);
  std::vector<Piece> a = make_pieces(c, kShapes, gen);
  FusedAdamW one(views_of(a, c), c, Backend::reference);
  train(one, a, 4, gen);
  const std::string path = "halfstep_test_block8.safetensors";
  const RemovedAtEnd removed{path};
  save_checkpoint(one, kNames, path);
  // The file: codes as U8 in the tensor's rows, scales as F32 a row of blocks each; the wide
  // tensor's moments F32.
  const File file = split(read_file(path));
  CHECK(file.header.find(R"("w.exp_avg":{"dtype":"U8","shape":[30,300])") != std::string::npos);
  CHECK(file.header.find(R"("w.exp_avg.scale":{"dtype":"F32","shape":[30,2])") != std::string::npos);
  CHECK(file.header.find(R"("u.exp_avg_sq":{"dtype":"U8","shape":[1,42000])") != std::string::npos);
  CHECK(file.header.find(R"("u.exp_avg_sq.scale":{"dtype":"F32","shape":[1,165])") != std::string::npos);
  CHECK(file.header.find(R"("b.exp_avg":{"dtype":"F32","shape":[1000])") != std::string::npos);
  CHECK(file.header.find("b.exp_avg.scale") == std::string::npos);
  // Into fresh buffers: the same state, and the same next steps.
  std::mt19937_64 other(99);
  std::vector<Piece> b = make_pieces(c, kShapes, other);
  FusedAdamW two(views_of(b, c), c, Backend::reference);
  load_checkpoint(two, kNames, path);
  for (std::size_t t = 0; t < a.size(); ++t) CHECK(same_state(a[t], b[t]));
  CHECK(two.state() == one.state());
  std::mt19937_64 ga(7), gb(7);
  train(one, a, 3, ga);
  train(two, b, 3, gb);
  for (std::size_t t = 0; t < a.size(); ++t) CHECK(same_state(a[t], b[t]));
  CHECK(a[0].ms != std::vector<float>(a[0].ms.size(), 0.0f));

  // Each rank of a sharded run reads its slices: codes from its first element, scales from its
  // first block.
  std::vector<ParamTensor> layout;
  for (const Piece& p : a) layout.push_back(shape_of(p));
  save_checkpoint(one, kNames, path);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const auto [begin, end] = even_shard(layout, c, 3, r);
    const HostFlat flat(layout, c, begin, end);
    const Shard& s = flat.shard;
    FusedAdamW mine(s.tensors, c, Backend::reference);
    load_checkpoint(mine, s, kNames, path);
    for (std::size_t k = 0; k < s.tensors.size(); ++k) {
      const ParamTensor& p = s.tensors[k];
      const Piece& w = a[static_cast<std::size_t>(s.source[k])];
      const auto at = static_cast<std::size_t>(p.offset), n = static_cast<std::size_t>(p.numel);
      const MomentBlocks mb = moment_blocks(c, p);
      CAPTURE(k, p.offset, p.numel);
      CHECK(std::memcmp(p.master, &w.master[at], 4 * n) == 0);
      CHECK(std::memcmp(p.model, &w.model[at], 2 * n) == 0);
      if (mb.quantized) {
        CHECK(std::memcmp(p.exp_avg, &w.m8[at], n) == 0);
        CHECK(std::memcmp(p.exp_avg_sq, &w.v8[at], n) == 0);
        CHECK(std::memcmp(p.exp_avg_scale, &w.ms[static_cast<std::size_t>(mb.first)], 4 * static_cast<std::size_t>(mb.blocks)) == 0);
        CHECK(std::memcmp(p.exp_avg_sq_scale, &w.vs[static_cast<std::size_t>(mb.first)], 4 * static_cast<std::size_t>(mb.blocks)) == 0);
      } else {
        CHECK(std::memcmp(p.exp_avg, &w.m32[at], 4 * n) == 0);
        CHECK(std::memcmp(p.exp_avg_sq, &w.v32[at], 4 * n) == 0);
      }
    }
    // A piece's own save is refused: a checkpoint holds codes whole.
    if (r == 1) {
      std::vector<std::string> names;
      for (std::size_t k = 0; k < s.tensors.size(); ++k) names.push_back("piece" + std::to_string(k));
      CHECK_THROWS_WITH(save_checkpoint(mine, names, "halfstep_test_piece.safetensors"),
                        Catch::Contains("of a tensor with block8 moments, whose codes and scales a checkpoint stores whole"));
    }
  }
}

TEST_CASE("block8 checkpoints convert to and from fp32 moments on load", "[block8][safetensors]") {
  const StepConfig q = config_with(MomentFormat::block8), wide = config_with(MomentFormat::f32);
  std::mt19937_64 gen(6);
  std::vector<Piece> a = make_pieces(q, kShapes, gen);
  FusedAdamW one(views_of(a, q), q, Backend::reference);
  train(one, a, 4, gen);
  const std::string path = "halfstep_test_block8_convert.safetensors";
  const RemovedAtEnd removed{path};
  save_checkpoint(one, kNames, path);

  // block8 into fp32 moments: each value decoded exactly, exp_avg_sq squared in double and rounded once.
  std::mt19937_64 g2(8);
  std::vector<Piece> f = make_pieces(wide, kShapes, g2);
  FusedAdamW two(views_of(f, wide), wide, Backend::reference);
  load_checkpoint(two, kNames, path);
  const detail::Block8Geometry g = detail::block8_geometry(9000, 300);
  for (std::size_t i = 0; i < 9000; ++i) {
    const auto k = static_cast<std::size_t>(g.block_of(static_cast<std::int64_t>(i)));
    const double m = detail::decode8(detail::kSignedCodec8, a[0].m8[i], a[0].ms[k]);
    const double r = detail::decode8(detail::kUnsignedCodec8, a[0].v8[i], a[0].vs[k]);
    if (f[0].m32[i] != static_cast<float>(m) || f[0].v32[i] != static_cast<float>(r * r)) {
      FAIL("element " << i << ": " << f[0].m32[i] << " " << f[0].v32[i] << " vs " << m << " " << r * r);
    }
  }
  CHECK(f[1].m32 == a[1].m32);  // the wide tensor's fp32 moments as they are
  CHECK(f[1].v32 == a[1].v32);
  CHECK(f[0].master == a[0].master);

  // fp32 moments into block8: each block encoded to nearest, as a step encodes (sqrt for exp_avg_sq).
  const std::string back = "halfstep_test_block8_from_f32.safetensors";
  const RemovedAtEnd removed_back{back};
  save_checkpoint(two, kNames, back);
  std::mt19937_64 g3(9);
  std::vector<Piece> b = make_pieces(q, kShapes, g3);
  FusedAdamW three(views_of(b, q), q, Backend::reference);
  load_checkpoint(three, kNames, back);
  const detail::Block8Geometry one_row = detail::block8_geometry(42000, 42000);
  for (std::int64_t k = 0; k < one_row.blocks; ++k) {
    const auto at = static_cast<std::size_t>(one_row.block_start(k));
    const int n = static_cast<int>(one_row.block_size(k));
    float root[detail::kBlock8];
    for (int j = 0; j < n; ++j) root[j] = static_cast<float>(std::sqrt(static_cast<double>(f[2].v32[at + static_cast<std::size_t>(j)])));
    std::uint8_t mc[detail::kBlock8], vc[detail::kBlock8];
    float ms = 0, vs = 0;
    REQUIRE(detail::encode_block8(detail::kSignedCodec8, &f[2].m32[at], n, false, nullptr, 0, false, mc, ms));
    REQUIRE(detail::encode_block8(detail::kUnsignedCodec8, root, n, false, nullptr, 0, true, vc, vs));
    CAPTURE(k);
    CHECK(std::memcmp(mc, &b[2].m8[at], static_cast<std::size_t>(n)) == 0);
    CHECK(std::memcmp(vc, &b[2].v8[at], static_cast<std::size_t>(n)) == 0);
    CHECK(ms == b[2].ms[static_cast<std::size_t>(k)]);
    CHECK(vs == b[2].vs[static_cast<std::size_t>(k)]);
  }
  // Decoded and encoded again to nearest, the codes come back mostly as they were; a block's scale
  // becomes its largest decoded value, the map's largest magnitude (a cell's centre, below 1)
  // times the scale.
  std::size_t same = 0;
  for (std::size_t i = 0; i < 42000; ++i) same += b[2].m8[i] == a[2].m8[i];
  CHECK(same > 41000);
  for (std::size_t k = 0; k < a[2].ms.size(); ++k) {
    CHECK(b[2].ms[k] <= a[2].ms[k]);
    CHECK(b[2].ms[k] >= 0.99f * a[2].ms[k]);
  }
}

TEST_CASE("block8 checkpoints load into shards of another geometry as its blocks encode the decoded values",
          "[block8][safetensors]") {
  const StepConfig c = config_with(MomentFormat::block8);
  std::mt19937_64 gen(12);
  std::vector<Piece> a = make_pieces(c, {{9000, 300, 0, 9000, 0}}, gen);
  FusedAdamW one(views_of(a, c), c, Backend::reference);
  train(one, a, 3, gen);
  const std::string path = "halfstep_test_block8_regeometry.safetensors";
  const RemovedAtEnd removed{path};
  save_checkpoint(one, {"w"}, path);
  // The values the file holds, decoded in its rows of 300.
  const detail::Block8Geometry stored = detail::block8_geometry(9000, 300);
  std::vector<float> m(9000), v(9000);
  for (std::size_t i = 0; i < 9000; ++i) {
    const auto k = static_cast<std::size_t>(stored.block_of(static_cast<std::int64_t>(i)));
    m[i] = static_cast<float>(detail::decode8(detail::kSignedCodec8, a[0].m8[i], a[0].ms[k]));
    const double r = detail::decode8(detail::kUnsignedCodec8, a[0].v8[i], a[0].vs[k]);
    v[i] = static_cast<float>(r * r);
  }
  // Loaded into two ranks' shards of the same tensor in rows of 600 (three blocks a row: 256, 256, 88).
  std::vector<ParamTensor> layout{shape_of(a[0])};
  layout[0].row = 600;
  const detail::Block8Geometry mine = detail::block8_geometry(9000, 600);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    const auto [begin, end] = even_shard(layout, c, 2, r);
    const HostFlat flat(layout, c, begin, end);
    const Shard& s = flat.shard;
    const std::vector<unsigned char>& mc = flat.m;
    const std::vector<unsigned char>& vc = flat.v;
    const std::vector<float>& ms = flat.ms;
    const std::vector<float>& vs = flat.vs;
    FusedAdamW rank(s.tensors, c, Backend::reference);
    load_checkpoint(rank, s, {"w"}, path);
    REQUIRE(s.tensors.size() == 1);
    const MomentBlocks b = moment_blocks(c, s.tensors[0]);
    for (std::int64_t k = 0; k < b.blocks; ++k) {
      const std::int64_t start = mine.block_start(b.first + k), n = mine.block_size(b.first + k);
      float root[detail::kBlock8];
      for (std::int64_t j = 0; j < n; ++j) root[j] = static_cast<float>(std::sqrt(static_cast<double>(v[static_cast<std::size_t>(start + j)])));
      std::uint8_t want_m[detail::kBlock8], want_v[detail::kBlock8];
      float want_ms = 0, want_vs = 0;
      REQUIRE(detail::encode_block8(detail::kSignedCodec8, &m[static_cast<std::size_t>(start)], static_cast<int>(n), false,
                                    nullptr, 0, false, want_m, want_ms));
      REQUIRE(detail::encode_block8(detail::kUnsignedCodec8, root, static_cast<int>(n), false, nullptr, 0, true, want_v, want_vs));
      const auto at = static_cast<std::size_t>(start - begin);
      CAPTURE(k);
      CHECK(std::memcmp(want_m, &mc[at], static_cast<std::size_t>(n)) == 0);
      CHECK(std::memcmp(want_v, &vc[at], static_cast<std::size_t>(n)) == 0);
      CHECK(want_ms == ms[static_cast<std::size_t>(k)]);
      CHECK(want_vs == vs[static_cast<std::size_t>(k)]);
    }
    CHECK(std::memcmp(flat.master.data(), &a[0].master[static_cast<std::size_t>(begin)], 4 * flat.master.size()) == 0);
  }
}

TEST_CASE("block8 checkpoints with bad codes or scales are refused by name, nothing changed", "[block8][safetensors]") {
  const StepConfig c = config_with(MomentFormat::block8);
  std::mt19937_64 gen(10);
  std::vector<Piece> a = make_pieces(c, kShapes, gen);
  FusedAdamW one(views_of(a, c), c, Backend::reference);
  train(one, a, 2, gen);
  const std::string path = "halfstep_test_block8_bad.safetensors";
  const RemovedAtEnd removed{path};
  save_checkpoint(one, kNames, path);
  const std::string good = read_file(path);
  std::mt19937_64 g2(11);
  std::vector<Piece> b = make_pieces(c, kShapes, g2);
  const std::vector<Piece> before = b;
  FusedAdamW two(views_of(b, c), c, Backend::reference);
  auto refused = [&](const std::string& bytes, const std::string& needle) {
    write_file(path, bytes);
    CHECK_THROWS_WITH(load_checkpoint(two, kNames, path), Catch::Contains(needle));
    for (std::size_t t = 0; t < b.size(); ++t) CHECK(same_state(b[t], before[t]));
  };
  refused(with_element(good, "w.exp_avg.scale", 7, -1.0f), "tensor 'w.exp_avg.scale' block 7's scale is -1");
  refused(with_element(good, "u.exp_avg_sq.scale", 164, std::nanf("")), "block 164's scale is nan");
  {
    File f = split(good);
    replace(f.header, "\"w.exp_avg.scale\"", "\"w.exp_avg.skale\"");
    refused(join(f), "tensor 'w.exp_avg' holds block8 codes, and the file has no 'w.exp_avg.scale'");
  }
  {
    File f = split(good);  // codes in rows of 20: moments never in blocks
    replace(f.header, "\"shape\":[30,300]", "\"shape\":[450,20]");
    refused(join(f), "a shape whose moments are never in blocks");
  }
  {
    File f = split(good);  // rows of 600: the scales no longer one a block
    replace(f.header, "\"shape\":[30,300]", "\"shape\":[15,600]");
    refused(join(f), "need F32 of 45 (a scale per block)");
  }
  {
    File f = split(good);  // codes for a master
    replace(f.header, "\"w\":{\"dtype\":\"F32\",\"shape\":[9000]", "\"w\":{\"dtype\":\"U8\",\"shape\":[36000]");
    refused(join(f), "tensor 'w' is U8, this optimizer needs F32");
  }
}
