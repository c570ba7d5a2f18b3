"""resources._sparkctl_imports reads a probe's sparkctl imports by line (cheap at every run); here
Python's own parser checks that reading on every probe and module that can go to a node."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sparkctl.spec import resources
from sparkctl.spec.resources import PROBE_MODULES, _sparkctl_imports

PKG = Path(resources.__file__).resolve().parent.parent


def by_ast(text: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(text)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sparkctl":
            names = [node.module.removeprefix("sparkctl.")]
        elif isinstance(node, ast.Import):
            names = [a.name.removeprefix("sparkctl.") for a in node.names if a.name.split(".")[0] == "sparkctl"]
        found += [n for n in names if n not in found]
    return found


@pytest.mark.parametrize("path", sorted((PKG / "probes").glob("*.py")) + [PKG / f"{m.replace('.', '/')}.py" for m in PROBE_MODULES],
                         ids=lambda p: p.name)
def test_the_line_reading_finds_what_pythons_parser_finds(path: Path) -> None:
    text = path.read_text()
    assert _sparkctl_imports(text, path.name) == by_ast(text)


@pytest.mark.parametrize("text, want", [
    ("import os, sparkctl.checkpoint.safetensors as st  # a comment, sparkctl.checkpoint.verify\n", ["checkpoint.safetensors"]),
    ("def f():\n    from sparkctl.checkpoint.safetensors import parse_header\n", ["checkpoint.safetensors"]),
    ("x = 'import sparkctl'\nimport json\n", []),
])
def test_imports_anywhere_in_the_file(text: str, want: list[str]) -> None:
    assert _sparkctl_imports(text, "t.py") == want == by_ast(text)


@pytest.mark.parametrize("text, said", [
    ("from .safetensors import parse_header\n", "absolutely"),
    ("from sparkctl.checkpoint.verify import verify\n", "not a probe module"),
    ("    import sparkctl.spec.planner\n", "not a probe module"),
    ("import os, sparkctl.spec.settings\n", "not a probe module"),
])
def test_a_probe_that_imports_what_nodes_lack_is_refused(text: str, said: str) -> None:
    with pytest.raises(RuntimeError, match=said):
        _sparkctl_imports(text, "t.py")
