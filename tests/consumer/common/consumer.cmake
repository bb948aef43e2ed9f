# The user's program of two files (main.cpp, second.cpp), built against both
# of mpipe's targets, with a test of each: the consumer projects' ctest entries
# run these two (tests/CMakeLists.txt).
enable_testing()
foreach(_mode compiled header_only)
  add_executable(consumer_${_mode} ${CMAKE_CURRENT_LIST_DIR}/main.cpp ${CMAKE_CURRENT_LIST_DIR}/second.cpp)
  add_test(NAME consumer_${_mode} COMMAND consumer_${_mode})
endforeach()
target_link_libraries(consumer_compiled PRIVATE mpipe::mpipe)
target_link_libraries(consumer_header_only PRIVATE mpipe::mpipe_header_only)
