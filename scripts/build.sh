#!/usr/bin/env bash
# Configures and builds mpipe (library, tests, examples) into ${MPIPE_BUILD_DIR:-build}.
# Extra CMake arguments pass through, e.g. -DCMAKE_PREFIX_PATH=... for another LibTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-debian.sh

build=${MPIPE_BUILD_DIR:-build}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "$@"
cmake --build "$build" -j "$(nproc)"
