#!/usr/bin/env bash
# The main job: installs what is missing, builds libmpipe and the example
# only (not the tests or the benchmark), and trains the spiking network of
# examples/snn_fashion_mnist on Fashion-MNIST: the full run on the GPU(s) if
# there are any, the quick form on the CPU otherwise. Its output goes to
# snn_fashion_mnist_out/ (git ignores it). Arguments go to the example (try
# --help).
set -euo pipefail
cd "$(dirname "$0")/.."
MPIPE_BUILD_TARGETS=${MPIPE_BUILD_TARGETS:-snn_fashion_mnist} bash scripts/build.sh >&2
example="${MPIPE_BUILD_DIR:-build}/examples/snn_fashion_mnist/snn_fashion_mnist"
[ $# -eq 0 ] && set -- --quick-on-cpu
exec "$example" "$@"
