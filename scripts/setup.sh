#!/usr/bin/env bash
# Install everything, build composite_runner, then run the main job on the embedded default:
# export it in 6 shards and generate through the C++ runner (and the Python host runner).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet -e .
bash scripts/build_runner.sh build

python3 -m composite.export --config configs/default.yaml
echo "--- composite_runner (C++)"
./build/composite_runner --artifacts artifacts --prompt "Once upon a time" --max_new_tokens 32 \
  --stats_json artifacts/stats.json 2> >(grep -v "cpuinfo_utils" >&2)
echo "--- composite.run (Python)"
python3 -m composite.run --artifacts artifacts --prompt "Once upon a time" --max-new-tokens 32 \
  2> >(grep -v "cpuinfo_utils" >&2)
