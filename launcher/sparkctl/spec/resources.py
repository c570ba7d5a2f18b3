"""Where sparkctl's data lives: inside the installed package, or at the top of a checkout.

A wheel carries templates/ and images/ under sparkctl/_data/ (see pyproject.toml); an editable
install or a plain checkout finds them at the repository root, three levels above this file.
Recipes always live inside the package (sparkctl/recipes/).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Path:
    """Return the folder `name` (templates or images), wherever this sparkctl was installed from."""
    for candidate in (_PKG / "_data" / name, _PKG.parent.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"sparkctl data folder {name!r} not found next to {_PKG}")


def recipes_dir() -> Path:
    return _PKG / "recipes"


def probe_script(name: str) -> bytes:
    """The script that ships probe `name` (a file in sparkctl/probes/, e.g. "ckpt_scan.py" or
    "node_facts.sh") to a node's stdin: nodes do not have sparkctl installed.

    A Python probe may import stdlib-only sparkctl modules (`from sparkctl.checkpoint.safetensors import ...`):
    it is sent as one self-contained script that first defines those modules from their source, so
    the node runs the very code this machine runs (one header parser, not a copy kept in step by
    hand). Any other sparkctl import is refused here, before anything is sent."""
    path = _PKG / "probes" / name
    if path.suffix != ".py":
        return path.read_bytes()
    return _bundle(path).encode()


#: sparkctl modules a probe may take to a node: they import nothing but the standard library.
PROBE_MODULES = ("checkpoint.safetensors",)


@cache
def _bundle(path: Path) -> str:
    text = path.read_text()
    wanted = _sparkctl_imports(text, path.name)
    if not wanted:
        return text
    lines = ["# sparkctl probe bundle: the modules below, then the probe itself",
             "import sys as _sys, types as _types",
             "_pkg = _sys.modules.setdefault('sparkctl', _types.ModuleType('sparkctl'))",
             "_pkg.__path__ = []",
             "def _define(_name, _src):",
             "    _parent = _name.rpartition('.')[0]",
             "    if _parent not in _sys.modules:",
             "        _sys.modules[_parent] = _types.ModuleType(_parent)",
             "        _sys.modules[_parent].__path__ = []",
             "    _m = _types.ModuleType(_name)",
             "    _m.__file__ = '<sparkctl probe module ' + _name + '>'",
             "    _sys.modules[_name] = _m",
             "    exec(compile(_src, _m.__file__, 'exec'), _m.__dict__)"]
    for mod in wanted:
        src = (_PKG / f"{mod.replace('.', '/')}.py").read_text()
        if _sparkctl_imports(src, f"{mod}.py"):
            raise RuntimeError(f"sparkctl/{mod.replace('.', '/')}.py imports other sparkctl modules: it cannot go to a node")
        lines.append(f"_define({'sparkctl.' + mod!r}, {src!r})")
    # in __main__'s own namespace: a worker process (fork) unpickles the probe's functions from there
    lines.append(f"exec(compile({text!r}, {'<probe ' + path.name + '>'!r}, 'exec'), _sys.modules['__main__'].__dict__)")
    return "\n".join(lines) + "\n"


# A probe's sparkctl imports, read by line (parsing the sources with `ast` on every run cost 0.2 s of
# CPU); tests/unit/spec/test_resources.py checks that this reading finds what Python's own parser does.
_IMPORT_RE = re.compile(r"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+import\b|import[ \t]+(.+))", re.M)


def _sparkctl_imports(text: str, where: str) -> list[str]:
    """The sparkctl modules `text` imports, checked against PROBE_MODULES."""
    found: list[str] = []
    for m in _IMPORT_RE.finditer(text):
        dots, module, plain = m.group(1), m.group(2), m.group(3)
        if dots:
            raise RuntimeError(f"{where}: a probe imports sparkctl modules absolutely (`from sparkctl.X import`)")
        if module:
            names = [module.removeprefix("sparkctl.")] if module.split(".")[0] == "sparkctl" else []
        elif plain:
            words = [w.strip().split(" ")[0] for w in plain.split("#")[0].split(",")]
            names = [w.removeprefix("sparkctl.") for w in words if w.split(".")[0] == "sparkctl"]
        else:
            names = []
        for mod in names:
            if mod not in PROBE_MODULES:
                raise RuntimeError(f"{where} imports sparkctl.{mod}, which is not a probe module "
                                   f"({', '.join(PROBE_MODULES)}): nodes do not have sparkctl installed")
            if mod not in found:
                found.append(mod)
    return found
