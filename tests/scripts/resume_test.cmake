# A run of 2N steps and a run of N steps, checkpointed and resumed for N more, must end with
# byte-identical checkpoints (optimizer state, masters and moments). A resumed run's trace: a new
# or empty file gets the header, an existing trace only the rows, and the description next to it
# names both runs. The CPU engine's numbers do not depend on the CPU: the same run under two of
# OpenBLAS's kernel sets (OPENBLAS_CORETYPE; they sum products in different orders, and
# halfstep-train once multiplied with them) ends byte-identical.
# EXTRA (a list) is added to every run of the first check, and EXACT_ONLY=ON stops after it
# (--moments;block8: a resume through block8 codes and scales in the checkpoint).
# Run as: cmake -DTRAIN=... -DWORK_DIR=... [-DEXTRA=... -DEXACT_ONLY=ON] -P resume_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
function(train)
  execute_process(COMMAND "${TRAIN}" --cpu --quiet ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "halfstep-train ${ARGN} failed (${rc})")
  endif()
endfunction()
function(same a b what)
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files "${a}" "${b}" RESULT_VARIABLE differ)
  if(NOT differ EQUAL 0)
    message(FATAL_ERROR "${what}")
  endif()
endfunction()
train(${EXTRA} --steps 240 --checkpoint "${WORK_DIR}/straight.safetensors")
train(${EXTRA} --steps 120 --checkpoint "${WORK_DIR}/half.safetensors" --trace "${WORK_DIR}/continued.csv")
train(${EXTRA} --steps 240 --resume "${WORK_DIR}/half.safetensors" --checkpoint "${WORK_DIR}/resumed.safetensors"
      --trace "${WORK_DIR}/continued.csv")
same("${WORK_DIR}/straight.safetensors" "${WORK_DIR}/resumed.safetensors"
     "a resumed run ended differently from a straight one")
message(STATUS "resumed run is byte-identical to the straight run")
if(EXACT_ONLY)
  return()
endif()

set(header_line "attempt,step,outcome,reason,spike,loss,lr,scale_used,scale_next,grad_norm,clip_coef,nonfinite_count,first_nonfinite_tensor,max_abs_scaled,headroom_log2,subnormal_count,zero_count,numel,held_elements")
# check_trace(<file> <rows> <first attempt>): the header once, on the first line, then the rows.
function(check_trace file rows first)
  file(STRINGS "${file}" lines)
  list(LENGTH lines n)
  list(FILTER lines INCLUDE REGEX "^attempt,")
  list(LENGTH lines headers)
  file(STRINGS "${file}" first_lines LIMIT_COUNT 2)
  list(GET first_lines 0 line0)
  list(GET first_lines 1 line1)
  math(EXPR want "${rows} + 1")
  if(NOT line0 STREQUAL header_line OR NOT headers EQUAL 1 OR NOT n EQUAL want OR NOT line1 MATCHES "^${first},")
    message(FATAL_ERROR "${file}: ${n} lines, ${headers} headers, first lines '${line0}' '${line1}'; wanted the "
                        "header once, first, then ${rows} rows from attempt ${first}")
  endif()
endfunction()
check_trace("${WORK_DIR}/continued.csv" 240 1)
file(READ "${WORK_DIR}/continued.csv.json" description)
if(NOT description MATCHES "\"command\": \"halfstep-train --cpu --quiet --steps 120 [^\n]*\n.*\"first_attempt\": 1\n.*\"command\": \"halfstep-train --cpu --quiet --steps 240 --resume [^\n]*\n.*\"first_attempt\": 121\n")
  message(FATAL_ERROR "continued.csv.json does not name both runs:\n${description}")
endif()
train(--steps 125 --resume "${WORK_DIR}/half.safetensors" --trace "${WORK_DIR}/new.csv")
check_trace("${WORK_DIR}/new.csv" 5 121)
file(WRITE "${WORK_DIR}/empty.csv" "")
train(--steps 125 --resume "${WORK_DIR}/half.safetensors" --trace "${WORK_DIR}/empty.csv")
check_trace("${WORK_DIR}/empty.csv" 5 121)
message(STATUS "a resumed run's trace: the header in a new or empty file, rows alone after an existing trace's")

foreach(kernels Prescott Nehalem)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env OPENBLAS_CORETYPE=${kernels} "${TRAIN}" --cpu --quiet --steps 40
                          --checkpoint "${WORK_DIR}/${kernels}.safetensors" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "halfstep-train under OPENBLAS_CORETYPE=${kernels} failed (${rc})")
  endif()
endforeach()
same("${WORK_DIR}/Prescott.safetensors" "${WORK_DIR}/Nehalem.safetensors"
     "the same run ended differently under OpenBLAS's Prescott and Nehalem kernels")
message(STATUS "the same run under two sets of BLAS kernels is byte-identical")

# A checkpoint from another shape is refused, saying what differs.
execute_process(COMMAND "${TRAIN}" --cpu --quiet --steps 130 --width 128 --resume "${WORK_DIR}/half.safetensors"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "another network, batch or seed: --width 256 there, 128 in this run")
  message(FATAL_ERROR "a checkpoint of another shape was not refused: ${rc} ${err}")
endif()
