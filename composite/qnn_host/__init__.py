"""The QNN host libraries that lower QNN shards and run them on the x86 HTP simulator.

Two sources, in this order:
- `QNN_SDK_ROOT` naming a Qualcomm SDK (its `lib/x86_64-linux-clang`);
- the `onnxruntime-qnn` wheel (installed with `--no-deps`; only its .so files are used, under
  Qualcomm's license), which carries newer QNN libraries than the 2.37 ExecuTorch 1.5.1 was built
  against. A small C library (`htp_abi_shim.c`, compiled here on first use) bridges the one ABI
  difference that matters; see that file.

Either way an SDK-shaped folder is laid out under the cache directory with the shim standing in
for libQnnHtp.so, because ExecuTorch looks for `$QNN_SDK_ROOT/lib/x86_64-linux-clang` and loads
"libQnnHtp.so" by name. The dynamic loader reads LD_LIBRARY_PATH only at process start, so a
process that needs QNN re-executes itself once with the environment this module computes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from composite.errors import UserError

# QNN library build ids this project lowered and ran shards with; anything else is refused by
# name (set COMPOSITE_QNN_ALLOW_UNVERIFIED=1 to try one anyway).
VERIFIED_BUILD_IDS = {
    "v2.51.0.260929181845": "onnxruntime-qnn 2.7.0",
}
ONNXRUNTIME_QNN_PIN = "onnxruntime-qnn==2.7.0"
INSTALL_HINT = (
    f"install the QNN host libraries with `pip install --no-deps {ONNXRUNTIME_QNN_PIN}` "
    "or point QNN_SDK_ROOT at a Qualcomm AI Engine Direct SDK"
)
SHIM_SOURCE = Path(__file__).with_name("htp_abi_shim.c")
LAYOUT_HEADER = Path(__file__).with_name("qnn_interface_layout.h")


def interface_layout() -> dict[str, int]:
    """The QNN ABI positions written once in qnn_interface_layout.h (the C side includes it)."""
    return {
        name: int(value) for name, value in re.findall(r"#define (COMPOSITE_QNN_\w+) (\d+)", LAYOUT_HEADER.read_text())
    }


HOST_LIB_SUBDIR = Path("lib") / "x86_64-linux-clang"
ACTIVE_MARKER = "COMPOSITE_QNN_HOST"  # set in the environment of a process whose loader path is ready
REAL_HTP_VARIABLE = "COMPOSITE_QNN_REAL_HTP"  # the shim loads the real libQnnHtp.so from this path


@dataclass(frozen=True)
class QnnHost:
    root: Path  # the SDK-shaped folder (QNN_SDK_ROOT for ExecuTorch)
    real_htp: Path  # the real libQnnHtp.so the shim forwards to
    search_dirs: tuple[Path, ...]  # where the real library finds its siblings
    build_id: str
    source: str

    @property
    def lib_dir(self) -> Path:
        return self.root / HOST_LIB_SUBDIR

    def environment(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        previous = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        ours = [str(self.lib_dir), *map(str, self.search_dirs)]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(ours + [p for p in previous if p not in ours])
        env["QNN_SDK_ROOT"] = str(self.root)
        env[REAL_HTP_VARIABLE] = str(self.real_htp)
        env[ACTIVE_MARKER] = str(self.root)
        return env


def _source_libraries() -> tuple[Path, tuple[Path, ...], str]:
    """(real libQnnHtp.so, directories its siblings live in, description)."""
    sdk = os.environ.get("QNN_SDK_ROOT")
    if sdk and not os.environ.get(ACTIVE_MARKER):
        lib_dir = Path(sdk) / HOST_LIB_SUBDIR
        if not (lib_dir / "libQnnHtp.so").is_file():
            raise UserError(f"QNN_SDK_ROOT={sdk} has no {HOST_LIB_SUBDIR}/libQnnHtp.so; {INSTALL_HINT}")
        return lib_dir / "libQnnHtp.so", (lib_dir,), f"QNN SDK at {sdk}"
    try:
        distribution = importlib.metadata.distribution("onnxruntime-qnn")
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"no QNN host libraries found: {INSTALL_HINT}") from None
    package = Path(distribution.locate_file("onnxruntime_qnn"))
    real = package / "libQnnHtp.so"
    if not real.is_file():
        raise UserError(f"onnxruntime-qnn {distribution.version} has no libQnnHtp.so at {real}; {INSTALL_HINT}")
    return real, (package, package.parent / "onnxruntime_qnn.libs"), f"onnxruntime-qnn {distribution.version}"


@functools.cache
def read_build_id(real_htp: Path) -> str:
    """Ask the library itself (QnnInterface_getProviders → backendGetBuildId), once per process and
    library, in a child process: once the real library is loaded under its soname, a later
    dlopen("libQnnHtp.so") in the same process would get it instead of the shim."""
    layout = interface_layout()
    slot = layout["COMPOSITE_QNN_FUNCTION_TABLE_OFFSET"] + 8 * layout["COMPOSITE_QNN_BACKEND_GET_BUILD_ID_INDEX"]
    result = subprocess.run(
        [sys.executable, "-c", _BUILD_ID_PROBE, str(real_htp), str(slot)], capture_output=True, text=True
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("build-id ")]
    if result.returncode != 0 or not lines:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"cannot read the QNN build id of {real_htp}: {detail}")
    return lines[-1].split(" ", 1)[1]


_BUILD_ID_PROBE = """
import ctypes, sys
library = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)
providers = ctypes.POINTER(ctypes.c_void_p)()
count = ctypes.c_uint32()
if library.QnnInterface_getProviders(ctypes.byref(providers), ctypes.byref(count)) != 0 or count.value == 0:
    sys.exit("no QNN interface provider")
