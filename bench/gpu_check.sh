#!/usr/bin/env bash
# The whole GPU verification in one call, for a machine with a GPU and no network:
#   build (gpu preset), every GPU test including [large] (one process per test case, several at
#   once), the case matrix's digests against the emulated device's (the same bits on the GPU as under
#   the emulator, when a digest directory is given), compute-sanitizer (memcheck on every case at
#   reduced sizes; racecheck, synccheck and initcheck on the cases that cover every kernel and state
#   format), the benchmark (short configuration, alone on the GPU), the Python package's GPU tests
#   and bench/compare_torch.py when PyTorch with CUDA is importable, halfstep inside Trainer and
#   accelerate next to the standard pipeline, a short halfstep-train run on the GPU (also with bf16
#   weights, no master and 8-bit moments), the NCCL tests, and halfstep-train --ranks over every
#   visible GPU against the one-GPU run.
# Logs go under LOG_DIR; a table of results is printed last. Exits non-zero if anything failed.
#
# usage: bench/gpu_check.sh LOG_DIR
# Environment:
#   HALFSTEP_BUILD_DIR    a build tree made elsewhere (any preset whose CUDA architectures include
#                         this GPU's): no build here; shared libraries it needs that this machine
#                         lacks may sit in HALFSTEP_BUILD_DIR/lib
#   HALFSTEP_DIGESTS      a directory of case-matrix digests written on the emulated device
#                         (build/default/tests/emulator/digests/forward): the GPU must write them
#   HALFSTEP_CHECK_FAST=1 the Python package's GPU tests alone, not its whole suite
#   HALFSTEP_GPU_JOBS     test processes at once (default: cores, at most 12)
#   HALFSTEP_CHECK_SECONDS  a time limit for the correctness phase: no sanitizer case starts after
#                         it, no GPU test case after 1.5 times it (a short lease)
# Catch2 and Google Benchmark come from the system, or from Debian packages in .debs/
# (tools/fetch_debs.sh), unpacked into a private prefix.
set -u
logs=${1:?usage: bench/gpu_check.sh LOG_DIR}
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
cd "$(dirname "$0")/.."
t0=$(date +%s)
jobs=$(nproc)
gpu_jobs=${HALFSTEP_GPU_JOBS:-$(( jobs < 12 ? jobs : 12 ))}
fast=${HALFSTEP_CHECK_FAST:-0}
declare -a table
failed=0
record() {  # name verdict detail
  table+=("$(printf '| %-34s | %-7s | %s |' "$1" "$2" "$3")")
  [ "$2" = "FAIL" ] && failed=1
  echo "[$(elapsed)] $1: $2 $3"
  return 0
}
elapsed() { echo "$(( $(date +%s) - t0 ))s"; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$logs/gpu.txt" 2>&1
git rev-parse HEAD > "$logs/commit.txt" 2>/dev/null || echo unknown > "$logs/commit.txt"

# --- build, or a tree built elsewhere ---------------------------------------------------------------
if [ -n "${HALFSTEP_BUILD_DIR:-}" ]; then
  bin=$HALFSTEP_BUILD_DIR
  [ -d "$bin/lib" ] && export LD_LIBRARY_PATH="$bin/lib:${LD_LIBRARY_PATH:-}"
  record "build" prebuilt "$bin"
else
  prefix_args=()
  if ls .debs/*.deb >/dev/null 2>&1; then
    deps=/tmp/halfstep-deps
    mkdir -p "$deps"
    for f in .debs/*.deb; do dpkg -x "$f" "$deps"; done
    prefix_args=(-DCMAKE_PREFIX_PATH="$deps/usr")
    export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  fi
  if cmake --preset gpu "${prefix_args[@]}" > "$logs/configure.log" 2>&1 &&
     cmake --build --preset gpu -j "$jobs" > "$logs/build.log" 2>&1; then
    record "build (gpu preset)" ok "$(elapsed)"
  else
    record "build (gpu preset)" FAIL "see build.log / configure.log"
    tail -30 "$logs/configure.log" "$logs/build.log"
    printf '%s\n' "${table[@]}"
    exit 1
  fi
  bin=build/gpu
fi
bin=$(cd "$bin" && pwd)  # absolute: the Python runs are given the library's path
tests_bin="$bin/tests/halfstep_gpu_tests"
lib="$bin/libhalfstep.so"

# --- Catch2 cases, one process each, several at once --------------------------------------------------
# run_cases NAME OUTDIR TIMEOUT PREFIX... < names: runs `PREFIX... halfstep_gpu_tests "<case>"`
# for each case name read (Catch's ',' '[' ']' escaped), gpu_jobs at a time; a line
# "<rc> <seconds> <case>" per case in OUTDIR/results.txt, each case's output in OUTDIR/<n>.log.
run_cases() {
  local out=$2 limit=$3
  shift 3
  mkdir -p "$out"
  : > "$out/results.txt"
  local n=0
  while IFS= read -r name; do
    [ -n "$name" ] || continue
    n=$((n + 1))
    printf '%s\0%s\0' "$n" "$name"
  done | xargs -0 -n 2 -P "$gpu_jobs" bash -c '
    out=$1; limit=$2; shift 2
    n=${@: -2:1}; name=${@: -1}
    set -- "${@:1:$(($# - 2))}"
    spec=$(printf "%s" "$name" | sed "s/[],[]/\\\\&/g")
    s=$(date +%s)
    left=$(( ${HALFSTEP_CHECK_DEADLINE:-0} > 0 ? HALFSTEP_CHECK_DEADLINE - s : limit ))
    if [ "$left" -lt 10 ]; then
      rc=125  # not started: past the deadline
    else
      timeout -k 5 "$(( left < limit ? left : limit ))" "$@" "$spec" > "$out/$n.log" 2>&1
      rc=$?
    fi
    printf "%s %s %s\n" "$rc" "$(( $(date +%s) - s ))" "$name" >> "$out/results.txt"
  ' _ "$out" "$limit" "$@"
}
# verdict_of NAME OUTDIR: one table row from results.txt (77 = skipped: fewer GPUs than the case needs).
verdict_of() {
  local r=$2/results.txt total ok skip bad late slow
  total=$(wc -l < "$r")
  ok=$(awk '$1 == 0' "$r" | wc -l)
  skip=$(awk '$1 == 77' "$r" | wc -l)
  bad=$(awk '$1 != 0 && $1 != 77 && $1 != 125' "$r" | wc -l)
  late=$(awk '$1 == 125' "$r" | wc -l)
  slow=$(sort -k2 -n -r "$r" | head -1 | awk '{print $2 "s"}')
  if [ "$total" -eq 0 ]; then
    record "$1" FAIL "no case ran"
  elif [ "$bad" -gt 0 ]; then
    record "$1" FAIL "$ok passed, $skip skipped, $bad failed: $(awk '$1 != 0 && $1 != 77 && $1 != 125 {rc=$1; $1=""; $2=""; print "rc " rc ":" $0}' "$r" | head -3 | tr '\n' ';')"
  elif [ "$ok" -eq 0 ]; then
    record "$1" skipped "every case skipped: $(grep -h SKIPPED "$2"/*.log 2>/dev/null | head -1)"
  elif [ "$late" -gt 0 ]; then
    record "$1" partial "$ok passed, $skip skipped, $late not started (HALFSTEP_CHECK_SECONDS)"
  else
    record "$1" ok "$ok passed, $skip skipped (fewer GPUs), slowest $slow"
  fi
}

"$tests_bin" --list-test-names-only 2>/dev/null | sed -e 's/[[:space:]]*$//' | grep -v '^$' > "$logs/cases.txt"
# racecheck, synccheck and initcheck: every kernel (pass 1, finalize, pass 2 in every state format,
# the graph and NCCL paths) at reduced sizes.
grep -E '^(gpu every state format steps like the reference backend|gpu block8 moments: pass 2 matches|gpu step matches the reference at edge sizes|gpu norm equals the reference bit for bit|gpu step skips the whole step for inf or NaN|gpu graph replayed 20 times|gpu a one-rank NCCL communicator|matrix: inf and NaN)' \
  "$logs/cases.txt" > "$logs/sanitizer_cases.txt"

# HALFSTEP_CHECK_SECONDS: the sanitizers start no case after that many seconds from the start, and
# the GPU suite none after 1.5 times that (the default, 0: no limit).
budget=${HALFSTEP_CHECK_SECONDS:-0}

# Phase 1, correctness (nothing timed): the GPU suite with every case, the matrix's digests, and the
# sanitizers, all at once (they share the GPU; each case is its own process).
digest_dir="$logs/digests_gpu"
(
  (( budget > 0 )) && export HALFSTEP_CHECK_DEADLINE=$(( t0 + budget * 3 / 2 ))
  run_cases "GPU tests" "$logs/gpu_tests" 300 "$tests_bin" --digest-dir "$digest_dir" < "$logs/cases.txt"
) &
pid_tests=$!
sanitize_pids=()
if command -v compute-sanitizer >/dev/null 2>&1; then
  (
    export HALFSTEP_TEST_REDUCED=1
    (( budget > 0 )) && export HALFSTEP_CHECK_DEADLINE=$(( t0 + budget ))
    # NCCL's communicator set-up probes its kernels and meets CUDA errors it handles itself
    # (cudaErrorNoKernelImageForDevice from cudaFuncGetAttributes, seen with NCCL 2.28 on an H200):
    # memcheck reports API errors except in the cases that make a communicator (halfstep's own
    # calls are checked there too: every one throws on an error, and the case fails).
    "$tests_bin" "[nccl]" --list-test-names-only 2>/dev/null | sed -e 's/[[:space:]]*$//' | grep -v '^$' \
      > "$logs/nccl_cases.txt"
    run_cases memcheck "$logs/sanitizer_memcheck/nccl" 240 compute-sanitizer --tool memcheck --report-api-errors no \
      --error-exitcode 99 "$tests_bin" < "$logs/nccl_cases.txt"
    grep -v -F -x -f "$logs/nccl_cases.txt" "$logs/cases.txt" | grep -v -F 'one tensor of 2^31 + 7 elements' |
      run_cases memcheck "$logs/sanitizer_memcheck" 240 compute-sanitizer --tool memcheck --error-exitcode 99 "$tests_bin"
    cat "$logs/sanitizer_memcheck/nccl/results.txt" >> "$logs/sanitizer_memcheck/results.txt"
    for tool in racecheck synccheck initcheck; do
      run_cases "$tool" "$logs/sanitizer_$tool" 180 compute-sanitizer --tool "$tool" --error-exitcode 99 "$tests_bin" \
        < "$logs/sanitizer_cases.txt"
    done
  ) &
  sanitize_pids+=($!)
fi
wait "$pid_tests"
verdict_of "GPU tests (every case, one each)" "$logs/gpu_tests"
for tag in state nccl block8 host large; do
  n=$(grep -c . <("$tests_bin" "[$tag]" --list-test-names-only 2>/dev/null | grep -v '^$'))
  p=$(grep -F -f <("$tests_bin" "[$tag]" --list-test-names-only 2>/dev/null | grep -v '^$' | sed 's/[[:space:]]*$//') \
        "$logs/gpu_tests/results.txt" | awk '$1 == 0' | wc -l)
  record "  [$tag] cases" "$([ "$p" -eq "$n" ] && echo ok || echo partial)" "$p of $n passed"
done
if [ -n "${HALFSTEP_DIGESTS:-}" ]; then
  want=$(ls "$HALFSTEP_DIGESTS" | wc -l)
  same=0 differ=""
  for f in "$HALFSTEP_DIGESTS"/*.txt; do
    name=$(basename "$f")
    if cmp -s "$f" "$digest_dir/$name"; then same=$((same + 1)); else differ="$differ $name"; fi
  done
  if [ "$same" -eq "$want" ] && [ "$want" -gt 0 ]; then
    record "case matrix = emulated device" ok "$same of $want digests identical"
  else
    record "case matrix = emulated device" FAIL "$same of $want identical; differ:$(echo "$differ" | cut -c1-200)"
  fi
fi

# --- the NCCL tests and the leanest state over NCCL, in the main job (correctness) -----------------------
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
ranks=$(( gpus < 2 ? 1 : gpus ))
train="$bin/examples/halfstep-train"
lean=(--precision bf16 --master none --moments block8)
(
  timeout 120 "$train" --steps 300 --quiet --ranks "$ranks" --trace "$logs/train_ranks.csv" > "$logs/train_ranks.log" 2>&1
  echo $? > "$logs/train_ranks.rc"
  timeout 120 "$train" --steps 300 --quiet "${lean[@]}" --trace "$logs/train_lean1.csv" > "$logs/train_lean1.log" 2>&1 &&
    timeout 120 "$train" --steps 300 --quiet "${lean[@]}" --ranks "$ranks" --replicate-batch \
      --trace "$logs/train_lean_ranks.csv" > "$logs/train_lean_ranks.log" 2>&1
  echo $? > "$logs/train_lean_ranks.rc"
) &
pid_ranks=$!

# --- the Python package's GPU tests (correctness) ----------------------------------------------------------
have_torch=0
python3 -c "import torch, pytest, sys; sys.exit(0 if torch.cuda.is_available() else 1)" > /dev/null 2>&1 && have_torch=1
if [ "$have_torch" = 1 ]; then
  pyfiles=python/tests/test_gpu.py
  [ "$fast" = 1 ] || pyfiles=python/tests
  PYTHONPATH="$PWD/python" HALFSTEP_LIBRARY="$lib" timeout 150 \
    python3 -m pytest -q -rs -p no:cacheprovider $pyfiles > "$logs/python_tests.log" 2>&1
  rc=$?
  summary=$(tail -1 "$logs/python_tests.log")
  if [ $rc -eq 0 ] && ! grep -q "SKIPPED.*test_gpu" "$logs/python_tests.log"; then
    record "Python package tests (GPU)" ok "$summary"
  else
    record "Python package tests (GPU)" FAIL "rc $rc: $summary (python_tests.log)"
  fi
else
  record "Python package tests (GPU)" skipped "no PyTorch with CUDA and pytest"
fi

wait "$pid_ranks"
if [ "$(cat "$logs/train_ranks.rc")" = 0 ]; then
  same=ok
  for ((r = 1; r < ranks; ++r)); do
    cmp -s "$logs/train_ranks.csv" "$logs/train_ranks.rank$r.csv" || same=FAIL
  done
  record "halfstep-train --ranks $ranks (NCCL)" "$same" "$(grep -E '^done' "$logs/train_ranks.log")"
else
  record "halfstep-train --ranks $ranks (NCCL)" FAIL "rc $(cat "$logs/train_ranks.rc") (train_ranks.log)"
fi
# The leanest state on ranks: ranges cut where blocks start, and with --replicate-batch every rank's
# trace must equal the one-GPU run's, row for row (on 1 or 2 GPUs: the average of 2 equal 16-bit
# gradients is exact however NCCL sums it; of 3 or more it may round, so there the ranks must agree).
if [ "$(cat "$logs/train_lean_ranks.rc")" = 0 ]; then
  same=ok
  for ((r = 0; r < ranks; ++r)); do
    trace="$logs/train_lean_ranks.csv"
    (( r > 0 )) && trace="$logs/train_lean_ranks.rank$r.csv"
    if (( ranks <= 2 )); then
      cmp -s <(tail -n +2 "$logs/train_lean1.csv") <(tail -n +2 "$trace") || same=FAIL
    else
      cmp -s "$logs/train_lean_ranks.csv" "$trace" || same=FAIL
    fi
  done
  record "lean halfstep-train --ranks $ranks = one GPU" "$same" "$(grep -E '^done' "$logs/train_lean_ranks.log")"
else
  record "lean halfstep-train --ranks $ranks" FAIL "rc $(cat "$logs/train_lean_ranks.rc") (train_lean1.log, train_lean_ranks.log)"
fi

# The sanitizers may still run: the timed parts below want the GPU alone.
for p in "${sanitize_pids[@]}"; do wait "$p"; done
if [ ${#sanitize_pids[@]} -gt 0 ]; then
  for tool in memcheck racecheck synccheck initcheck; do
    verdict_of "compute-sanitizer $tool" "$logs/sanitizer_$tool"
  done
else
  record "compute-sanitizer" FAIL "not on PATH"
fi

# Phase 2, timed, one at a time: the benchmark, the PyTorch comparison, the main job.
if [ -x "$bin/bench/halfstep-bench" ]; then
  if timeout 150 "$bin/bench/halfstep-bench" --halfstep_quick --benchmark_out="$logs/bench.json" \
       --benchmark_out_format=json > "$logs/bench.log" 2>&1; then
    record "halfstep-bench (quick)" ok "bench.log, bench.json"
  else
    record "halfstep-bench (quick)" FAIL "rc $? (bench.log)"
  fi
else
  record "halfstep-bench" FAIL "not built (Google Benchmark missing?)"
fi
if [ "$have_torch" = 1 ]; then
  if PYTHONPATH="$PWD/python" timeout 120 python3 bench/compare_torch.py --lib "$lib" > "$logs/compare_torch.log" 2>&1; then
    record "compare_torch.py" ok "$(grep RESULT "$logs/compare_torch.log")"
  else
    record "compare_torch.py" FAIL "$(grep -E 'RESULT|Error' "$logs/compare_torch.log" | tail -1)"
  fi
fi
if timeout 60 "$train" --steps 2000 --trace "$logs/train_gpu.csv" > "$logs/train_gpu.log" 2>&1; then
  record "halfstep-train (GPU, 2000 steps)" ok "$(grep -E '^halfstep-train:|^done|loss .* over the last' "$logs/train_gpu.log" | tr '\n' ' ')"
else
  record "halfstep-train (GPU, 2000 steps)" FAIL "train_gpu.log"
fi
if timeout 60 "$train" --steps 2000 "${lean[@]}" --trace "$logs/train_lean.csv" > "$logs/train_lean.log" 2>&1; then
  record "halfstep-train lean (GPU, 2000 steps)" ok "$(grep -E '^halfstep-train:|^done|loss .* over the last' "$logs/train_lean.log" | tr '\n' ' ')"
else
  record "halfstep-train lean (GPU, 2000 steps)" FAIL "train_lean.log"
fi

# --- halfstep inside Trainer and accelerate on the GPU (fp16, their GradScaler driving the fused step) --
fw_python=${HALFSTEP_FRAMEWORKS_PYTHON:-python3}
if "$fw_python" -c "import torch, transformers, accelerate, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
     > /dev/null 2>&1; then
  if PYTHONPATH="$PWD/python" HALFSTEP_LIBRARY="$lib" timeout 200 "$fw_python" examples/torch/frameworks.py \
       --device cuda --check --out "$logs/frameworks_gpu.json" > "$logs/frameworks_gpu.log" 2>&1; then
    record "frameworks.py --device cuda" ok "$(grep -c '^ok' "$logs/frameworks_gpu.log") pairs agree"
  else
    record "frameworks.py --device cuda" FAIL "$(grep -E '^FAILED|Error' "$logs/frameworks_gpu.log" | head -1)"
  fi
  # Trainer with 8-bit moments on halfstep's side (the model's large weights hold codes).
  if PYTHONPATH="$PWD/python" HALFSTEP_LIBRARY="$lib" timeout 150 "$fw_python" examples/torch/frameworks.py \
       --device cuda --runs trainer --moments uint8 --check --workdir "$logs/fw_u8" > "$logs/frameworks_u8_gpu.log" 2>&1; then
    record "frameworks.py trainer, 8-bit, cuda" ok "$(grep -c '^ok' "$logs/frameworks_u8_gpu.log") pairs agree"
  else
    record "frameworks.py trainer, 8-bit, cuda" FAIL "$(grep -E '^FAILED|Error' "$logs/frameworks_u8_gpu.log" | head -1)"
  fi
  if [ "$gpus" -ge 2 ]; then
    if PYTHONPATH="$PWD/python" HALFSTEP_LIBRARY="$lib" timeout 300 "$fw_python" -m torch.distributed.run \
         --standalone --nproc_per_node 2 examples/torch/frameworks.py --device cuda --runs trainer-fsdp --check \
         --workdir "$logs/fsdp_gpu" > "$logs/frameworks_fsdp_gpu.log" 2>&1; then
      record "frameworks.py trainer-fsdp (2 GPUs)" ok "$(grep '^ok' "$logs/frameworks_fsdp_gpu.log" | cut -c1-80)"
    else
      record "frameworks.py trainer-fsdp (2 GPUs)" FAIL "frameworks_fsdp_gpu.log"
    fi
  fi
else
  record "frameworks.py --device cuda" skipped "no PyTorch with CUDA, transformers and accelerate in $fw_python"
fi

# --- the table -----------------------------------------------------------------------------------------
echo
echo "## gpu_check on $(cat "$logs/gpu.txt") at $(cut -c1-12 "$logs/commit.txt"), $(date -u +%Y-%m-%d), $(elapsed)"
echo
grep -E '^\| (device-to-device|fused|unfused)' "$logs/bench.log" 2>/dev/null | head -40
grep RESULT "$logs/compare_torch.log" 2>/dev/null
echo
echo "| check | verdict | detail |"
echo "|---|---|---|"
printf '%s\n' "${table[@]}"
exit $failed
