#!/usr/bin/env bash
# Installs what mpipe's build, tests and examples need on Debian 12, if missing.
# Skipped when MPIPE_SKIP_APT=1 (e.g. on a machine that brings its own LibTorch).
set -euo pipefail

[ "${MPIPE_SKIP_APT:-0}" = 1 ] && exit 0

packages=(cmake ninja-build g++ ccache libgtest-dev libbenchmark-dev
          libcli11-dev nlohmann-json3-dev zlib1g-dev libexpat1-dev dataset-fashion-mnist fortunes doxygen
          python3)
# Debian's LibTorch (CPU only), unless the build uses another one (scripts/build.sh).
[ "${MPIPE_SKIP_LIBTORCH_DEB:-0}" = 1 ] || packages+=(libtorch-dev libgloo-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "mpipe: installing ${missing[*]}"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
$sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
