#!/usr/bin/env bash
# Build composite_runner (and its unit tests) on the host against the executorch pip wheel.
# Usage: scripts/build_runner.sh [build-dir] [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shift || true

need=()
for header in /usr/include/nlohmann/json.hpp /usr/include/sentencepiece_processor.h /usr/include/pcre2.h \
              /usr/include/openssl/evp.h /usr/include/gtest/gtest.h; do
  [ -f "$header" ] || need=(nlohmann-json3-dev libsentencepiece-dev libpcre2-dev libssl-dev libgtest-dev pkg-config)
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: missing C++ packages; run: sudo apt-get install ${need[*]}" >&2
    exit 2
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

cmake_bin=$(python3 -c "import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, 'cmake'))")
et_dir=$(python3 -c "import executorch, os; print(os.path.join(list(executorch.__path__)[0], 'share', 'cmake'))")
"$cmake_bin" -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -Dexecutorch_DIR="$et_dir" "$@" >"$build.configure.log" 2>&1 \
  || { cat "$build.configure.log" >&2; exit 1; }
grep "composite_runner backends" "$build.configure.log" || true
"$cmake_bin" --build "$build" -j"$(nproc)" >"$build.build.log" 2>&1 || { tail -50 "$build.build.log" >&2; exit 1; }
echo "built $build/composite_runner"
