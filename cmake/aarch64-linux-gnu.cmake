# Cross-compiling for aarch64 Linux with Debian's g++-aarch64-linux-gnu. Target libraries come
# from Debian's arm64 multiarch packages (/usr/lib/aarch64-linux-gnu) and ExecuTorch from the
# unpacked aarch64 wheel (passed as executorch_DIR). Used by scripts/build_arm64.sh.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# COMPOSITE_ARM64_SYSROOT: arm64 packages unpacked by the build script (SentencePiece), searched
# first; find_library re-roots the .pc files' /usr/lib/aarch64-linux-gnu under it.
set(CMAKE_FIND_ROOT_PATH ${COMPOSITE_ARM64_SYSROOT} /usr/aarch64-linux-gnu /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
# pkg-config must describe the arm64 packages, never the host's (the build script sets this
# before configuring; the default covers a plain cmake invocation).
if(NOT DEFINED ENV{PKG_CONFIG_LIBDIR})
  set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
endif()
