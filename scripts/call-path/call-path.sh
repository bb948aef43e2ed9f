#!/usr/bin/env bash
# Which of mpipe's files one call runs code from, and whether it comes back into
# a file it left (Note [Counting a call's files] in trace.py). Runs train_step
# (1F1B, 8 micro-batches, 4 CPU stages, threaded) and constant_train_step
# (T = 8, time chunk 4) once to warm up, then once traced.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=${MPIPE_CALL_PATH_DIR:-build-call-path}
src=${MPIPE_CALL_PATH_SOURCE:-$PWD}
cmake -S scripts/call-path -B "$work" -G Ninja -DMPIPE_SOURCE_DIR="$src" "$@" > "$work.configure.log"
ninja -C "$work" trace > "$work.build.log"
"$work/trace" "$work"
for call in train_step constant_train_step; do
  python3 scripts/call-path/trace.py "$work/trace" "$work/$call.events" "$call" "$src/include/"
done
