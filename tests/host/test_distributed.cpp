// Many ranks on the CPU: N ranks as threads, each a FusedAdamW on the reference backend holding a
// shard of the flat parameter space cut at random offsets, their StepTotals records reduced in a
// random order each step. Every rank must hold bitwise the report a single unsharded rank holds,
// and the union of the shards must be bitwise the unsharded state, step after step.
#include <catch2/catch.hpp>

#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <random>

#include "halfstep/error.hpp"
#include "halfstep/fused_adamw.hpp"
#include "halfstep/safetensors.hpp"
#include "ranks.hpp"
#include "record_faults.hpp"
#include "sharded_run.hpp"
#include "step_check.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

struct RankResult {
  std::vector<StepReport> reports;
  FlatBuffers buffers;
  Shard shard;
};

// Runs `c` unsharded and over the given ranges; returns the unsharded reports and buffers and
// each rank's.
std::pair<std::pair<std::vector<StepReport>, FlatBuffers>, std::vector<RankResult>> run(
    const ShardedCase& c, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges, std::uint64_t seed) {
  FlatBuffers whole = c.initial;
  FusedAdamW one(c.whole(whole), c.config, Backend::reference);
  std::vector<StepReport> reports;
  for (const auto& g : c.grads) {
    whole.grad = g;
    one.step();
    reports.push_back(one.last_report());
  }
  const int n = static_cast<int>(ranges.size());
  std::vector<RankResult> ranks(static_cast<std::size_t>(n));
  HostAllReduce reduce(n, seed);
  run_ranks(n, [&](int r) {
    RankResult& me = ranks[static_cast<std::size_t>(r)];
    const auto [begin, end] = ranges[static_cast<std::size_t>(r)];
    me.buffers = c.initial.slice(begin, end);
    me.shard = shard(c.layout, begin, end, me.buffers.view(), c.config);
    FusedAdamW opt(me.shard.tensors, c.config, Distributed{r, {}}, Backend::reference);
    for (const auto& g : c.grads) {
      std::copy(g.begin() + begin, g.begin() + end, me.buffers.grad.begin());
      opt.step_local();
      reduce.all_reduce(r, *opt.device_totals());
      opt.step_finish();
      me.reports.push_back(opt.last_report());
    }
  });
  return {{reports, whole}, ranks};
}

}  // namespace

TEST_CASE("N ranks with sharded state step bitwise like one rank for 200 steps", "[distributed]") {
  for (const DType dtype : {DType::f16, DType::bf16}) {
    for (const int n : {1, 2, 3, 4, 7}) {
      const std::uint64_t seed = 900 + static_cast<std::uint64_t>(n) + (dtype == DType::bf16 ? 50u : 0u);
      const ShardedCase c = ShardedCase::make(seed, dtype, 200, 900);
      const auto ranges = c.random_cuts(n, seed + 1);
      const auto [one, ranks] = run(c, ranges, seed + 2);
      CAPTURE(dtype_name(dtype), n);
      int overflows = 0, spikes = 0, applied = 0, clipped = 0;
      for (std::size_t s = 0; s < c.grads.size(); ++s) {
        const StepReport& want = one.first[s];
        overflows += want.outcome == Outcome::skipped_overflow;
        spikes += want.outcome == Outcome::skipped_spike;
        applied += want.outcome == Outcome::applied;
        clipped += want.outcome == Outcome::applied && want.clip_coef < 1.0f;
        for (int r = 0; r < n; ++r) {
          const RankResult& me = ranks[static_cast<std::size_t>(r)];
          auto map = [&](std::int32_t rank, std::int32_t local) {
            return ranks[static_cast<std::size_t>(rank)].shard.source[static_cast<std::size_t>(local)];
          };
          CAPTURE(s, r);
          const StepReport& got = me.reports[s];
          if (!same_report(got, want, map)) {
            CAPTURE(got.outcome, want.outcome, got.grad_norm, want.grad_norm, got.attempt, want.attempt);
            CAPTURE(got.first_nonfinite_tensor, got.first_nonfinite_rank, want.first_nonfinite_tensor);
            CAPTURE(got.max_abs_scaled, want.max_abs_scaled, got.numel, want.numel, got.zero_count, want.zero_count);
            CAPTURE(got.scale_used, want.scale_used, got.scale_next, want.scale_next, got.nonfinite_count, want.nonfinite_count);
            FAIL("reports differ");
          }
        }
      }
      // The union of the shards is the unsharded state, bit for bit.
      FlatBuffers joined;
      for (const RankResult& me : ranks) joined.append(me.buffers);
      CHECK(joined == one.second);
      CHECK(overflows >= 3);
      CHECK(spikes >= 1);
      CHECK(clipped >= 10);
      CHECK(applied >= 100);
    }
  }
}

