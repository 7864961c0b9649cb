// Internal: the multi-rank parts of the step that touch NCCL (src/distributed.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "halfstep/distributed.hpp"

namespace halfstep::detail {

/// Throws unless `dist` is well formed: rank in [0, 2^31 - 1), no null communicator.
void validate_distributed(const Distributed& dist);

/// Throws unless `comm` (dist.comms[index]) is a working communicator of device `device`.
void check_communicator(ncclComm* comm, std::size_t index, int device);

/// Enqueues on `stream` the all-reduce of the record `totals` (device memory) over each
/// communicator in turn: SUM over totals->sum, MAX over totals->max, as one NCCL group per
/// communicator.
void allreduce_totals(StepTotals* totals, const std::vector<ncclComm*>& comms, cudaStream_t stream);

}  // namespace halfstep::detail
