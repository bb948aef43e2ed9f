# The user's program, built against one of mpipe's targets, with a test: the
# consumer projects' ctest entries run it (tests/CMakeLists.txt).
# MPIPE_CONSUMER_MODE: compiled (mpipe::mpipe; add_subdirectory) or
# header_only (mpipe::mpipe_header_only; find_package). Header-only, main.cpp
# and second.cpp both include mpipe, so that header-only mode must define
# everything once (inline) or fail to link.
enable_testing()
if(MPIPE_CONSUMER_MODE STREQUAL "compiled")
  add_executable(consumer_compiled ${CMAKE_CURRENT_LIST_DIR}/main.cpp)
  target_link_libraries(consumer_compiled PRIVATE mpipe::mpipe)
elseif(MPIPE_CONSUMER_MODE STREQUAL "header_only")
  add_executable(consumer_header_only ${CMAKE_CURRENT_LIST_DIR}/main.cpp ${CMAKE_CURRENT_LIST_DIR}/second.cpp)
  target_link_libraries(consumer_header_only PRIVATE mpipe::mpipe_header_only)
  target_compile_definitions(consumer_header_only PRIVATE MPIPE_CONSUMER_SECOND_FILE=1)
else()
  message(FATAL_ERROR "MPIPE_CONSUMER_MODE must be compiled or header_only, got '${MPIPE_CONSUMER_MODE}'")
endif()
add_test(NAME consumer_${MPIPE_CONSUMER_MODE} COMMAND consumer_${MPIPE_CONSUMER_MODE})