TEST_CASE("N ranks with lean state (remainders or no master, bf16 moments rounded stochastically) step bitwise like one rank",
          "[distributed][state]") {
  // Stochastic rounding's bits are keyed by tensor and element index, never by the cut: the
  // ranks' shards round every element (moments, and weights without a master) as the unsharded
  // run does.
  for (const MasterFormat master : {MasterFormat::bf16_remainder, MasterFormat::none}) {
    StateFormat lean;
    lean.master = master;
    lean.exp_avg = lean.exp_avg_sq = MomentFormat::bf16;
    lean.seed = 2024;
    for (const int n : {1, 2, 3, 4, 7}) {
      const std::uint64_t seed = 980 + static_cast<std::uint64_t>(n) + (master == MasterFormat::none ? 100u : 0u);
      const ShardedCase c = ShardedCase::make(seed, DType::bf16, 120, 900, lean);
      const auto [one, ranks] = run(c, c.random_cuts(n, seed + 1), seed + 2);
      CAPTURE(n);
      for (std::size_t s = 0; s < c.grads.size(); ++s) {
        for (int r = 0; r < n; ++r) {
          auto map = [&](std::int32_t rank, std::int32_t local) {
            return ranks[static_cast<std::size_t>(rank)].shard.source[static_cast<std::size_t>(local)];
          };
          CAPTURE(s, r);
          REQUIRE(same_report(ranks[static_cast<std::size_t>(r)].reports[s], one.first[s], map));
        }
      }
      FlatBuffers joined;
      for (const RankResult& me : ranks) joined.append(me.buffers);
      CHECK(joined == one.second);
    }
  }
}

TEST_CASE("inf on one rank only: every rank skips with the same report naming that rank", "[distributed]") {
  const ShardedCase base = ShardedCase::make(950, DType::f16, 1, 5000);
  ShardedCase c = base;
  const auto ranges = c.random_cuts(4, 951);
  // The inf in the third rank's range (the lowest rank holding one is named).
  const std::int64_t at = (ranges[2].first + ranges[2].second) / 2;
  REQUIRE(ranges[2].first < ranges[2].second);
  std::fill(c.grads[0].begin(), c.grads[0].end(), std::uint16_t{0x3C00});
  c.grads[0][static_cast<std::size_t>(at)] = 0xFE00;  // NaN
  const auto [one, ranks] = run(c, ranges, 952);
  for (std::size_t k = 0; k < ranks.size(); ++k) {
    const StepReport& r = ranks[k].reports[0];
    CHECK(r.outcome == Outcome::skipped_overflow);
    CHECK(r.nonfinite_count == 1);
    CHECK(r.first_nonfinite_rank == 2);
    CHECK(ranks[2].shard.source[static_cast<std::size_t>(r.first_nonfinite_tensor)] == one.first[0].first_nonfinite_tensor);
    FlatBuffers untouched = c.initial.slice(ranges[k].first, ranges[k].second);
    untouched.grad = ranks[k].buffers.grad;
    CHECK(ranks[k].buffers == untouched);  // nothing written on any rank
  }
}

