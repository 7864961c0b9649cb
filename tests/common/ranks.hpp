// Test helper: ranks as threads of one process. run_ranks runs a body per rank and rethrows the
// first failure on the calling thread (Catch's assertions are for that thread only, so rank bodies
// return what they saw and the test checks it afterwards). HostAllReduce reduces StepTotals
// records between ranks with NCCL's semantics — every rank contributes, every rank leaves with the
// combination of all — in an order and grouping it draws at random each time, as NCCL's
// algorithms choose theirs.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "halfstep/distributed.hpp"

namespace halfstep_test {

template <class Body>
void run_ranks(int n, Body body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

class HostAllReduce {
 public:
  HostAllReduce(int n, std::uint64_t seed) : n_(n), slots_(static_cast<std::size_t>(n)), rng_(seed) {}

  /// Rank `rank`'s part: blocks until every rank has called, then leaves `totals` holding the
  /// reduction over all ranks.
  void all_reduce(int rank, halfstep::StepTotals& totals) {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::uint64_t generation = generation_;
    slots_[static_cast<std::size_t>(rank)] = &totals;
    if (++arrived_ == n_) {
      combine_all();
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
    } else {
      changed_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  // Pairs neighbours of a random permutation until one record is left, then copies it to all.
  void combine_all() {
    std::vector<halfstep::StepTotals> parts;
    for (auto* p : slots_) parts.push_back(*p);
    std::shuffle(parts.begin(), parts.end(), rng_);
    while (parts.size() > 1) {
      const std::size_t i = static_cast<std::size_t>(rng_() % (parts.size() - 1));
      halfstep::combine(parts[i], parts[i + 1]);
      parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    }
    for (auto* p : slots_) *p = parts[0];
  }

  const int n_;
  std::vector<halfstep::StepTotals*> slots_;
  std::mt19937_64 rng_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
};

}  // namespace halfstep_test
