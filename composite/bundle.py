"""What composite_runner needs on the device besides itself: the shared libraries it links.

The runner's ELF names its libraries (DT_NEEDED), each of those names more, and so on. Every
library in that closure that is not part of the target's own system (Android: bionic and the NDK's
stable system libraries; Linux: glibc and the GCC runtime) is found on this machine and pushed
beside the runner, where its RUNPATH `$ORIGIN` finds it on the device.

Where a library is looked for, in order: the folders given with --library-path, the RUNPATH/RPATH
of the ELF that needs it (`$ORIGIN` meaning that ELF's own folder; the build records where it found
each library there), then the target's default library folders on this machine (Debian multiarch
for Linux targets; the NDK sysroot for Android when ANDROID_NDK is set).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

from composite.errors import UserError

# Present on every device of the kind; never pushed.
GLIBC_RUNTIME = (
    "ld-linux",
    "libc.so",
    "libm.so",
    "libdl.so",
    "libpthread.so",
    "librt.so",
    "libutil.so",
    "libresolv.so",
    "libstdc++.so",
    "libgcc_s.so",
)
ANDROID_SYSTEM = {
    f"{name}.so"
    for name in (
        "libc",
        "libm",
        "libdl",
        "liblog",
        "libandroid",
        "libz",
        "libEGL",
        "libGLESv1_CM",
        "libGLESv2",
        "libGLESv3",
        "libjnigraphics",
        "libOpenSLES",
        "libOpenMAXAL",
        "libvulkan",
        "libnativewindow",
        "libmediandk",
        "libcamera2ndk",
        "libneuralnetworks",
        "libsync",
        "libaaudio",
        "libamidi",
        "libbinder_ndk",
        "libicu",
        "libcdsprpc",
    )
}
MULTIARCH = {"EM_X86_64": "x86_64-linux-gnu", "EM_AARCH64": "aarch64-linux-gnu"}
NDK_TRIPLE = {"EM_AARCH64": "aarch64-linux-android", "EM_X86_64": "x86_64-linux-android"}


@dataclass(frozen=True)
class ElfInfo:
    path: Path
    machine: str  # e.g. EM_AARCH64
    android: bool
    needed: tuple[str, ...]
    search_path: tuple[str, ...]  # RUNPATH (or RPATH) entries as written


def read_elf(path: Path) -> ElfInfo:
    try:
        with open(path, "rb") as f:
            elf = ELFFile(f)
            interpreter = ""
            for segment in elf.iter_segments():
                if segment["p_type"] == "PT_INTERP":
                    interpreter = segment.get_interp_name()
            needed, search = [], []
            android = interpreter.startswith("/system/") or elf.get_section_by_name(".note.android.ident") is not None
            for section in elf.iter_sections():
                if not isinstance(section, DynamicSection):
                    continue
                for tag in section.iter_tags():
                    if tag.entry.d_tag == "DT_NEEDED":
                        needed.append(tag.needed)
                    elif tag.entry.d_tag == "DT_RUNPATH":
                        search = tag.runpath.split(":")
                    elif tag.entry.d_tag == "DT_RPATH" and not search:
                        search = tag.rpath.split(":")
            return ElfInfo(path, elf["e_machine"], android, tuple(needed), tuple(s for s in search if s))
    except FileNotFoundError:
        raise UserError(f"runner binary {path} not found") from None
    except (ELFError, OSError) as e:
        raise UserError(f"{path} is not a readable ELF binary: {e}") from None


def is_system_library(name: str, android: bool) -> bool:
    if android:
        return name in ANDROID_SYSTEM
    return name.startswith(GLIBC_RUNTIME)


def default_dirs(runner: ElfInfo) -> list[Path]:
    if runner.android:
        ndk = os.environ.get("ANDROID_NDK")
        triple = NDK_TRIPLE.get(runner.machine)
        if not ndk or not triple:
            return []
        return sorted(Path(ndk).glob(f"toolchains/llvm/prebuilt/*/sysroot/usr/lib/{triple}"))
    arch = MULTIARCH.get(runner.machine)
    return [Path(f"/usr/lib/{arch}"), Path(f"/lib/{arch}")] if arch else []


def library_closure(runner_path: Path, library_path: list[Path] = ()) -> list[Path]:
    """Every non-system shared library the runner loads at start-up, as files on this machine."""
    runner = read_elf(runner_path)
    fallback = default_dirs(runner)
    found: dict[str, Path] = {}
    queue = [runner]
    while queue:
        elf = queue.pop()
        origin = str(elf.path.resolve().parent)
        dirs = [
            *library_path,
            *(Path(d.replace("$ORIGIN", origin).replace("${ORIGIN}", origin)) for d in elf.search_path),
            *fallback,
        ]
        for name in elf.needed:
            if name in found or is_system_library(name, runner.android):
                continue
            location = next((d / name for d in dirs if (d / name).is_file()), None)
            if location is None:
                where = ", ".join(str(d) for d in dirs) or "nowhere"
                raise UserError(
                    f"{runner_path.name} needs {name} (via {elf.path.name}), found neither in {where} "
                    "nor as a system library of the target: pass its folder with --library-path"
                )
            library = read_elf(location)
            if library.machine != runner.machine:
                raise UserError(
                    f"{location} is built for {library.machine}, but {runner_path.name} for {runner.machine}"
                )
            found[name] = location
            queue.append(library)
    return [found[name] for name in sorted(found)]
