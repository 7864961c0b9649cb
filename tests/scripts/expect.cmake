# expect(<want> <regex> args...): runs ${PROGRAM} with args and adds to `failures` unless it exits
# as wanted — ok (0), fail (an exit code other than 0; a crash or a timeout is no exit code) or
# that exit code — and its standard output and error together match <regex>. A case runs for
# EXPECT_TIMEOUT seconds at most (default 120).
# A test script sets PROGRAM, includes this file, runs its cases and ends with
# expect_report(<what the cases show>).
set(failures "")
if(NOT DEFINED EXPECT_TIMEOUT)
  set(EXPECT_TIMEOUT 120)
endif()
function(expect want pattern)
  execute_process(COMMAND ${PROGRAM} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                  TIMEOUT ${EXPECT_TIMEOUT})
  set(text "${out}${err}")
  if(want STREQUAL "ok")
    set(wanted_rc "^0$")
  elseif(want STREQUAL "fail")
    set(wanted_rc "^[1-9][0-9]*$")
  else()
    set(wanted_rc "^${want}$")
  endif()
  if(NOT rc MATCHES "${wanted_rc}" OR NOT text MATCHES "${pattern}")
    set(failures "${failures}\n  ${ARGN}: exit ${rc}, wanted ${want} and /${pattern}/, got:\n${text}" PARENT_SCOPE)
  endif()
endfunction()
function(expect_report what)
  if(failures)
    message(FATAL_ERROR "${PROGRAM}:${failures}")
  endif()
  message(STATUS "${what}")
endfunction()