TEST_CASE("shard cuts tensors anywhere and names where each piece came from", "[distributed][validate]") {
  std::vector<ParamTensor> layout(3);
  layout[0].numel = 10;
  layout[1].numel = 0;
  layout[2].numel = 5;
  layout[2].group = 1;
  layout[2].duplicate = true;
  FlatBuffers flat = ShardedCase::make(1, DType::f16, 0, 2).initial;  // any buffers of 15 elements
  flat.master.assign(7, 0.0f);
  flat.exp_avg.assign(7, 0.0f);
  flat.exp_avg_sq.assign(7, 0.0f);
  flat.grad.assign(7, 0);
  flat.model.assign(7, 0);
  const Shard s = shard(layout, 6, 13, flat.view());
  REQUIRE(s.tensors.size() == 2);
  CHECK(s.source == std::vector<std::int32_t>{0, 2});
  CHECK(s.offset == std::vector<std::int64_t>{6, 0});
  CHECK(s.tensors[0].numel == 4);
  CHECK(s.tensors[1].numel == 3);
  CHECK(s.tensors[1].master == flat.master.data() + 4);
  CHECK(s.tensors[1].grad == flat.grad.data() + 4);
  CHECK(s.tensors[1].group == 1);
  CHECK(s.tensors[1].duplicate);
  CHECK_THROWS_WITH(shard(layout, 6, 16, flat.view()), Catch::Contains("must lie in the parameter space"));
  CHECK_THROWS_WITH(shard(layout, 6, 12, flat.view()), Catch::Contains("flat.numel must be end - begin = 6"));
  CHECK(even_shard(10, 3, 0) == std::make_pair<std::int64_t, std::int64_t>(0, 4));
  CHECK(even_shard(10, 3, 1) == std::make_pair<std::int64_t, std::int64_t>(4, 8));
  CHECK(even_shard(10, 3, 2) == std::make_pair<std::int64_t, std::int64_t>(8, 10));
  CHECK(even_shard(2, 3, 2) == std::make_pair<std::int64_t, std::int64_t>(2, 2));  // empty
  CHECK_THROWS_WITH(even_shard(10, 3, 3), Catch::Contains("rank must be in [0, 3)"));
  // Near 2^63 elements: the last range ends at numel, with no product past INT64_MAX (UBSan).
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  CHECK(even_shard(kMax, 2, 1) == std::make_pair(kMax / 2 + 1, kMax));
  CHECK(even_shard(kMax, 2, 0) == std::make_pair(std::int64_t{0}, kMax / 2 + 1));
  CHECK(even_shard(kMax, 7, 6).second == kMax);
  CHECK(even_shard(kMax - 1, 2147483647, 2147483646).second == kMax - 1);
}

TEST_CASE("a record no reduction gives, or ranks with other hyperparameters, is never applied", "[distributed][validate]") {
  for (const bool has_inf : {false, true}) {
    for (const RecordFault& fault : record_faults(has_inf)) {
      CAPTURE(has_inf, fault.name);
      ShardedCase c = ShardedCase::make(961, DType::f16, 3, 200);
      FlatBuffers flat = c.initial;
      FusedAdamW opt(c.whole(flat), c.config, Backend::reference);
      for (int k = 0; k < 2; ++k) {
        flat.grad = c.grads[static_cast<std::size_t>(k)];
        opt.step();
      }
      flat.grad = c.grads[2];
      if (has_inf) flat.grad[flat.grad.size() / 2] = 0xFC00;  // -inf
      const FlatBuffers before = flat;
      const OptimizerState state = opt.state();
      opt.step_local();
      fault.apply(*opt.device_totals());
      opt.step_finish();
      const StepReport r = opt.last_report();
      CHECK(r.outcome == Outcome::skipped_inconsistent);
      CHECK(r.reason == fault.reason);
      CHECK(flat == before);
      OptimizerState expected = state;
      expected.attempts += 1;  // only the attempt counts
      CHECK(opt.state() == expected);
      if (fault.reason == SkipReason::inconsistent_totals) {
        CHECK_THROWS_AS(summarize(*opt.device_totals(), DType::f16), Error);  // the same rules, by name
      } else {
        const TotalsSummary s = summarize(*opt.device_totals(), DType::f16);
        CHECK(!s.hyperparameters_agree);
        CHECK(s.rank_refused == (fault.reason == SkipReason::rank_refused));
      }
    }
  }
}

