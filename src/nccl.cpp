// The NCCL all-reduce of the totals record, and the checks of a caller's communicators. Built
// with NCCL when the build has it (HALFSTEP_NCCL, on by default where the CUDA toolkit ships
// NCCL); without it, halfstep::has_nccl() is false and a Distributed with communicators is
// refused at construction (src/distributed.cpp), so nothing here is reached.
#include "check.hpp"
#include "distributed_impl.hpp"

#if HALFSTEP_HAS_NCCL
#include <nccl.h>
#endif

namespace halfstep {

bool has_nccl() { return HALFSTEP_HAS_NCCL != 0; }

namespace detail {
#if HALFSTEP_HAS_NCCL

namespace {

void check_nccl(ncclResult_t result, const char* call, ncclComm* comm) {
  if (result == ncclSuccess) return;
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  throw Error(ErrorKind::cuda, concat(call, " failed: ", ncclGetErrorString(result),
                                      last != nullptr && *last != '\0' ? concat(" (", last, ")") : ""));
}

}  // namespace

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

#else

void check_communicator(ncclComm*, std::size_t index, int) {
  fail("Distributed.comms[", index, "]: this libhalfstep was built without NCCL");
}

void allreduce_totals(StepTotals*, const std::vector<ncclComm*>& comms, cudaStream_t) {
  if (!comms.empty()) fail("Distributed.comms: this libhalfstep was built without NCCL");
}

#endif
}  // namespace detail
}  // namespace halfstep