# argv[2]: the byte offset of backendGetBuildId in a QnnInterface_t (qnn_interface_layout.h)
function = ctypes.c_void_p.from_address(providers[0] + int(sys.argv[2])).value
get_build_id = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.POINTER(ctypes.c_char_p))(function)
build_id = ctypes.c_char_p()
if get_build_id(ctypes.byref(build_id)) != 0 or not build_id.value:
    sys.exit("no build id reported")
print("build-id", build_id.value.decode())
"""


def build_id_in_file(library: Path) -> str | None:
    """The QNN build id ("v2.51.0.260929181845") a libQnnHtp.so of any architecture carries in its
    bytes (read, not loaded: an Android library cannot run here), or None unless exactly one."""
    found = set(re.findall(rb"v\d+\.\d+\.\d+\.\d{6,}", library.read_bytes()))
    return found.pop().decode() if len(found) == 1 else None


def cache_dir() -> Path:
    base = os.environ.get("COMPOSITE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "composite"
    )
    return Path(base)


def _compile_shim(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise UserError("no C compiler found to build the QNN ABI shim: install gcc (apt-get install gcc)")
    partial = target.with_suffix(".partial")
    command = [
        compiler,
        f"-I{LAYOUT_HEADER.parent}",
        "-O2",
        "-shared",
        "-fPIC",
        "-o",
        str(partial),
        str(SHIM_SOURCE),
        "-ldl",
        "-Wl,-z,nodelete",
        "-Wl,-soname,libQnnHtp.so",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"compiling the QNN ABI shim failed: {result.stderr.strip().splitlines()[-1:]}")
    partial.replace(target)


def prepare() -> QnnHost:
    """Find the libraries, check their build id, lay out the SDK-shaped folder. Idempotent."""
    real_htp, search_dirs, source = _source_libraries()
    build_id = read_build_id(real_htp)
    if build_id not in VERIFIED_BUILD_IDS and os.environ.get("COMPOSITE_QNN_ALLOW_UNVERIFIED") != "1":
        verified = ", ".join(f"{b} ({s})" for b, s in VERIFIED_BUILD_IDS.items())
        raise UserError(
            f"QNN host libraries {build_id} from {source} are not verified with composite "
            f"(verified: {verified}); install {ONNXRUNTIME_QNN_PIN} or set COMPOSITE_QNN_ALLOW_UNVERIFIED=1"
        )
    shim_digest = hashlib.sha256(SHIM_SOURCE.read_bytes() + LAYOUT_HEADER.read_bytes()).hexdigest()[:12]
    location = hashlib.sha256(str(real_htp.resolve()).encode()).hexdigest()[:8]
    root = cache_dir() / "qnn-host" / f"{build_id}-{location}-{shim_digest}"
    lib_dir = root / HOST_LIB_SUBDIR
    if not (lib_dir / "libQnnHtp.so").is_file():
        lib_dir.mkdir(parents=True, exist_ok=True)
        for sibling in real_htp.parent.glob("*.so"):
            link = lib_dir / sibling.name
            if sibling.name != "libQnnHtp.so" and not link.exists():
                link.symlink_to(sibling)
        _compile_shim(lib_dir / "libQnnHtp.so")
    return QnnHost(root, real_htp, search_dirs, build_id, source)


def is_active(host: QnnHost) -> bool:
    return os.environ.get(ACTIVE_MARKER) == str(host.root) and os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)[
        0
    ] == str(host.lib_dir)


def activate() -> QnnHost:
    """Make this process able to use QNN. A composite CLI (`python -m composite.…`) re-executes
    itself once with the loader path set; any other process must have been started with it."""
    host = prepare()
    if is_active(host):
        return host
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main_spec is None or not main_spec.name.startswith("composite."):
        raise UserError(
            "QNN host libraries are not on this process's loader path: start it after "
            '`eval "$(python -m composite.qnn_host env)"`'
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], host.environment())


def main(argv: list[str] | None = None) -> None:
    """`python -m composite.qnn_host [install|env|check]`: install the pinned host libraries (unless
    QNN_SDK_ROOT names an SDK), print shell exports for this machine, or a one-line status."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m composite.qnn_host", description=main.__doc__)
    parser.add_argument("action", choices=["install", "env", "check"], nargs="?", default="check")
    args = parser.parse_args(argv)
    if args.action == "install" and not os.environ.get("QNN_SDK_ROOT"):
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", ONNXRUNTIME_QNN_PIN]
        if subprocess.run(command).returncode != 0:
            raise UserError(f"pip could not install {ONNXRUNTIME_QNN_PIN}")
    host = prepare()
    if args.action == "env":
        env = host.environment()
        for key in ("QNN_SDK_ROOT", "LD_LIBRARY_PATH", REAL_HTP_VARIABLE, ACTIVE_MARKER):
            print(f"export {key}='{env[key]}'")
    else:
        print(f"QNN host libraries {host.build_id} from {host.source}; SDK-shaped folder {host.root}", file=sys.stderr)
