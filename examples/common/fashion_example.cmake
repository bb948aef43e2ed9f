# Shared CMake for the Fashion-MNIST training examples.

# An example executable `name` from main.cpp and the shared data loader.
function(mpipe_fashion_example name)
  find_package(ZLIB REQUIRED)
  find_path(CLI11_INCLUDE_DIR CLI/CLI.hpp REQUIRED)
  set(common ${CMAKE_CURRENT_FUNCTION_LIST_DIR})
  # The data loader, compiled once for both examples.
  if(NOT TARGET mpipe_examples_fashion_data)
    add_library(mpipe_examples_fashion_data STATIC ${common}/fashion_mnist.cpp)
    target_include_directories(mpipe_examples_fashion_data PUBLIC ${common})
    target_link_libraries(mpipe_examples_fashion_data PUBLIC torch ZLIB::ZLIB)
  endif()
  add_executable(${name} main.cpp)
  target_include_directories(${name} SYSTEM PRIVATE ${CLI11_INCLUDE_DIR})
  target_link_libraries(${name} PRIVATE mpipe::mpipe mpipe_examples_fashion_data)
endfunction()

# A ctest that runs `name` on the CPU with `min_accuracy` asserted and the
# remaining arguments; skipped (exit 77) where the data set is not installed.
function(mpipe_fashion_accuracy_test test_name name min_accuracy)
  add_test(NAME ${test_name}
    COMMAND ${name} --devices cpu --min-accuracy ${min_accuracy} --skip-if-no-data ${ARGN})
  set_tests_properties(${test_name} PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 900 COST 15)
endfunction()
