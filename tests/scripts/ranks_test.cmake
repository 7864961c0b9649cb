# halfstep-train --ranks on the CPU engine: one verdict and exact sharding.
#   1. --ranks 3 --batch 96: 32 samples per rank; every rank's trace is byte-identical.
#   2. --ranks 1, 2, 3 with --replicate-batch (every rank computes the whole batch): the traces'
#      rows — loss, norm, scale, outcome and every other column — are byte-identical to each
#      other and to the run without --ranks: the sharded step is the unsharded one, exactly.
#   3. A checkpoint written by 3 ranks at step 100, resumed on 2: the same rows again.
# EXTRA (a list) is added to every run: --moments;bf16 checks the same with bf16 moments, rounded
# stochastically from bits keyed by element, not by rank; --moments;block8 with block8 moments,
# the ranges cut where blocks start.
# Run as: cmake -DTRAIN=... -DWORK_DIR=... [-DEXTRA=...] -P ranks_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
function(train)
  execute_process(COMMAND "${TRAIN}" --cpu --quiet ${EXTRA} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "halfstep-train ${ARGN} failed (${rc})")
  endif()
endfunction()
# The rows of a trace, without its header line.
function(rows file out)
  file(STRINGS "${file}" lines)
  list(LENGTH lines n)
  if(n LESS 200)
    message(FATAL_ERROR "${file} has ${n} lines, expected a header and 200 rows")
  endif()
  list(REMOVE_AT lines 0)
  set(${out} "${lines}" PARENT_SCOPE)
endfunction()

train(--steps 200 --ranks 3 --batch 96 --trace "${WORK_DIR}/split.csv")
file(READ "${WORK_DIR}/split.csv" rank0)
foreach(r 1 2)
  file(READ "${WORK_DIR}/split.rank${r}.csv" other)
  if(NOT other STREQUAL rank0)
    message(FATAL_ERROR "split.rank${r}.csv differs from rank 0's trace: the ranks did not share one verdict")
  endif()
endforeach()

train(--steps 200 --trace "${WORK_DIR}/plain.csv")
rows("${WORK_DIR}/plain.csv" plain)
foreach(n 1 2 3)
  train(--steps 200 --ranks ${n} --replicate-batch --trace "${WORK_DIR}/replicated${n}.csv")
  rows("${WORK_DIR}/replicated${n}.csv" replicated)
  if(NOT replicated STREQUAL plain)
    message(FATAL_ERROR "--ranks ${n} --replicate-batch: the trace differs from the unsharded run's")
  endif()
endforeach()
set(resumed "${WORK_DIR}/resumed.csv")
train(--steps 100 --ranks 3 --replicate-batch --trace "${resumed}" --checkpoint "${WORK_DIR}/ranks3.safetensors")
train(--steps 200 --ranks 2 --replicate-batch --trace "${resumed}" --resume "${WORK_DIR}/ranks3.safetensors")
rows("${resumed}" resumed_rows)
if(NOT resumed_rows STREQUAL plain)
  message(FATAL_ERROR "a 3-rank checkpoint resumed on 2 ranks did not continue the run exactly")
endif()
message("every rank's trace identical; replicated runs on 1, 2 and 3 ranks identical to the unsharded run, "
        "also across a checkpoint from 3 ranks resumed on 2")
