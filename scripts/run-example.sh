#!/usr/bin/env bash
# The main job: builds mpipe and runs the pipelined-MLP example on the GPU if
# there is one, else on the CPU. Arguments go to the example (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >&2
exec "${MPIPE_BUILD_DIR:-build}/examples/pipelined_mlp/pipelined_mlp" "$@"
