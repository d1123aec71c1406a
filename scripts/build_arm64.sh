#!/usr/bin/env bash
# Cross-build composite_runner for aarch64 Linux (XNNPACK; the aarch64 executorch wheel has no QNN
# backend) and leave it runnable under qemu-user:
#   qemu-aarch64-static -L /usr/aarch64-linux-gnu build-arm64/composite_runner --artifacts ...
# Usage: scripts/build_arm64.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-arm64}
mkdir -p "$build"

# Target libraries are Debian's arm64 packages. libc, libstdc++, PCRE2 and OpenSSL install
# side by side with the host's (multiarch); SentencePiece does not (installing :arm64 would remove
# the host's), so its two arm64 packages are unpacked into the build tree instead.
arm64_packages=(libc6:arm64 libstdc++6:arm64 libpcre2-dev:arm64 libssl-dev:arm64)
need=()
command -v aarch64-linux-gnu-g++ >/dev/null || need+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
[ -f /usr/include/nlohmann/json.hpp ] || need+=(nlohmann-json3-dev)
[ -f /usr/include/sentencepiece_processor.h ] || need+=(libsentencepiece-dev)
for package in "${arm64_packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || need+=("$package")
done
sysroot="$(realpath "$build")/sysroot"
if [ ${#need[@]} -gt 0 ] || [ ! -e "$sysroot/usr/lib/aarch64-linux-gnu/libsentencepiece.so" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "error: missing packages; run as root, or: sudo dpkg --add-architecture arm64 && sudo apt-get update" \
         "&& sudo apt-get install ${need[*]}" >&2
    exit 2
  fi
  dpkg --add-architecture arm64
  apt-get update -qq
  [ ${#need[@]} -eq 0 ] || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  rm -rf "$build/debs" "$sysroot"
  mkdir -p "$build/debs" "$sysroot"
  (cd "$build/debs" && apt-get download -qq libsentencepiece0:arm64 libsentencepiece-dev:arm64)
  for deb in "$build"/debs/*.deb; do dpkg-deb -x "$deb" "$sysroot"; done
fi

# ExecuTorch for aarch64: the same release as the host's, from its PyPI wheel, unpacked (not installed).
version=$(python3 -c "import importlib.metadata as m; print(m.version('executorch'))")
et_root="$build/executorch-$version-aarch64"
if [ ! -f "$et_root/executorch/share/cmake/executorch-config.cmake" ]; then
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_aarch64 "executorch==$version" -d "$build/wheels" 2> >(grep -v "^WARNING" >&2)
  rm -rf "$et_root.partial"
  python3 -m zipfile -e "$build"/wheels/executorch-"$version"-*aarch64*.whl "$et_root.partial"
  mv "$et_root.partial" "$et_root"
fi

source scripts/device_build.sh
PKG_CONFIG_LIBDIR="$sysroot/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig" \
device_build "$build" xnnpack -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
  -Dexecutorch_DIR="$(realpath "$et_root")/executorch/share/cmake" \
  -DCOMPOSITE_ARM64_SYSROOT="$sysroot" -DCMAKE_BUILD_RPATH="$sysroot/usr/lib/aarch64-linux-gnu"
echo "built $build/composite_runner (aarch64)"
