"""Where an export is written: a hidden staging folder beside the target, renamed into place only
when complete, so a failed or killed export never leaves a folder that looks usable."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from composite import manifest as manifest_schema
from composite.errors import UserError

# Folders being written that a terminated export must remove (export.terminated): it cannot
# unwind the stack, so it has to know them.
_unfinished: set[Path] = set()


def unfinished(folder: Path) -> Path:
    _unfinished.add(folder)
    return folder


def finished(folder: Path) -> None:
    _unfinished.discard(folder)


def remove_unfinished() -> None:
    for folder in list(_unfinished):
        shutil.rmtree(folder, ignore_errors=True)


def check_output(output: Path) -> None:
    """Refuse a target that cannot take an export before any slow work; say when one is replaced."""
    if output.exists() and not output.is_dir():
        raise UserError(f"--output {output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()):
        if not (output / manifest_schema.FILENAME).exists():
            raise UserError(
                f"--output {output} is a non-empty folder that is not a composite export; refusing to replace it"
            )
        print(f"note: {output} holds an earlier export; it is replaced when this one is complete", file=sys.stderr)


def make_staging(output: Path) -> Path:
    """The hidden folder the export is written into, beside the target and named after this
    process; ones left by exports that died (their process is gone) are removed first."""
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        for leftover in output.parent.glob(f".{output.name}.partial-*"):
            if not process_alive(leftover.name.rsplit(".partial-", 1)[1].split("-", 1)[0]):
                shutil.rmtree(leftover, ignore_errors=True)
        return unfinished(Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-{os.getpid()}-", dir=output.parent)))
    except OSError as e:
        raise UserError(f"cannot write an export to {output}: {e.strerror}") from None


def process_alive(pid_text: str) -> bool:
    try:
        os.kill(int(pid_text), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True  # another user's process
    return True


def replace_folder(staging: Path, output: Path) -> None:
    """Move the complete staging folder to `output`; an older export there is swapped out whole."""
    os.chmod(staging, 0o755)
    if not output.exists():
        os.rename(staging, output)
        finished(staging)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
    os.rename(output, retired / "artifacts")
    os.rename(staging, output)
    finished(staging)
    shutil.rmtree(retired, ignore_errors=True)
