// The execution engine of the emulated device: a grid runs block after block; within a block every
// CUDA thread is a fiber (Boost.Context) and the threads switch only at synchronisation points —
// __syncthreads, warp operations, exit — in the order the schedule picks. Barriers and warp
// operations complete in lockstep once every participant has arrived; anything that would hang,
// diverge or depend on undefined behaviour on a real device is a fault with a message.
#include <boost/context/fiber.hpp>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include "halfstep_emu/device.hpp"
#include "internal.hpp"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define HALFSTEP_EMU_ASAN 1
#endif

namespace halfstep_emu {
namespace {

namespace bctx = boost::context;
using internal::Settings;
using internal::ThreadOrder;

constexpr int kMaxThreads = 1024;
constexpr std::size_t kSharedLimit = 48 * 1024;  // static shared memory per block
#if defined(HALFSTEP_EMU_ASAN)
constexpr std::size_t kStackBytes = 256 * 1024;
#else
constexpr std::size_t kStackBytes = 64 * 1024;
#endif

// splitmix64: small, seedable, good enough for schedules.
struct Rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) { return next() % n; }
};

std::uint64_t mix(std::uint64_t a, std::uint64_t b) {
  Rng r{a ^ (b * 0xD6E8FEB86659FD93ull)};
  return r.next();
}

// Fiber stacks, reused from block to block; each has a guard page below it, so a stack overflow
// faults at once instead of corrupting a neighbour.
class StackPool {
 public:
  StackPool() : page_(static_cast<std::size_t>(sysconf(_SC_PAGESIZE))) {}
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;
  ~StackPool() {
    for (void* base : all_) munmap(base, kStackBytes + page_);
  }
  bctx::stack_context allocate() {
    void* base = nullptr;
    if (!free_.empty()) {
      base = free_.back();
      free_.pop_back();
    } else {
      base = mmap(nullptr, kStackBytes + page_, PROT_READ | PROT_WRITE,
                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) internal::fatal("cannot map a fiber stack");
      mprotect(base, page_, PROT_NONE);  // the guard page
      all_.push_back(base);
    }
    bctx::stack_context s;
    s.size = kStackBytes;
    s.sp = static_cast<char*>(base) + page_ + kStackBytes;
#if defined(HALFSTEP_EMU_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(static_cast<char*>(base) + page_, kStackBytes);
#endif
    return s;
  }
  void deallocate(bctx::stack_context& s) {
    free_.push_back(static_cast<char*>(s.sp) - kStackBytes - page_);
  }

 private:
  std::size_t page_;
  std::vector<void*> free_, all_;
};

// Thrown inside a lane after its fault was recorded; ends the lane.
struct LaneFault {};

enum class Status : std::uint8_t { runnable, barrier, warp, exited };

struct Lane {
  bctx::fiber fiber;      // the suspended lane (empty while it runs and after it ends)
  bctx::fiber scheduler;  // inside the lane: the scheduler to switch back to
  ThreadState state{};
  Status status = Status::runnable;
  const char* file = "";
  int line = 0;
  WarpOp op = WarpOp::syncwarp;
  unsigned mask = 0;
  int arg = 0, width = 32;
  std::size_t bytes = 0;
  unsigned char value[8] = {}, result[8] = {};
  const void* stack_bottom = nullptr;
  std::size_t stack_size = 0;
  void* fake_stack = nullptr;
  bool started = false;
};

// Hands out pooled stacks and tells the lane where its stack is (for ASan's fiber annotations).
struct LaneStackAllocator {
  StackPool* pool;
  Lane* lane;
  bctx::stack_context allocate() {
    bctx::stack_context s = pool->allocate();
    lane->stack_bottom = static_cast<char*>(s.sp) - s.size;
    lane->stack_size = s.size;
    return s;
  }
  void deallocate(bctx::stack_context& s) { pool->deallocate(s); }
};

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::shfl_idx: return "__shfl_sync";
    case WarpOp::shfl_up: return "__shfl_up_sync";
    case WarpOp::shfl_down: return "__shfl_down_sync";
    case WarpOp::shfl_xor: return "__shfl_xor_sync";
    case WarpOp::syncwarp: return "__syncwarp";
    case WarpOp::ballot: return "__ballot_sync";
    case WarpOp::any: return "__any_sync";
    case WarpOp::all: return "__all_sync";
  }
  return "warp operation";
}

