#!/usr/bin/env bash
# On demand (not CI, not a runtime dependency): llama.cpp for the benchmark's second peer.
# PyPI is the only source of llama.cpp here: the llama-cpp-python sdist vendors its whole tree
# (CMake, tools/llama-bench, llama-quantize, convert_hf_to_gguf.py, gguf-py). This fetches that
# sdist, builds llama-bench, llama-quantize, llama-perplexity, llama-lookup and llama-lookahead (the
# guessing peers of docs/benchmark.md, "Several tokens per call"), and prints the folder for
# `python -m composite.bench --llama-cpp DIR` and `scripts/quality_table.py --llama-cpp DIR`
# (default: where this script puts it). JOBS=N builds with N parallel jobs (default: every core).
#
# The build is not -DGGML_NATIVE=ON: on some of these VMs cpuid reports AMX that the VM does not
# allow, and a native build dies with "Illegal instruction" in its Q4_0/Q8_0 paths. The x86
# extensions /proc/cpuinfo lists are switched on one by one instead, and AMX stays off.
set -euo pipefail

VERSION=0.3.36
DEST=${COMPOSITE_LLAMA_CPP:-$HOME/.cache/composite/llama.cpp}
SRC=$DEST/src
BUILD=$DEST/build

targets=(llama-bench llama-quantize llama-perplexity llama-lookup llama-lookahead)
if [[ $(for t in "${targets[@]}"; do [[ -x $BUILD/bin/$t ]] || echo missing; done) == "" ]]; then
  echo "$DEST"
  exit 0
fi
mkdir -p "$DEST"
if [[ ! -f $SRC/convert_hf_to_gguf.py ]]; then
  fetch=$(mktemp -d)
  trap 'rm -rf "$fetch"' EXIT
  # --no-build-isolation: with isolation pip would build CMake from source to read the sdist's
  # metadata; scikit-build-core in a throwaway venv is all it needs.
  python3 -m venv "$fetch/venv"
  "$fetch/venv/bin/pip" install -q scikit-build-core >&2
  "$fetch/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python --no-build-isolation \
    "llama-cpp-python==$VERSION" -d "$fetch" >&2
  tar -xzf "$fetch/llama_cpp_python-$VERSION.tar.gz" -C "$fetch"
  rm -rf "$SRC"
  mv "$fetch/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
fi

flags=(-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
  -DGGML_AMX_BF16=OFF -DCMAKE_BUILD_TYPE=Release)
if [[ $(uname -m) == x86_64 ]]; then
  cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512vbmi:AVX512_VBMI \
    avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
    state=OFF
    [[ $cpu_flags == *" ${pair%%:*} "* ]] && state=ON
    flags+=("-DGGML_${pair##*:}=$state")
  done
fi
cmake -S "$SRC" -B "$BUILD" "${flags[@]}" >&2
cmake --build "$BUILD" --target "${targets[@]}" -j "${JOBS:-$(nproc)}" >&2
echo "$DEST"
