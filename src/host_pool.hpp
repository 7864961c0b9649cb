// Internal: the host backend's threads (HostPool) and the floating-point mode its passes run in
// (IeeeMode). A header of its own so that the host tests can drive the pool directly.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace halfstep::detail {

/// IEEE arithmetic for the scope: no flush of subnormal results or inputs to zero, rounding to
/// nearest (a caller may have set MXCSR otherwise: torch.set_flush_denormal(True) does), restored
/// on exit.
class IeeeMode {
 public:
  IeeeMode() {
#if defined(__x86_64__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(0x8000u | 0x0040u | 0x6000u));  // FTZ, DAZ, rounding control
#endif
  }
  ~IeeeMode() {
#if defined(__x86_64__)
    _mm_setcsr(saved_);
#endif
  }
  IeeeMode(const IeeeMode&) = delete;
  IeeeMode& operator=(const IeeeMode&) = delete;

 private:
  unsigned saved_ = 0;
};

/// Threads that run one job at a time over items [0, n): each thread, the caller's among them,
/// takes the next piece of `grain` items (one shared counter; about eight pieces a thread) until
/// none is left, and the caller returns once every piece is done. Pieces taken in turn, not a fixed
/// share each, and no waiting for a worker that took none: a thread that runs slower than the
/// others, or wakes late, on a core it shares (PyTorch's OpenMP workers, for one, keep spinning on
/// theirs for a while after each parallel operation) takes fewer pieces or none. With fixed halves,
/// each job waited for both threads to wake and finish, and right after a PyTorch step the step of
/// 10^6 parameters on two threads took longer than on one (bench/RESULTS.md). Which thread takes
/// which items changes no bit: pass 1's partials are per chunk and its sums integers, pass 2's
/// chunks are independent. Workers start at the first job that needs them and wait for the next; a
/// process forked from one with workers starts its own (the child has none of the parent's threads:
/// their state is left behind, never touched).
///
/// A step runs two jobs a few microseconds apart (pass 1, the decision, pass 2), and a thread put
/// to sleep on a condition variable takes tens of microseconds to wake: on a step of 10^6
/// parameters that was most of what a second thread gained. So a worker that finished a job, and
/// the caller waiting for the pieces, first watch for the next event for up to kSpin (pausing
/// between looks), and only then sleep. The counts that decide (the generation, the items done, the
/// workers inside the job) are atomic; a worker joins a job under the mutex, only while the job is
/// open, so once the caller has closed it and seen no worker inside, none can reach the job (which
/// lives in the caller's frame); whoever changes what a sleeper waits for takes the mutex before
/// notifying, so no wake-up is lost.
class HostPool {
 public:
  explicit HostPool(int threads) : threads_(threads) {}
  ~HostPool() { release(); }
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  int threads() const { return threads_; }

  void set_threads(int threads) {
    if (threads == threads_) return;
    release();
    threads_ = threads;
  }