TEST_CASE("ranks whose learning rates differ all skip the step, naming why, and stay replicas", "[distributed][validate]") {
  ShardedCase c = ShardedCase::make(962, DType::bf16, 6, 300);
  std::vector<FlatBuffers> flats(2, c.initial);
  std::vector<std::unique_ptr<FusedAdamW>> opts;
  for (int r = 0; r < 2; ++r) {
    opts.push_back(std::make_unique<FusedAdamW>(c.whole(flats[static_cast<std::size_t>(r)]), c.config,
                                                Distributed{r, {}}, Backend::reference));
  }
  for (int step = 0; step < 6; ++step) {
    if (step == 3) opts[1]->set_lr(1, c.config.groups[1].lr * 0.5f);  // one rank's schedule only
    StepTotals total_record{};
    for (int r = 0; r < 2; ++r) {
      flats[static_cast<std::size_t>(r)].grad = c.grads[static_cast<std::size_t>(step)];
      opts[static_cast<std::size_t>(r)]->step_local();
      combine(total_record, *opts[static_cast<std::size_t>(r)]->device_totals());
    }
    for (int r = 0; r < 2; ++r) {
      *opts[static_cast<std::size_t>(r)]->device_totals() = total_record;
      opts[static_cast<std::size_t>(r)]->step_finish();
      const StepReport rep = opts[static_cast<std::size_t>(r)]->last_report();
      CAPTURE(step, r);
      if (step >= 3) {
        CHECK(rep.outcome == Outcome::skipped_inconsistent);
        CHECK(rep.reason == SkipReason::hyperparameters_differ);
      } else {
        CHECK(rep.reason != SkipReason::hyperparameters_differ);
      }
    }
    CHECK(!(summarize(total_record, DType::bf16).hyperparameters_agree) == (step >= 3));
    CHECK(flats[0] == flats[1]);
  }
}

TEST_CASE("ranks whose loss scales differ all skip the step, and stay replicas", "[distributed][validate]") {
  // The fingerprint covers the scale the gradients are divided by: a rank whose own scale was
  // set apart (set_loss_scale), whose external scaler gives another scale, marks its gradients
  // unscaled alone, or alone reports an external found_inf, makes every rank skip.
  ShardedCase c = ShardedCase::make(963, DType::f16, 1, 300);
  struct Skew {
    const char* what;
    std::function<void(FusedAdamW&, int)> apply;
    bool differ;
  };
  const float half = 512.0f, full = 1024.0f, none = 0.0f, found = 1.0f;
  const std::vector<Skew> skews = {
      {"equal own scales", [](FusedAdamW&, int) {}, false},
      {"one rank's own scale set apart", [&](FusedAdamW& o, int r) { if (r == 1) o.set_loss_scale(half); }, true},
      {"equal external scales", [&](FusedAdamW& o, int) { o.use_external_scale(&full, &none); }, false},
      {"external scales that differ",
       [&](FusedAdamW& o, int r) { o.use_external_scale(r == 0 ? &full : &half, &none); }, true},
      {"one rank external, one own", [&](FusedAdamW& o, int r) { if (r == 0) o.use_external_scale(&full, &none); }, true},
      {"one rank's gradients marked unscaled", [&](FusedAdamW& o, int r) { if (r == 1) o.mark_unscaled(); }, true},
      {"one rank's found_inf", [&](FusedAdamW& o, int r) { o.use_external_scale(&full, r == 1 ? &found : &none); }, true},
  };
  for (const Skew& skew : skews) {
    CAPTURE(skew.what);
    std::vector<FlatBuffers> flats(2, c.initial);
    std::vector<std::unique_ptr<FusedAdamW>> opts;
    StepTotals total_record{};
    for (int r = 0; r < 2; ++r) {
      auto& f = flats[static_cast<std::size_t>(r)];
      opts.push_back(std::make_unique<FusedAdamW>(c.whole(f), c.config, Distributed{r, {}}, Backend::reference));
      f.grad = c.grads[0];
      skew.apply(*opts.back(), r);
      opts.back()->step_local();
      combine(total_record, *opts.back()->device_totals());
    }
    CHECK(summarize(total_record, DType::f16).hyperparameters_agree == !skew.differ);
    for (int r = 0; r < 2; ++r) {
      *opts[static_cast<std::size_t>(r)]->device_totals() = total_record;
      opts[static_cast<std::size_t>(r)]->step_finish();
      const StepReport rep = opts[static_cast<std::size_t>(r)]->last_report();
      CAPTURE(r);
      CHECK((rep.reason == SkipReason::hyperparameters_differ) == skew.differ);
      if (skew.differ) CHECK(rep.outcome == Outcome::skipped_inconsistent);
    }
    CHECK(flats[0] == flats[1]);
  }
}

