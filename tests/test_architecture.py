"""The import structure matches docs/architecture.md's package table.

Each top-level package (or module) of resilient_ckpt has a floor in the
table, and a module imports (at module level or lazily inside a function)
only from its own package or from packages on lower floors. No import cycle
exists between modules, in the package, in tests/ or in bench/; bench/
never imports tests/, and no test module imports another (shared helpers
live in tests/support).
"""
from __future__ import annotations

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "resilient_ckpt"
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w.]+)/?`((?:,\s*`[\w.]+/?`)*)\s*\|")


def floors() -> dict[str, int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    out = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            for name in [m.group(2)] + re.findall(r"`([\w.]+)/?`", m.group(3)):
                out[name] = int(m.group(1))
    return out


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name (without `resilient_ckpt.`)."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:  # the top-level __init__ is the public namespace, above every floor
            out[".".join(parts)] = p
    return out


def project_imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports (`from .x import y`
    counts as importing y when y is a module, else x)."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1] if node.level > 1 else list(here)
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.startswith("resilient_ckpt"):
                mod = node.module.split(".")[1:]
            else:
                continue
            for a in node.names:
                sub = ".".join(mod + [a.name])
                targets.append(sub if sub in known else ".".join(mod))
        elif isinstance(node, ast.Import):
            targets = [".".join(a.name.split(".")[1:]) for a in node.names
                       if a.name.startswith("resilient_ckpt.")]
        found |= {t for t in targets if t in known and t != name}
    return found


def top(name: str) -> str:
    return name.split(".")[0]


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (a list of its nodes, first repeated last),
    or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        path.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return []


def package_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: project_imports(name, path, set(mods)) for name, path in mods.items()}


def test_every_package_has_a_floor_and_every_floor_a_package():
    table = floors()
    tops = {top(n) for n in modules()}
    assert tops - set(table) == set(), "packages missing from docs/architecture.md"
    assert set(table) - tops == set(), "rows in docs/architecture.md with no package"


def test_packages_import_only_lower_floors():
    table, graph = floors(), package_graph()
    wrong = sorted(f"{name} ({table[top(name)]}) imports {dep} ({table[top(dep)]})"
                   for name, deps in graph.items() for dep in deps
                   if top(dep) != top(name) and table[top(dep)] >= table[top(name)])
    assert wrong == []


def test_no_import_cycle_between_the_package_modules():
    graph = package_graph()
    # a package's __init__ may gather its own submodules' names
    graph = {n: {d for d in deps if not d.startswith(n + ".")} for n, deps in graph.items()}
    assert cycle(graph) == []


def local_graph(folder: pathlib.Path) -> dict[str, set[str]]:
    """Imports between the Python files of a script folder (bench/ or tests/,
    with its sub-packages), by module name relative to that folder."""
    files = {".".join(p.relative_to(folder).with_suffix("").parts).removesuffix(".__init__"): p
             for p in folder.rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = name.split(".")[:-node.level] if path.name != "__init__.py" else \
                    name.split(".")[:len(name.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] + [f"{mod}.{a.name}".strip(".") for a in node.names]
            else:
                continue
            # tests/ is imported as the package `tests` (from tests.support import x)
            names = [n.removeprefix(folder.name + ".") for n in names]
            deps |= {n for n in names if n in files and n != name}
        out[name] = deps
    return out


def test_no_import_cycle_in_tests_or_bench():
    for folder in (ROOT / "tests", ROOT / "bench"):
        assert cycle(local_graph(folder)) == [], folder.name


def test_test_modules_import_helpers_only_from_tests_support():
    """A helper two test files share lives in tests/support, not in one of them."""
    wrong = sorted(f"{name} imports {dep}" for name, deps in local_graph(ROOT / "tests").items()
                   for dep in deps if dep.split(".")[-1].startswith("test_"))
    assert wrong == []


def test_bench_does_not_import_tests():
    """bench/ may run the test suite (a campaign), never import from it."""
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {"tests"}
    offenders = []
    for p in (ROOT / "bench").rglob("*.py"):
        text = p.read_text()
        if re.search(r"sys\.path\.\w+\(.*[\"']tests[\"']", text):
            offenders.append(f"{p.name}: puts tests/ on sys.path")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{p.name}: imports {n}" for n in names
                          if n.split(".")[0] in test_modules and n.split(".")[0] != "conftest"
                          and not (ROOT / "bench" / f"{n.split('.')[0]}.py").exists()]
    assert offenders == []


def test_cycle_finder_finds_a_cycle():
    """The checker itself: a cycle planted in a graph is reported."""
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


@pytest.mark.skipif(shutil.which("ruff") is None and not (pathlib.Path(sys.executable).parent
                                                           / "ruff").exists(),
                    reason="ruff is not installed")
def test_no_module_reads_another_class_private_members():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).parent / "ruff")
    out = subprocess.run([ruff, "check", "--select", "SLF001", "--output-format", "concise",
                          "resilient_ckpt"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
