# Runs examples/torch/plot_frameworks.py as the README does (the script itself, Debian's python3)
# on what the framework runs wrote, then checks that a PNG came out, and that input that is not
# theirs is refused in one line with exit code 2.
# Run as: cmake -DPLOT=<script> -DRESULTS=<a.json;b.json> -DOUT=<png> -P plot_frameworks_test.cmake
include(${CMAKE_CURRENT_LIST_DIR}/script_run.cmake)
file(REMOVE "${OUT}")
run("${PLOT}" ${RESULTS} -o "${OUT}")
file(READ "${OUT}" signature LIMIT 8 HEX)
file(SIZE "${OUT}" size)
if(NOT signature STREQUAL "89504e470d0a1a0a" OR size LESS 30000)
  message(FATAL_ERROR "${OUT} is not the plot (${size} bytes, starting ${signature})")
endif()
get_filename_component(dir "${OUT}" DIRECTORY)
file(WRITE "${dir}/not-results.json" "[1, 2, 3]\n")
execute_process(COMMAND "${PLOT}" "${dir}/not-results.json" -o "${dir}/never.png"
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 2 OR NOT err MATCHES "^plot_frameworks: .*not the JSON examples/torch/frameworks.py --out writes\n$"
   OR EXISTS "${dir}/never.png")
  message(FATAL_ERROR "a file that is not a result was not refused in one line (${rc}):\n${out}\n${err}")
endif()
message(STATUS "plotted ${size} bytes into ${OUT}")
