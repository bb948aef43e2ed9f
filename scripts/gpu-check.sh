#!/usr/bin/env bash
# On a CUDA machine whose LibTorch is python3's torch (the project's GPU machine):
# builds mpipe against it and runs the steps named in MPIPE_GPU_STEPS (default:
# "tests snn"): tests = every ctest test plus the GPU tests verbosely;
# mlpfm = the Fashion-MNIST MLP training; frompython = examples/from_python
# with a model scripted by python3's torch, read back by it;
# bf16 = the bf16 rows and the transformer beside the reference class;
# scaling = wide-mlp's training throughput on 1, 2 and 4 GPUs beside the reference class;
# bench = mpipe_bench (only the workloads in MPIPE_BENCH_ONLY, if set) beside
# the reference class's bench_seed.py (copied to .devdata/seed) and
# bench/compare.py's table; soak = bench/mpipe_soak on cuda:0;
# gtest = mpipe_tests with --gtest_filter=$MPIPE_GTEST_FILTER;
# stress = scripts/stress.sh (the cross-process stress test's long form) while
# every ctest test runs beside it with -j 8 (ctest-beside.log);
# profile = one profiled call per measurement of mpipe_bench --only
# $MPIPE_PROFILE_ONLY, summarised by bench/trace_summary.py (profile.txt, and
# the traces as profiles.tar.gz); snn = the Fashion-MNIST SNN
# training (data from .devdata/fashion-mnist, extra flags in MPIPE_SNN_FLAGS, several
# runs separated by ";", at once with MPIPE_SNN_PARALLEL=1);
# lm = the transformer language model through the pipeline (default options:
# its steps replayed from CUDA graphs), then eager (--graphs off), then --plain,
# then --plain --micro-batches 1 (data
# from .devdata/fortunes, extra flags in MPIPE_LM_FLAGS; loss curves come back);
# overhead = mpipe_bench --only overhead, ${MPIPE_OVERHEAD_RUNS:-3} runs
# (overhead1.json, ...; the runtime's and the host's cost per task);
# ops = mpipe_bench --count-ops (the ATen operations of one call per row, on
# the GPU's code paths) of $MPIPE_OPS_ONLY, by name in ops.tar.gz;
# headeronly = mpipe_tests built against mpipe::mpipe_header_only (into
# build-gpu-ho; --gtest_filter=$MPIPE_GTEST_FILTER); consumers = the
# consumer tests; compiletime = scripts/compile-time.sh (compile-time.txt). Logs go to
# ${OUT:-/tmp/mpipe-gpu}: build.log, and run.log for everything the steps print
# (few files, since a device call brings back at most 8), plus the benchmark's
# JSON and compare.md. Header-only extras that machine lacks (CLI11, zlib's
# headers) may be carried in .devdata/include.
set -uo pipefail  # each step's pipeline fails with its first failing command
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mpipe-gpu}
mkdir -p "$out"
steps=${MPIPE_GPU_STEPS:-tests snn}
log="$out/run.log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
export MPIPE_SKIP_APT=1 MPIPE_BUILD_DIR=${MPIPE_BUILD_DIR:-build-gpu}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
extra=()
if [ ! -f /usr/include/zlib.h ] && [ -f .devdata/include/zlib.h ]; then
  libz=$(ls /usr/lib/x86_64-linux-gnu/libz.so* /lib/x86_64-linux-gnu/libz.so* 2>/dev/null | head -n 1)
  extra+=("-DZLIB_INCLUDE_DIR=$PWD/.devdata/include" "-DZLIB_LIBRARY=$libz")
fi
# Pipelines across processes: Gloo's headers (not in the wheel) come in
# .devdata/include (scripts/prepare-devdata.sh); NCCL's from the nvidia-nccl wheel.
nccl_include=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null || true)
[ -n "$nccl_include" ] && [ -f "$nccl_include/nccl.h" ] && export MPIPE_NCCL_INCLUDE=$nccl_include
status=0
failed=()
# Runs a step; its failure (any command of a pipeline) fails the script at the end.
step() {
  local name=$1
  shift
  if ! "$@"; then
    failed+=("$name")
    status=1
  fi
}
bash scripts/build.sh "-DCMAKE_PREFIX_PATH=$prefix;$PWD/.devdata" "${extra[@]}" > "$out/build.log" 2>&1 \
  || { tail -n 60 "$out/build.log"; exit 1; }
