#!/usr/bin/env bash
# Builds mpipe and runs every test through ctest. GPU tests (_CUDA, _MultiCUDA)
# skip themselves where the GPUs are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
cd "${MPIPE_BUILD_DIR:-build}"
ctest --output-on-failure -j "$(nproc)"
