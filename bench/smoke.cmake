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
foreach(w narrow-mlp wide-mlp wide-mlp-bf16 wide-mlp-bf16-linear wide-mlp-bf16w)
  string(JSON ms GET "${text}" workloads ${w} mpipe_train_ms)
endforeach()
string(JSON ms GET "${text}" workloads transformer mpipe_1f1b_split2_train_ms)
string(JSON ms GET "${text}" workloads transformer mpipe_1f1b_split2_train_tflops)
string(JSON ms GET "${text}" workloads overhead train_step_threads_per_task_us)
foreach(w snn-1024 snn-256)
  string(JSON ms GET "${text}" workloads ${w} mpipe_constant_train_ms)
endforeach()
message(STATUS "bench smoke OK: snn-256 mpipe_constant_train_ms = ${ms}")
# A guard on the runtime's hot path: each call kind's time against the plain
# loop of the same stage calls (4 stages of Linear(4, 4), 8 one-row
# micro-batches). On the CPU the ratios are 1.3 to 3 (bench/RESULTS.md); a
# ratio above 6 means the runtime's cost per task more than doubled.
if(NOT BUILD_TYPE MATCHES "^(Release|RelWithDebInfo|MinSizeRel)$")
  message(STATUS "bench smoke: ${BUILD_TYPE} build, overhead ratios not guarded")
  return()
endif()
# Two reps are noisy on a loaded machine: a ratio above the bound is measured
# again with more reps before it fails the test.
set(keys forward_inline_to_plain forward_threads_to_plain train_step_inline_to_plain
         train_step_threads_to_plain)
set(again FALSE)
foreach(key ${keys})
  string(JSON ratio GET "${text}" workloads overhead ${key})
  message(STATUS "bench smoke: overhead ${key} = ${ratio}")
  if(ratio GREATER 6)
    set(again TRUE)
  endif()
endforeach()
if(again)
  execute_process(COMMAND ${BENCH} --device cpu --only overhead --reps 9 --warmup 2
                          --json ${OUT}.overhead RESULT_VARIABLE rc)
  file(READ ${OUT}.overhead text)
  foreach(key ${keys})
    string(JSON ratio GET "${text}" workloads overhead ${key})
    if(ratio GREATER 6)
      message(FATAL_ERROR "overhead ${key} = ${ratio} twice: the pipeline's cost per task "
                          "regressed (more than 6x the plain loop of the same stage calls)")
    endif()
    message(STATUS "bench smoke: overhead ${key} = ${ratio} (measured again, 9 reps)")
  endforeach()
endif()
