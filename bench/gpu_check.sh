#!/usr/bin/env bash
# The whole GPU verification in one call, for a machine with a GPU and no network:
#   build (gpu preset), every GPU test including [large], compute-sanitizer (memcheck, racecheck,
#   initcheck, synccheck) on the GPU tests at reduced sizes, the benchmark (short configuration),
#   the Python package's tests (with the GPU ones) and bench/compare_torch.py through the package
#   when PyTorch with CUDA is importable, halfstep inside Trainer and accelerate (fp16, and Trainer
#   on FSDP2 with two GPUs) next to the standard pipeline, a short halfstep-train run on the GPU, the
#   NCCL tests alone, and halfstep-train --ranks over every visible GPU (also with bf16 weights, no
#   master and 8-bit moments, against the one-GPU run).
# Logs go under LOG_DIR; a table of results is printed last. Exits non-zero if anything failed.
#
# usage: bench/gpu_check.sh LOG_DIR
# Catch2 and Google Benchmark come from the system, or from Debian packages in .debs/
# (tools/fetch_debs.sh), unpacked into a private prefix.
set -u
logs=${1:?usage: bench/gpu_check.sh LOG_DIR}
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
cd "$(dirname "$0")/.."
t0=$(date +%s)
jobs=$(nproc)
declare -a table
failed=0
record() {  # name verdict detail
  table+=("$(printf '| %-34s | %-7s | %s |' "$1" "$2" "$3")")
  [ "$2" = "FAIL" ] && failed=1
  return 0
}
elapsed() { echo "$(( $(date +%s) - t0 ))s"; }

