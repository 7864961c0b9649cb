# halfstep-train's output that cannot be written ends the run with a message naming the file and a
# non-zero exit code, never with "done" and the output lost: the trace, the standard output, the
# checkpoint. Every case runs a few steps at most.
# Run as: cmake -DTRAIN=... -DWORK_DIR=... -P train_output_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(PROGRAM "${TRAIN}")
include(${CMAKE_CURRENT_LIST_DIR}/expect.cmake)
# /dev/full takes no byte: a run fails writing the trace's header, before its first step (a resumed
# run too: /dev/full is not an existing trace to append rows to).
expect(1 "halfstep-train: writing the trace /dev/full failed: No space left on device"
       --cpu --quiet --steps 5 --trace /dev/full)
expect(ok "checkpoint written" --cpu --quiet --steps 3 --checkpoint "${WORK_DIR}/at3.safetensors")
expect(1 "halfstep-train: writing the trace /dev/full failed: No space left on device"
       --cpu --quiet --steps 6 --trace /dev/full --resume "${WORK_DIR}/at3.safetensors")
# The progress, the summary, --help: on a standard output that takes nothing.
foreach(args "--cpu;--quiet;--steps;2" "--cpu;--steps;4;--print-every;1" "--help")
  execute_process(COMMAND "${TRAIN}" ${args} OUTPUT_FILE /dev/full ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(NOT rc EQUAL 1 OR NOT err MATCHES "writing the standard output failed: No space left on device")
    string(APPEND failures "\n  ${args} > /dev/full: exit ${rc}, wanted 1 and the standard output named, got:\n${err}")
  endif()
endforeach()
# The checkpoint's file cannot be created next to its target (where a directory has its name):
# halfstep::save_checkpoint throws, and the run fails naming the checkpoint.
file(MAKE_DIRECTORY "${WORK_DIR}/end.safetensors.partial")
expect(1 "halfstep-train: checkpoint [^\n]*/end.safetensors: "
       --cpu --quiet --steps 2 --checkpoint "${WORK_DIR}/end.safetensors")
expect_report("halfstep-train fails on output it cannot write, naming it")
