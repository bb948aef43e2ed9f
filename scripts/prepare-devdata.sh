#!/usr/bin/env bash
# Fills the ignored folder .devdata with what the GPU machine lacks and
# scripts/gpu-check.sh reads: header-only libraries (CLI11, nlohmann-json) and
# zlib's headers, the Fashion-MNIST files, and the reference Python runner.
# Run it here (Debian, after scripts/setup-debian.sh); then name .devdata in
# the device call's carry list.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devdata/include .devdata/fashion-mnist .devdata/seed
cp -r /usr/include/CLI /usr/include/nlohmann .devdata/include/
cp /usr/include/zlib.h /usr/include/zconf.h .devdata/include/
cp /usr/share/datasets/fashion-mnist/*.gz .devdata/fashion-mnist/
cp ../shared/seed/*.py .devdata/seed/
du -sh .devdata
