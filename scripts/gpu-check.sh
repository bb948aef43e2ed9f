#!/usr/bin/env bash
# On a CUDA machine whose LibTorch is python3's torch (the project's GPU machine):
# builds mpipe against it and runs the steps named in MPIPE_GPU_STEPS (default:
# "tests snn"): tests = every ctest test plus the GPU tests verbosely;
# mlp = the pipelined-MLP example; snn = the Fashion-MNIST SNN training (data
# from .devdata/fashion-mnist, extra flags in MPIPE_SNN_FLAGS). Logs go to
# ${OUT:-/tmp/mpipe-gpu}. Header-only extras that machine lacks (CLI11, zlib's
# headers) may be carried in .devdata/include.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mpipe-gpu}
mkdir -p "$out"
steps=${MPIPE_GPU_STEPS:-tests snn}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
export MPIPE_SKIP_APT=1 MPIPE_BUILD_DIR=${MPIPE_BUILD_DIR:-build-gpu}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
extra=()
if [ ! -f /usr/include/zlib.h ] && [ -f .devdata/include/zlib.h ]; then
  libz=$(ls /usr/lib/x86_64-linux-gnu/libz.so* /lib/x86_64-linux-gnu/libz.so* 2>/dev/null | head -n 1)
  extra+=("-DZLIB_INCLUDE_DIR=$PWD/.devdata/include" "-DZLIB_LIBRARY=$libz")
fi
status=0
bash scripts/build.sh "-DCMAKE_PREFIX_PATH=$prefix;$PWD/.devdata" "${extra[@]}" > "$out/build.log" 2>&1 \
  || { tail -n 60 "$out/build.log"; exit 1; }
bin=$MPIPE_BUILD_DIR
if [[ " $steps " == *" tests "* ]]; then
  (cd "$bin" && ctest --output-on-failure -j 8) 2>&1 | tee "$out/test.log"
  status=${PIPESTATUS[0]}
  "$bin/tests/mpipe_tests" --gtest_filter='*CUDA*' 2>&1 | tee "$out/cuda-tests.log"
fi
if [[ " $steps " == *" mlp "* ]]; then
  "$bin/examples/pipelined_mlp/pipelined_mlp" 2>&1 | tee "$out/mlp.log"
fi
if [[ " $steps " == *" snn "* ]]; then
  # shellcheck disable=SC2086
  timeout "${MPIPE_SNN_TIMEOUT:-540}" "$bin/examples/snn_fashion_mnist/snn_fashion_mnist" \
    --data .devdata/fashion-mnist --out /tmp/snn_out ${MPIPE_SNN_FLAGS:-} 2>&1 | tee "$out/snn.log"
fi
exit "$status"
