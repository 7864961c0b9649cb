# Two halfstep-train runs that must be the same run: the rows of their traces (loss, norm, scale,
# outcome and every other column of every step) byte-identical. With A = --precision;bf16 and
# B = --precision;bf16;--master;remainder: int16 remainders rebuild the fp32 masters exactly, so
# the run holding 2 B of master per parameter is the run holding 4.
# Run as: cmake -DTRAIN=... -DWORK_DIR=... -DA=... -DB=... [-DSTEPS=300] -P train_same_run_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
if(NOT STEPS)
  set(STEPS 300)
endif()
foreach(run A B)
  execute_process(COMMAND "${TRAIN}" --cpu --quiet --steps ${STEPS} ${${run}} --trace "${WORK_DIR}/${run}.csv"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "halfstep-train ${${run}} failed (${rc})")
  endif()
  file(STRINGS "${WORK_DIR}/${run}.csv" rows_${run})
  list(LENGTH rows_${run} n)
  math(EXPR expected "${STEPS} + 1")
  if(NOT n EQUAL expected)
    message(FATAL_ERROR "${run}.csv has ${n} lines, expected a header and ${STEPS} rows")
  endif()
endforeach()
if(NOT rows_A STREQUAL rows_B)
  message(FATAL_ERROR "the runs with '${A}' and with '${B}' differ")
endif()
message("the runs with '${A}' and '${B}' are the same run: ${STEPS} identical trace rows")
