# Compiles each kernel file for sm_90 with ptxas' resource report and fails if any kernel
# spills registers. Writes the report (registers, spills, shared memory per kernel) to OUTPUT.
# Run as: cmake -DNVCC=... -DSOURCE_DIR=... -DOUTPUT=... -P check_ptxas.cmake
set(kernels check_and_norm finalize apply)
find_program(CXXFILT c++filt)
set(report "")
set(failed "")
foreach(k IN LISTS kernels)
  execute_process(
    COMMAND "${NVCC}" -std=c++17 -O3 -arch=sm_90 -cubin -o /dev/null -Xptxas=-v
            -I${SOURCE_DIR}/include -I${SOURCE_DIR}/src -I${SOURCE_DIR}/kernels
            ${SOURCE_DIR}/kernels/${k}.cu
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "nvcc failed on kernels/${k}.cu:\n${err}")
  endif()
  string(REPLACE "\n" ";" lines "${out}${err}")
  set(entry "")
  foreach(line IN LISTS lines)
    if(line MATCHES "Compiling entry function '([^']+)'")
      set(entry "${CMAKE_MATCH_1}")
      if(CXXFILT)
        execute_process(COMMAND "${CXXFILT}" "${entry}" OUTPUT_VARIABLE entry
                        OUTPUT_STRIP_TRAILING_WHITESPACE)
        string(REGEX REPLACE "\\(anonymous namespace\\)::|halfstep::detail::|halfstep::" "" entry "${entry}")
      endif()
    elseif(line MATCHES "([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads")
      set(spill_stores "${CMAKE_MATCH_1}")
      set(spill_loads "${CMAKE_MATCH_2}")
      if(NOT spill_stores EQUAL 0 OR NOT spill_loads EQUAL 0)
        list(APPEND failed "${k}: ${entry} spills ${spill_stores} B stored, ${spill_loads} B loaded")
      endif()
    elseif(line MATCHES "Used ([0-9]+) registers")
      string(APPEND report "${k}.cu  ${CMAKE_MATCH_1} registers, spills ${spill_stores}/${spill_loads} B  ${entry}\n")
    endif()
  endforeach()
endforeach()
file(WRITE "${OUTPUT}" "ptxas resource report, sm_90\n${report}")
message(STATUS "ptxas, sm_90:\n${report}")
if(failed)
  message(FATAL_ERROR "register spills in pass kernels:\n${failed}")
endif()
