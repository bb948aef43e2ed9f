#!/usr/bin/env bash
# Builds mpipe and runs every test through ctest. GPU tests (_CUDA, _MultiCUDA)
# skip themselves where the GPUs are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
cd "${MPIPE_BUILD_DIR:-build}"
# Up to eight tests per core side by side, each holding its CPU slots (Note
# [CPU slots], CMakeLists.txt); the fault drills, which sleep, hold none.
ctest --output-on-failure -j "$((8 * $(nproc)))" --resource-spec-file "$PWD/cpus.json"
