# Runs the benchmark's CPU form briefly and checks its JSON has every workload.
execute_process(COMMAND ${BENCH} --device cpu --reps 2 --warmup 1 --json ${OUT}
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mpipe_bench exited with ${rc}")
endif()
file(READ ${OUT} text)
# A variant that failed reports "<key>_error" instead of a time: that fails the smoke test.
string(REGEX MATCH "\"[A-Za-z0-9_]*_error\" *: *\"[^\"]*" failed "${text}")
if(failed)
  message(FATAL_ERROR "a benchmark variant failed: ${failed}")
endif()
foreach(w narrow-mlp wide-mlp)
  string(JSON ms GET "${text}" workloads ${w} mpipe_train_ms)
endforeach()
foreach(w snn-1024 snn-256)
  string(JSON ms GET "${text}" workloads ${w} mpipe_constant_train_ms)
endforeach()
message(STATUS "bench smoke OK: snn-256 mpipe_constant_train_ms = ${ms}")