bool is_shuffle(WarpOp op) {
  return op == WarpOp::shfl_idx || op == WarpOp::shfl_up || op == WarpOp::shfl_down ||
         op == WarpOp::shfl_xor;
}

bool same_site(const Lane& a, const Lane& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

std::string hex(unsigned v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

class Executor;
thread_local Executor* t_exec = nullptr;  // the executor running a block on this host thread
thread_local Lane* t_lane = nullptr;      // the lane running now (null in scheduler code)

class Executor {
 public:
  void run_grid(const char* name, dim3 grid, dim3 block, const std::function<void()>& body) {
    if (t_lane != nullptr) internal::fatal("a kernel launched a kernel (dynamic parallelism is not emulated)");
    const Settings& s = internal::settings();
    settings_ = &s;
    name_ = name;
    grid_ = grid;
    block_ = block;
    body_ = &body;
    n_threads_ = static_cast<int>(block.x * block.y * block.z);
    n_warps_ = (n_threads_ + 31) / 32;
    const std::uint64_t n_blocks = std::uint64_t{grid.x} * grid.y * grid.z;
    ++internal::mutable_counters().launches;
    const std::uint64_t launch = internal::next_schedule_index();
    lanes_.clear();
    lanes_.resize(static_cast<std::size_t>(n_threads_));
    shared_.assign(kSharedLimit, 0);

    // The block order: forward, reverse, or a seeded random permutation (an affine bijection for
    // grids too large to shuffle).
    Rng order_rng{mix(s.seed, launch)};
    std::vector<std::uint32_t> perm;
    std::uint64_t stride = 1, offset = 0;
    if (s.blocks == internal::BlockOrder::random) {
      if (n_blocks <= (1u << 22)) {
        perm.resize(n_blocks);
        for (std::uint32_t i = 0; i < n_blocks; ++i) perm[i] = i;
        for (std::uint64_t i = n_blocks; i > 1; --i) std::swap(perm[i - 1], perm[order_rng.below(i)]);
      } else {
        do stride = order_rng.below(n_blocks - 1) + 1; while (gcd(stride, n_blocks) != 1);
        offset = order_rng.below(n_blocks);
      }
    }
    for (std::uint64_t k = 0; k < n_blocks; ++k) {
      std::uint64_t b = k;
      if (s.blocks == internal::BlockOrder::reverse) b = n_blocks - 1 - k;
      if (s.blocks == internal::BlockOrder::random) {
        b = perm.empty() ? (offset + k * stride) % n_blocks : perm[k];
      }
      if (!run_block(b, launch)) return;
    }
  }

  // --- called from kernel code (inside a lane) -----------------------------------------------
  [[noreturn]] void lane_fault(cudaError_t code, const std::string& what, const char* file, int line) {
    record_fault(code, where(lane_index(*t_lane)) + ": " + what + " [" + file + ":" +
                           std::to_string(line) + "]");
    throw LaneFault{};
  }

  void* shared_bytes(const void* site, std::size_t bytes, std::size_t align, const char* name) {
    for (const Site& s : sites_) {
      if (s.key == site) return shared_.data() + s.offset;
    }
    const std::size_t a = std::max<std::size_t>(align, 16);
    const std::size_t offset = (shared_used_ + a - 1) / a * a;
    if (offset + bytes > kSharedLimit) {
      lane_fault(cudaErrorLaunchOutOfResources,
                 std::string("shared memory '") + name + "' takes the block past 48 KiB of static shared memory",
                 __FILE__, __LINE__);
    }
    unsigned char* p = shared_.data() + offset;
    switch (settings_->shared) {  // fresh shared memory holds garbage, as on a device
      case internal::SharedFill::nan: std::memset(p, 0xFF, bytes); break;
      case internal::SharedFill::zero: std::memset(p, 0, bytes); break;
      case internal::SharedFill::random:
        for (std::size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(rng_.next());
        break;
    }
    sites_.push_back(Site{site, offset, bytes});
    shared_used_ = offset + bytes;
    return p;
  }

  bool in_shared(const void* p, std::size_t bytes) const {
    const auto* c = static_cast<const unsigned char*>(p);
    return c >= shared_.data() && c + bytes <= shared_.data() + shared_used_;
  }

  void syncthreads(const char* file, int line) {
    Lane& l = *t_lane;
    l.status = Status::barrier;
    l.file = file;
    l.line = line;
    yield(l);
  }

  void warp_operation(WarpOp op, unsigned mask, const void* value, std::size_t bytes, int arg,
                      int width, void* result, const char* file, int line) {
    Lane& l = *t_lane;
    l.status = Status::warp;
    l.op = op;
    l.mask = mask;
    l.arg = arg;
    l.width = width;
    l.bytes = bytes;
    l.file = file;
    l.line = line;
    if (bytes > 0) std::memcpy(l.value, value, bytes);
    yield(l);
    switch (op) {
      case WarpOp::syncwarp: break;
      case WarpOp::ballot: std::memcpy(result, l.result, sizeof(unsigned)); break;
      case WarpOp::any:
      case WarpOp::all: std::memcpy(result, l.result, sizeof(int)); break;
      default: std::memcpy(result, l.result, bytes); break;
    }
  }

 private:
  struct Site {
    const void* key;
    std::size_t offset, bytes;
  };

  static std::uint64_t gcd(std::uint64_t a, std::uint64_t b) {
    while (b) {
      const std::uint64_t t = a % b;
      a = b;
      b = t;
    }
    return a;
  }

  int lane_index(const Lane& l) const { return static_cast<int>(&l - lanes_.data()); }

  std::string where(int i) const {
    const ThreadState& t = lanes_[static_cast<std::size_t>(i)].state;
    std::ostringstream out;
    out << "kernel " << name_ << ", block (" << t.block_idx.x << "," << t.block_idx.y << ","
        << t.block_idx.z << "), thread (" << t.thread_idx.x << "," << t.thread_idx.y << ","
        << t.thread_idx.z << ")";
    return out.str();
  }

  std::string site_of(const Lane& l) const {
    std::string s = l.status == Status::barrier ? "__syncthreads" : op_name(l.op);
    return s + " (" + l.file + ":" + std::to_string(l.line) + ")";
  }

  void record_fault(cudaError_t code, const std::string& message) {
    if (faulted_) return;  // the first fault is the one reported
    faulted_ = true;
    code_ = code;
    message_ = message;
  }

  void fault(cudaError_t code, int lane, const std::string& what) {
    record_fault(code, where(lane) + ": " + what);
  }

  // Switching between the scheduler and a lane (with ASan's fiber annotations when present).
  void resume(int i) {
    Lane& l = lanes_[static_cast<std::size_t>(i)];
    if (!l.started) start_lane(i);  // fibers are made when a thread first runs
    t_lane = &l;
#if defined(HALFSTEP_EMU_ASAN)
    __sanitizer_start_switch_fiber(&scheduler_fake_stack_, l.stack_bottom, l.stack_size);
#endif
    l.fiber = std::move(l.fiber).resume();
#if defined(HALFSTEP_EMU_ASAN)
    __sanitizer_finish_switch_fiber(scheduler_fake_stack_, nullptr, nullptr);
#endif
    t_lane = nullptr;
    ++internal::mutable_counters().switches;
  }

  void yield(Lane& l) {
#if defined(HALFSTEP_EMU_ASAN)
    __sanitizer_start_switch_fiber(&l.fake_stack, scheduler_stack_bottom_, scheduler_stack_size_);
#endif
    l.scheduler = std::move(l.scheduler).resume();
#if defined(HALFSTEP_EMU_ASAN)
    __sanitizer_finish_switch_fiber(l.fake_stack, &scheduler_stack_bottom_, &scheduler_stack_size_);
#endif
    if (cancelling_) throw LaneFault{};  // the block faulted elsewhere: leave the kernel
  }

  void start_lane(int i) {
    Lane& l = lanes_[static_cast<std::size_t>(i)];
    l.started = true;
    l.fiber = bctx::fiber(std::allocator_arg, LaneStackAllocator{&stacks_, &l},
                          [this, i](bctx::fiber&& from) {
      Lane& me = lanes_[static_cast<std::size_t>(i)];
      me.scheduler = std::move(from);
#if defined(HALFSTEP_EMU_ASAN)
      __sanitizer_finish_switch_fiber(nullptr, &scheduler_stack_bottom_, &scheduler_stack_size_);
#endif
      try {
        (*body_)();
      } catch (const LaneFault&) {
        // recorded; the scheduler stops the block
      } catch (const std::exception& e) {
        record_fault(cudaErrorLaunchFailure, where(i) + ": the kernel threw " + e.what());
      }
      me.status = Status::exited;
#if defined(HALFSTEP_EMU_ASAN)
      __sanitizer_start_switch_fiber(nullptr, scheduler_stack_bottom_, scheduler_stack_size_);
#endif
      return std::move(me.scheduler);
    });
  }

  bool run_block(std::uint64_t b, std::uint64_t launch) {
    const uint3 bi{static_cast<unsigned>(b % grid_.x),
                   static_cast<unsigned>((b / grid_.x) % grid_.y),
                   static_cast<unsigned>(b / (std::uint64_t{grid_.x} * grid_.y))};
    rng_ = Rng{mix(mix(settings_->seed, launch), b)};
    sites_.clear();
    shared_used_ = 0;
    faulted_ = false;
    exited_ = 0;
    at_barrier_ = 0;
    std::fill(std::begin(runnable_), std::end(runnable_), 0u);
    std::fill(std::begin(waiting_), std::end(waiting_), 0u);
    std::fill(std::begin(at_barrier_mask_), std::end(at_barrier_mask_), 0u);
    std::fill(std::begin(exited_mask_), std::end(exited_mask_), 0u);
    for (int i = 0; i < n_threads_; ++i) {
      Lane& l = lanes_[static_cast<std::size_t>(i)];
      const unsigned u = static_cast<unsigned>(i);
      l.state.thread_idx = uint3{u % block_.x, (u / block_.x) % block_.y, u / (block_.x * block_.y)};
      l.state.block_idx = bi;
      l.state.block_dim = block_;
      l.state.grid_dim = grid_;
      l.status = Status::runnable;
      l.started = false;
      runnable_[i / 32] |= 1u << (i % 32);
    }
    draw_priorities();
    Counters& c = internal::mutable_counters();
    ++c.blocks;
    c.threads += static_cast<std::uint64_t>(n_threads_);
    t_exec = this;
    while (exited_ < n_threads_ && !faulted_) {
      const int i = pick();
      if (i < 0) {
        deadlock();
        break;
      }
      resume(i);
      if (!faulted_) after_resume(i);
    }
    if (faulted_) {
      // Resume every lane suspended at a synchronisation point once more; it leaves the kernel by
      // an exception thrown on its own stack, so its frames unwind in order (lanes that never ran
      // have no fiber). Then report.
      cancelling_ = true;
      for (int i = 0; i < n_threads_; ++i) {
        if (lanes_[static_cast<std::size_t>(i)].fiber) resume(i);
      }
      cancelling_ = false;
      t_exec = nullptr;
      ++c.faults;
      internal::set_sticky_fault(code_, message_);
      return false;
    }
    t_exec = nullptr;
    return true;
  }

  void clear_runnable(int i) { runnable_[i / 32] &= ~(1u << (i % 32)); }
  void set_runnable(int i) {
    lanes_[static_cast<std::size_t>(i)].status = Status::runnable;
    runnable_[i / 32] |= 1u << (i % 32);
  }

  // The schedule: which runnable lane goes next.
  int pick() {
    switch (settings_->threads) {
      case ThreadOrder::forward:
        for (int w = 0; w < n_warps_; ++w) {
          if (runnable_[w]) return w * 32 + __builtin_ctz(runnable_[w]);
        }
        return -1;
      case ThreadOrder::reverse:
        for (int w = n_warps_ - 1; w >= 0; --w) {
          if (runnable_[w]) return w * 32 + 31 - __builtin_clz(runnable_[w]);
        }
        return -1;
      case ThreadOrder::random: return pick_random(0xFFFFFFFFu);
      case ThreadOrder::warps:
        for (int k = 0; k < n_warps_; ++k) {
          const int w = order_[k];
          if (runnable_[w]) return w * 32 + __builtin_ctz(runnable_[w]);
        }
        return -1;
      case ThreadOrder::starve: {
        const int i = pick_random(~starved_);
        return i >= 0 ? i : pick_random(0xFFFFFFFFu);
      }
    }
    return -1;
  }

  // A uniformly random runnable lane among the warps in `warps` (a bit per warp).
  int pick_random(std::uint32_t warps) {
    std::uint64_t total = 0;
    for (int w = 0; w < n_warps_; ++w) {
      if (warps >> w & 1u) total += static_cast<unsigned>(__builtin_popcount(runnable_[w]));
    }
    if (total == 0) return -1;
    std::uint64_t k = rng_.below(total);
    for (int w = 0; w < n_warps_; ++w) {
      if (!(warps >> w & 1u)) continue;
      std::uint32_t m = runnable_[w];
      const auto c = static_cast<std::uint64_t>(__builtin_popcount(m));
      if (k < c) {
        for (; k > 0; --k) m &= m - 1;  // drop the lowest k set bits
        return w * 32 + __builtin_ctz(m);
      }
      k -= c;
    }
    return -1;
  }

  // New warp priorities (one warp at a time) or a new starved half (starvation), per block and
  // after every barrier.
  void draw_priorities() {
    for (int w = 0; w < n_warps_; ++w) order_[w] = w;
    for (int w = n_warps_; w > 1; --w) {
      std::swap(order_[w - 1], order_[rng_.below(static_cast<std::uint64_t>(w))]);
    }
    starved_ = static_cast<std::uint32_t>(rng_.next());
  }

  void after_resume(int i) {
    Lane& l = lanes_[static_cast<std::size_t>(i)];
    clear_runnable(i);
    switch (l.status) {
      case Status::exited: on_exit(i); break;
      case Status::barrier: on_barrier(i); break;
      case Status::warp: on_warp(i); break;
      case Status::runnable: internal::fatal("a lane yielded without waiting for anything");
    }
  }

  // Lanes of warp w that exist in this block.
  std::uint32_t existing_lanes(int w) const {
    const int n = std::min(32, n_threads_ - w * 32);
    return n == 32 ? 0xFFFFFFFFu : (1u << n) - 1u;
  }

  void on_exit(int i) {
    ++exited_;
    exited_mask_[i / 32] |= 1u << (i % 32);
    if (at_barrier_ > 0) {
      const Lane& waiting = first_with(Status::barrier);
      fault(cudaErrorLaunchFailure, i,
            "exits while " + std::to_string(at_barrier_) + " threads of its block wait at " +
                site_of(waiting) +
                ": every thread must reach every __syncthreads (CUDA leaves it undefined)");
      return;
    }
    const int w = i / 32, lane = i % 32;
    for (std::uint32_t m = waiting_[w]; m != 0; m &= m - 1) {
      const int b = __builtin_ctz(m);
      const Lane& p = lanes_[static_cast<std::size_t>(w * 32 + b)];
      if (p.mask >> lane & 1u) {
        fault(cudaErrorLaunchFailure, i,
              "exits while lane " + std::to_string(b) + " of its warp waits for it at " + site_of(p));
        return;
      }
    }
  }

  const Lane& first_with(Status s) const {
    for (const Lane& l : lanes_) {
      if (l.status == s) return l;
    }
    return lanes_.front();
  }

  void on_barrier(int i) {
    const Lane& l = lanes_[static_cast<std::size_t>(i)];
    ++at_barrier_;
    at_barrier_mask_[i / 32] |= 1u << (i % 32);
    if (exited_ > 0) {
      fault(cudaErrorLaunchFailure, i,
            "reaches " + site_of(l) + " after " + std::to_string(exited_) +
                " threads of its block exited without reaching it: every thread must reach every "
                "__syncthreads (CUDA leaves it undefined; hardware may count exited threads as arrived)");
      return;
    }
    const int w = i / 32;
    if (waiting_[w] != 0) {
      const int b = __builtin_ctz(waiting_[w]);
      const Lane& p = lanes_[static_cast<std::size_t>(w * 32 + b)];
      {
        fault(cudaErrorLaunchFailure, i,
              "waits at " + site_of(l) + " while lane " + std::to_string(b) +
                  " of its warp waits at " + site_of(p) + " (divergent warp)");
        return;
      }
    }
    if (at_barrier_ == n_threads_) release_barrier();
  }

  void release_barrier() {
    const Lane& first = lanes_.front();
    for (int j = 1; j < n_threads_; ++j) {
      const Lane& p = lanes_[static_cast<std::size_t>(j)];
      if (!same_site(first, p)) {
        fault(cudaErrorLaunchFailure, j,
              "waits at " + site_of(p) + " while thread (" + std::to_string(first.state.thread_idx.x) +
                  "," + std::to_string(first.state.thread_idx.y) + "," +
                  std::to_string(first.state.thread_idx.z) + ") waits at " + site_of(first) +
                  ": the threads of a block reached different __syncthreads");
        return;
      }
    }
    for (int j = 0; j < n_threads_; ++j) set_runnable(j);
    std::fill(std::begin(at_barrier_mask_), std::end(at_barrier_mask_), 0u);
    at_barrier_ = 0;
    ++internal::mutable_counters().barriers;
    draw_priorities();
  }

  void on_warp(int i) {
    const Lane& l = lanes_[static_cast<std::size_t>(i)];
    const int w = i / 32, lane = i % 32;
    const std::uint32_t existing = existing_lanes(w);
    if (!(l.mask >> lane & 1u)) {
      fault(cudaErrorLaunchFailure, i,
            std::string(op_name(l.op)) + " with mask " + hex(l.mask) + " that leaves out the calling lane " +
                std::to_string(lane) + " [" + l.file + ":" + std::to_string(l.line) + "]");
      return;
    }
    if (is_shuffle(l.op) && l.mask != 0xFFFFFFFFu) {
      fault(cudaErrorLaunchFailure, i,
            std::string("partial-mask ") + op_name(l.op) + " (mask " + hex(l.mask) + ") [" + l.file +
                ":" + std::to_string(l.line) +
                "]: the emulated device runs full-warp shuffles only, as halfstep's kernels use them");
      return;
    }
    if (l.mask & ~existing) {
      fault(cudaErrorLaunchFailure, i,
            std::string(op_name(l.op)) + " mask " + hex(l.mask) + " names lanes that do not exist in a block of " +
                std::to_string(n_threads_) + " threads [" + l.file + ":" + std::to_string(l.line) + "]");
      return;
    }
    if (is_shuffle(l.op) && (l.width < 1 || l.width > 32 || (l.width & (l.width - 1)) != 0)) {
      fault(cudaErrorLaunchFailure, i,
            std::string(op_name(l.op)) + " width " + std::to_string(l.width) +
                " is not a power of two in [1, 32] [" + l.file + ":" + std::to_string(l.line) + "]");
      return;
    }
    // Partners that can never arrive: exited, or waiting at a barrier.
    if (const std::uint32_t gone = l.mask & exited_mask_[w]) {
      fault(cudaErrorLaunchFailure, i,
            "waits at " + site_of(l) + " for lane " + std::to_string(__builtin_ctz(gone)) +
                ", which has exited");
      return;
    }
    if (const std::uint32_t blocked = l.mask & at_barrier_mask_[w]) {
      const int b = __builtin_ctz(blocked);
      fault(cudaErrorLaunchFailure, i,
            "waits at " + site_of(l) + " while lane " + std::to_string(b) + " of its warp waits at " +
                site_of(lanes_[static_cast<std::size_t>(w * 32 + b)]) + " (divergent warp)");
      return;
    }
    // Lanes already waiting in the mask must be at the same operation: comparing with one of them
    // here catches a mismatch early; all are compared once the group is complete.
    if (const std::uint32_t others = waiting_[w] & l.mask) {
      if (!check_match(i, w * 32 + __builtin_ctz(others))) return;
    }
    waiting_[w] |= 1u << lane;
    if ((waiting_[w] & l.mask) != l.mask) return;  // not everyone is there yet
    for (std::uint32_t m = l.mask; m != 0; m &= m - 1) {
      if (!check_match(i, w * 32 + __builtin_ctz(m))) return;
    }
    waiting_[w] &= ~l.mask;
    resolve_warp(w, l.mask);
  }

  // Lanes i and j wait at the same warp operation (same site, mask, width and type for shuffles
  // and votes; the same mask for __syncwarp); faults and returns false otherwise.
  bool check_match(int i, int j) {
    const Lane& l = lanes_[static_cast<std::size_t>(i)];
    const Lane& p = lanes_[static_cast<std::size_t>(j)];
    const bool matches = p.op == l.op && p.mask == l.mask &&
                         (l.op == WarpOp::syncwarp ||
                          (same_site(p, l) && p.width == l.width && p.bytes == l.bytes));
    if (matches) return true;
    fault(cudaErrorLaunchFailure, i,
          "waits at " + site_of(l) + " with mask " + hex(l.mask) + " while lane " +
              std::to_string(j % 32) + " of its warp waits at " + site_of(p) + " with mask " +
              hex(p.mask) + " (divergent warp)");
    return false;
  }

  // Every lane of `mask` has arrived at the same operation: exchange in lockstep.
  void resolve_warp(int w, std::uint32_t mask) {
    Lane* lanes = &lanes_[static_cast<std::size_t>(w * 32)];
    const WarpOp op = lanes[__builtin_ctz(mask)].op;
    if (op == WarpOp::ballot || op == WarpOp::any || op == WarpOp::all) {
      unsigned ballot = 0;
      for (int b = 0; b < 32; ++b) {
        if ((mask >> b & 1u) && lanes[b].arg != 0) ballot |= 1u << b;
      }
      const int any = ballot != 0, all = ballot == mask;
      for (int b = 0; b < 32; ++b) {
        if (!(mask >> b & 1u)) continue;
        if (op == WarpOp::ballot) std::memcpy(lanes[b].result, &ballot, sizeof ballot);
        if (op == WarpOp::any) std::memcpy(lanes[b].result, &any, sizeof any);
        if (op == WarpOp::all) std::memcpy(lanes[b].result, &all, sizeof all);
      }
    } else if (is_shuffle(op)) {
      for (int b = 0; b < 32; ++b) {
        Lane& d = lanes[b];
        const int width = d.width, base = b & ~(width - 1);
        int src = b;  // out of range: the lane's own value, as CUDA returns it
        switch (op) {
          case WarpOp::shfl_idx: src = base + static_cast<int>(static_cast<unsigned>(d.arg) & static_cast<unsigned>(width - 1)); break;
          case WarpOp::shfl_up:
            if (d.arg >= 0 && b - base >= d.arg) src = b - d.arg;
            break;
          case WarpOp::shfl_down:
            if (d.arg >= 0 && (b - base) + d.arg < width) src = b + d.arg;
            break;
          case WarpOp::shfl_xor: {
            const int s = b ^ d.arg;
            if (s >= 0 && s < base + width && s < 32) src = s;
            break;
          }
          default: break;
        }
        std::memcpy(d.result, lanes[src].value, d.bytes);
      }
    }
    for (int b = 0; b < 32; ++b) {
      if (mask >> b & 1u) set_runnable(w * 32 + b);
    }
    ++internal::mutable_counters().warp_ops;
  }

  void deadlock() {
    std::ostringstream out;
    out << "no thread can run: ";
    int shown = 0;
    for (int j = 0; j < n_threads_ && shown < 4; ++j) {
      const Lane& p = lanes_[static_cast<std::size_t>(j)];
      if (p.status == Status::barrier || p.status == Status::warp) {
        out << (shown ? "; " : "") << "thread " << j << " waits at " << site_of(p);
        ++shown;
      }
    }
    fault(cudaErrorLaunchFailure, 0, "deadlock: " + out.str());
  }

  const Settings* settings_ = nullptr;
  const char* name_ = "";
  dim3 grid_, block_;
  const std::function<void()>* body_ = nullptr;
  int n_threads_ = 0, n_warps_ = 0;
  std::vector<Lane> lanes_;
  std::uint32_t runnable_[32] = {};  // per warp: lanes that can run
  std::uint32_t waiting_[32] = {};   // per warp: lanes waiting at a warp operation
  std::uint32_t at_barrier_mask_[32] = {};
  std::uint32_t exited_mask_[32] = {};
  int exited_ = 0, at_barrier_ = 0;
  Rng rng_{1};
  int order_[32] = {};
  std::uint32_t starved_ = 0;
  std::vector<unsigned char> shared_;
  std::vector<Site> sites_;
  std::size_t shared_used_ = 0;
  bool faulted_ = false;
  bool cancelling_ = false;
  cudaError_t code_ = cudaSuccess;
  std::string message_;
  StackPool stacks_;
  void* scheduler_fake_stack_ = nullptr;
  const void* scheduler_stack_bottom_ = nullptr;
  std::size_t scheduler_stack_size_ = 0;
};

Executor& executor() {
  static thread_local Executor e;
  return e;
}

Executor& running(const char* what) {
  if (t_exec == nullptr || t_lane == nullptr) {
    internal::fatal(std::string(what) + " called outside a kernel running on the emulated device");
  }
  return *t_exec;
}

}  // namespace

namespace internal {
void run_grid(const char* name, dim3 grid, dim3 block, const std::function<void()>& body) {
  executor().run_grid(name, grid, block, body);
}
}  // namespace internal

ThreadState& current() {
  running("threadIdx / blockIdx / blockDim / gridDim");
  return t_lane->state;
}

void check_access(const void* p, std::size_t bytes, std::size_t align, bool write,
                  const char* what, const char* file, int line) {
  Executor& e = running(what);
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  if (align > 1 && a % align != 0) {
    e.lane_fault(cudaErrorMisalignedAddress,
                 std::string("misaligned ") + std::to_string(bytes) + "-byte " + what + " at " +
                     hex(static_cast<unsigned>(a & 0xFFFFFFFFu)) + "... (address % " + std::to_string(align) +
                     " = " + std::to_string(a % align) + ")",
                 file, line);
  }
  if (e.in_shared(p, bytes)) return;
  if (!internal::in_device_memory(p, bytes)) {
    std::ostringstream msg;
    msg << (write ? "write" : "read") << " of " << bytes << " bytes at " << p << " (" << what
        << ") outside every device allocation and this block's shared memory";
    e.lane_fault(cudaErrorIllegalAddress, msg.str(), file, line);
  }
  (write ? internal::mutable_counters().bytes_written : internal::mutable_counters().bytes_read) += bytes;
}

void* shared_bytes(const void* site, std::size_t bytes, std::size_t align, const char* name) {
  return running("shared memory").shared_bytes(site, bytes, align, name);
}

void warp_operation(WarpOp op, unsigned mask, const void* value, std::size_t bytes, int arg,
                    int width, void* result, const char* file, int line) {
  running(op_name(op)).warp_operation(op, mask, value, bytes, arg, width, result, file, line);
}

}  // namespace halfstep_emu

void __syncthreads(const char* file, int line) {
  halfstep_emu::running("__syncthreads").syncthreads(file, line);
}
