"""Run the commands the docs show on the tiny default, so the docs cannot rot.

    python scripts/docs_check.py                 # README.md, then docs/*.md in name order
    python scripts/docs_check.py FILE.md ...     # only these

A fenced block opened as ```bash tiny holds commands that need nothing but this repository, its
build (build/composite_runner) and the QNN host libraries: the embedded default model, texts the
repository or Debian's base-files ship. Each command (a line, `\\` continuations joined; `#`
comments dropped) runs with bash in one scratch folder shared by every file in the order given, so
a guide may use what the README's quick start exported (artifacts/tiny). The scratch folder links
the repository's configs/, composite/, scripts/, build/ and checkpoints/, so the commands' paths
read as they do in a clone. The first command that fails ends the check: its file, line, command
and last lines of output, exit 1. Blocks opened as plain ```bash (real checkpoints, a phone, a
cluster) are run by the tests or scripts the docs name instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINKED = ("configs", "composite", "scripts", "build", "checkpoints")
MARKER = "```bash tiny"


def commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of each command in the file's ```bash tiny blocks."""
    found, inside, pending, first = [], False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not inside:
            inside = stripped == MARKER
            continue
        if stripped.startswith("```"):
            inside = False
            continue
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            first = number
        code = line.split("  # ")[0].rstrip()
        if code.endswith("\\"):
            pending += code[:-1].strip() + " "
            continue
        found.append((first, pending + code.strip()))
        pending = ""
    return found


def scratch_folder(root: Path) -> None:
    for name in LINKED:
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)


def run(paths: list[Path], timeout: float) -> int:
    todo = [(path, number, command) for path in paths for number, command in commands(path)]
    if not todo:
        print("docs check: no ```bash tiny commands in " + ", ".join(str(p) for p in paths), file=sys.stderr)
        return 1
    env = {**os.environ}
    with tempfile.TemporaryDirectory(prefix="docs_check_") as scratch:
        scratch_folder(Path(scratch))
        for path, number, command in todo:
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}"
            print(f"docs check: {where}: $ {command}", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                done = subprocess.run(
                    ["bash", "-c", command], cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout
                )
            except subprocess.TimeoutExpired:
                print(f"docs check: {where}: `{command}` took more than {timeout:.0f} s", file=sys.stderr)
                return 1
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
                print(f"docs check: {where}: `{command}` failed (exit {done.returncode}):\n{tail}", file=sys.stderr)
                return 1
            print(f"docs check:   ok, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(f"docs check: {len(todo)} commands from {len(paths)} files ran", file=sys.stderr)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="*", help="markdown files (default: README.md, then docs/*.md)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per command (default 900)")
    args = p.parse_args()
    paths = [Path(f).resolve() for f in args.files] or [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        sys.exit(f"error: no such file: {missing[0]}")
    sys.exit(run(paths, args.timeout))


if __name__ == "__main__":
    main()
