# Runs LAUNCH with ARGS (a list) and checks its exit code (EXPECT_CODE), that
# it took at most MAX_SECONDS, and that its output (stdout and stderr) matches
# every regular expression of EXPECT (a list).
string(TIMESTAMP _t0 "%s")
execute_process(COMMAND ${LAUNCH} ${ARGS} RESULT_VARIABLE _code OUTPUT_VARIABLE _out
                ERROR_VARIABLE _out TIMEOUT 50)
string(TIMESTAMP _t1 "%s")
math(EXPR _took "${_t1} - ${_t0}")
message(STATUS "exit ${_code} after ${_took} s; output:\n${_out}")
if(NOT "${_code}" STREQUAL "${EXPECT_CODE}")
  message(FATAL_ERROR "expected exit code ${EXPECT_CODE}, got ${_code}")
endif()
if(_took GREATER MAX_SECONDS)
  message(FATAL_ERROR "took ${_took} s, more than ${MAX_SECONDS}")
endif()
foreach(_re IN LISTS EXPECT)
  if(NOT _out MATCHES "${_re}")
    message(FATAL_ERROR "output does not match '${_re}'")
  endif()
endforeach()
