# cmake -DEXE=<example> -DDIR=<out folder> -DWEIGHTS=<file name> "-DARGS=<flags;...>"
#       -P check_saved_accuracy.cmake
# Trains with ARGS into DIR, evaluates the saved weights with the same ARGS,
# and checks that both report the same test accuracy: what is saved is what
# was evaluated. Prints "SKIP:" when the data set is not installed.
execute_process(COMMAND ${EXE} ${ARGS} --skip-if-no-data --out ${DIR}
                OUTPUT_VARIABLE trained ERROR_VARIABLE trained RESULT_VARIABLE rc)
if(rc EQUAL 77)
  message("SKIP: the data set is not installed")
  return()
endif()
if(NOT rc EQUAL 0 OR NOT trained MATCHES "final test accuracy ([0-9.]+)%")
  message(FATAL_ERROR "training exited with ${rc}:\n${trained}")
endif()
set(final ${CMAKE_MATCH_1})
execute_process(COMMAND ${EXE} ${ARGS} --eval ${DIR}/${WEIGHTS}
                OUTPUT_VARIABLE evaluated ERROR_VARIABLE evaluated RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT evaluated MATCHES "test accuracy of [^\n]*: ([0-9.]+)%")
  message(FATAL_ERROR "evaluation exited with ${rc}:\n${evaluated}")
endif()
if(NOT CMAKE_MATCH_1 STREQUAL final)
  message(FATAL_ERROR "the saved weights evaluate to ${CMAKE_MATCH_1}%, training reported ${final}%")
endif()
message(STATUS "trained and saved weights both at ${final}%")
