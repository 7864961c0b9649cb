// Records a faulty or mismatched all-reduce could leave between step_local and step_finish, each
// breaking one rule that every reduction of halfstep records keeps (or the ranks' hyperparameter
// fingerprints disagreeing, or a rank's refusal), and the reason the step must name when it skips
// one.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "halfstep/distributed.hpp"
#include "halfstep/step.hpp"

namespace halfstep_test {

struct RecordFault {
  std::string name;
  std::function<void(halfstep::StepTotals&)> apply;  // changes a record pass 1 wrote
  halfstep::SkipReason reason;
};

// The record holds gradients with at least one inf (so that a key and a count are set) or none.
inline std::vector<RecordFault> record_faults(bool has_inf) {
  using halfstep::SkipReason;
  using halfstep::StepTotals;
  constexpr int n = StepTotals::kSumLimbs;
  std::vector<RecordFault> faults = {
      {"a negative inf/NaN count", [](StepTotals& r) { r.sum[n] = ~std::uint64_t{0}; }, SkipReason::inconsistent_totals},
      {"an element count past 2^63", [](StepTotals& r) { r.sum[n + 3] |= std::uint64_t{1} << 63; },
       SkipReason::inconsistent_totals},
      {"zero elements with five zeros",
       [](StepTotals& r) {
         r.sum[n] = 0;
         r.max[1] = 0;
         r.sum[n + 3] = 0;
         r.sum[n + 2] = 5;
       },
       SkipReason::inconsistent_totals},
      {"an infinite maximum", [](StepTotals& r) { r.max[0] = 0x7C00u | 0x7F80u; }, SkipReason::inconsistent_totals},
      {"a sum of squares past numel times the largest square",
       [](StepTotals& r) {
         r.sum[n] = 0;
         r.max[1] = 0;
         r.sum[n - 1] += 1;  // 2^(32·18 - 266): far beyond any fp16/bf16 square
       },
       SkipReason::inconsistent_totals},
      {"rank fingerprints that differ", [](StepTotals& r) { r.max[2] ^= 1; }, SkipReason::hyperparameters_differ},
      {"a rank's refusal mark", [](StepTotals& r) { r.max[2] = r.max[3] = ~std::uint64_t{0}; },
       SkipReason::rank_refused},
      {"half a refusal mark (max[2] alone)", [](StepTotals& r) { r.max[2] = ~std::uint64_t{0}; },
       SkipReason::inconsistent_totals},
  };
  if (has_inf) {
    faults.push_back({"an inf/NaN count without its key", [](StepTotals& r) { r.max[1] = 0; },
                      SkipReason::inconsistent_totals});
    faults.push_back({"a key whose rank half is not a rank",
                      [](StepTotals& r) { r.max[1] &= 0x7FFFFFFFFFFFFFFFull; }, SkipReason::inconsistent_totals});
  } else {
    faults.push_back({"a key without a count (rank -2)", [](StepTotals& r) { r.max[1] = std::uint64_t{1} << 32 | 0xFFFFFFFFu; },
                      SkipReason::inconsistent_totals});
  }
  return faults;
}

}  // namespace halfstep_test