TEST_CASE("a rank that refuses its step makes every rank skip it, and the ranks stay in step", "[distributed][validate]") {
  // Three ranks of the split step on even shards; at step 4 rank 1 refuses (step_local_refused:
  // it reads no gradient). Every rank skips that step as rank_refused and the run goes on exactly
  // as one rank's run without that step: nothing written, scaler and step counter unchanged, only
  // the attempt counted.
  ShardedCase c = ShardedCase::make(964, DType::f16, 10, 500);
  constexpr int kRanks = 3;
  constexpr std::size_t kRefused = 4;
  std::vector<FlatBuffers> flats;
  std::vector<std::unique_ptr<FusedAdamW>> opts;
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (int r = 0; r < kRanks; ++r) ranges.push_back(even_shard(c.numel(), kRanks, r));
  for (int r = 0; r < kRanks; ++r) flats.push_back(c.initial.slice(ranges[static_cast<std::size_t>(r)].first,
                                                                   ranges[static_cast<std::size_t>(r)].second));
  for (int r = 0; r < kRanks; ++r) {
    FlatBuffers& f = flats[static_cast<std::size_t>(r)];
    const Shard s = shard(c.layout, ranges[static_cast<std::size_t>(r)].first, ranges[static_cast<std::size_t>(r)].second,
                          f.view());
    opts.push_back(std::make_unique<FusedAdamW>(s.tensors, c.config, Distributed{r, {}}, Backend::reference));
  }
  FlatBuffers one = c.initial;
  FusedAdamW single(c.whole(one), c.config, Backend::reference);
  for (std::size_t step = 0; step < c.grads.size(); ++step) {
    StepTotals total{};
    for (int r = 0; r < kRanks; ++r) {
      const auto [begin, end] = ranges[static_cast<std::size_t>(r)];
      FlatBuffers& f = flats[static_cast<std::size_t>(r)];
      f.grad.assign(c.grads[step].begin() + begin, c.grads[step].begin() + end);
      if (step == kRefused && r == 1) {
        opts[1]->step_local_refused();
      } else {
        opts[static_cast<std::size_t>(r)]->step_local();
      }
      combine(total, *opts[static_cast<std::size_t>(r)]->device_totals());
    }
    CHECK(summarize(total, DType::f16).rank_refused == (step == kRefused));
    if (step != kRefused) {
      one.grad = c.grads[step];
      single.step();
    }
    for (int r = 0; r < kRanks; ++r) {
      CAPTURE(step, r);
      *opts[static_cast<std::size_t>(r)]->device_totals() = total;
      opts[static_cast<std::size_t>(r)]->step_finish();
      const StepReport got = opts[static_cast<std::size_t>(r)]->last_report();
      CHECK(got.attempt == static_cast<std::int64_t>(step) + 1);
      if (step == kRefused) {
        CHECK(got.outcome == Outcome::skipped_inconsistent);
        CHECK(got.reason == SkipReason::rank_refused);
        // The refusing rank's record holds no elements: the others' are counted.
        CHECK(got.numel == c.numel() - (ranges[1].second - ranges[1].first));
        continue;
      }
      const StepReport want = single.last_report();
      CHECK(got.outcome == want.outcome);
      CHECK(same_bits(got.grad_norm, want.grad_norm));
      CHECK(got.scale_next == want.scale_next);
      CHECK(got.step == want.step);
    }
  }
  FlatBuffers joined;
  for (const FlatBuffers& f : flats) joined.append(f);
  CHECK(joined.master == one.master);
  CHECK(joined.model == one.model);
  CHECK(joined.exp_avg_sq == one.exp_avg_sq);
  CHECK_THROWS_WITH(opts[0]->step_refused(), Catch::Contains("step_local_refused"));
}