  /// Runs f(begin, end, worker) over pieces of [0, n), each piece once, on every thread at once
  /// (f is called once a piece, several times on one thread: it adds to what its worker holds);
  /// returns when all are done. f must not throw (the passes do not): a worker has no one to hand
  /// it to.
  template <class F>
  void run(std::int64_t n, F&& f) {
    const int used = static_cast<int>(std::min<std::int64_t>(threads_, n));
    if (used <= 1) {
      IeeeMode ieee;
      if (n > 0) f(std::int64_t{0}, n, 0);
      return;
    }
    State& s = state();
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.job = [&f](std::int64_t b, std::int64_t e, int w) { f(b, e, w); };
      s.items = n;
      s.grain = std::max<std::int64_t>(1, n / (std::int64_t{8} * used));
      s.used = used;
      s.open = true;
      s.next.store(0, std::memory_order_relaxed);
      s.done.store(0, std::memory_order_relaxed);
      s.generation.fetch_add(1, std::memory_order_release);
    }
    s.start.notify_all();
    {
      IeeeMode ieee;
      take_pieces(s, n, s.grain, f, 0);
    }
    const auto all_done = [&s, n] { return s.done.load(std::memory_order_acquire) == n; };
    const auto none_inside = [&s] { return s.inside.load(std::memory_order_acquire) == 0; };
    spin_until(all_done);
    std::unique_lock<std::mutex> lock(s.mutex);
    s.finished.wait(lock, all_done);
    s.open = false;  // no worker joins from here; those inside find no piece left and leave
    lock.unlock();
    spin_until(none_inside);
    lock.lock();
    s.finished.wait(lock, none_inside);
    s.job = nullptr;
  }

 private:
  struct State {
    std::uint64_t process;  // process_epoch() when made (another value: a parent process's state)
    std::mutex mutex;
    std::condition_variable start, finished;
    std::function<void(std::int64_t, std::int64_t, int)> job;  // these five under the mutex
    std::int64_t items = 0, grain = 1;
    int used = 0;
    bool open = false;                          // workers may join the job
    std::atomic<std::int64_t> next{0};          // the first item no thread has taken
    std::atomic<std::int64_t> done{0};          // items whose piece is done
    std::atomic<int> inside{0};                 // workers that joined the job and have not left it
    std::atomic<std::uint64_t> generation{0};   // jobs started
    std::atomic<bool> quit{false};
    std::vector<std::thread> workers;
  };

  /// Runs f on the pieces of [0, n) this thread takes, until none is left; tells the caller when
  /// the last piece is done.
  template <class F>
  static void take_pieces(State& s, std::int64_t n, std::int64_t grain, F& f, int w) {
    for (;;) {
      const std::int64_t begin = s.next.fetch_add(grain, std::memory_order_relaxed);
      if (begin >= n) return;
      const std::int64_t end = std::min(n, begin + grain);
      f(begin, end, w);
      if (s.done.fetch_add(end - begin, std::memory_order_acq_rel) + (end - begin) == n && w != 0) {
        std::lock_guard<std::mutex> lock(s.mutex);  // the caller may be between its look and its sleep
        s.finished.notify_all();
      }
    }
  }

  /// How long a thread watches for the next event before it sleeps.
  static constexpr std::chrono::microseconds kSpin{100};

  /// Returns when ready() holds or kSpin has passed (the clock read every 64 looks).
  template <class Ready>
  static void spin_until(const Ready& ready) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (unsigned k = 1; !ready(); ++k) {
#if defined(__x86_64__)
      _mm_pause();
#endif
      if (k % 64 == 0 && std::chrono::steady_clock::now() >= until) return;
    }
  }

  /// Which process this is: a count of the forks this process descends from, since the first
  /// pool was made (a child's handler counts each fork). Not the process id: a grandchild may be
  /// given the id of a grandparent that has exited.
  static std::uint64_t process_epoch() { return forks().load(std::memory_order_relaxed); }
  static std::atomic<std::uint64_t>& forks() {
    static std::atomic<std::uint64_t> count{0};
    return count;
  }

  State& state() {
    static const int registered = ::pthread_atfork(nullptr, nullptr, [] { forks().fetch_add(1, std::memory_order_relaxed); });
    (void)registered;
    if (state_ != nullptr && state_->process != process_epoch()) release();  // forked: the parent's workers are not here
    if (state_ == nullptr) {
      auto* s = new State();
      s->process = process_epoch();
      try {
        for (int w = 1; w < threads_; ++w) s->workers.emplace_back([s, w] { work(*s, w); });
      } catch (...) {  // a thread the system would not start: stop those that did, and say so
        stop(*s);
        delete s;
        throw;
      }
      state_ = s;
    }
    return *state_;
  }

  /// Stops this process's workers and frees their state. A forked child's inherited state is not
  /// the child's to stop or free (its mutex may be held by a thread the child does not have): it is
  /// kept reachable for the life of the process instead.
  void release() {
    if (state_ == nullptr) return;
    if (state_->process == process_epoch()) {
      stop(*state_);
      delete state_;
    } else {
      static std::mutex kept;
      std::lock_guard<std::mutex> lock(kept);
      inherited_states().push_back(state_);
    }
    state_ = nullptr;
  }

  static std::vector<State*>& inherited_states() {
    static std::vector<State*> states;
    return states;
  }

  static void work(State& s, int w) {
    std::uint64_t seen = 0;
    const auto next = [&] { return s.quit.load(std::memory_order_acquire) || s.generation.load(std::memory_order_acquire) != seen; };
    for (;;) {
      std::int64_t items = 0, grain = 1;
      std::function<void(std::int64_t, std::int64_t, int)> job;
      spin_until(next);
      {
        std::unique_lock<std::mutex> lock(s.mutex);
        s.start.wait(lock, next);
        if (s.quit.load(std::memory_order_relaxed)) return;
        seen = s.generation.load(std::memory_order_relaxed);
        if (!s.open || w >= s.used) continue;  // woke after the job was done, or not needed for it
        s.inside.fetch_add(1, std::memory_order_relaxed);
        items = s.items;
        grain = s.grain;
        job = s.job;
      }
      {
        IeeeMode ieee;
        take_pieces(s, items, grain, job, w);
      }
      job = nullptr;
      if (s.inside.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(s.mutex);  // the caller may be between its look and its sleep
        s.finished.notify_all();
      }
    }
  }

  static void stop(State& s) {
    {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.quit.store(true, std::memory_order_release);
    }
    s.start.notify_all();
    for (std::thread& t : s.workers) t.join();
  }

  int threads_;
  State* state_ = nullptr;
};

}  // namespace halfstep::detail
