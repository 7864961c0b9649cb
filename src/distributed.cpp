// The multi-rank step: the StepTotals record's public helpers, and the NCCL all-reduce that makes
// every rank decide from the same totals.
#include <nccl.h>

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
