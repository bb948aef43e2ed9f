# cmake -DEXE=<example> "-DARGS=<flags;...>" "-DRANKS=<launcher;...>" -DDIR=<out folder>
#       -DPATTERN=<regex> -P same_across_ranks.cmake
# Runs the example in one process, then as ranks of one pipeline (RANKS, e.g.
# "mpipe-launch;-n;2;--timeout;120;--"), both with ARGS, and checks that the
# ranks print the same results (every match of PATTERN: losses, accuracies)
# as the one process: a pipeline across processes trains exactly as one does.
# Prints "SKIP:" when the data set is not installed.
execute_process(COMMAND ${EXE} ${ARGS} --skip-if-no-data --out ${DIR}/one
                OUTPUT_VARIABLE one ERROR_VARIABLE one RESULT_VARIABLE rc)
if(rc EQUAL 77)
  message("SKIP: the data set is not installed")
  return()
endif()
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "one process exited with ${rc}:\n${one}")
endif()
execute_process(COMMAND ${RANKS} ${EXE} ${ARGS} --out ${DIR}/ranks
                OUTPUT_VARIABLE ranks ERROR_VARIABLE ranks RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the ranks exited with ${rc}:\n${ranks}")
endif()
string(REGEX MATCHALL "${PATTERN}" one_results "${one}")
string(REGEX MATCHALL "${PATTERN}" rank_results "${ranks}")
if(NOT one_results)
  message(FATAL_ERROR "one process printed no result matching '${PATTERN}':\n${one}")
endif()
if(NOT one_results STREQUAL rank_results)
  message(FATAL_ERROR "the ranks trained differently from one process\n"
                      "one process: ${one_results}\nranks:       ${rank_results}\n${ranks}")
endif()
list(LENGTH one_results n)
message(STATUS "the ranks printed the same ${n} results as one process: ${one_results}")
