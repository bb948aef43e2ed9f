#!/usr/bin/env bash
# Configures and builds mpipe (library, tests, examples) into ${MPIPE_BUILD_DIR:-build}.
# Extra CMake arguments pass through, e.g. -DCMAKE_PREFIX_PATH=... for another LibTorch.
#
# Which LibTorch: the one named by -DCMAKE_PREFIX_PATH / -DTorch_DIR (arguments)
# or Torch_DIR (environment); else python3's torch when it was built with CUDA
# (so a GPU machine trains on its GPUs); else Debian's libtorch-dev (CPU only),
# installed if missing. MPIPE_TORCH=debian forces the last.
set -euo pipefail
cd "$(dirname "$0")/.."

torch_args=()
if [[ "$*" != *CMAKE_PREFIX_PATH* && "$*" != *Torch_DIR* && -z "${Torch_DIR:-}" &&
      "${MPIPE_TORCH:-auto}" != debian ]]; then
  if prefix=$(python3 -c 'import sys, torch
sys.exit(1) if not torch.version.cuda else print(torch.utils.cmake_prefix_path)' 2>/dev/null); then
    echo "mpipe: using python3's CUDA LibTorch ($prefix)" >&2
    torch_args=("-DCMAKE_PREFIX_PATH=$prefix")
    export MPIPE_SKIP_LIBTORCH_DEB=1
  fi
fi
bash scripts/setup-debian.sh

build=${MPIPE_BUILD_DIR:-build}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "${torch_args[@]}" "$@"
# MPIPE_BUILD_TARGETS (space-separated): build only these targets (and what
# they need), e.g. the one example the first README command runs.
targets=()
for t in ${MPIPE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${targets[@]}"
