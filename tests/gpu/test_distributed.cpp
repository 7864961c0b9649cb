// Many ranks on the device, through NCCL: each rank a thread with its own communicator, stream and
// shard of the flat parameter space (cut at random offsets), the optimizer reducing its StepTotals
// record over the communicator on the step's stream. Every rank must hold the report an unsharded
// single-rank run holds, bit for bit, and the union of the shards its buffers. On the emulated
// device the ranks share the one device and NCCL is the emulator's stand-in; on GPUs each rank
// needs a GPU of its own, so the multi-rank cases run where there are at least two.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <stdexcept>
#include <string>

#include "gpu_support.hpp"
#if defined(HALFSTEP_EMULATED)
#include "halfstep_emu/control.hpp"
#endif
#include "ranks.hpp"
#include "record_faults.hpp"
#include "sharded_run.hpp"
#include "state_codec.hpp"
#include "step_check.hpp"

using namespace halfstep;
using namespace halfstep_test;

namespace {

// Checks for rank threads, where Catch's assertions may not run.
void must(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
void must(ncclResult_t e, const char* what) {
  if (e != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(e));
}

// Ranks this machine can run: every rank on the emulated device, else one GPU each.
int rank_capacity() {
#if defined(HALFSTEP_EMULATED)
  return 64;
#else
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess ? devices : 0;
#endif
}
int device_of(int rank) {
#if defined(HALFSTEP_EMULATED)
  (void)rank;
  return 0;
#else
  return rank;
#endif
}

// One device allocation, freed on scope exit; thread-safe checks.
template <class T>
struct Buffer {
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit Buffer(const std::vector<T>& host) : n(host.size()) {
    must(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<std::size_t>(n, 1) * sizeof(T)), "cudaMalloc");
    put(host);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { cudaFree(ptr); }
  void put(const std::vector<T>& host) {
    if (n) must(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice), "upload");
    // A copy from pageable memory may return before it lands, and the ranks' non-blocking
    // streams do not wait for the legacy stream it used.
    must(cudaStreamSynchronize(cudaStreamLegacy), "upload");
  }
  void get(std::vector<T>& host) const {
    host.resize(n);
    if (n) must(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  }
};

// A rank's flat buffers on the device, the state in the host buffers' format.
struct DeviceFlat {
  Buffer<float> master, exp_avg, exp_avg_sq;
  Buffer<std::uint16_t> grad, model, remainder, exp_avg16, exp_avg_sq16;
  StateFormat format;
  explicit DeviceFlat(const FlatBuffers& h)
      : master(h.master), exp_avg(h.exp_avg), exp_avg_sq(h.exp_avg_sq), grad(h.grad), model(h.model),
        remainder(h.remainder), exp_avg16(h.exp_avg16), exp_avg_sq16(h.exp_avg_sq16), format(h.format) {}
  ParamTensor view() {
    ParamTensor p;
    p.master = format.master == MasterFormat::f32              ? static_cast<void*>(master.ptr)
               : format.master == MasterFormat::bf16_remainder ? static_cast<void*>(remainder.ptr)
                                                               : nullptr;
    p.grad = grad.ptr;
    p.exp_avg = format.exp_avg == MomentFormat::f32 ? static_cast<void*>(exp_avg.ptr) : exp_avg16.ptr;
    p.exp_avg_sq = format.exp_avg_sq == MomentFormat::f32 ? static_cast<void*>(exp_avg_sq.ptr) : exp_avg_sq16.ptr;
    p.model = model.ptr;
    p.numel = static_cast<std::int64_t>(grad.n);
    return p;
  }
  FlatBuffers download() const {
    FlatBuffers h;
    master.get(h.master);
    exp_avg.get(h.exp_avg);
    exp_avg_sq.get(h.exp_avg_sq);
    grad.get(h.grad);
    model.get(h.model);
    remainder.get(h.remainder);
    exp_avg16.get(h.exp_avg16);
    exp_avg_sq16.get(h.exp_avg_sq16);
    h.format = format;
    return h;
  }
};

struct RankRun {
  std::vector<StepReport> reports;
  FlatBuffers buffers;
  std::vector<std::int32_t> source;
};

enum class Reduce { communicator, caller };

// A rank that refuses one step (step_refused / step_local_refused); rank -1: none.
struct Refusal {
  int rank = -1;
  std::size_t step = 0;
};

// Steps `c` on `ranges.size()` ranks: the optimizer reduces over its communicator, or (Reduce::
// caller) the caller reduces the record itself with NCCL between step_local and step_finish.
std::vector<RankRun> run_ranks_nccl(const ShardedCase& c, const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges,
                                    Reduce how, Refusal refusal = {}) {
  const int n = static_cast<int>(ranges.size());
  ncclUniqueId id;
  must(ncclGetUniqueId(&id), "ncclGetUniqueId");
  std::vector<RankRun> out(static_cast<std::size_t>(n));
  run_ranks(n, [&](int r) {
    must(cudaSetDevice(device_of(r)), "cudaSetDevice");
    ncclComm_t comm = nullptr;
    must(ncclCommInitRank(&comm, n, id, r), "ncclCommInitRank");
    cudaStream_t stream = nullptr;
    must(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    {
      const auto [begin, end] = ranges[static_cast<std::size_t>(r)];
      DeviceFlat flat(c.initial.slice(begin, end));
      const Shard s = shard(c.layout, begin, end, flat.view(), c.config);
      Distributed dist{r, {}};
      if (how == Reduce::communicator) dist.comms.push_back(comm);
      FusedAdamW opt(s.tensors, c.config, dist);
      RankRun& me = out[static_cast<std::size_t>(r)];
      me.source = s.source;
      std::vector<std::uint16_t> g(static_cast<std::size_t>(end - begin));
      for (std::size_t k = 0; k < c.grads.size(); ++k) {
        const auto& step = c.grads[k];
        std::copy(step.begin() + begin, step.begin() + end, g.begin());
        flat.grad.put(g);
        const bool refuses = refusal.rank == r && refusal.step == k;
        if (how == Reduce::communicator) {
          if (refuses) {
            opt.step_refused(stream);
          } else {
            opt.step(stream);
          }
        } else {  // what a caller with its own engine does, here with NCCL too
          if (refuses) {
            opt.step_local_refused(stream);
          } else {
            opt.step_local(stream);
          }
          StepTotals* t = opt.device_totals();
          must(ncclGroupStart(), "ncclGroupStart");
          must(ncclAllReduce(t->sum, t->sum, StepTotals::kSumWords, ncclUint64, ncclSum, comm, stream), "sum");
          must(ncclAllReduce(t->max, t->max, StepTotals::kMaxWords, ncclUint64, ncclMax, comm, stream), "max");
          must(ncclGroupEnd(), "ncclGroupEnd");
          opt.step_finish(stream);
        }
        me.reports.push_back(opt.last_report());
      }
      must(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      me.buffers = flat.download();
    }
    cudaStreamDestroy(stream);
    ncclCommDestroy(comm);
  });
  return out;
}

// The same case unsharded, on one rank without a communicator.
std::pair<std::vector<StepReport>, FlatBuffers> run_one(const ShardedCase& c) {
  DeviceFlat flat(c.initial);
  FusedAdamW opt(c.whole(flat.view()), c.config);
  std::vector<StepReport> reports;
  for (const auto& step : c.grads) {
    flat.grad.put(step);
    opt.step();
    reports.push_back(opt.last_report());
  }
  return {reports, flat.download()};
}

void check_against_one(const ShardedCase& c, const std::vector<RankRun>& ranks,
                       const std::pair<std::vector<StepReport>, FlatBuffers>& one) {
  for (std::size_t s = 0; s < c.grads.size(); ++s) {
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      auto map = [&](std::int32_t rank, std::int32_t local) {
        return ranks[static_cast<std::size_t>(rank)].source[static_cast<std::size_t>(local)];
      };
      CAPTURE(s, r);
      REQUIRE(same_report(ranks[r].reports[s], one.first[s], map));
    }
  }
  FlatBuffers joined;
  for (const RankRun& me : ranks) joined.append(me.buffers);
  REQUIRE(joined == one.second);
}

}  // namespace

TEST_CASE("gpu a one-rank NCCL communicator steps bitwise like no communicator", "[gpu][distributed][nccl]") {
  const ShardedCase c = ShardedCase::make(1100, DType::f16, 40, 3000);
  const auto one = run_one(c);
  check_against_one(c, run_ranks_nccl(c, {{0, c.numel()}}, Reduce::communicator), one);
  check_against_one(c, run_ranks_nccl(c, {{0, c.numel()}}, Reduce::caller), one);
}

#if defined(HALFSTEP_EMULATED)
TEST_CASE("gpu a step with a communicator launches finalize on both sides of the all-reduce", "[gpu][distributed][nccl]") {
  // The emulator's NCCL stand-in launches no grid, so its counter sees halfstep's kernels only.
  const ShardedCase c = ShardedCase::make(1101, DType::bf16, 1, 3000);
  ncclUniqueId id;
  must(ncclGetUniqueId(&id), "ncclGetUniqueId");
  ncclComm_t comm = nullptr;
  must(ncclCommInitRank(&comm, 1, id, 0), "ncclCommInitRank");
  {
    DeviceFlat flat(c.initial);
    const Shard s = shard(c.layout, 0, c.numel(), flat.view());
    FusedAdamW opt(s.tensors, c.config, Distributed{0, {comm}});
    flat.grad.put(c.grads[0]);
    must(cudaDeviceSynchronize(), "sync");
    const std::uint64_t before = halfstep_emu::counters().launches;
    opt.step();
    must(cudaDeviceSynchronize(), "sync");
    CHECK(static_cast<int>(halfstep_emu::counters().launches - before) == opt.launches_per_step());
    CHECK(opt.launches_per_step() == 4);
  }
  ncclCommDestroy(comm);
}
#endif

namespace {

// The state formats the API offers, for f16 and bf16 models (remainders and no master need a bf16 one).
std::vector<StateFormat> formats_for(DType dtype) {
  std::vector<StateFormat> out;
  for (const MasterFormat master : {MasterFormat::f32, MasterFormat::bf16_remainder, MasterFormat::none}) {
    if (master != MasterFormat::f32 && dtype != DType::bf16) continue;
    for (const MomentFormat m : {MomentFormat::f32, MomentFormat::bf16}) {
      for (const MomentFormat v : {MomentFormat::f32, MomentFormat::bf16}) {
        for (const Rounding rounding : {Rounding::stochastic, Rounding::nearest}) {
          // (unused: nothing rounds)
          if (m == MomentFormat::f32 && v == MomentFormat::f32 && master != MasterFormat::none && rounding == Rounding::nearest) continue;
          StateFormat f;
          f.master = master;
          f.exp_avg = m;
          f.exp_avg_sq = v;
          f.rounding = rounding;
          f.seed = 0xC0FFEEu + out.size();
          out.push_back(f);
        }
      }
    }
  }
  return out;
}

std::string describe(const StateFormat& f) {
  return std::string(master_format_name(f.master)) + "/" + moment_format_name(f.exp_avg) + "/" +
         moment_format_name(f.exp_avg_sq) + "/" + rounding_name(f.rounding);
}

}  // namespace

namespace {

// A flat space's buffers as tensors of fp32 values (remainders joined, bf16 moments widened),
// for check_step.
HostModel as_tensors(const ShardedCase& c, const FlatBuffers& flat) {
  const FlatBuffers w = flat.as_f32();
  HostModel m;
  std::size_t at = 0;
  for (const ParamTensor& t : c.layout) {
    const auto n = static_cast<std::size_t>(t.numel);
    auto cut = [&](const auto& v) { return std::decay_t<decltype(v)>(v.begin() + at, v.begin() + at + n); };
    HostTensor h;
    h.master = cut(w.master);
    h.exp_avg = cut(w.exp_avg);
    h.exp_avg_sq = cut(w.exp_avg_sq);
    h.grad = cut(w.grad);
    h.model = cut(w.model);
    h.grad_dtype = c.config.grad_dtype;
    h.group = t.group;
    m.tensors.push_back(std::move(h));
    at += n;
  }
  return m;
}

}  // namespace

TEST_CASE("gpu every state format steps like the reference backend", "[gpu][state]") {
  // Each step of the device from the state it holds, against the reference's step from the same
  // buffers and optimizer state (its own codecs, double arithmetic): the report exactly, the
  // masters and moments within adam_bound (bf16 moments one bf16 ulp more), the model copy the
  // device's master rounded, a skipped step writing nothing; through overflows, spikes and clips.
  const int steps = reduced_sizes() ? 20 : 60;
  for (const DType dtype : {DType::f16, DType::bf16}) {
    for (const StateFormat& f : formats_for(dtype)) {
      const ShardedCase c = ShardedCase::make(1400 + (dtype == DType::bf16 ? 1u : 0u), dtype, steps, 700, f);
      CAPTURE(dtype_name(dtype), describe(f));
      DeviceFlat flat(c.initial);
      FusedAdamW opt(c.whole(flat.view()), c.config);
      int applied = 0;
      for (std::size_t s = 0; s < c.grads.size(); ++s) {
        flat.grad.put(c.grads[s]);
        FlatBuffers host = flat.download();
        const HostModel before = as_tensors(c, host);
        const OptimizerState state = opt.state();
        opt.step();
        const StepReport got = opt.last_report();
        FusedAdamW ref(c.whole(host), c.config, Backend::reference);
        ref.set_state(state);
        ref.step();
        CAPTURE(s);
        check_step(got, ref.last_report(), before, as_tensors(c, flat.download()), as_tensors(c, host), c.config,
                   got.step);
        applied += got.outcome == Outcome::applied;
      }
      CHECK(applied >= steps / 2);
    }
  }
}

#if defined(HALFSTEP_EMULATED)
TEST_CASE("gpu the bytes one step moves per parameter are what state_bytes says, in every format", "[gpu][state][bytes]") {
  // Tensors whose every chunk takes the vector path (sizes and offsets multiples of 256
  // elements), so that every access to a per-element buffer is a vector access the emulated
  // device counts: an applied step moves state_bytes(config).moved bytes per element (pass 1
  // reads the gradients, pass 2 reads the gradients and the state and writes the state and the
  // model copy); a skipped step only pass 1's gradient bytes, and the thread that met the inf
  // reads its own words once more to name the first (here 2 vectors of 16 bytes: 4096 elements
  // in 256 threads).
  for (const DType dtype : {DType::f16, DType::bf16}) {
    for (const StateFormat& f : formats_for(dtype)) {
      ShardedCase c = ShardedCase::make(1650, dtype, 2, 4);
      c.layout.clear();
      for (const std::int64_t n : {4096, 1024, 2048, 256}) {
        ParamTensor p;
        p.numel = n;
        p.group = static_cast<std::int32_t>(c.layout.size() % 2);
        c.layout.push_back(p);
      }
      const std::int64_t total = 4096 + 1024 + 2048 + 256;
      FlatBuffers flat32 = ShardedCase::make(1651, dtype, 0, total).initial;  // buffers of any contents...
      flat32.master.resize(static_cast<std::size_t>(total), 0.5f);
      flat32.exp_avg.assign(static_cast<std::size_t>(total), 0.0f);
      flat32.exp_avg_sq.assign(static_cast<std::size_t>(total), 0.0f);
      flat32.model.assign(static_cast<std::size_t>(total), to_bits16(dtype, 0.5));
      flat32.grad.assign(static_cast<std::size_t>(total), to_bits16(dtype, 1e-3 * c.config.scaler.init_scale));
      c.config.state = f;
      c.config.spike.enabled = false;
      c.initial = flat32.in_format(f);
      CAPTURE(dtype_name(dtype), describe(f));
      DeviceFlat flat(c.initial);
      FusedAdamW opt(c.whole(flat.view()), c.config);
      const StateBytes want = state_bytes(c.config);
      for (const bool skip : {false, true}) {
        std::vector<std::uint16_t> g = c.initial.grad;
        if (skip) g[100] = dtype == DType::f16 ? 0x7C00 : 0x7F80;  // an overflow: pass 2 does not run
        flat.grad.put(g);
        must(cudaDeviceSynchronize(), "sync");
        const halfstep_emu::Counters before = halfstep_emu::counters();
        opt.step();
        must(cudaDeviceSynchronize(), "sync");
        const halfstep_emu::Counters after = halfstep_emu::counters();
        REQUIRE(opt.last_report().outcome == (skip ? Outcome::skipped_overflow : Outcome::applied));
        const std::uint64_t moved = (after.bytes_read - before.bytes_read) + (after.bytes_written - before.bytes_written);
        CAPTURE(skip, after.bytes_read - before.bytes_read, after.bytes_written - before.bytes_written);
        if (skip) {
          CHECK(moved - static_cast<std::uint64_t>(total) * want.gradient <= 64);
        } else {
          CHECK(moved == static_cast<std::uint64_t>(total) * want.moved);
        }
      }
    }
  }
}
#endif

TEST_CASE("gpu remainders step bitwise like fp32 masters with a bf16 model copy", "[gpu][state]") {
  const int steps = reduced_sizes() ? 40 : 200;
  for (const MomentFormat moments : {MomentFormat::f32, MomentFormat::bf16}) {
    StateFormat f32;
    f32.exp_avg = f32.exp_avg_sq = moments;
    StateFormat lean = f32;
    lean.master = MasterFormat::bf16_remainder;
    const auto a = run_one(ShardedCase::make(1450, DType::bf16, steps, 900, f32));
    const auto b = run_one(ShardedCase::make(1450, DType::bf16, steps, 900, lean));
    CAPTURE(moment_format_name(moments));
    for (std::size_t s = 0; s < a.first.size(); ++s) {
      CAPTURE(s);
      REQUIRE(same_report(b.first[s], a.first[s], [](std::int32_t, std::int32_t t) { return t; }));
    }
    REQUIRE(b.second.as_f32() == a.second.as_f32());
  }
}

TEST_CASE("gpu without a master each step rounds the fp32-master step's result with the weight's own bits",
          "[gpu][state]") {
  // From the weights a master-free run holds, the device's step with an fp32 master (the weights
  // widened, exactly) computes the same fp32 result: the master-free step must store the same
  // moments and, as each weight, that result rounded with the bits state_codec.hpp draws for it
  // (keyed by seed, applied step, tensor and element index), bit for bit; to nearest, likewise.
  const int steps = reduced_sizes() ? 15 : 40;
  for (const Rounding rounding : {Rounding::stochastic, Rounding::nearest}) {
    StateFormat lean;
    lean.master = MasterFormat::none;
    lean.rounding = rounding;
    lean.seed = 0xABCDu;
    const ShardedCase c = ShardedCase::make(1470, DType::bf16, steps, 900, lean);
    ShardedCase c_wide = c;
    c_wide.config.state = StateFormat{};
    DeviceFlat flat(c.initial);
    FusedAdamW opt(c.whole(flat.view()), c.config);
    int applied = 0;
    for (std::size_t s = 0; s < c.grads.size(); ++s) {
      flat.grad.put(c.grads[s]);
      FlatBuffers wide_host = flat.download().as_f32();
      DeviceFlat wide(wide_host);
      FusedAdamW one(c_wide.whole(wide.view()), c_wide.config);
      one.set_state(opt.state());
      one.step();
      opt.step();
      const StepReport r = opt.last_report();
      CAPTURE(rounding_name(rounding), s);
      REQUIRE(same_report(r, one.last_report(), [](std::int32_t, std::int32_t t) { return t; }));
      const FlatBuffers got = flat.download(), want = wide.download();
      REQUIRE(got.exp_avg == want.exp_avg);
      REQUIRE(got.exp_avg_sq == want.exp_avg_sq);
      if (r.outcome != Outcome::applied) continue;
      ++applied;
      REQUIRE(r.held_elements == 0);  // every weight is written
      std::size_t i = 0;
      for (std::size_t t = 0; t < c.layout.size(); ++t) {
        const std::uint64_t key = detail::tensor_key(detail::step_key(lean.seed, r.step), static_cast<std::uint32_t>(t + 1));
        for (std::int64_t k = 0; k < c.layout[t].numel; ++k, ++i) {
          const std::uint32_t b = detail::bits_of(want.master[i]);
          const std::uint32_t bits = detail::weight_bits(detail::element_bits(key, k)) & 0xFFFFu;
          const std::uint16_t expect = rounding == Rounding::nearest ? detail::bf16_nearest(want.master[i])
                                                                     : static_cast<std::uint16_t>((b + bits) >> 16);
          // The fp32 master stores an upper tie one ulp lower (canonical_master); the weight rounds
          // the result itself: either may have been the fp32 result.
          const bool tie = rounding == Rounding::stochastic && (b & 0x1FFFFu) == 0x7FFFu &&
                           got.model[i] == static_cast<std::uint16_t>((b + 1 + bits) >> 16);
          if (got.model[i] != expect && !tie) {
            CAPTURE(t, k, b, got.model[i], expect);
            FAIL("the weight is not the fp32 result rounded with its own bits");
          }
        }
      }
    }
    CHECK(applied >= steps / 2);
  }
}

TEST_CASE("gpu N ranks over NCCL with lean state step bitwise like one rank", "[gpu][distributed][nccl][multi_gpu][state]") {
  const int capacity = rank_capacity();
  if (capacity < 2) {
    skip_test("multi-rank NCCL needs at least two GPUs (found " + std::to_string(capacity) + ")");
    return;
  }
  StateFormat lean;
  lean.master = MasterFormat::bf16_remainder;
  lean.exp_avg = lean.exp_avg_sq = MomentFormat::bf16;
  lean.seed = 99;
  const int steps = reduced_sizes() ? 30 : 120;
  for (const int n : {2, 3, 4, 7}) {
    if (n > capacity) continue;
    const std::uint64_t seed = 1500 + static_cast<std::uint64_t>(n);
    const ShardedCase c = ShardedCase::make(seed, DType::bf16, steps, 900, lean);
    CAPTURE(n);
    check_against_one(c, run_ranks_nccl(c, c.random_cuts(n, seed + 1), Reduce::communicator), run_one(c));
  }
}

TEST_CASE("gpu N ranks over NCCL with sharded state step bitwise like one rank", "[gpu][distributed][nccl][multi_gpu]") {
  const int capacity = rank_capacity();
  if (capacity < 2) {
    skip_test("multi-rank NCCL needs at least two GPUs (found " + std::to_string(capacity) + ")");
    return;
  }
  const int steps = reduced_sizes() ? 40 : 200;
  int ran = 0;
  for (const DType dtype : {DType::f16, DType::bf16}) {
    for (const int n : {2, 3, 4, 7}) {
      if (n > capacity) continue;
      const std::uint64_t seed = 1200 + static_cast<std::uint64_t>(n) + (dtype == DType::bf16 ? 50u : 0u);
      const ShardedCase c = ShardedCase::make(seed, dtype, steps, 900);
      CAPTURE(dtype_name(dtype), n);
      const auto one = run_one(c);
      check_against_one(c, run_ranks_nccl(c, c.random_cuts(n, seed + 1), Reduce::communicator), one);
      ++ran;
    }
  }
  // The split step, reduced by the caller over NCCL, on even shards.
  const int n = std::min(capacity, 3);
  const ShardedCase c = ShardedCase::make(1300, DType::f16, steps / 4, 900);
  std::vector<std::pair<std::int64_t, std::int64_t>> even;
  for (int r = 0; r < n; ++r) even.push_back(even_shard(c.numel(), n, r));
  check_against_one(c, run_ranks_nccl(c, even, Reduce::caller), run_one(c));
  CHECK(ran >= 1);
}

#if !defined(HALFSTEP_EMULATED)
// The emulator's NCCL cannot be captured; real NCCL can. (Skipped without a GPU.)
TEST_CASE("gpu a one-rank NCCL step captured in a CUDA graph replays like eager steps", "[gpu][distributed][nccl][graph]") {
  HostModel h = random_model(1500, {5000, 70000, 3}, 1024.0f);
  DeviceModel captured_dev(h), eager_dev(h);
  const StepConfig c = config_for(DType::f16, DType::f16, 1024.0f, 1.0f);
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  ncclComm_t comm = nullptr;
  REQUIRE(ncclCommInitRank(&comm, 1, id, 0) == ncclSuccess);
  cudaStream_t stream = nullptr;
  GPU_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    FusedAdamW captured(captured_dev.views(), c, Distributed{0, {comm}});
    FusedAdamW eager(eager_dev.views(), c);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    captured.step(stream);
    GPU_CHECK(cudaStreamEndCapture(stream, &graph));
    GPU_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 10; ++i) {
      GPU_CHECK(cudaGraphLaunch(exec, stream));
      eager.step();
    }
    GPU_CHECK(cudaStreamSynchronize(stream));
    const StepReport a = captured.last_report(), b = eager.last_report();
    CHECK(a.attempt == 10);
    CHECK(same_bits(a.grad_norm, b.grad_norm));
    CHECK(a.step == b.step);
    CHECK(captured.state() == eager.state());
    const HostModel x = captured_dev.download(h), y = eager_dev.download(h);
    for (std::size_t t = 0; t < x.tensors.size(); ++t) CHECK(x.tensors[t] == y.tensors[t]);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(stream);
  ncclCommDestroy(comm);
}
#endif

TEST_CASE("gpu two communicators (data- and tensor-parallel) reduce over every rank, a replicated tensor counted once",
          "[gpu][distributed][nccl][multi_gpu]") {
  if (rank_capacity() < 4) {
    skip_test("needs 4 ranks (found " + std::to_string(rank_capacity()) + " GPUs)");
    return;
  }
  // A flat space sharded over 4 ranks, plus a tensor R held whole by ranks 0 and 1 (replicated
  // across their tensor-parallel group) and counted by rank 0 only. Communicators: {0,1}, {2,3}
  // (tensor-parallel) then {0,2}, {1,3} (data-parallel); reduced in turn they cover all four.
  ShardedCase c = ShardedCase::make(1600, DType::f16, 40, 1500);
  const ShardedCase extra = ShardedCase::make(1601, DType::f16, 40, 300);
  const std::int64_t r_numel = extra.numel();
  // The unsharded model: the flat space, then R.
  ShardedCase whole = c;
  halfstep::ParamTensor r_shape;
  r_shape.numel = r_numel;
  whole.layout.push_back(r_shape);
  whole.initial.append(extra.initial);
  for (std::size_t s = 0; s < whole.grads.size(); ++s) {
    whole.grads[s].insert(whole.grads[s].end(), extra.grads[s].begin(), extra.grads[s].end());
  }
  const auto one = run_one(whole);

  ncclUniqueId tp_id[2], dp_id[2];
  for (auto& id : tp_id) REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  for (auto& id : dp_id) REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<std::vector<StepReport>> reports(4);
  std::vector<FlatBuffers> shards(4), replicas(2);
  run_ranks(4, [&](int r) {
    must(cudaSetDevice(device_of(r)), "cudaSetDevice");
    ncclComm_t tp = nullptr, dp = nullptr;
    must(ncclCommInitRank(&tp, 2, tp_id[r / 2], r % 2), "ncclCommInitRank");
    must(ncclCommInitRank(&dp, 2, dp_id[r % 2], r / 2), "ncclCommInitRank");
    cudaStream_t stream = nullptr;
    must(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    {
      const auto [begin, end] = even_shard(c.numel(), 4, r);
      DeviceFlat flat(c.initial.slice(begin, end));
      std::vector<ParamTensor> tensors = shard(c.layout, begin, end, flat.view()).tensors;
      std::unique_ptr<DeviceFlat> replica;
      if (r < 2) {  // R, whole, on ranks 0 and 1; only rank 0 counts it
        replica = std::make_unique<DeviceFlat>(extra.initial);
        ParamTensor p = replica->view();
        p.duplicate = r != 0;
        tensors.push_back(p);
      }
      FusedAdamW opt(tensors, c.config, Distributed{r, {tp, dp}});
      std::vector<std::uint16_t> g(static_cast<std::size_t>(end - begin));
      for (std::size_t s = 0; s < c.grads.size(); ++s) {
        std::copy(c.grads[s].begin() + begin, c.grads[s].begin() + end, g.begin());
        flat.grad.put(g);
        if (replica) replica->grad.put(extra.grads[s]);
        opt.step(stream);
        reports[static_cast<std::size_t>(r)].push_back(opt.last_report());
      }
      must(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      shards[static_cast<std::size_t>(r)] = flat.download();
      if (replica) replicas[static_cast<std::size_t>(r)] = replica->download();
    }
    cudaStreamDestroy(stream);
    ncclCommDestroy(tp);
    ncclCommDestroy(dp);
  });
  for (std::size_t s = 0; s < c.grads.size(); ++s) {
    for (int r = 0; r < 4; ++r) {
      const StepReport& got = reports[static_cast<std::size_t>(r)][s];
      const StepReport& want = one.first[s];
      CAPTURE(s, r);
      REQUIRE(same_bits(got.grad_norm, want.grad_norm));
      REQUIRE(got.outcome == want.outcome);
      REQUIRE(got.numel == want.numel);
      REQUIRE(got.scale_next == want.scale_next);
      REQUIRE(got.max_abs_scaled == want.max_abs_scaled);
    }
  }
  FlatBuffers joined;
  for (const FlatBuffers& f : shards) joined.append(f);
  joined.append(replicas[0]);
  CHECK(joined == one.second);
  CHECK(replicas[1] == replicas[0]);  // both holders of R applied the same update
}

TEST_CASE("gpu a rank that refuses its step makes every rank skip it, and no rank waits", "[gpu][distributed][nccl][multi_gpu]") {
  const int capacity = rank_capacity();
  if (capacity < 3) {
    skip_test("three NCCL ranks need at least three GPUs (found " + std::to_string(capacity) + ")");
    return;
  }
  const ShardedCase c = ShardedCase::make(1400, DType::f16, 10, 700);
  const Refusal refusal{1, 4};
  // What the ranks must hold: one rank's run without the refused step (nothing of it is written;
  // the scaler and step counter stay; only the attempt counts).
  ShardedCase without = c;
  without.grads.erase(without.grads.begin() + static_cast<std::ptrdiff_t>(refusal.step));
  const auto one = run_one(without);
  std::vector<std::pair<std::int64_t, std::int64_t>> even;
  for (int r = 0; r < 3; ++r) even.push_back(even_shard(c.numel(), 3, r));
  for (const Reduce how : {Reduce::communicator, Reduce::caller}) {
    CAPTURE(how == Reduce::caller);
    const std::vector<RankRun> ranks = run_ranks_nccl(c, even, how, refusal);
    FlatBuffers joined;
    for (const RankRun& me : ranks) {
      joined.append(me.buffers);
      for (std::size_t s = 0; s < c.grads.size(); ++s) {
        CAPTURE(s);
        const StepReport& got = me.reports[s];
        CHECK(got.attempt == static_cast<std::int64_t>(s) + 1);
        if (s == refusal.step) {
          CHECK(got.outcome == Outcome::skipped_inconsistent);
          CHECK(got.reason == SkipReason::rank_refused);
          CHECK(got.scale_next == got.scale_used);
          continue;
        }
        const StepReport& want = one.first[s < refusal.step ? s : s - 1];
        CHECK(got.outcome == want.outcome);
        CHECK(same_bits(got.grad_norm, want.grad_norm));
        CHECK(got.scale_next == want.scale_next);
        CHECK(got.step == want.step);
      }
    }
    CHECK(joined == one.second);
  }
}

TEST_CASE("gpu a record no reduction gives, or ranks with other hyperparameters, is never applied", "[gpu][distributed]") {
  for (const bool has_inf : {false, true}) {
    for (const RecordFault& fault : record_faults(has_inf)) {
      CAPTURE(has_inf, fault.name);
      const ShardedCase c = ShardedCase::make(963, DType::bf16, 3, 3000);
      DeviceFlat flat(c.initial);
      std::vector<ParamTensor> whole = c.layout;
      std::int64_t at = 0;
      for (ParamTensor& p : whole) {  // the flat device buffers, tensor by tensor
        p.master = flat.master.ptr + at;
        p.grad = flat.grad.ptr + at;
        p.exp_avg = flat.exp_avg.ptr + at;
        p.exp_avg_sq = flat.exp_avg_sq.ptr + at;
        p.model = flat.model.ptr + at;
        at += p.numel;
      }
      FusedAdamW opt(whole, c.config);
      for (int k = 0; k < 2; ++k) {
        flat.grad.put(c.grads[static_cast<std::size_t>(k)]);
        opt.step();
      }
      std::vector<std::uint16_t> g = c.grads[2];
      if (has_inf) g[g.size() / 3] = 0x7F80;  // +inf in bf16
      flat.grad.put(g);
      const FlatBuffers before = flat.download();
      const OptimizerState state = opt.state();
      opt.step_local();
      StepTotals record{};
      must(cudaMemcpy(&record, opt.device_totals(), sizeof record, cudaMemcpyDeviceToHost), "download");
      fault.apply(record);
      must(cudaMemcpy(opt.device_totals(), &record, sizeof record, cudaMemcpyHostToDevice), "upload");
      must(cudaStreamSynchronize(cudaStreamLegacy), "upload");
      opt.step_finish();
      const StepReport r = opt.last_report();
      CHECK(r.outcome == Outcome::skipped_inconsistent);
      CHECK(r.reason == fault.reason);
      CHECK(flat.download() == before);
      OptimizerState expected = state;
      expected.attempts += 1;  // only the attempt counts
      CHECK(opt.state() == expected);
    }
  }
}
