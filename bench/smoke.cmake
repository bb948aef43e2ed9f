# The benchmark's CPU form. PART=workloads: every workload runs once and its
# JSON has every key; the ATen operations a call adds to the plain loop stay
# bounded. PART=overhead: the runtime's time per task against the plain loop
# (bench/CMakeLists.txt runs this part alone, as it times).
if(PART STREQUAL "overhead")
  # A guard on the runtime's hot path: each call kind's time against the plain
  # loop of the same stage calls (4 stages of Linear(4, 4), 8 one-row
  # micro-batches). Inline, the ratios are 1.3 to 3 (bench/RESULTS.md): above 6,
  # the runtime's cost per task more than doubled. With worker threads a task
  # also waits for a thread's wake-up, which the OS prices: 2 to 4 on an idle
  # machine, 6.3 and 7.5 on a loaded 2-core CI runner (stop 63), so their bound
  # is 12.
  if(NOT BUILD_TYPE MATCHES "^(Release|RelWithDebInfo|MinSizeRel)$")
    message(STATUS "bench smoke: ${BUILD_TYPE} build, overhead ratios not guarded")
    return()
  endif()
  set(keys forward_inline_to_plain forward_threads_to_plain train_step_inline_to_plain
           train_step_threads_to_plain)
  set(reps 3)
  # A ratio above the bound is measured again with more reps before it fails.
  foreach(attempt 1 2)
    execute_process(COMMAND ${BENCH} --device cpu --only overhead --reps ${reps} --warmup 1
                            --json ${OUT}.overhead RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "mpipe_bench --only overhead exited with ${rc}")
    endif()
    file(READ ${OUT}.overhead text)
    set(over "")
    foreach(key ${keys})
      string(JSON ratio GET "${text}" workloads overhead ${key})
      message(STATUS "bench smoke: overhead ${key} = ${ratio} (${reps} reps)")
      set(bound 6)
      if(key MATCHES "threads")
        set(bound 12)
      endif()
      if(ratio GREATER bound)
        list(APPEND over "${key} = ${ratio} (bound ${bound})")
      endif()
    endforeach()
    if(NOT over)
      return()
    endif()
    set(reps 9)
  endforeach()
  message(FATAL_ERROR "overhead ${over} twice: the pipeline's cost per task regressed "
                      "(against the plain loop of the same stage calls)")
endif()
execute_process(COMMAND ${BENCH} --device cpu --reps 1 --warmup 0 --json ${OUT}
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
string(JSON ms GET "${text}" workloads lm mpipe_default_ms)
string(JSON ms GET "${text}" workloads lm plain_fair_ms)
string(JSON ms GET "${text}" workloads lm predicted_2_devices_zbh1_ms)
foreach(w snn-1024 snn-256)
  string(JSON ms GET "${text}" workloads ${w} mpipe_constant_train_ms)
endforeach()
message(STATUS "bench smoke OK: snn-256 mpipe_constant_train_ms = ${ms}")
# A guard that does not depend on the machine's load: the ATen operations of
# one call (--count-ops) beside the plain call of the same stages. At the time
# of writing (LibTorch 1.13, bench/RESULTS.md): forward adds 0.03 operations per
# task to the plain loop, train_step 6.0 (the cuts' detaches and leaf
# gradients, the loss's weight); snn-256's chunk = T calls add 3 per time step
# (the CPU sums a chunk's steps one at a time: a select and an add each) and
# a few per call (forward 3; the training step 24, most of them the cuts at
# the stage boundaries: detaches, the leaves' AccumulateGrad).
execute_process(COMMAND ${BENCH} --device cpu --count-ops --only overhead,snn-256 --warmup 1
                        --json ${OUT}.ops RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "mpipe_bench --count-ops exited with ${rc}")
endif()
file(READ ${OUT}.ops ops_text)
string(JSON fwd_added GET "${ops_text}" workloads overhead forward_inline_added_per_task_ops)
string(JSON train_added GET "${ops_text}" workloads overhead train_step_inline_added_per_task_ops)
string(JSON threads_added GET "${ops_text}" workloads overhead train_step_threads_added_per_task_ops)
message(STATUS "bench smoke: operations added per task: forward ${fwd_added}, train_step "
               "${train_added} (with threads ${threads_added})")
if(fwd_added GREATER 1 OR train_added GREATER 8 OR NOT threads_added STREQUAL train_added)
  message(FATAL_ERROR "the pipeline's ATen operations per task grew: forward ${fwd_added} "
                      "(bound 1), train_step ${train_added} (bound 8), with threads "
                      "${threads_added} (must equal inline)")
endif()
# snn-256's rows: <plain row>:<mpipe row>:<bound on the difference>.
foreach(rows "fwd:constant_fwd:200" "train:constant_train_step:224")  # 3 T + 8, 3 T + 32; T = 64
  string(REPLACE ":" ";" parts "${rows}")
  list(GET parts 0 plain_row)
  list(GET parts 1 piped_row)
  list(GET parts 2 bound)
  string(JSON plain GET "${ops_text}" workloads snn-256 plain_multistep_${plain_row}_ops)
  string(JSON piped GET "${ops_text}" workloads snn-256 mpipe_chunk64_${piped_row}_ops)
  string(REGEX REPLACE "\\.0*$" "" plain "${plain}")  # counts, written as JSON numbers
  string(REGEX REPLACE "\\.0*$" "" piped "${piped}")
  math(EXPR added "${piped} - ${plain}")
  message(STATUS "bench smoke: snn-256 chunk = T ${piped_row}: ${piped} operations, plain ${plain}")
  if(added GREATER bound)
    message(FATAL_ERROR "snn-256's chunk = T ${piped_row} makes ${added} ATen operations more "
                        "than the plain multi-step call (bound ${bound})")
  endif()
endforeach()
