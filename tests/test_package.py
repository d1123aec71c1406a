"""The package's shape: every module imports on its own, and no module imports another in a cycle
(imports inside functions count: they are the same dependency, paid later)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "composite"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path) -> set[str]:
    """composite modules that `path` imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return {name for name in found if name in MODULES}


def test_no_module_imports_another_in_a_cycle():
    graph = {name: imported_modules(path) - {name} for name, path in MODULES.items()}
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycle = trail[trail.index(target) :] + [name, target] if target in trail else [name, target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*trail, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


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
