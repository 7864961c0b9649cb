# Runs halfstep-train on the CPU engine with a trace, then checks the scenario's signature.
# Run as: cmake -DTRAIN=... -DPYTHON=... -DCHECK=... -DWORK_DIR=... -DNAME=... "-DARGS=a;b;c" -P
file(MAKE_DIRECTORY "${WORK_DIR}")
set(trace "${WORK_DIR}/${NAME}.csv")
execute_process(COMMAND "${TRAIN}" --cpu --quiet --trace "${trace}" ${ARGS}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "halfstep-train failed (${rc})")
endif()
execute_process(COMMAND "${PYTHON}" "${CHECK}" "${NAME}" "${trace}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "scenario ${NAME}: signature not found in ${trace}")
endif()