bin=$MPIPE_BUILD_DIR
if [[ " $steps " == *" tests "* ]]; then
  step ctest bash -o pipefail -c "cd '$bin' && ctest --output-on-failure -j 8 2>&1 | tee -a '$log'"
  # The one-GPU tests again, verbosely; on this machine none may skip itself.
  step gpu-tests bash -o pipefail -c "'$bin/tests/mpipe_tests' --gtest_filter='*_CUDA' 2>&1 \
    | tee -a '$log' > '$out/gpu-tests.txt' && ! grep '^\[  SKIPPED \]' '$out/gpu-tests.txt'"
fi
if [[ " $steps " == *" stress "* ]]; then
  # The cross-process stress test's long form (scripts/stress.sh) while the
  # whole ctest suite runs beside it with -j 8 (issue 30).
  (cd "$bin" && ctest -j 8 > "$out/ctest-beside.log" 2>&1; echo "ctest beside: exit $?" >> "$out/ctest-beside.log") &
  beside=$!
  step stress bash -o pipefail -c "MPIPE_BUILD_DIR='$bin' bash scripts/stress.sh 2>&1 | tee -a '$log'"
  wait "$beside"
  tail -n 4 "$out/ctest-beside.log" | tee -a "$log"
  grep -q "ctest beside: exit 0" "$out/ctest-beside.log" || { failed+=(ctest-beside); status=1; }
fi
if [[ " $steps " == *" gtest "* ]]; then
  step gtest bash -o pipefail -c "'$bin/tests/mpipe_tests' --gtest_filter='${MPIPE_GTEST_FILTER:-*_CUDA}' 2>&1 \
    | tee -a '$log'"
fi
if [[ " $steps " == *" headeronly "* ]]; then
  ho=${bin}-ho
  step headeronly-build bash -o pipefail -c "cmake -S . -B '$ho' -G Ninja -DCMAKE_BUILD_TYPE=Release \
    '-DCMAKE_PREFIX_PATH=$prefix;$PWD/.devdata' ${extra[*]:-} -DMPIPE_TESTS_HEADER_ONLY=ON \
    -DMPIPE_BUILD_EXAMPLES=OFF -DMPIPE_BUILD_BENCH=OFF > '$out/build-ho.log' 2>&1 \
    && cmake --build '$ho' --target mpipe_tests >> '$out/build-ho.log' 2>&1"
  step headeronly-gtest bash -o pipefail -c "'$ho/tests/mpipe_tests' --gtest_filter='${MPIPE_GTEST_FILTER:-*}' 2>&1 \
    | tee -a '$log' | tail -n 5"
fi
if [[ " $steps " == *" consumers "* ]]; then
  step consumers bash -o pipefail -c "cd '$bin' && ctest --output-on-failure -R '^consumer\.' 2>&1 | tee -a '$log'"
fi
if [[ " $steps " == *" compiletime "* ]]; then
  step compile-time bash -o pipefail -c "bash scripts/compile-time.sh '-DCMAKE_PREFIX_PATH=$prefix;$PWD/.devdata' \
    ${extra[*]:-} 2>&1 | tee '$out/compile-time.txt' | tee -a '$log'"
fi
if [[ " $steps " == *" profile "* ]]; then
  rm -rf /tmp/mpipe-profile
  step profile bash -o pipefail -c "'$bin/bench/mpipe_bench' --only '${MPIPE_PROFILE_ONLY:-narrow-mlp,snn-1024,wide-mlp-bf16}' \
    --reps 5 --warmup 2 --profile /tmp/mpipe-profile --json '$out/profile_bench.json' 2>&1 | tee -a '$log' \
    && python3 bench/trace_summary.py /tmp/mpipe-profile > '$out/profile.txt'"
  [ -d /tmp/mpipe-profile ] && tar -czf "$out/profiles.tar.gz" -C /tmp mpipe-profile
