"""Every module of the package imports on its own (import cycles and layers: test_structure.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, runner_built

PACKAGE = REPO / "composite"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = [module_name(p) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_module_imports_on_its_own():
    # One process (a fresh interpreter per module cost two minutes of torch imports): before each
    # module, every composite module is forgotten, so none imports thanks to an earlier one.
    script = """
import importlib, sys, traceback
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "composite" or m.startswith("composite.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException as e:
        print(f"{name}: {traceback.format_exception_only(e)[-1].strip()}")
"""
    result = subprocess.run([sys.executable, "-c", script, *MODULES], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert not result.stdout.strip(), result.stdout


def test_a_missing_runner_fails_the_tests_that_need_it_where_the_test_command_requires_it(tmp_path, monkeypatch):
    missing = tmp_path / "composite_runner"
    monkeypatch.delenv("COMPOSITE_REQUIRE_RUNNER", raising=False)
    assert runner_built(missing) is False  # a skip, where nothing requires it
    monkeypatch.setenv("COMPOSITE_REQUIRE_RUNNER", "1")
    with pytest.raises(pytest.fail.Exception, match="COMPOSITE_REQUIRE_RUNNER=1 requires it"):
        runner_built(missing)
    missing.write_bytes(b"")
    assert runner_built(missing)
