// Internal to the emulator: what the execution engine (execution.cpp) and the runtime stand-in
// (runtime.cpp) share.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "halfstep_emu/control.hpp"

namespace halfstep_emu::internal {

enum class ThreadOrder : std::uint8_t { forward, reverse, random, warps, starve };
enum class BlockOrder : std::uint8_t { forward, reverse, random };
enum class SharedFill : std::uint8_t { nan, random, zero };
enum class StreamModel : std::uint8_t { eager, lazy };

struct Settings {
  ThreadOrder threads = ThreadOrder::forward;
  BlockOrder blocks = BlockOrder::forward;
  SharedFill shared = SharedFill::nan;
  StreamModel streams = StreamModel::eager;
  std::uint64_t seed = 1;
  std::size_t memory = std::size_t{8} << 30;
  bool abort_on_fault = false;
  bool report = false;
};

/// The settings in force (parsed from HALFSTEP_EMU on first use).
const Settings& settings();

/// Parses a HALFSTEP_EMU string; throws std::invalid_argument naming the bad part.
Settings parse_settings(const std::string& spec);
std::string format_settings(const Settings& s);

/// Counters, updated by the execution engine.
Counters& mutable_counters();

/// Launches since the settings were last configured: with the seed, it picks each launch's
/// schedule, so configuring the same settings again replays the same schedules.
std::uint64_t next_schedule_index();

/// Runs one grid now, block after block. A fault sets the sticky error (set_sticky_fault) and
/// stops the grid.
void run_grid(const char* name, dim3 grid, dim3 block, const std::function<void()>& body);

/// Records a kernel fault as the sticky error: every later runtime call returns `code`.
void set_sticky_fault(cudaError_t code, const std::string& message);

/// True if [p, p + bytes) lies inside one live device allocation.
bool in_device_memory(const void* p, std::size_t bytes);

/// Prints an emulator message to stderr ("halfstep emulator: ...").
void print(const std::string& message);

/// Aborts with a message: misuse of the emulator itself (a kernel built-in outside a kernel, ...).
[[noreturn]] void fatal(const std::string& message);

}  // namespace halfstep_emu::internal