fi
if [[ " $steps " == *" mlpfm "* ]]; then
  step mlp_fashion_mnist bash -o pipefail -c "timeout ${MPIPE_MLP_TIMEOUT:-300} \
    '$bin/examples/mlp_fashion_mnist/mlp_fashion_mnist' --data .devdata/fashion-mnist \
    --out /tmp/mlp_out ${MPIPE_MLP_FLAGS:-} 2>&1 | tee -a '$log'"
fi
if [[ " $steps " == *" bench "* ]]; then
  # mpipe's benchmark and the reference class's, in the same run (seed copied to .devdata/seed).
  # The schedules' timelines travel back as one archive (a call brings back few files).
  only=()
  [ -n "${MPIPE_BENCH_ONLY:-}" ] && only=(--only "$MPIPE_BENCH_ONLY")
  step mpipe_bench bash -o pipefail -c "'$bin/bench/mpipe_bench' --json '$out/mpipe_bench.json' \
    --timelines /tmp/mpipe-timelines ${only[*]:-} ${MPIPE_BENCH_ARGS:-} 2>&1 | tee -a '$log'"
  [ -d /tmp/mpipe-timelines ] && tar -czf "$out/timelines.tar.gz" -C /tmp mpipe-timelines
  if [ -z "${MPIPE_BENCH_ARGS:-}" ]; then
    step bench_seed bash -o pipefail -c "PYTHONUNBUFFERED=1 python3 .devdata/seed/bench_seed.py \
      --json '$out/seed_bench.json' 2>&1 | tee -a '$log'"
    # compare.py fails when a variant reported an error instead of a time.
    step compare bash -o pipefail -c "python3 bench/compare.py '$out/mpipe_bench.json' \
      '$out/seed_bench.json' | tee '$out/compare.md'"
  fi
fi
if [[ " $steps " == *" overhead "* ]]; then
  for i in $(seq "${MPIPE_OVERHEAD_RUNS:-3}"); do
    step "overhead_$i" bash -o pipefail -c "'$bin/bench/mpipe_bench' --only overhead \
      --json '$out/overhead$i.json' 2>&1 | tee -a '$log'"
  done
fi
if [[ " $steps " == *" frompython "* ]]; then
  # examples/from_python end to end: Python scripts the model, the C++
  # program splits, checks, fine-tunes and saves it, Python reads it back.
  fp=/tmp/mpipe-from-python
  mkdir -p "$fp"
  step from_python bash -o pipefail -c "{ python3 examples/from_python/make_model.py save --out '$fp/model.pt' \
    && '$bin/examples/from_python/from_python' --model '$fp/model.pt' --data .devdata/fashion-mnist \
      --out '$fp' --devices cuda:0 \
    && python3 examples/from_python/make_model.py check --model '$fp/finetuned.pt' \
      --data .devdata/fashion-mnist; } 2>&1 | tee -a '$log'"
fi
if [[ " $steps " == *" ops "* ]]; then
  step ops bash -o pipefail -c "'$bin/bench/mpipe_bench' --count-ops --warmup 2 \
    --only '${MPIPE_OPS_ONLY:-overhead,narrow-mlp,snn-1024,snn-256}' --ops-by-name /tmp/mpipe-ops \
    --json '$out/ops.json' 2>&1 | tee -a '$log'"
  [ -d /tmp/mpipe-ops ] && tar -czf "$out/ops.tar.gz" -C /tmp mpipe-ops
fi
if [[ " $steps " == *" bf16 "* ]]; then
  # bf16 rows (issue 15): wide-mlp under autocast and with bf16 weights, the
  # transformer workload, and the reference class on the same transformer.
  step bf16_bench bash -o pipefail -c "'$bin/bench/mpipe_bench' --only wide-mlp-bf16,wide-mlp-bf16-linear,wide-mlp-bf16w,transformer \
    --json '$out/bf16_bench.json' ${MPIPE_BENCH_ARGS:-} 2>&1 | tee -a '$log'"
  step seed_transformer bash -o pipefail -c "PYTHONUNBUFFERED=1 python3 bench/seed_transformer.py .devdata/seed \
    --json '$out/seed_transformer.json' 2>&1 | tee -a '$log'"
  step compare_bf16 bash -o pipefail -c "python3 bench/compare.py '$out/bf16_bench.json' /dev/null \
    --transformer='$out/seed_transformer.json' | tee '$out/compare_bf16.md'"
