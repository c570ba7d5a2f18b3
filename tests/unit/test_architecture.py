"""The package's shape: no module of sparkctl uses another module's private name (`_name`).

A private name is the module's own business; a module that needs another's helper gets it public, or the two
are one module. Read with `ast`: `from X import _name` (absolute or relative) and `X._name` where X is bound
to another sparkctl module. Dunder names (`__file__`, `__version__`) are not private.
"""

from __future__ import annotations

import ast
from pathlib import Path

import sparkctl

PKG = Path(sparkctl.__file__).parent


def _module_name(path: Path, pkg: Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def crossings(pkg: Path = PKG) -> list[str]:
    """Every use of another sparkctl module's private name in the package, as `file:line: what`."""
    modules = {_module_name(p, pkg): p for p in sorted(pkg.rglob("*.py"))}
    found = []
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> the sparkctl module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for alias in node.names:
                    if f"{src}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{src}.{alias.name}"
                    elif src in modules and src != mod and _private(alias.name):
                        found.append(f"{path.relative_to(pkg)}:{node.lineno}: from {src} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and bound[node.value.id] != mod and _private(node.attr)):
                found.append(f"{path.relative_to(pkg)}:{node.lineno}: {bound[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_name() -> None:
    assert crossings() == []


def test_the_checker_sees_both_forms_of_a_crossing(tmp_path: Path) -> None:
    pkg = tmp_path / "sparkctl"
    (pkg / "rules").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rules" / "__init__.py").write_text("")
    (pkg / "rules" / "a.py").write_text("def _helper(): ...\ndef public(): return _helper()\n")
    (pkg / "rules" / "b.py").write_text("from .a import _helper, public\n")
    (pkg / "c.py").write_text("from .rules import a as rules_a\nfrom sparkctl.rules import a\n"
                              "x = rules_a._helper\ny = a.public\nz = a.__file__\n")
    assert sorted(crossings(pkg)) == ["c.py:3: sparkctl.rules.a._helper", "rules/b.py:1: from sparkctl.rules.a import _helper"]