TEST_CASE("the split step refuses calls out of order and the reference backend refuses communicators", "[distributed][validate]") {
  ShardedCase c = ShardedCase::make(960, DType::f16, 1, 100);
  FlatBuffers flat = c.initial;
  FusedAdamW opt(c.whole(flat), c.config, Backend::reference);
  CHECK_THROWS_WITH(opt.step_finish(), Catch::Contains("no step_local"));
  opt.step_local();
  CHECK_THROWS_WITH(opt.step_local(), Catch::Contains("step_finish must end that step first"));
  CHECK_THROWS_WITH(opt.step(), Catch::Contains("step_finish must end that step first"));
  opt.step_finish();
  CHECK(opt.last_report().attempt == 1);
  CHECK_THROWS_WITH(FusedAdamW(c.whole(flat), c.config, Distributed{-1, {}}, Backend::reference),
                    Catch::Contains("Distributed.rank must be in [0, 2^31 - 1)"));
  auto* fake = reinterpret_cast<ncclComm*>(&flat);
  CHECK_THROWS_WITH(FusedAdamW(c.whole(flat), c.config, Distributed{0, {fake}}, Backend::reference),
                    Catch::Contains("Backend::reference takes no NCCL communicators"));
  CHECK_THROWS_WITH(FusedAdamW(c.whole(flat), c.config, Distributed{0, {nullptr}}, Backend::reference),
                    Catch::Contains("Distributed.comms[0] is null"));
  CHECK_THROWS_WITH(FusedAdamW(c.whole(flat), c.config, Distributed{0, {fake, fake}}, Backend::reference),
                    Catch::Contains("repeats comms[0]"));
}

