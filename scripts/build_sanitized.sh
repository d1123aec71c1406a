#!/usr/bin/env bash
# One clang build with AddressSanitizer + UndefinedBehaviorSanitizer and libFuzzer coverage:
# composite_runner, its unit tests and the fuzz targets. scripts/sanitize.sh and scripts/fuzz.sh
# both use it, so given the same folder the second finds everything built.
# Usage: scripts/build_sanitized.sh build-dir
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: scripts/build_sanitized.sh build-dir}

if ! command -v clang++ >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then echo "error: clang is missing; run: sudo apt-get install clang" >&2; exit 2; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null
fi
CC=clang CXX=clang++ bash scripts/build_runner.sh "$build" -DCOMPOSITE_FUZZ=ON -DCOMPOSITE_SANITIZE=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo
