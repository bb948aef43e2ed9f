# include() it for mpipe_same_across_ranks_test(); its tests run it with -P.
#
# mpipe_same_across_ranks_test(NAME EXE PATTERN RANKS <launcher...> ARGS <flags...>)
# adds the ctest NAME: EXE (a target) in one process and as ranks, with ARGS,
# must print the same matches of PATTERN. One ATen thread in both, as
# mpipe-launch gives its ranks, so that both sum in the same order.
if(NOT CMAKE_SCRIPT_MODE_FILE)
  function(mpipe_same_across_ranks_test name exe pattern)
    cmake_parse_arguments(PARSE_ARGV 3 _same "" "" "RANKS;ARGS")
    add_test(NAME ${name}
      COMMAND ${CMAKE_COMMAND} -DEXE=$<TARGET_FILE:${exe}> -DDIR=${CMAKE_CURRENT_BINARY_DIR}/${name}_out
        "-DARGS=${_same_ARGS}" "-DRANKS=${_same_RANKS}" "-DPATTERN=${pattern}"
        -P ${CMAKE_CURRENT_FUNCTION_LIST_FILE})
    set_tests_properties(${name} PROPERTIES TIMEOUT 300 PROCESSORS 2 SKIP_REGULAR_EXPRESSION "SKIP:"
      ENVIRONMENT OMP_NUM_THREADS=1)
  endfunction()
  return()
endif()

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
