# Installs the build tree into a scratch prefix, then configures, builds and runs
# tests/consumer against it with find_package(halfstep CONFIG REQUIRED).
file(REMOVE_RECURSE "${WORK_DIR}")
include(${CMAKE_CURRENT_LIST_DIR}/script_run.cmake)
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix")
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run("${WORK_DIR}/build/halfstep_consumer")
message(STATUS "consumer project built and ran against the install tree")
# The installed programs run from the prefix, found by their relative RPATH alone.
if(EXISTS "${WORK_DIR}/prefix/bin/halfstep-plan")
  execute_process(COMMAND "${WORK_DIR}/prefix/bin/halfstep-plan" --params 7e9
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "fits")
    message(FATAL_ERROR "the installed halfstep-plan did not run (${rc}):\n${out}\n${err}")
  endif()
  execute_process(COMMAND "${WORK_DIR}/prefix/bin/halfstep-train" --version
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT out MATCHES "halfstep-train ${VERSION}")
    message(FATAL_ERROR "the installed halfstep-train --version failed (${rc}):\n${out}\n${err}")
  endif()
  execute_process(COMMAND "${WORK_DIR}/prefix/bin/halfstep-plot" --version
                  RESULT_VARIABLE rc OUTPUT_VARIABLE plot_out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0 OR NOT plot_out STREQUAL "halfstep-plot ${VERSION}\n")
    message(FATAL_ERROR "the installed halfstep-plot --version failed (${rc}):\n${plot_out}\n${err}")
  endif()
  foreach(f LICENSE CHANGELOG.md docs/design.md)
    if(NOT EXISTS "${WORK_DIR}/prefix/share/doc/halfstep/${f}")
      message(FATAL_ERROR "the install tree lacks share/doc/halfstep/${f}")
    endif()
  endforeach()
  message(STATUS "installed programs ran from the prefix: ${out}")
else()
  message(FATAL_ERROR "the install tree has no bin/halfstep-plan")
endif()
