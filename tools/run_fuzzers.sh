#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) with clang and runs each for SECONDS (default 60) over
# the committed seed corpus, plus whatever earlier runs added under build/fuzz/corpus. Exits
# non-zero, printing the end of the log and the input that did it, if a target finds a crash or a
# violated invariant.
#
# usage: tools/run_fuzzers.sh [SECONDS]        e.g. tools/run_fuzzers.sh 3600 for an hour each
set -euo pipefail
seconds=${1:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build/fuzz
CXX=${FUZZ_CXX:-clang++} cmake -S "$root/tests/fuzz" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo > "$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" > "$build.build.log" 2>&1 || { tail -40 "$build.build.log"; exit 1; }
for target in checkpoint config safetensors block8; do
  corpus=$build/corpus/$target
  mkdir -p "$corpus"
  log=$build/fuzz_$target.log
  # libFuzzer caps inputs near the largest seed unless told: the header reader gets 4 MB, room
  # for headers nested hundreds of thousands deep.
  max_len=()
  [[ $target == safetensors ]] && max_len=(-max_len=4194304)
  if ! "$build/fuzz_$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 "${max_len[@]}" \
       -artifact_prefix="$build/crash-$target-" -print_final_stats=1 \
       "$corpus" "$root/tests/fuzz/corpus/$target" > "$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz_$target failed; the input is under $build/crash-$target-*" >&2
    exit 1
  fi
  runs=$(grep -o "stat::number_of_executed_units: [0-9]*" "$log" | grep -o "[0-9]*$")
  cov=$(grep -o "cov: [0-9]*" "$log" | tail -1)
  echo "fuzz_$target: $runs inputs in ${seconds} s, no failure ($cov, corpus $(ls "$corpus" | wc -l) files)"
done
