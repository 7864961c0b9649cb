# Configures, builds and runs tests/embed, which pulls halfstep's source tree in with
# add_subdirectory, then checks that only the library came with it.
# Run as: cmake -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -P embed_test.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
include(${CMAKE_CURRENT_LIST_DIR}/script_run.cmake)
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/embed" -B "${WORK_DIR}" -G "${GENERATOR}"
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90-real "-DHALFSTEP_SOURCE_DIR=${SOURCE_DIR}")
run(${CMAKE_COMMAND} --build "${WORK_DIR}" --target help)
foreach(target halfstep_host_tests halfstep_gpu_tests halfstep-train halfstep-plan halfstep-bench halfstep_emulated)
  if(out MATCHES "(^|\n)${target}[:\n ]")
    message(FATAL_ERROR "embedding halfstep brought in its target ${target}")
  endif()
endforeach()
run(${CMAKE_COMMAND} --build "${WORK_DIR}")
run(ctest --test-dir "${WORK_DIR}" -N)
if(NOT out MATCHES "Total Tests: 1\n")
  message(FATAL_ERROR "the embedding project's ctest lists halfstep's tests:\n${out}")
endif()
run(ctest --test-dir "${WORK_DIR}" --output-on-failure)
message(STATUS "an embedding project got the library alone, built it and ran against it")
