#!/usr/bin/env bash
# Times the compilation of one user file (tests/consumer/common/main.cpp, which
# includes <mpipe/mpipe.h> and builds a pipeline) against mpipe::mpipe and
# against mpipe::mpipe_header_only: the median of ${REPS:-3} runs each, no
# ccache, the flags CMake gives (Release). Extra arguments go to CMake, e.g.
# -DCMAKE_PREFIX_PATH=... for another LibTorch.
set -euo pipefail
cd "$(dirname "$0")/.."
reps=${REPS:-3}
work=${MPIPE_COMPILE_TIME_DIR:-build-compile-time}
for mode in compiled header_only; do
  mkdir -p "$work"
  cmake -S tests/consumer/add_subdirectory -B "$work/$mode" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DMPIPE_SOURCE_DIR="$PWD" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
    "$@" > "$work/$mode.configure.log"
  python3 - "$work/$mode/compile_commands.json" "$mode" "$reps" <<'PY'
import json, re, shlex, statistics, subprocess, sys, time
entries, mode, reps = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
e = next(e for e in entries
         if e["file"].endswith("common/main.cpp") and "consumer_%s.dir" % mode in e["command"])
cmd = re.sub(r"^\S*ccache ", "", e["command"])
cmd = re.sub(r" -o \S+", " -o /dev/null", cmd)
cmd = re.sub(r" -M[DT]\b( \S+)?| -MF \S+", "", cmd)
times = []
for _ in range(reps):
    t = time.perf_counter()
    subprocess.run(shlex.split(cmd), cwd=e["directory"], check=True)
    times.append(time.perf_counter() - t)
print("compile time of one user file, %s: median %.1f s of %d (%s)"
      % (mode, statistics.median(times), reps, ", ".join("%.1f" % t for t in times)))
PY
done
