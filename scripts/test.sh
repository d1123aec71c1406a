#!/usr/bin/env bash
# Install test dependencies, build composite_runner and its unit tests, run ctest, then pytest
# (which also runs composite_runner end to end).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet -e '.[test]'
bash scripts/build_runner.sh build

cmake_bin=$(python3 -c "import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, 'ctest'))")
(cd build && "$cmake_bin" --output-on-failure)
python3 -m pytest -q "$@"
