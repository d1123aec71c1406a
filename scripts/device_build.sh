# Sourced by build_arm64.sh and build_android.sh: every device build of composite_runner is
# configured with these options; only the toolchain and where the dependencies come from differ.
#   device_build BUILD_DIR REQUIRED_BACKENDS [more cmake args: toolchain, executorch_DIR, ...]
# REQUIRED_BACKENDS (e.g. "xnnpack;qnn"): configuring fails with one line if ExecuTorch lacks one,
# as it does for any missing kernel library.
# CMake's first error, which it wraps over several lines, as one line.
configure_error() {
  awk '/^CMake Error/ {on = 1; next} on && (/^Call Stack/ || /^$/ && text) {exit} on {sub(/^ +/, ""); text = text (text ? " " : "") $0}
       END {print "error: " (text ? text : "cmake configure failed") " (log: " FILENAME ")"}' "$1" >&2
}

device_build() {
  local build=$1 backends=$2
  shift 2
  local cmake_bin
  cmake_bin=$(python3 -c "import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, 'cmake'))")
  "$cmake_bin" -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCOMPOSITE_BUILD_TESTS=OFF \
    -DCOMPOSITE_REQUIRED_BACKENDS="$backends" "$@" >"$build.configure.log" 2>&1 \
    || { configure_error "$build.configure.log"; exit 1; }
  grep "composite_runner backends" "$build.configure.log" || true
  "$cmake_bin" --build "$build" --target composite_runner -j"$(nproc)" >"$build.build.log" 2>&1 \
    || { tail -50 "$build.build.log" >&2; exit 1; }
}
