# Writes OUT, a ctest file with one entry per test of the gtest program EXE
# (Note [One process per shard], tests/main.cpp): the entry prints the file
# that the program's shard wrote to RESULTS for that test, and passes, skips
# or fails by its first line. Run after each build of EXE.
foreach(_var EXE OUT RESULTS CMAKE)
  if(NOT ${_var})
    message(FATAL_ERROR "gtest_entries.cmake: ${_var} is not set")
  endif()
endforeach()
execute_process(COMMAND ${EXE} --gtest_list_tests OUTPUT_VARIABLE _list RESULT_VARIABLE _code
                TIMEOUT 120)
if(NOT _code EQUAL 0)
  message(FATAL_ERROR "${EXE} --gtest_list_tests failed (${_code}):\n${_list}")
endif()
# The list: "Suite." lines, each followed by indented test names (with
# "  # GetParam() = ..." after those of parameterized tests).
string(REPLACE ";" "\\;" _list "${_list}")
string(REPLACE "\n" ";" _lines "${_list}")
set(_text "")
set(_count 0)
foreach(_line IN LISTS _lines)
  string(REGEX REPLACE " *#.*" "" _line "${_line}")
  if(_line MATCHES "^([^ ].*)\\.$")
    set(_suite ${CMAKE_MATCH_1})
  elseif(_line MATCHES "^  +([^ ]+)$" AND _suite)
    set(_name "${_suite}.${CMAKE_MATCH_1}")
    if(_name MATCHES "(^|\\.|/)DISABLED_")
      continue()
    endif()
    string(REPLACE "/" "~" _file "${_name}")
    string(APPEND _text
      "add_test([=[${_name}]=] [=[${CMAKE}]=] -E cat [=[${RESULTS}/${_file}.result]=])\n"
      "set_tests_properties([=[${_name}]=] PROPERTIES FIXTURES_REQUIRED mpipe_gtest TIMEOUT 30 "
      "PASS_REGULAR_EXPRESSION [=[^PASSED]=] SKIP_REGULAR_EXPRESSION [=[^SKIPPED]=])\n")
    math(EXPR _count "${_count} + 1")
  endif()
endforeach()
if(_count EQUAL 0)
  message(FATAL_ERROR "${EXE} lists no test")
endif()
file(WRITE ${OUT}.new "${_text}")
execute_process(COMMAND ${CMAKE} -E copy_if_different ${OUT}.new ${OUT})
file(REMOVE ${OUT}.new)
