"""Where sparkctl's data lives: inside the installed package, or at the top of a checkout.

A wheel carries templates/ and images/ under sparkctl/_data/ (see pyproject.toml); an editable
install or a plain checkout finds them at the repository root, two levels above this file.
Recipes always live inside the package (sparkctl/recipes/).
"""

from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """Return the folder `name` (templates or images), wherever this sparkctl was installed from."""
    for candidate in (_PKG / "_data" / name, _PKG.parent.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"sparkctl data folder {name!r} not found next to {_PKG}")


def recipes_dir() -> Path:
    return _PKG / "recipes"


def probe_script(name: str) -> bytes:
    """A script from sparkctl/probes/ that is shipped to nodes on stdin (nodes don't have sparkctl)."""
    return (_PKG / "probes" / name).read_bytes()
