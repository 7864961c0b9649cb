# A run of 2N steps and a run of N steps, checkpointed and resumed for N more, must end with
# byte-identical checkpoints (optimizer state, masters and moments). The CPU engine's numbers do
# not depend on the CPU: the same run under two of OpenBLAS's kernel sets (OPENBLAS_CORETYPE; they
# sum products in different orders, and halfstep-train once multiplied with them) ends
# byte-identical.
# Run as: cmake -DTRAIN=... -DWORK_DIR=... -P resume_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
function(train)
  execute_process(COMMAND "${TRAIN}" --cpu --quiet ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "halfstep-train ${ARGN} failed (${rc})")
  endif()
endfunction()
train(--steps 240 --checkpoint "${WORK_DIR}/straight.safetensors")
train(--steps 120 --checkpoint "${WORK_DIR}/half.safetensors")
train(--steps 240 --resume "${WORK_DIR}/half.safetensors" --checkpoint "${WORK_DIR}/resumed.safetensors")
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files "${WORK_DIR}/straight.safetensors"
                "${WORK_DIR}/resumed.safetensors" RESULT_VARIABLE same)
if(NOT same EQUAL 0)
  message(FATAL_ERROR "a resumed run ended differently from a straight one")
endif()
foreach(kernels Prescott Nehalem)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env OPENBLAS_CORETYPE=${kernels} "${TRAIN}" --cpu --quiet --steps 40
                          --checkpoint "${WORK_DIR}/${kernels}.safetensors" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "halfstep-train under OPENBLAS_CORETYPE=${kernels} failed (${rc})")
  endif()
endforeach()
execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files "${WORK_DIR}/Prescott.safetensors"
                "${WORK_DIR}/Nehalem.safetensors" RESULT_VARIABLE differ)
if(NOT differ EQUAL 0)
  message(FATAL_ERROR "the same run ended differently under OpenBLAS's Prescott and Nehalem kernels")
endif()
# A checkpoint from another shape is refused, saying what differs.
execute_process(COMMAND "${TRAIN}" --cpu --quiet --steps 130 --width 128 --resume "${WORK_DIR}/half.safetensors"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "another network, batch or seed: --width 256 there, 128 in this run")
  message(FATAL_ERROR "a checkpoint of another shape was not refused: ${rc} ${err}")
endif()
message(STATUS "resumed run is byte-identical to the straight run, and the same run under two sets of BLAS kernels")
