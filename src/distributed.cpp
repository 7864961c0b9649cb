// The multi-rank step: the StepTotals record's public helpers, and the NCCL all-reduce that makes
// every rank decide from the same totals.
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "check.hpp"
#include "distributed_impl.hpp"
#include "step_math.hpp"

namespace halfstep {

void combine(StepTotals& into, const StepTotals& other) {
  for (int i = 0; i < StepTotals::kSumWords; ++i) into.sum[i] += other.sum[i];
  for (int i = 0; i < StepTotals::kMaxWords; ++i) {
    if (other.max[i] > into.max[i]) into.max[i] = other.max[i];
  }
}

TotalsSummary summarize(const StepTotals& totals, DType grad_dtype) {
  detail::require(grad_dtype == DType::f16 || grad_dtype == DType::bf16,
                  "grad_dtype must be f16 or bf16, got ", dtype_name(grad_dtype));
  const bool bf16 = grad_dtype == DType::bf16;
  constexpr std::uint64_t kInt64Max = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  constexpr int n = StepTotals::kSumLimbs;
  for (int i = n; i < StepTotals::kSumWords; ++i) {
    detail::require(totals.sum[i] <= kInt64Max, "totals.sum[", i, "] = ", totals.sum[i],
                    " is past any count of elements");
  }
  detail::require(totals.sum[n + 1] + totals.sum[n + 2] <= totals.sum[n + 3],
                  "totals: subnormal (sum[", n + 1, "]) and zero (sum[", n + 2,
                  "]) elements outnumber the elements in the norm (sum[", n + 3, "])");
  const std::uint64_t exponent = bf16 ? 0x7F80u : 0x7C00u;
  detail::require(totals.max[0] <= 0x7FFFu && (totals.max[0] & exponent) != exponent,
                  "totals.max[0] = ", totals.max[0], " is not the pattern of a finite |", dtype_name(grad_dtype),
                  "| value");
  detail::require((totals.max[1] == 0) == (totals.sum[n] == 0),
                  "totals: max[1] (the first inf/NaN) and sum[", n,
                  "] (the inf/NaN count) must be zero together");
  if (totals.max[1] != 0) {
    detail::require((totals.max[1] >> 32) >= 0x80000000u && (totals.max[1] & 0xFFFFFFFFu) >= 0x80000000u,
                    "totals.max[1] = ", totals.max[1], " is not a (rank, tensor) key");
  }
  const detail::Totals t = detail::decode_totals(totals, bf16);
  TotalsSummary s{};
  s.sum_sq = t.sum_sq;
  s.max_abs = t.max_abs;
  s.nonfinite = t.nonfinite;
  s.subnormal = t.subnormal;
  s.zero = t.zero;
  s.numel = t.numel;
  s.first_nonfinite_rank = t.first_nonfinite_rank;
  s.first_nonfinite_tensor = t.first_nonfinite_tensor;
  return s;
}

Shard shard(const std::vector<ParamTensor>& layout, std::int64_t begin, std::int64_t end,
            const ParamTensor& flat) {
  std::int64_t total = 0;
  for (std::size_t t = 0; t < layout.size(); ++t) {
    detail::require(layout[t].numel >= 0, "layout[", t, "].numel must be >= 0, got ", layout[t].numel);
    detail::require(total <= std::numeric_limits<std::int64_t>::max() - layout[t].numel,
                    "layout: the tensors hold more than 2^63 - 1 elements");
    total += layout[t].numel;
  }
  detail::require(begin >= 0 && begin <= end && end <= total, "the shard [", begin, ", ", end,
                  ") must lie in the parameter space [0, ", total, ")");
  detail::require(flat.numel == end - begin, "flat.numel must be end - begin = ", end - begin,
                  ", got ", flat.numel);
  Shard s;
  std::int64_t at = 0;  // where tensor t starts in the flat space
  for (std::size_t t = 0; t < layout.size(); ++t) {
    const std::int64_t lo = std::max(at, begin), hi = std::min(at + layout[t].numel, end);
    if (lo < hi) {
      const std::int64_t into_flat = lo - begin;
      ParamTensor p = layout[t];
      p.master = flat.master + into_flat;
      p.grad = static_cast<const std::uint16_t*>(flat.grad) + into_flat;
      p.exp_avg = flat.exp_avg + into_flat;
      p.exp_avg_sq = flat.exp_avg_sq + into_flat;
      p.model = flat.model != nullptr ? static_cast<std::uint16_t*>(flat.model) + into_flat : nullptr;
      p.numel = hi - lo;
      s.tensors.push_back(p);
      s.source.push_back(static_cast<std::int32_t>(t));
      s.offset.push_back(lo - at);
    }
    at += layout[t].numel;
  }
  return s;
}

std::pair<std::int64_t, std::int64_t> even_shard(std::int64_t numel, std::int32_t ranks, std::int32_t rank) {
  detail::require(numel >= 0, "numel must be >= 0, got ", numel);
  detail::require(ranks >= 1, "ranks must be >= 1, got ", ranks);
  detail::require(rank >= 0 && rank < ranks, "rank must be in [0, ", ranks, "), got ", rank);
  const std::int64_t chunk = numel / ranks + (numel % ranks != 0 ? 1 : 0);
  return {std::min(numel, rank * chunk), std::min(numel, (rank + 1) * chunk)};
}

namespace detail {
namespace {

void check_nccl(ncclResult_t result, const char* call, ncclComm* comm) {
  if (result == ncclSuccess) return;
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  throw Error(ErrorKind::cuda, concat(call, " failed: ", ncclGetErrorString(result),
                                      last != nullptr && *last != '\0' ? concat(" (", last, ")") : ""));
}

}  // namespace

void validate_distributed(const Distributed& dist) {
  require(dist.rank >= 0 && dist.rank < std::numeric_limits<std::int32_t>::max(),
          "Distributed.rank must be in [0, 2^31 - 1), got ", dist.rank);
  for (std::size_t c = 0; c < dist.comms.size(); ++c) {
    require(dist.comms[c] != nullptr, "Distributed.comms[", c, "] is null");
    for (std::size_t d = 0; d < c; ++d) {
      require(dist.comms[d] != dist.comms[c], "Distributed.comms[", c, "] repeats comms[", d,
              "]: reducing twice over one group counts its ranks twice");
    }
  }
}

void check_communicator(ncclComm* comm, std::size_t index, int device) {
  ncclResult_t async = ncclSuccess;
  check_nccl(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError", comm);
  if (async != ncclSuccess) {
    throw Error(ErrorKind::invalid_argument,
                concat("Distributed.comms[", index, "] has failed: ", ncclGetErrorString(async)));
  }
  int comm_device = -1, count = 0;
  check_nccl(ncclCommCuDevice(comm, &comm_device), "ncclCommCuDevice", comm);
  check_nccl(ncclCommCount(comm, &count), "ncclCommCount", comm);
  require(comm_device == device, "Distributed.comms[", index, "] belongs to device ", comm_device,
          " but the current device is ", device);
  require(count >= 1, "Distributed.comms[", index, "] has ", count, " ranks");
}

void allreduce_totals(StepTotals* totals, const std::vector<ncclComm*>& comms, cudaStream_t stream) {
  for (ncclComm* comm : comms) {
    check_nccl(ncclGroupStart(), "ncclGroupStart", nullptr);
    const ncclResult_t sum = ncclAllReduce(totals->sum, totals->sum, StepTotals::kSumWords, ncclUint64,
                                           ncclSum, comm, stream);
    const ncclResult_t max = sum == ncclSuccess
                                 ? ncclAllReduce(totals->max, totals->max, StepTotals::kMaxWords,
                                                 ncclUint64, ncclMax, comm, stream)
                                 : sum;
    const ncclResult_t end = ncclGroupEnd();  // always closes the group it opened
    check_nccl(sum, "ncclAllReduce (SUM)", comm);
    check_nccl(max, "ncclAllReduce (MAX)", comm);
    check_nccl(end, "ncclGroupEnd", comm);
  }
}

}  // namespace detail
}  // namespace halfstep
