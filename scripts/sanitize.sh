#!/usr/bin/env bash
# Build the C++ unit tests and composite_runner with AddressSanitizer + UndefinedBehaviorSanitizer
# (scripts/build_sanitized.sh), run the unit tests, one end-to-end generation and a few bad inputs
# under them. Any sanitizer report fails the script. Usage: scripts/sanitize.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-sanitized}
bash scripts/build_sanitized.sh "$build"

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
"$build/composite_unit_tests" --gtest_brief=1

artifacts="$build/artifacts"
# The tests' 3-shard default (tests/conftest.py: MAX_SEQ_LEN, PREFILL_LEN): scripts/test.sh gives both one shard cache.
python3 -m composite.export --shards 3 --max-seq-len 96 --prefill-len 12 --output "$artifacts" >/dev/null
"$build/composite_runner" --artifacts "$artifacts" --prompt "Once upon a time" --max_new_tokens 32 \
  --temperature 0.8 --top_p 0.9 --seed 3 --stats_json "$build/stats.json" --verify >/dev/null
# Past the context of 96: shifts of the cache (moves and re-rotations) under the sanitizers.
"$build/composite_runner" --artifacts "$artifacts" --prompt "Once upon a time" --max_new_tokens 200 --evict 30 >/dev/null
# A chat of three turns whose last one no longer fits: the cache carried between turns, the end.
printf 'Hi.\n\nMore </s> now.\n%s\n' "$(printf 'word %.0s' $(seq 100))" |
  "$build/composite_runner" --artifacts "$artifacts" --chat --max_new_tokens 4 >/dev/null 2>&1

# Bad input must end in a clean error (exit 2), never in a sanitizer report (which aborts).
expect_clean_error() {
  local status=0
  "$build/composite_runner" "$@" >/dev/null 2>"$build/stderr.txt" || status=$?
  if [ "$status" -ne 2 ]; then
    echo "error: composite_runner $* exited with $status under the sanitizers:" >&2
    cat "$build/stderr.txt" >&2
    exit 1
  fi
}
expect_clean_error --artifacts "$build/missing" --prompt hi
expect_clean_error --artifacts "$artifacts" --prompt ""
expect_clean_error --artifacts "$artifacts" --prompt_ids 1,x
expect_clean_error --artifacts "$artifacts" --prompt hi --seq_len 100000 --no_context_shift
expect_clean_error --artifacts "$artifacts" --prompt hi --evict 0
rm -rf "$build/broken"  # a rerun must not nest the copy inside the old one
cp -r "$artifacts" "$build/broken"
head -c 1000 "$artifacts/shard_01.pte" >"$build/broken/shard_01.pte"
expect_clean_error --artifacts "$build/broken" --prompt hi
echo '{"format": "composite-manifest", "shards": [' >"$build/broken/manifest.json"
expect_clean_error --artifacts "$build/broken" --prompt hi
echo "sanitizers: unit tests, generation and bad inputs clean"
