// The data-parallel example of README.md, compiled and run: ranks as threads, each with its NCCL
// communicator (the emulator's stand-in on the emulated device; one GPU per rank on hardware),
// sharding the optimizer state, the model copies all-gathered. The union of the ranks' shards and
// every rank's gathered model copy must equal one unsharded optimizer's, bit for bit.
// tests/check_readme_example.cmake checks that README.md quotes the marked lines verbatim.
#include <catch2/catch.hpp>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <functional>
#include <stdexcept>

#include "gpu_support.hpp"
#include "ranks.hpp"
#include "sharded_run.hpp"

using namespace halfstep_test;

namespace {

void must(cudaError_t e) {
  if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
}
void must(ncclResult_t e) {
  if (e != ncclSuccess) throw std::runtime_error(ncclGetErrorString(e));
}

// One rank's training loop, as the README shows it. `layout` lists the model's tensors (numel,
// group); `grads` and `model` hold the whole flat space (padded to world · chunk elements);
// `master`, `exp_avg`, `exp_avg_sq`, `grad_slice` and `model_slice` this rank's chunk.
void train_rank(ncclComm_t comm, int rank, int world, const std::vector<halfstep::ParamTensor>& layout,
                std::int64_t numel, const halfstep::StepConfig& config, int steps, cudaStream_t stream,
                std::uint16_t* grads, std::uint16_t* model, float* master, float* exp_avg, float* exp_avg_sq,
                std::uint16_t* grad_slice, std::uint16_t* model_slice,
                const std::function<void(int step, const float* loss_scale, std::uint16_t* grads)>& backward) {
  // example:begin
  // One rank of data parallelism with sharded optimizer state (ZeRO-1/2): this rank owns a chunk
  // of the flat parameter space, its masters, moments and model copy, cut across tensors anywhere.
  const std::int64_t chunk = (numel + world - 1) / world;  // collectives move `chunk` per rank
  const auto [begin, end] = halfstep::even_shard(numel, world, rank);
  const halfstep::Shard mine = halfstep::shard(layout, begin, end,
      {master, grad_slice, exp_avg, exp_avg_sq, model_slice, end - begin});
  halfstep::FusedAdamW opt(mine.tensors, config, halfstep::Distributed{rank, {comm}});
  for (int step = 0; step < steps; ++step) {
    backward(step, opt.device_loss_scale(), grads);  // fp16 gradients of loss × S
    ncclReduceScatter(grads, grad_slice, chunk, ncclFloat16, ncclAvg, comm, stream);
    opt.step(stream);  // every rank: the same verdict, norm, clip and scale, bit for bit
    ncclAllGather(model_slice, model, chunk, ncclFloat16, comm, stream);  // the next forward's weights
  }
  // example:end
}

}  // namespace

