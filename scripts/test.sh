#!/usr/bin/env bash
# Install test dependencies and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet -e '.[test]'

python3 -m pytest -q "$@"
