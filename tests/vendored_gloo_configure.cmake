# A Gloo inside the source tree (third_party/gloo) must configure and generate:
# copies what configuring mpipe reads from SOURCE_DIR to WORK_DIR/src, and
# GLOO_DIR/gloo (the Gloo headers the build found) to
# WORK_DIR/src/third_party/gloo/gloo, then configures it (build tree inside the
# copied source tree, install rules on) with MPIPE_GLOO_INCLUDE pointing there,
# and the add_subdirectory consumer (header-only) on the copy: both must
# generate and compile with the vendored Gloo. Passes TORCH_DIR and GENERATOR
# on. Only configure and generate, no build.
foreach(_var SOURCE_DIR WORK_DIR GLOO_DIR GENERATOR)
  if(NOT ${_var})
    message(FATAL_ERROR "vendored_gloo_configure.cmake: ${_var} is not set")
  endif()
endforeach()
set(_src ${WORK_DIR}/src)
set(_gloo ${_src}/third_party/gloo)
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${_src}/docs ${_gloo})
file(COPY ${SOURCE_DIR}/CMakeLists.txt ${SOURCE_DIR}/cmake ${SOURCE_DIR}/include ${SOURCE_DIR}/src
          ${SOURCE_DIR}/tools DESTINATION ${_src})
file(COPY ${SOURCE_DIR}/docs/Doxyfile.in DESTINATION ${_src}/docs)
file(COPY ${GLOO_DIR}/gloo DESTINATION ${_gloo})
set(_args)
if(TORCH_DIR)
  list(APPEND _args -DTorch_DIR=${TORCH_DIR})
endif()
execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${_src} -B ${_src}/build -G ${GENERATOR} ${_args}
    -DMPIPE_GLOO_INCLUDE=${_gloo} -DMPIPE_INSTALL=ON -DMPIPE_BUILD_TESTS=OFF
    -DMPIPE_BUILD_EXAMPLES=OFF -DMPIPE_BUILD_BENCH=OFF -DMPIPE_BUILD_LAUNCHER=OFF
    -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
  RESULT_VARIABLE _code OUTPUT_VARIABLE _out ERROR_VARIABLE _out TIMEOUT 600)
message(STATUS "cmake exited with ${_code}; output:\n${_out}")
if(NOT _code EQUAL 0)
  message(FATAL_ERROR "configuring with Gloo's headers in the source tree (${_gloo}) failed")
endif()
if(NOT _out MATCHES "pipelines across processes on")
  message(FATAL_ERROR "c10d was not found with MPIPE_GLOO_INCLUDE=${_gloo}")
endif()
# expect_include(BUILD SOURCE [TARGET]): the compile command of SOURCE (the end
# of its path; for TARGET, when given) in BUILD/compile_commands.json names
# the vendored Gloo.
function(expect_include build source)
  file(READ ${build}/compile_commands.json _commands)
  string(REGEX MATCHALL "{[^}]*}" _entries "${_commands}")
  foreach(_entry IN LISTS _entries)
    if(_entry MATCHES "\"file\": \"[^\"]*${source}\"" AND _entry MATCHES "${ARGN}")
      string(FIND "${_entry}" "${_gloo}" _at)
      if(_at EQUAL -1)
        message(FATAL_ERROR "${source} is compiled without ${_gloo}:\n${_entry}")
      endif()
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "no compile command for ${source} in ${build}/compile_commands.json")
endfunction()
# The build tree uses the vendored Gloo (src/distributed.cpp's include path) ...
expect_include(${_src}/build src/distributed.cpp)
# ... and the install's export names no path of the source tree.
file(GLOB_RECURSE _exports ${_src}/build/CMakeFiles/Export/*.cmake)
if(NOT _exports)
  message(FATAL_ERROR "no export files under ${_src}/build/CMakeFiles/Export")
endif()
foreach(_file IN LISTS _exports)
  file(READ ${_file} _text)
  string(FIND "${_text}" "${_src}" _at)
  if(NOT _at EQUAL -1)
    message(FATAL_ERROR "${_file} names the source tree ${_src}")
  endif()
endforeach()
# ... and so does mpipe::mpipe_header_only under add_subdirectory (the build
# interface): the add_subdirectory consumer's header-only program, on the copy.
execute_process(
  COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/consumer/add_subdirectory -B ${WORK_DIR}/consumer
    -G ${GENERATOR} ${_args} -DMPIPE_SOURCE_DIR=${_src} -DMPIPE_GLOO_INCLUDE=${_gloo}
    -DMPIPE_CONSUMER_MODE=header_only -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
  RESULT_VARIABLE _code OUTPUT_VARIABLE _out ERROR_VARIABLE _out TIMEOUT 600)
message(STATUS "cmake (add_subdirectory consumer) exited with ${_code}; output:\n${_out}")
if(NOT _code EQUAL 0)
  message(FATAL_ERROR "configuring the add_subdirectory consumer on ${_src} failed")
endif()
expect_include(${WORK_DIR}/consumer common/main.cpp consumer_header_only)
