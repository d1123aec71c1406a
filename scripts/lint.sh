#!/usr/bin/env bash
# Lint and format check of the whole tree: ruff (Python, ruff.toml) and clang-format (C++,
# .clang-format). Fails on any violation; `ruff format . && ruff check --fix .` and
# `clang-format -i <files>` fix most. Part of the test command (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v clang-format >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then echo "error: clang-format is missing; run: sudo apt-get install clang-format" >&2; exit 2; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang-format >/dev/null
fi
python3 -m ruff check .
python3 -m ruff format --check .
mapfile -t cpp < <(git ls-files 'runner_cpp/*.cpp' 'runner_cpp/*.h')
clang-format --dry-run --Werror "${cpp[@]}"
echo "lint: ruff and clang-format clean (${#cpp[@]} C++ files)"
