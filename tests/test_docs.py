"""The docs cannot rot: every ```bash tiny command in README.md and docs/ runs (scripts/docs_check.py),
and the check fails, naming the file and line, on a command that does not work."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

CHECK = [sys.executable, str(REPO / "scripts" / "docs_check.py")]


def docs_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CHECK, *args], capture_output=True, text=True, cwd=REPO)


def test_every_tiny_command_in_the_docs_runs(qnn_ready, needs_runner):
    done = docs_check()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "commands from" in done.stderr


def test_a_command_that_no_longer_works_fails_the_check(tmp_path):
    guide = tmp_path / "guide.md"
    guide.write_text(
        "# A guide\n\n```bash tiny\npython -m composite.export --help   # works\n"
        "python -m composite.export --shards 0 \\\n    --output artifacts/x\n```\n"
    )
    done = docs_check(str(guide))
    assert done.returncode == 1
    assert f"{guide}:5: `python -m composite.export --shards 0 --output artifacts/x` failed (exit 2)" in done.stderr
    assert "error:" in done.stderr  # the command's own message comes along


def test_a_guide_without_runnable_commands_is_not_a_silent_pass(tmp_path):
    guide = tmp_path / "guide.md"
    guide.write_text("# A guide\n\n```bash\npython -m composite.export --shards 0\n```\n")
    assert docs_check(str(guide)).returncode == 1
