# A job that loses ranks ends as if it had not (issue 49): LAUNCH runs JOB
# uninterrupted into OUT/reference, then with the FAULTS (a list of
# A/R/S[/save|/stall], comma-separated) under --max-restarts RESTARTS into OUT/faulted, then
# compares every rank's final weights, optimizer state and loss bit for bit.
# -DLAUNCH= -DJOB= -DN= -DOUT= -DFAULTS= -DRESTARTS= [-DREPLICAS=]
if(NOT REPLICAS)
  set(REPLICAS 1)
endif()
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT}/reference ${OUT}/faulted ${OUT}/ck_reference ${OUT}/ck_faulted)
execute_process(COMMAND ${LAUNCH} -n ${N} --timeout 120 -- ${JOB} --dir ${OUT}/ck_reference
                  --out ${OUT}/reference --replicas ${REPLICAS}
                RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE log)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the uninterrupted run failed (${rc}):\n${log}")
endif()
string(REPLACE "," ";" FAULTS "${FAULTS}")
set(fault_args)
foreach(f ${FAULTS})
  string(REPLACE "/" ":" f ${f})
  list(APPEND fault_args --fault ${f})
endforeach()
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${LAUNCH} -n ${N} --timeout 240 --max-restarts ${RESTARTS} -- ${JOB}
                  --dir ${OUT}/ck_faulted --out ${OUT}/faulted --replicas ${REPLICAS} ${fault_args}
                RESULT_VARIABLE rc OUTPUT_VARIABLE log ERROR_VARIABLE err)
string(TIMESTAMP t1 "%s")
math(EXPR seconds "${t1} - ${t0}")
message(STATUS "the faulted run took ${seconds} s:\n${log}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the run with faults did not finish (${rc})")
endif()
execute_process(COMMAND ${JOB} --compare ${OUT}/reference ${OUT}/faulted --world ${N}
                RESULT_VARIABLE rc OUTPUT_VARIABLE cmp ERROR_VARIABLE cmp)
message(STATUS "${cmp}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the resumed job differs from the uninterrupted one")
endif()
file(REMOVE_RECURSE ${OUT})