fi
if [[ " $steps " == *" scaling "* ]]; then
  # wide-mlp's training throughput on 1, 2 and 4 GPUs, mpipe and the reference class (issue 7).
  step scaling bash -o pipefail -c "'$bin/bench/mpipe_bench' --only scaling --json '$out/scaling.json' 2>&1 \
    | tee -a '$log'"
  step seed_scaling bash -o pipefail -c "PYTHONUNBUFFERED=1 python3 bench/seed_scaling.py .devdata/seed \
    --json '$out/seed_scaling.json' 2>&1 | tee -a '$log'"
  step compare_scaling bash -o pipefail -c "python3 bench/compare.py '$out/scaling.json' /dev/null \
    '$out/seed_scaling.json' 2>&1 | tee -a '$out/compare.md'"
fi
if [[ " $steps " == *" soak "* ]]; then
  # Memory and threads over many calls (docs/RELIABILITY.md); extra flags in MPIPE_SOAK_ARGS.
  step soak bash -o pipefail -c "timeout ${MPIPE_SOAK_TIMEOUT:-400} '$bin/bench/mpipe_soak' \
    --json '$out/soak_gpu.json' ${MPIPE_SOAK_ARGS:-} 2>&1 | tee -a '$log'"
fi
if [[ " $steps " == *" snn "* ]]; then
  # MPIPE_SNN_FLAGS may hold several runs' flags separated by ';': one after
  # the other, or all at once with MPIPE_SNN_PARALLEL=1 (for accuracy, not
  # timing). Each run's log and plots come back in snn_runs.tar.gz.
  IFS=';' read -r -a snn_runs <<< "${MPIPE_SNN_FLAGS:-}"
  [ ${#snn_runs[@]} -eq 0 ] && snn_runs=("")
  pids=()
  rm -rf /tmp/snn_runs  # a warm machine keeps the last call's
  for i in "${!snn_runs[@]}"; do
    cmd="timeout ${MPIPE_SNN_TIMEOUT:-540} '$bin/examples/snn_fashion_mnist/snn_fashion_mnist' \
      --data .devdata/fashion-mnist --out /tmp/snn_runs/$i ${snn_runs[$i]} > /tmp/snn_runs/$i.log 2>&1"
    mkdir -p /tmp/snn_runs
    echo "snn run $i: ${snn_runs[$i]}" | tee -a "$log"
    if [ "${MPIPE_SNN_PARALLEL:-0}" = 1 ]; then
      bash -c "$cmd" & pids+=($!)
    else
      step "snn_$i" bash -c "$cmd"
      tail -n 3 "/tmp/snn_runs/$i.log" | tee -a "$log"
    fi
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { failed+=("snn_$i"); status=1; }
    tail -n 3 "/tmp/snn_runs/$i.log" | tee -a "$log"
  done
  tar -czf "$out/snn_runs.tar.gz" --exclude="*.pt" -C /tmp snn_runs
fi
if [[ " $steps " == *" lm "* ]]; then
  for mode in pipeline pipeline_eager plain plain_whole_batch; do
    flag=""
    [ "$mode" = pipeline_eager ] && flag="--graphs off"
    [ "$mode" = plain ] && flag="--plain"  # the same micro-batches, accumulated
    [ "$mode" = plain_whole_batch ] && flag="--plain --micro-batches 1"
    step "transformer_lm_$mode" bash -o pipefail -c "timeout ${MPIPE_LM_TIMEOUT:-300} \
      '$bin/examples/transformer_lm/transformer_lm' --data .devdata/fortunes --out /tmp/lm_out \
      $flag ${MPIPE_LM_FLAGS:-} 2>&1 | tee -a '$log'"
  done
  cp /tmp/lm_out/*.svg "$out/" 2>/dev/null
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-check: failed steps: ${failed[*]}" | tee -a "$log"
fi
exit "$status"
