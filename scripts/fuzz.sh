#!/usr/bin/env bash
# Build the libFuzzer targets with clang + ASan/UBSan (scripts/build_sanitized.sh) and run each for
# a bounded time from its seed corpus in tests/fuzz/<target>/ (inputs found during the run go to the build tree, not the repo).
# A crash fails the script and leaves the input in <build>/crashes/; fix the bug and add the input
# to the seed corpus as a regression test. Usage: scripts/fuzz.sh [seconds-per-target] [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
build=${2:-build-sanitized}

bash scripts/build_sanitized.sh "$build" >/dev/null

# Valid tokenizers for the text fuzzer: the embedded default's SentencePiece model and a small
# tiktoken ranks file, both made from the package's corpus, and the tokenizer.json seed.
python3 - "$build" <<'PY'
import base64, sys
from pathlib import Path
from composite.model.default import DEFAULT_ARGS, corpus_text
from composite.tokenizer import train_sentencepiece
build = Path(sys.argv[1])
(build / "fuzz_sentencepiece.model").write_bytes(train_sentencepiece(corpus_text(), DEFAULT_ARGS.vocab_size))
pieces = [bytes([b]) for b in range(256)] + sorted({w.encode() for w in corpus_text().split() if len(w) > 1})[:256]
(build / "fuzz_tiktoken.model").write_text("".join(f"{base64.b64encode(p).decode()} {i}\n" for i, p in enumerate(pieces)))
PY
export COMPOSITE_FUZZ_SENTENCEPIECE="$build/fuzz_sentencepiece.model" COMPOSITE_FUZZ_TIKTOKEN="$build/fuzz_tiktoken.model"
export COMPOSITE_FUZZ_HF_JSON="tests/fuzz/fuzz_hf_json_load/llama3_style.json"
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

mkdir -p "$build/crashes"
for fuzzer in fuzz_manifest fuzz_tiktoken_load fuzz_hf_json_load fuzz_tokenizer_text; do
  corpus="$build/corpus/$fuzzer"
  mkdir -p "$corpus"
  "$build/$fuzzer" -max_total_time="$seconds" -print_final_stats=0 -artifact_prefix="$build/crashes/$fuzzer-" \
    "$corpus" "tests/fuzz/$fuzzer" >"$build/$fuzzer.log" 2>&1 \
    || { echo "error: $fuzzer found a crash (input in $build/crashes/):" >&2; tail -40 "$build/$fuzzer.log" >&2; exit 1; }
  echo "$fuzzer: $(grep -oE 'Done [0-9]+ runs' "$build/$fuzzer.log" | tail -1) in ${seconds}s, no crash"
done
