"""The import structure matches docs/architecture.md's floors table.

Each module may import (at module level or lazily inside a function) only
modules on lower floors; a package's `__init__` may also import its own
submodules. Every module of the package has a row, and every row a module.
"""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "resilient_ckpt"
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([\w.]+)`((?:,\s*`[\w.]+`)*)\s*\|")


def floors() -> dict[str, int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    out = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            for name in [m.group(2)] + re.findall(r"`([\w.]+)`", m.group(3)):
                out[name] = int(m.group(1))
    return out


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:  # the top-level __init__ is the public namespace, above every floor
            out[".".join(parts)] = p
    return out


def project_imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
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
            # `from .x import y`: y is a module of its own, or a name in module x
            for a in node.names:
                sub = ".".join(mod + [a.name])
                targets.append(sub if sub in known else ".".join(mod))
        elif isinstance(node, ast.Import):
            targets = [".".join(a.name.split(".")[1:]) for a in node.names
                       if a.name.startswith("resilient_ckpt.")]
        found |= {t for t in targets if t in known and t != name}
    return found


def test_every_module_has_a_floor_and_every_floor_a_module():
    table, mods = floors(), modules()
    assert set(mods) - set(table) == set(), "modules missing from docs/architecture.md"
    assert set(table) - set(mods) == set(), "rows in docs/architecture.md with no module"


def test_imports_only_go_down():
    table, mods = floors(), modules()
    wrong = []
    for name, path in mods.items():
        own_package = path.name == "__init__.py"
        for dep in project_imports(name, path, set(mods)):
            if own_package and dep.startswith(name + "."):
                ok = table[dep] <= table[name]
            else:
                ok = table[dep] < table[name]
            if not ok:
                wrong.append(f"{name} (floor {table[name]}) imports {dep} (floor {table[dep]})")
    assert wrong == []
