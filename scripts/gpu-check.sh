#!/usr/bin/env bash
# On a CUDA machine whose LibTorch is python3's torch (the project's GPU machine):
# builds mpipe against it, runs every test (the _CUDA ones included) and the
# example. Logs go to ${OUT:-/tmp/mpipe-gpu}. Header-only extras that machine
# lacks (CLI11) may be carried in .devdata/include.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mpipe-gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
export MPIPE_SKIP_APT=1 MPIPE_BUILD_DIR=${MPIPE_BUILD_DIR:-build-gpu}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
git rev-parse --short HEAD 2>/dev/null | tee "$out/commit.txt"
bash scripts/test.sh "-DCMAKE_PREFIX_PATH=$prefix;$PWD/.devdata" 2>&1 | tee "$out/test.log"
status=${PIPESTATUS[0]}
"$MPIPE_BUILD_DIR/tests/mpipe_tests" --gtest_filter='*CUDA*' 2>&1 | tee "$out/cuda-tests.log"
"$MPIPE_BUILD_DIR/examples/pipelined_mlp/pipelined_mlp" 2>&1 | tee "$out/example.log"
exit "$status"
