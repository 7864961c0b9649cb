// The emulated device, as tests see it: its settings (the schedule), its faults and its counters.
// Settings come from the environment variable HALFSTEP_EMU, a comma-separated list of key=value:
//
//   threads=forward|reverse|random|warps|starve   which runnable CUDA thread goes next between
//       synchronisation points: lowest index, highest index, a seeded random one, one warp at a
//       time (random warp priorities, redrawn at every barrier), or random with a random half of
//       the warps starved (they run only when nothing else can)                  (forward)
//   blocks=forward|reverse|random                 the order blocks of a grid run in (forward)
//   seed=N                                        seeds every random choice (1)
//   shared=nan|random|zero                        what fresh shared memory holds (nan: 0xFF bytes)
//   streams=eager|lazy                            eager: work runs when enqueued; lazy: only when
//       the host waits for it, after exactly the work CUDA orders it after            (eager)
//   memory=N[K|M|G]                               device memory the emulated device reports (8G)
//   faults=report|abort                           a kernel fault becomes a sticky CUDA error with
//       a message on stderr, or aborts the process at once                           (report)
//   report=0|1                                    print the counters below at exit    (0)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace halfstep_emu {

/// Replaces the settings (same syntax as HALFSTEP_EMU); unknown keys or values throw
/// std::invalid_argument. Pending work of the lazy stream model runs first.
void configure(const std::string& spec);

/// The settings in force, in HALFSTEP_EMU syntax.
std::string settings();

/// The sticky error a kernel fault left (cudaSuccess if none) and its message.
cudaError_t fault_code();
std::string fault_message();

/// Clears a sticky fault and drops work still pending, as a new process would start. Device
/// allocations stay.
void clear_fault();

/// What the emulated device has executed since the process started.
struct Counters {
  std::uint64_t launches = 0;    ///< grids run
  std::uint64_t blocks = 0;      ///< thread blocks run
  std::uint64_t threads = 0;     ///< CUDA threads run (fibers)
  std::uint64_t switches = 0;    ///< fiber switches
  std::uint64_t barriers = 0;    ///< __syncthreads episodes completed
  std::uint64_t warp_ops = 0;    ///< warp operations completed (per warp)
  std::uint64_t faults = 0;      ///< kernel faults
  /// Bytes of device memory kernels read and wrote through checked accesses (the vector loads and
  /// stores, __ldg, atomics; not plain pointer accesses, nor shared memory).
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
};
Counters counters();

}  // namespace halfstep_emu