TEST_CASE("a checkpoint of a 3-rank run resumes on 2 ranks and on 1, bit for bit", "[distributed][checkpoint]") {
  const ShardedCase c = ShardedCase::make(970, DType::f16, 100, 2000);
  std::vector<std::string> names;
  for (std::size_t t = 0; t < c.layout.size(); ++t) names.push_back("tensor" + std::to_string(t));
  const std::string path = "halfstep_test_resharded.safetensors";

  // The uninterrupted run, unsharded.
  FlatBuffers straight = c.initial;
  FusedAdamW one(c.whole(straight), c.config, Backend::reference);
  for (const auto& g : c.grads) {
    straight.grad = g;
    one.step();
  }

  // 50 steps on 3 ranks; then the shards gathered into whole buffers and saved as one checkpoint
  // (the state from any rank: all hold the same).
  const int half = 50;
  {
    const auto ranges = c.random_cuts(3, 971);
    std::vector<FlatBuffers> flats(3);
    std::vector<std::unique_ptr<FusedAdamW>> opts;
    for (int r = 0; r < 3; ++r) {
      flats[static_cast<std::size_t>(r)] = c.initial.slice(ranges[static_cast<std::size_t>(r)].first, ranges[static_cast<std::size_t>(r)].second);
      opts.push_back(std::make_unique<FusedAdamW>(
          shard(c.layout, ranges[static_cast<std::size_t>(r)].first, ranges[static_cast<std::size_t>(r)].second, flats[static_cast<std::size_t>(r)].view()).tensors,
          c.config, Distributed{r, {}}, Backend::reference));
    }
    for (int s = 0; s < half; ++s) {
      StepTotals total{};
      for (int r = 0; r < 3; ++r) {
        const auto [b, e] = ranges[static_cast<std::size_t>(r)];
        std::copy(c.grads[static_cast<std::size_t>(s)].begin() + b, c.grads[static_cast<std::size_t>(s)].begin() + e,
                  flats[static_cast<std::size_t>(r)].grad.begin());
        opts[static_cast<std::size_t>(r)]->step_local();
        combine(total, *opts[static_cast<std::size_t>(r)]->device_totals());
      }
      for (int r = 0; r < 3; ++r) {
        *opts[static_cast<std::size_t>(r)]->device_totals() = total;
        opts[static_cast<std::size_t>(r)]->step_finish();
      }
    }
    FlatBuffers gathered;
    for (const FlatBuffers& f : flats) gathered.append(f);
    FusedAdamW whole(c.whole(gathered), c.config, Backend::reference);
    whole.load_state(opts[1]->save_state());
    save_checkpoint(whole, names, path);
  }

  // Resumed on 2 ranks, and on 1, each loading only its slices.
  for (const int n : {2, 1}) {
    std::vector<FlatBuffers> flats(static_cast<std::size_t>(n));
    std::vector<std::unique_ptr<FusedAdamW>> opts;
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    for (int r = 0; r < n; ++r) {
      ranges.push_back(even_shard(c.numel(), n, r));
      FlatBuffers& f = flats[static_cast<std::size_t>(r)];
      f = c.initial.slice(ranges.back().first, ranges.back().second);
      std::fill(f.master.begin(), f.master.end(), -7.0f);  // all of it comes from the file
      const Shard sh = shard(c.layout, ranges.back().first, ranges.back().second, f.view());
      opts.push_back(std::make_unique<FusedAdamW>(sh.tensors, c.config, Distributed{r, {}}, Backend::reference));
      load_checkpoint(*opts.back(), sh, names, path);
    }
    CHECK(opts[0]->state().attempts == half);
    for (std::size_t s = half; s < c.grads.size(); ++s) {
      StepTotals total{};
      for (int r = 0; r < n; ++r) {
        const auto [b, e] = ranges[static_cast<std::size_t>(r)];
        std::copy(c.grads[s].begin() + b, c.grads[s].begin() + e, flats[static_cast<std::size_t>(r)].grad.begin());
        opts[static_cast<std::size_t>(r)]->step_local();
        combine(total, *opts[static_cast<std::size_t>(r)]->device_totals());
      }
      for (int r = 0; r < n; ++r) {
        *opts[static_cast<std::size_t>(r)]->device_totals() = total;
        opts[static_cast<std::size_t>(r)]->step_finish();
      }
    }
    FlatBuffers joined;
    for (const FlatBuffers& f : flats) joined.append(f);
    CAPTURE(n);
    CHECK(joined == straight);
    CHECK(opts[0]->state() == one.state());
  }
  // A shard that asks for more than the file holds is refused, naming the tensor.
  FlatBuffers f = c.initial;
  std::vector<ParamTensor> longer = c.layout;
  longer[0].numel += 1;
  f.master.push_back(0.0f);
  f.exp_avg.push_back(0.0f);
  f.exp_avg_sq.push_back(0.0f);
  f.grad.push_back(0);
  f.model.push_back(0);
  const Shard too_long = shard(longer, 0, c.numel() + 1, f.view());
  FusedAdamW wrong(too_long.tensors, c.config, Backend::reference);
  CHECK_THROWS_WITH(load_checkpoint(wrong, too_long, names, path), Catch::Contains("tensor 'tensor0'"));
  std::remove(path.c_str());
}
