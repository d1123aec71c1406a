"""The code's shape, checked: the exporter reads top to bottom (export.py at most 350 lines, tune()
a list of named steps), no module of the package over 450 lines, no function longer than 90 lines
(Python and C++), no import cycle, and no module importing from a layer above its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "composite"
MAX_FUNCTION_LINES = 90
MAX_MODULE_LINES = 450

# Each top-level module or subpackage of composite, by layer: a module imports only from its own
# layer or lower ones, wherever the import statement is (an import inside a function is the same
# dependency, paid later).
LAYERS = {
    0: {"composite", "errors", "quiet", "memory", "manifest", "manifest_files", "manifest_write", "units", "config", "placement_options", "config_flags", "tokenizer", "qnn_host", "qnn_soc", "report", "bundle",
        "ops", "staging", "chat_template"},
    1: {"model", "executor"},
    2: {"split"},
    3: {"runtime"},
    4: {"lowering"},
    5: {"shard_cache", "eval", "export_report", "spill_fill"},
    6: {"export", "tune", "bench", "run", "deploy"},
}  # fmt: skip
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The composite modules `path` imports, anywhere in its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("composite"):
            for alias in node.names:  # `from composite.lowering import xnnpack` is lowering.xnnpack
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
    return found & known.keys()


def top_level(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "composite"


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(p, known) - {name} for name, p in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def python_functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method."""
    tree = ast.parse(path.read_text())
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


# A C++ function definition's opening line(s): a signature ending in `{`, not a control statement.
CPP_SIGNATURE = re.compile(
    r"^\s*(?!(?:if|for|while|switch|catch|else|do|return|namespace|struct|class|enum)\b)"
    r"[\w:<>,*&~\s\[\]]+\([^;{}]*\)\s*(?:const\s*)?(?:noexcept\s*)?(?:override\s*)?(?:->\s*[\w:<>,\s*&]+)?\{\s*$"
)


def cpp_functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of each function body in a C++ file, found by its signature (up
    to 6 lines long) and counted to its matching brace."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].rstrip().endswith("{"):
            for first in range(i, max(-1, i - 6), -1):
                signature = " ".join(line.strip() for line in lines[first : i + 1])
                if CPP_SIGNATURE.match(signature):
                    depth, end = 0, i
                    for end in range(i, len(lines)):
                        depth += lines[end].count("{") - lines[end].count("}")
                        if depth == 0:
                            break
                    found.append((re.search(r"([\w:~]+)\s*\(", signature).group(1), first + 1, end - first + 1))
                    i = end
                    break
                if first < i and lines[first].rstrip().endswith((";", "}", "{")):
                    break
        i += 1
    return found


def test_the_exporter_reads_top_to_bottom():
    lines = len((PACKAGE / "export.py").read_text().splitlines())
    assert lines <= 350, f"composite/export.py has {lines} lines: move what another module owns there"
    (tune,) = [f for f in python_functions(PACKAGE / "tune" / "steps.py") if f[0] == "tune"]
    assert tune[2] <= 60, f"composite.tune's tune() has {tune[2]} lines: name its steps"


def test_no_module_is_longer_than_450_lines():
    long = [
        f"{path.relative_to(REPO)} ({n} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "modules over 450 lines: split them by concern\n" + "\n".join(long)


def test_no_function_is_longer_than_90_lines():
    long = [
        f"{path.relative_to(REPO)}:{line} {name} ({n} lines)"
        for path in sorted(PACKAGE.rglob("*.py"))
        for name, line, n in python_functions(path)
        if n > MAX_FUNCTION_LINES
    ]
    long += [
        f"{path.relative_to(REPO)}:{line} {name} ({n} lines)"
        for path in sorted((REPO / "runner_cpp").rglob("*"))
        if path.suffix in (".cpp", ".h")
        for name, line, n in cpp_functions(path)
        if n > MAX_FUNCTION_LINES
    ]
    assert not long, "functions over 90 lines:\n" + "\n".join(long)


def test_the_cpp_counter_finds_functions_and_their_length(tmp_path):
    source = tmp_path / "a.cpp"
    body = "\n".join(f"  x += {i};" for i in range(120))
    source.write_text(
        f"namespace {{\nint short_one(int a,\n              int b) {{\n  if (a) {{\n    return b;\n  }}\n  return a;\n}}\n"
        f"}}  // namespace\n\nstd::vector<int> Chain::long_one(const std::string& s) const {{\n{body}\n}}\n"
    )
    assert cpp_functions(source) == [("short_one", 2, 7), ("Chain::long_one", 11, 122)]


def test_no_import_cycles_and_no_import_from_a_higher_layer():
    graph = import_graph()
    assert cycles(graph) == []
    unknown = {top_level(m) for m in graph} - set(LAYER_OF)
    assert not unknown, f"put {sorted(unknown)} in a layer of tests/test_structure.py"
    upward = [
        f"{a} imports {b}"
        for a, targets in graph.items()
        for b in targets
        if LAYER_OF[top_level(b)] > LAYER_OF[top_level(a)]
    ]
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("guide", ["README.md"])
def test_the_readme_is_short_and_its_guides_exist(guide):
    text = (REPO / guide).read_text()
    assert len(text.splitlines()) <= 250, f"{guide} has {len(text.splitlines())} lines"
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links, "the README links its guides in docs/"
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, f"{guide} links to missing guides: {missing}"
