#!/usr/bin/env bash
# Install test dependencies and the QNN host libraries; check lint and format; build composite_runner, its unit tests and
# the aarch64 runner; run ctest, the sanitizer build and the fuzzers; then pytest (which also runs
# composite_runner end to end, QNN shards and the emulated aarch64 runner included).
set -euo pipefail
cd "$(dirname "$0")/.."

# Each stage's wall time goes to stderr, so a slow CI run says where its minutes went.
stage_started=$SECONDS
stage() {
    echo "[test.sh] $1: $((SECONDS - stage_started)) s (total $SECONDS s)" >&2
    stage_started=$SECONDS
}

python3 -m pip install --quiet -e '.[test]'
stage "install"
bash scripts/lint.sh                  # ruff + clang-format over the whole tree
stage "lint"
python3 -m composite.qnn_host install
stage "qnn host libraries"
bash scripts/build_runner.sh build
stage "build runner"
bash scripts/build_arm64.sh build-arm64   # cross-built runner, run under qemu by tests/test_arm64.py
stage "build aarch64 runner"

# One cache of lowered shards for this run's exports, the sanitizer check's and pytest's (which
# share some: tests/conftest.py); fresh every run.
export COMPOSITE_TEST_SHARD_CACHE="$PWD/build/test-shard-cache"
rm -rf "$COMPOSITE_TEST_SHARD_CACHE"

cmake_bin=$(python3 -c "import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, 'ctest'))")
(cd build && "$cmake_bin" --output-on-failure)
stage "ctest"
COMPOSITE_CACHE="$COMPOSITE_TEST_SHARD_CACHE" bash scripts/sanitize.sh build-sanitized   # unit tests + one generation + bad inputs under ASan/UBSan
stage "sanitizers"
bash scripts/fuzz.sh 5 build-sanitized     # libFuzzer (the same build): manifest, tiktoken, both tokenizers
stage "fuzzers"
# QNN tests run on the HTP simulator: the loader path must be set before the process starts.
eval "$(python3 -m composite.qnn_host env)"
export COMPOSITE_REQUIRE_QNN=1 COMPOSITE_REQUIRE_ARM64=1 COMPOSITE_REQUIRE_RUNNER=1
# Two worker processes, one per core (lowering is mostly single-threaded Python); each test file
# runs in one of them, and the session exports they share are made once (tests/conftest.py).
python3 -m pytest -q -n 2 --dist loadfile --durations=25 "$@"
stage "pytest"
