# A run of 2N steps and a run of N steps, checkpointed and resumed for N more, must end with
# byte-identical checkpoints (optimizer state, masters and moments).
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
# A checkpoint from another shape is refused.
execute_process(COMMAND "${TRAIN}" --cpu --quiet --steps 130 --width 128 --resume "${WORK_DIR}/half.safetensors"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "was written for shape")
  message(FATAL_ERROR "a checkpoint of another shape was not refused: ${rc} ${err}")
endif()
message(STATUS "resumed run is byte-identical to the straight run")
