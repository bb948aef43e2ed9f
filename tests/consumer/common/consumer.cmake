# The user's program, built against both of mpipe's targets, with a test of
# each: the consumer projects' ctest entries run these two
# (tests/CMakeLists.txt). Header-only mode where MPIPE_CONSUMER_TWO_FILES is
# set (find_package): main.cpp and second.cpp both include mpipe, so that
# header-only mode must define everything once (inline) or fail to link.
# Otherwise main.cpp alone: a second file adds nothing to what is checked
# (compiled mode; header-only under add_subdirectory: the same headers).
enable_testing()
foreach(_mode compiled header_only)
  add_executable(consumer_${_mode} ${CMAKE_CURRENT_LIST_DIR}/main.cpp)
  add_test(NAME consumer_${_mode} COMMAND consumer_${_mode})
endforeach()
target_link_libraries(consumer_compiled PRIVATE mpipe::mpipe)
target_link_libraries(consumer_header_only PRIVATE mpipe::mpipe_header_only)
if(MPIPE_CONSUMER_TWO_FILES)
  target_sources(consumer_header_only PRIVATE ${CMAKE_CURRENT_LIST_DIR}/second.cpp)
  target_compile_definitions(consumer_header_only PRIVATE MPIPE_CONSUMER_SECOND_FILE=1)
endif()
