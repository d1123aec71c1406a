#!/usr/bin/env bash
# Install everything, build composite_runner, then run the main job on the embedded default:
# export it in 6 shards (XNNPACK, 4 x QNN HTP fp16, XNNPACK) and generate through the C++ runner
# and the Python host runner; the QNN shards run on the x86 HTP simulator.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet -e .
python3 -m composite.qnn_host install   # onnxruntime-qnn's QNN host libraries, unless QNN_SDK_ROOT is set
bash scripts/build_runner.sh build

# The CLIs keep the QNN libraries' routine log lines off the terminal themselves (--verbose shows them).
# --no-weight-sharing: the host twin; the x86 HTP simulator cannot load weight-shared QNN shards.
python3 -m composite.export --config configs/default.yaml --no-weight-sharing
echo "--- composite_runner (C++)"
eval "$(python3 -m composite.qnn_host env)"
./build/composite_runner --artifacts artifacts --prompt "Once upon a time" --max_new_tokens 32 \
  --stats_json artifacts/stats.json
echo "--- composite.run (Python)"
python3 -m composite.run --artifacts artifacts --prompt "Once upon a time" --max-new-tokens 32
