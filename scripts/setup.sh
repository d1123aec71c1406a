#!/usr/bin/env bash
# Install everything, then run the main job on the embedded default:
# export it in 6 shards and generate through the host runner.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet -e .

python3 -m composite.export --config configs/default.yaml
python3 -m composite.run --artifacts artifacts --prompt "Once upon a time" --max-new-tokens 32
