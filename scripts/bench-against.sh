#!/usr/bin/env bash
# On the GPU machine: the benchmark of this tree against an earlier commit's,
# in one device run. The earlier tree is a git worktree in the ignored folder
# ${MPIPE_BASE_DIR:-.base} (git worktree add --detach .base <commit>), carried
# with the call beside .devdata. Builds both (mpipe_bench only), then runs
# base, this tree, base, this tree (two separate runs each, interleaved so
# that drift hits both alike), and the reference class's bench_seed.py once.
# Workloads: MPIPE_BENCH_ONLY (default: the four of
# ../shared/notes/benchmark-workloads.md). JSON and compare tables go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/mpipe-bench}
base=${MPIPE_BASE_DIR:-.base}
only=${MPIPE_BENCH_ONLY:-narrow-mlp,wide-mlp,snn-1024,snn-256}
mkdir -p "$out"
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
build() {  # source dir, build dir
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_PREFIX_PATH=$prefix;$PWD/.devdata" > "$out/configure-$(basename "$2").log" 2>&1 &&
    cmake --build "$2" --target mpipe_bench > "$out/build-$(basename "$2").log" 2>&1 ||
    { tail -n 40 "$out/build-$(basename "$2").log" "$out/configure-$(basename "$2").log"; exit 1; }
}
build "$base" /tmp/build-base
build . /tmp/build-current
for run in 1 2; do
  for tree in base current; do
    echo "== $tree, run $run"
    /tmp/build-$tree/bench/mpipe_bench --only "$only" --json "$out/$tree-$run.json" ${MPIPE_BENCH_ARGS:-} \
      > "$out/$tree-$run.log" 2>&1 || { tail -n 20 "$out/$tree-$run.log"; exit 1; }
  done
done
PYTHONUNBUFFERED=1 python3 .devdata/seed/bench_seed.py --json "$out/seed.json" > "$out/seed.log" 2>&1
for run in 1 2; do
  for tree in base current; do
    python3 bench/compare.py "$out/$tree-$run.json" "$out/seed.json" > "$out/compare-$tree-$run.md"
  done
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def rows(path):  # every mpipe_* timing of every workload
    w = json.load(open(path))["workloads"]
    return {f"{name}/{k}": v for name, r in w.items() for k, v in r.items()
            if k.startswith("mpipe") and k.endswith("_ms") and isinstance(v, (int, float))}
for run in (1, 2):
    b, c = rows(f"{out}/base-{run}.json"), rows(f"{out}/current-{run}.json")
    print(f"run {run}: row, base ms, current ms, current/base")
    for k in sorted(b):
        if k in c and b[k] and c[k]:
            print(f"  {k}: {b[k]:.3f} {c[k]:.3f} {c[k] / b[k]:.3f}")
PY