TEST_CASE("gpu the README's data-parallel loop shards exactly", "[gpu][distributed][nccl][readme]") {
#if defined(HALFSTEP_EMULATED)
  const int world = 3;
#else
  int devices = 0;
  GPU_CHECK(cudaGetDeviceCount(&devices));
  const int world = std::min(devices, 3);
#endif
  const ShardedCase c = ShardedCase::make(1400, halfstep::DType::f16, 30, 2000);
  const std::int64_t numel = c.numel(), chunk = (numel + world - 1) / world;
  const auto padded = static_cast<std::size_t>(chunk * world);

  // The reference: one unsharded optimizer over the same gradients.
  DeviceArray<float> m0(static_cast<std::size_t>(numel), 0), e0(static_cast<std::size_t>(numel), 0),
      v0(static_cast<std::size_t>(numel), 0);
  DeviceArray<std::uint16_t> g0(static_cast<std::size_t>(numel), 0), d0(static_cast<std::size_t>(numel), 0);
  m0.upload(c.initial.master);
  e0.upload(c.initial.exp_avg);
  v0.upload(c.initial.exp_avg_sq);
  d0.upload(c.initial.model);
  halfstep::FusedAdamW one(
      halfstep::shard(c.layout, 0, numel, {m0.ptr, g0.ptr, e0.ptr, v0.ptr, d0.ptr, numel}).tensors, c.config);
  for (const auto& g : c.grads) {
    g0.upload(g);
    one.step();
  }
  FlatBuffers want;
  m0.download(want.master);
  d0.download(want.model);

  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  std::vector<FlatBuffers> got(static_cast<std::size_t>(world));
  std::vector<std::vector<std::uint16_t>> gathered(static_cast<std::size_t>(world));
  run_ranks(world, [&](int rank) {
#if !defined(HALFSTEP_EMULATED)
    must(cudaSetDevice(rank));
#endif
    ncclComm_t comm = nullptr;
    must(ncclCommInitRank(&comm, world, id, rank));
    cudaStream_t stream = nullptr;
    must(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    {
      const auto [begin, end] = halfstep::even_shard(numel, world, rank);
      auto alloc = [&](auto*& p, std::size_t n) {
        must(cudaMalloc(reinterpret_cast<void**>(&p), std::max<std::size_t>(n, 1) * sizeof(*p)));
        must(cudaMemset(p, 0, std::max<std::size_t>(n, 1) * sizeof(*p)));
      };
      std::uint16_t *grads, *model, *grad_slice, *model_slice;
      float *master, *exp_avg, *exp_avg_sq;
      alloc(grads, padded);
      alloc(model, padded);
      alloc(grad_slice, static_cast<std::size_t>(chunk));
      alloc(model_slice, static_cast<std::size_t>(chunk));
      alloc(master, static_cast<std::size_t>(chunk));
      alloc(exp_avg, static_cast<std::size_t>(chunk));
      alloc(exp_avg_sq, static_cast<std::size_t>(chunk));
      const FlatBuffers init = c.initial.slice(begin, end);
      const auto len = static_cast<std::size_t>(end - begin);
      must(cudaMemcpy(master, init.master.data(), len * 4, cudaMemcpyHostToDevice));
      must(cudaMemcpy(model_slice, init.model.data(), len * 2, cudaMemcpyHostToDevice));
      must(cudaDeviceSynchronize());
      // Every rank computes the whole batch's gradients here, so the average is those gradients
      // and the result must be the unsharded optimizer's.
      auto backward = [&](int step, const float*, std::uint16_t* g) {
        must(cudaStreamSynchronize(stream));
        must(cudaMemcpy(g, c.grads[static_cast<std::size_t>(step)].data(), static_cast<std::size_t>(numel) * 2,
                        cudaMemcpyHostToDevice));
        must(cudaStreamSynchronize(cudaStreamLegacy));
      };
      train_rank(comm, rank, world, c.layout, numel, c.config, static_cast<int>(c.grads.size()), stream, grads,
                 model, master, exp_avg, exp_avg_sq, grad_slice, model_slice, backward);
      must(cudaStreamSynchronize(stream));
      FlatBuffers& me = got[static_cast<std::size_t>(rank)];
      me.master.resize(len);
      must(cudaMemcpy(me.master.data(), master, len * 4, cudaMemcpyDeviceToHost));
      gathered[static_cast<std::size_t>(rank)].resize(static_cast<std::size_t>(numel));
      must(cudaMemcpy(gathered[static_cast<std::size_t>(rank)].data(), model, static_cast<std::size_t>(numel) * 2,
                      cudaMemcpyDeviceToHost));
      for (void* p : {static_cast<void*>(grads), static_cast<void*>(model), static_cast<void*>(grad_slice),
                      static_cast<void*>(model_slice), static_cast<void*>(master), static_cast<void*>(exp_avg),
                      static_cast<void*>(exp_avg_sq)}) {
        cudaFree(p);
      }
    }
    cudaStreamDestroy(stream);
    ncclCommDestroy(comm);
  });
  std::vector<float> joined;
  for (const FlatBuffers& f : got) joined.insert(joined.end(), f.master.begin(), f.master.end());
  CHECK(joined == want.master);
  for (const auto& g : gathered) CHECK(g == want.model);
}
