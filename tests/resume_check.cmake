# A job that loses ranks ends as if it had not (issue 49): LAUNCH runs JOB
# uninterrupted into OUT/reference, then with the FAULTS (a list of
# A/R/S[/save|/stall], comma-separated) under --max-restarts RESTARTS into OUT/faulted, then
# compares every rank's final weights, optimizer state and loss bit for bit.
# A step S of "?" is drawn at random: the k-th of K faults falls in the k-th
# K-th of the job's 120 steps (a later fault after an earlier one's resume),
# a /save fault on a checkpoint step (a multiple of 10). The faults drawn are
# printed, so that a failure can be run again with them.
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
list(LENGTH FAULTS n_faults)
set(fault_args)
set(drawn)
set(k 0)
foreach(f ${FAULTS})
  if(f MATCHES "/[?]")
    math(EXPR lo "${k} * 120 / ${n_faults} + 3")
    math(EXPR hi "(${k} + 1) * 120 / ${n_faults} - 3")
    string(RANDOM LENGTH 4 ALPHABET 0123456789 r)
    string(REGEX REPLACE "^0+([0-9])" "\\1" r "${r}")
    math(EXPR step "${lo} + ${r} % (${hi} - ${lo} + 1)")
    if(f MATCHES "/save$")
      math(EXPR step "(${step} + 9) / 10 * 10")
    endif()
    string(REPLACE "?" "${step}" f "${f}")
  endif()
  list(APPEND drawn ${f})
  string(REPLACE "/" ":" f ${f})
  list(APPEND fault_args --fault ${f})
  math(EXPR k "${k} + 1")
endforeach()
string(REPLACE ";" "," drawn "${drawn}")
message(STATUS "faults: ${drawn} (-DFAULTS=${drawn} runs them again)")
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