# --- dependencies ---------------------------------------------------------------------------------
prefix_args=()
if ls .debs/*.deb >/dev/null 2>&1; then
  deps=/tmp/halfstep-deps
  mkdir -p "$deps"
  for f in .debs/*.deb; do dpkg -x "$f" "$deps"; done
  prefix_args=(-DCMAKE_PREFIX_PATH="$deps/usr")
  export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$logs/gpu.txt" 2>&1
git rev-parse HEAD > "$logs/commit.txt" 2>/dev/null || echo unknown > "$logs/commit.txt"

# --- build ----------------------------------------------------------------------------------------
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

# --- GPU tests, every case including [large] -------------------------------------------------------
"$bin/tests/halfstep_gpu_tests" --durations yes > "$logs/gpu_tests.log" 2>&1
rc=$?
summary=$(grep -E "^(All tests passed|test cases:)" "$logs/gpu_tests.log" | tail -1)
case $rc in
  0) record "GPU tests (all, incl. [large])" ok "$summary" ;;
  77) record "GPU tests (all, incl. [large])" skipped "$(grep SKIPPED "$logs/gpu_tests.log" | head -2 | tr '\n' ' ')" ;;
  *) record "GPU tests (all, incl. [large])" FAIL "$summary (gpu_tests.log)" ;;
esac

# --- parts of the GPU suite alone, by tag: skipped cases (fewer than 2 GPUs) make the row partial ----
run_tagged() {  # NAME TAG LOG
  "$bin/tests/halfstep_gpu_tests" "$2" > "$logs/$3" 2>&1
  local rc=$? summary
  summary=$(grep -E "^(All tests passed|test cases:)|SKIPPED" "$logs/$3" | tr '\n' ' ')
  case $rc in
    0) record "$1" ok "$summary" ;;
    77) record "$1" partial "$summary" ;;
    *) record "$1" FAIL "$summary ($3)" ;;
  esac
}
# The state formats: every format against the reference, remainders bitwise like fp32 masters,
# no master as the fp32-master step rounded with the weight's own bits, lean state over NCCL ranks
# where there are 2+ GPUs.
run_tagged "state formats ([state])" "[state]" state_tests.log
# The NCCL tests: one rank (eager and captured), and 2+ ranks where there are 2+ GPUs.
run_tagged "NCCL tests ([nccl])" "[nccl]" nccl_tests.log

# --- host tests (quick: everything but the training scenarios) --------------------------------------
if ctest --test-dir "$bin" -L host -j "$jobs" > "$logs/host_tests.log" 2>&1; then
  record "host tests" ok "$(grep -E 'tests passed' "$logs/host_tests.log")"
else
  record "host tests" FAIL "$(grep -E 'tests passed|tests failed' "$logs/host_tests.log")"
fi

# --- compute-sanitizer on the GPU tests at reduced sizes ---------------------------------------------
if command -v compute-sanitizer >/dev/null 2>&1; then
  export HALFSTEP_TEST_REDUCED=1
  for tool in memcheck racecheck initcheck synccheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 99 "$bin/tests/halfstep_gpu_tests" "~[large]" \
      > "$logs/sanitizer_$tool.log" 2>&1
    rc=$?
    verdict=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$logs/sanitizer_$tool.log" | tail -1)
    if [ $rc -eq 0 ]; then record "compute-sanitizer $tool" ok "$verdict"; else record "compute-sanitizer $tool" FAIL "rc $rc: $verdict"; fi
  done
  unset HALFSTEP_TEST_REDUCED
else
  record "compute-sanitizer" FAIL "not on PATH"
fi

# --- benchmark (short configuration) ----------------------------------------------------------------
if [ -x "$bin/bench/halfstep-bench" ]; then
  if "$bin/bench/halfstep-bench" --halfstep_quick --benchmark_out="$logs/bench.json" \
       --benchmark_out_format=json > "$logs/bench.log" 2>&1; then
    record "halfstep-bench (quick)" ok "bench.log, bench.json"
  else
    record "halfstep-bench (quick)" FAIL "bench.log"
  fi
else
  record "halfstep-bench" FAIL "not built (Google Benchmark missing?)"
fi

# --- the Python package on the GPU (python/tests, incl. test_gpu.py), and the PyTorch comparison ----
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" > /dev/null 2>&1; then
  if python3 -c "import pytest" > /dev/null 2>&1; then
    PYTHONPATH="$PWD/python" HALFSTEP_LIBRARY="$PWD/$bin/libhalfstep.so" \
      python3 -m pytest -q -rs -p no:cacheprovider python/tests > "$logs/python_tests.log" 2>&1
    rc=$?
    summary=$(tail -1 "$logs/python_tests.log")
    if [ $rc -eq 0 ] && ! grep -q "SKIPPED.*test_gpu" "$logs/python_tests.log"; then
      record "Python package tests (GPU)" ok "$summary"
    else
      record "Python package tests (GPU)" FAIL "$summary (python_tests.log)"
    fi
  else
    record "Python package tests (GPU)" skipped "pytest not importable"
  fi
  if PYTHONPATH="$PWD/python" python3 bench/compare_torch.py --lib "$bin/libhalfstep.so" > "$logs/compare_torch.log" 2>&1; then
    record "compare_torch.py" ok "$(grep RESULT "$logs/compare_torch.log")"
  else
    record "compare_torch.py" FAIL "$(grep -E 'RESULT|Error' "$logs/compare_torch.log" | tail -1)"
  fi
else
  record "compare_torch.py" skipped "PyTorch with CUDA not importable"
fi

# --- halfstep inside Trainer and accelerate on the GPU (fp16, their GradScaler driving the fused step) --
# examples/torch/frameworks.py needs transformers and accelerate next to a PyTorch with CUDA;
# the FSDP2 Trainer run needs two GPUs (NCCL, one per process).
fw_python=${HALFSTEP_FRAMEWORKS_PYTHON:-python3}
if "$fw_python" -c "import torch, transformers, accelerate, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
     > /dev/null 2>&1; then
  if PYTHONPATH="$PWD/python" HALFSTEP_LIBRARY="$PWD/$bin/libhalfstep.so" "$fw_python" examples/torch/frameworks.py \
       --device cuda --check --out "$logs/frameworks_gpu.json" > "$logs/frameworks_gpu.log" 2>&1; then
    record "frameworks.py --device cuda" ok "$(grep -c '^ok' "$logs/frameworks_gpu.log") pairs agree"
  else
    record "frameworks.py --device cuda" FAIL "$(grep -E '^FAILED|Error' "$logs/frameworks_gpu.log" | head -1)"
  fi
  if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    if PYTHONPATH="$PWD/python" HALFSTEP_LIBRARY="$PWD/$bin/libhalfstep.so" "$fw_python" -m torch.distributed.run \
         --standalone --nproc_per_node 2 examples/torch/frameworks.py --device cuda --runs trainer-fsdp --check \
         --workdir "$logs/fsdp_gpu" > "$logs/frameworks_fsdp_gpu.log" 2>&1; then
      record "frameworks.py trainer-fsdp (2 GPUs)" ok "$(grep '^ok' "$logs/frameworks_fsdp_gpu.log" | cut -c1-80)"
    else
      record "frameworks.py trainer-fsdp (2 GPUs)" FAIL "frameworks_fsdp_gpu.log"
    fi
  else
    record "frameworks.py trainer-fsdp (2 GPUs)" skipped "one GPU"
  fi
else
  record "frameworks.py --device cuda" skipped "no PyTorch with CUDA, transformers and accelerate in $fw_python"
fi

# --- the main job on the GPU -------------------------------------------------------------------------
if "$bin/examples/halfstep-train" --steps 2000 --trace "$logs/train_gpu.csv" > "$logs/train_gpu.log" 2>&1; then
  record "halfstep-train (GPU, 2000 steps)" ok "$(grep -E '^done|loss .* over the last' "$logs/train_gpu.log" | tr '\n' ' ')"
else
  record "halfstep-train (GPU, 2000 steps)" FAIL "train_gpu.log"
fi

# --- the leanest state in the main job: bf16 weights without a master, 8-bit moments ----------------
lean=(--precision bf16 --master none --moments block8)
if "$bin/examples/halfstep-train" --steps 2000 "${lean[@]}" --trace "$logs/train_lean.csv" > "$logs/train_lean.log" 2>&1; then
  record "halfstep-train ${lean[*]} (GPU, 2000 steps)" ok \
    "$(grep -E '^done|loss .* over the last' "$logs/train_lean.log" | tr '\n' ' ')"
else
  record "halfstep-train ${lean[*]} (GPU, 2000 steps)" FAIL "train_lean.log"
fi

# --- data parallelism in the main job: one rank per GPU over NCCL, every rank's trace identical -------
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
ranks=$(( gpus < 2 ? 1 : gpus ))
if "$bin/examples/halfstep-train" --steps 300 --quiet --ranks "$ranks" --trace "$logs/train_ranks.csv" \
     > "$logs/train_ranks.log" 2>&1; then
  same=ok
  for ((r = 1; r < ranks; ++r)); do
    cmp -s "$logs/train_ranks.csv" "$logs/train_ranks.rank$r.csv" || same=FAIL
  done
  record "halfstep-train --ranks $ranks (NCCL)" "$same" "$(grep -E '^done' "$logs/train_ranks.log")"
else
  record "halfstep-train --ranks $ranks (NCCL)" FAIL "train_ranks.log"
fi
# The same with the leanest state: ranges cut where blocks start (of different lengths), and with
# --replicate-batch every rank's trace must equal the one-GPU run's, row for row. (On 1 or 2 GPUs:
# the average of 2 equal 16-bit gradients is exact however NCCL sums it; of 3 or more it may round.)
if "$bin/examples/halfstep-train" --steps 300 --quiet "${lean[@]}" --trace "$logs/train_lean1.csv" \
     > "$logs/train_lean1.log" 2>&1 &&
   "$bin/examples/halfstep-train" --steps 300 --quiet "${lean[@]}" --ranks "$ranks" --replicate-batch \
     --trace "$logs/train_lean_ranks.csv" > "$logs/train_lean_ranks.log" 2>&1; then
  same=ok
  for ((r = 0; r < ranks; ++r)); do
    trace="$logs/train_lean_ranks.csv"
    (( r > 0 )) && trace="$logs/train_lean_ranks.rank$r.csv"
    if (( ranks <= 2 )); then
      cmp -s <(tail -n +2 "$logs/train_lean1.csv") <(tail -n +2 "$trace") || same=FAIL
    else
      cmp -s "$logs/train_lean_ranks.csv" "$trace" || same=FAIL  # the ranks agree with each other
    fi
  done
  record "halfstep-train ${lean[*]} --ranks $ranks --replicate-batch (NCCL) = one GPU" "$same" \
    "$(grep -E '^done' "$logs/train_lean_ranks.log")"
else
  record "halfstep-train ${lean[*]} --ranks $ranks --replicate-batch (NCCL)" FAIL "train_lean1.log, train_lean_ranks.log"
fi

# --- the table -----------------------------------------------------------------------------------------
echo
echo "## gpu_check on $(cat "$logs/gpu.txt") at $(cat "$logs/commit.txt" | cut -c1-12), $(date -u +%Y-%m-%d), $(elapsed)"
echo
sed -n '/^## halfstep-bench/,$p' "$logs/bench.log" 2>/dev/null | head -40
echo
echo "| check | verdict | detail |"
echo "|---|---|---|"
printf '%s\n' "${table[@]}"
exit $failed
