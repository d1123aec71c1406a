#!/usr/bin/env bash
# Cross-build composite_runner for Android arm64-v8a with XNNPACK and QNN. NOT run on this
# project's CI machines: there is no Android NDK or Qualcomm SDK here (see docs/testing.md, "What is
# verified where"). Same CMake options as scripts/build_arm64.sh (scripts/device_build.sh); only
# the toolchain and the dependency roots differ.
#
# Needs:
#   ANDROID_NDK        the NDK root (r26 or newer)
#   EXECUTORCH_PREFIX  an ExecuTorch install tree built for android-arm64-v8a with the NDK, with
#                      -DEXECUTORCH_BUILD_XNNPACK=ON -DEXECUTORCH_BUILD_QNN=ON
#                      -DEXECUTORCH_BUILD_KERNELS_OPTIMIZED=ON -DEXECUTORCH_BUILD_KERNELS_QUANTIZED=ON
#                      -DEXECUTORCH_BUILD_EXTENSION_MODULE=ON -DEXECUTORCH_BUILD_EXTENSION_TENSOR=ON
#                      -DEXECUTORCH_BUILD_EXTENSION_DATA_LOADER=ON -DQNN_SDK_ROOT=$QNN_SDK_ROOT,
#                      then `cmake --install`
#   ANDROID_DEPS       a prefix holding arm64 builds of sentencepiece, pcre2 and OpenSSL
#                      (with their .pc files under lib/pkgconfig) and nlohmann_json
#   ANDROID_STL        optional, default c++_shared (deploy push then sends the NDK's
#                      libc++_shared.so beside the runner)
# Then: python -m composite.deploy push --artifacts DIR --library-path "$ANDROID_DEPS/lib"
# (with QNN_SDK_ROOT set, for the QNN runtime libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${ANDROID_NDK:?set ANDROID_NDK}" "${EXECUTORCH_PREFIX:?set EXECUTORCH_PREFIX}" "${ANDROID_DEPS:?set ANDROID_DEPS}"

source scripts/device_build.sh
# The NDK's toolchain searches for libraries, headers and packages only under its find-root paths
# (mode ONLY), so the dependency prefixes are added to those; pkg-config reads only their .pc files.
PKG_CONFIG_LIBDIR="$ANDROID_DEPS/lib/pkgconfig" \
device_build build-android "xnnpack;qnn" \
  -DCMAKE_TOOLCHAIN_FILE="$ANDROID_NDK/build/cmake/android.toolchain.cmake" \
  -DANDROID_ABI=arm64-v8a -DANDROID_PLATFORM=android-30 -DANDROID_STL="${ANDROID_STL:-c++_shared}" \
  -DCMAKE_FIND_ROOT_PATH="$ANDROID_DEPS;$EXECUTORCH_PREFIX" \
  -Dexecutorch_DIR="$EXECUTORCH_PREFIX/lib/cmake/ExecuTorch"
echo "built build-android/composite_runner"
