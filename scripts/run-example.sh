#!/usr/bin/env bash
# The main job: installs what is missing, builds mpipe, and trains the spiking
# network of examples/snn_fashion_mnist on Fashion-MNIST: the full run on the
# GPU(s) if there are any, the quick form (a few minutes) on the CPU otherwise.
# Arguments go to the example (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh >&2
example="${MPIPE_BUILD_DIR:-build}/examples/snn_fashion_mnist/snn_fashion_mnist"
[ $# -eq 0 ] && set -- --quick-on-cpu
exec "$example" "$@"
