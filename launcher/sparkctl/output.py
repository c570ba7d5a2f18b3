"""Where output goes: with --json exactly one JSON document on stdout and human text on stderr;
without it, human text on stdout. Warnings always go to stderr."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console


def console(as_json: bool) -> Console:
    """The console human text goes to (stderr when stdout carries JSON).

    Piped into a file or a CI log there is no terminal width: use a wide one rather than rich's 80
    columns, so tables keep whole image IDs and hashes instead of cutting them with an ellipsis.
    """
    stream = sys.stderr if as_json else sys.stdout
    width = None if stream.isatty() else 200
    return Console(stderr=as_json, highlight=False, soft_wrap=False, width=width)


def warn_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def emit_json(doc: Any) -> None:
    """The document on stdout: indented for a terminal; one compact line for a pipe or a file (json's
    C encoder: the indented one is pure Python, a few ms per node of a large `check --json`)."""
    text = json.dumps(doc, indent=2, default=str) if sys.stdout.isatty() else \
        json.dumps(doc, separators=(",", ":"), default=str)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def warn(lines: list[str]) -> None:
    c = warn_console()
    for line in lines:
        c.print(f"[yellow]warning:[/] {line}", markup=True)
