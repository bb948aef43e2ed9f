#!/usr/bin/env bash
# Fills the ignored folder .devdata with what the GPU machine lacks and
# scripts/gpu-check.sh reads: header-only libraries (CLI11, nlohmann-json) and
# zlib's headers, the Fashion-MNIST files, and the reference Python runner.
# Run it here (Debian, after scripts/setup-debian.sh); then name .devdata in
# the device call's carry list.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devdata/include .devdata/fashion-mnist .devdata/seed .devdata/fortunes
cp -r /usr/include/CLI /usr/include/nlohmann .devdata/include/
cp /usr/include/zlib.h /usr/include/zconf.h .devdata/include/
cp /usr/share/datasets/fashion-mnist/*.gz .devdata/fashion-mnist/
# The fortunes text (the transformer example's data), plain files only.
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.*' -exec cp {} .devdata/fortunes/ \;
cp ../shared/seed/*.py .devdata/seed/
# Gloo's headers for c10d's ProcessGroupGloo.hpp (the wheel has none): from a
# snapshot of github.com/pytorch/gloo (GLOO_SRC, a git directory), with the
# config.h its CMake would write for a TCP-only build.
if [ -n "${GLOO_SRC:-}" ]; then
  rm -rf .devdata/include/gloo
  git --git-dir="$GLOO_SRC" archive HEAD gloo | tar -x -C .devdata/include --wildcards '*.h'
  sed -e 's/@GLOO_VERSION_MAJOR@/0/; s/@GLOO_VERSION_MINOR@/5/; s/@GLOO_VERSION_PATCH@/0/' \
      -e 's/#cmakedefine01 GLOO_HAVE_TRANSPORT_TCP$/#define GLOO_HAVE_TRANSPORT_TCP 1/' \
      -e 's/#cmakedefine01 \([A-Z_]*\)/#define \1 0/' \
      .devdata/include/gloo/config.h.in > .devdata/include/gloo/config.h 2>/dev/null \
    || git --git-dir="$GLOO_SRC" show HEAD:gloo/config.h.in | sed \
      -e 's/@GLOO_VERSION_MAJOR@/0/; s/@GLOO_VERSION_MINOR@/5/; s/@GLOO_VERSION_PATCH@/0/' \
      -e 's/#cmakedefine01 GLOO_HAVE_TRANSPORT_TCP$/#define GLOO_HAVE_TRANSPORT_TCP 1/' \
      -e 's/#cmakedefine01 \([A-Z_]*\)/#define \1 0/' > .devdata/include/gloo/config.h
fi
du -sh .devdata
