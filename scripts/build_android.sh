#!/usr/bin/env bash
# Cross-build composite_runner for Android arm64-v8a. NOT run on this project's CI machines:
# there is no Android NDK or Qualcomm SDK here (see README, "What is verified where").
#
# Needs:
#   ANDROID_NDK        the NDK root (r26 or newer)
#   EXECUTORCH_PREFIX  an ExecuTorch install tree built for android-arm64-v8a with the NDK, with
#                      -DEXECUTORCH_BUILD_XNNPACK=ON -DEXECUTORCH_BUILD_QNN=ON
#                      -DEXECUTORCH_BUILD_EXTENSION_MODULE=ON -DEXECUTORCH_BUILD_EXTENSION_TENSOR=ON
#                      -DQNN_SDK_ROOT=$QNN_SDK_ROOT, then `cmake --install`
#   ANDROID_DEPS       a prefix holding arm64 builds of sentencepiece, pcre2 and OpenSSL
#                      (with their .pc files under lib/pkgconfig) and nlohmann_json
#   QNN_SDK_ROOT       the Qualcomm AI Engine Direct SDK (its runtime libraries go to the phone)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${ANDROID_NDK:?set ANDROID_NDK}" "${EXECUTORCH_PREFIX:?set EXECUTORCH_PREFIX}" "${ANDROID_DEPS:?set ANDROID_DEPS}"

export PKG_CONFIG_LIBDIR="$ANDROID_DEPS/lib/pkgconfig"
cmake -S . -B build-android \
  -DCMAKE_TOOLCHAIN_FILE="$ANDROID_NDK/build/cmake/android.toolchain.cmake" \
  -DANDROID_ABI=arm64-v8a -DANDROID_PLATFORM=android-30 -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$EXECUTORCH_PREFIX;$ANDROID_DEPS" \
  -DCMAKE_FIND_ROOT_PATH_MODE_PACKAGE=BOTH \
  -DCOMPOSITE_BUILD_TESTS=OFF
cmake --build build-android -j"$(nproc)" --target composite_runner
echo "built build-android/composite_runner"
