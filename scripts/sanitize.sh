#!/usr/bin/env bash
# Builds the CPU test suite with sanitizers and runs it through ctest:
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer (into build-asan), with
#         the tests built header-only (mpipe::mpipe_header_only): CI's two
#         passes run every test in both modes. This pass also compiles each
#         public header on its own (MPIPE_HEADER_CHECK, Note [Header check in
#         CI] in tests/CMakeLists.txt)
#   tsan  ThreadSanitizer, for the threaded runtime (into build-tsan)
# Usage: bash scripts/sanitize.sh [asan] [tsan]      (both when none is named)
# Any report fails the run. LibTorch itself is not instrumented; the few
# suppressions, each justified, are in scripts/sanitizers/ (docs/RELIABILITY.md).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-debian.sh

modes=("$@")
[ ${#modes[@]} -eq 0 ] && modes=(asan tsan)
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
supp="$PWD/scripts/sanitizers"

for mode in "${modes[@]}"; do
  case "$mode" in
    # asan: -O1 -g1 (line tables), as ASan advises; it halves the compile time
    # of the header-only test files, each of which compiles the implementation.
    asan) flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
          mode_args=(-DMPIPE_TESTS_HEADER_ONLY=ON -DMPIPE_HEADER_CHECK=ON
                     "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG") ;;
    tsan) flags="-fsanitize=thread"
          mode_args=(-DMPIPE_TESTS_HEADER_ONLY=OFF -DMPIPE_HEADER_CHECK=OFF "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g -DNDEBUG") ;;
    *) echo "sanitize.sh: unknown mode '$mode' (asan or tsan)" >&2; exit 2 ;;
  esac
  build="build-$mode"
  echo "== $mode: building into $build"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${launcher[@]}" \
    -DMPIPE_BUILD_EXAMPLES=OFF -DMPIPE_BUILD_BENCH=OFF \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" \
    -DCMAKE_SHARED_LINKER_FLAGS="$flags" "${mode_args[@]}"
  # The tests and what ctest runs besides them (mpipe-launch, when CLI11 is there).
  targets=(mpipe_tests)
  for t in mpipe-launch mpipe_dist_tests mpipe_dist_stress mpipe_resume_job mpipe_header_check; do
    grep -q "build $t:" "$build/build.ninja" && targets+=("$t")
  done
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
  echo "== $mode: running the tests"
  (
    cd "$build"
    # libgomp (ATen's intra-op threads) is not instrumented: its barriers
    # would look like races to TSan. One OpenMP thread keeps ATen's kernels on
    # the calling thread; mpipe's own threads are what is under test.
    export OMP_NUM_THREADS=1
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:strict_init_order=1:detect_stack_use_after_return=1:suppressions=$supp/asan.supp"
    export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
    ctest --output-on-failure -j "$((4 * $(nproc)))" --resource-spec-file "$PWD/cpus.json" \
      -E '^consumer\.' --timeout 1200
  )
  echo "== $mode: clean"
done
