# The user's program, built against mpipe's targets, with a test of each: the
# consumer projects' ctest entries run these (tests/CMakeLists.txt).
# MPIPE_CONSUMER_MODES: which targets (default both, compiled and
# header_only). Header-only mode where MPIPE_CONSUMER_TWO_FILES is set
# (find_package): main.cpp and second.cpp both include mpipe, so that
# header-only mode must define everything once (inline) or fail to link.
# Otherwise main.cpp alone: a second file adds nothing to what is checked
# (compiled mode; header-only under add_subdirectory: the same headers).
enable_testing()
if(NOT DEFINED MPIPE_CONSUMER_MODES)
  set(MPIPE_CONSUMER_MODES compiled header_only)
endif()
foreach(_mode IN LISTS MPIPE_CONSUMER_MODES)
  add_executable(consumer_${_mode} ${CMAKE_CURRENT_LIST_DIR}/main.cpp)
  add_test(NAME consumer_${_mode} COMMAND consumer_${_mode})
endforeach()
if(TARGET consumer_compiled)
  target_link_libraries(consumer_compiled PRIVATE mpipe::mpipe)
endif()
target_link_libraries(consumer_header_only PRIVATE mpipe::mpipe_header_only)
if(MPIPE_CONSUMER_TWO_FILES)
  target_sources(consumer_header_only PRIVATE ${CMAKE_CURRENT_LIST_DIR}/second.cpp)
  target_compile_definitions(consumer_header_only PRIVATE MPIPE_CONSUMER_SECOND_FILE=1)
endif()
