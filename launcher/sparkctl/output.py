"""Where output goes: with --json exactly one JSON document on stdout and human text on stderr;
without it, human text on stdout. Warnings always go to stderr.

emit_json counts the documents it prints, so that a command given --json that fails before printing
one still ends with one: `cli.main` prints the failure's (errors.failure_document: one shape for every
command). A command with a report of its own ends with `finish`: its document on success, or its failure
raised with the report beside it, so the failure's document is the one it prints.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

from .errors import SparkctlError


def console(as_json: bool) -> Console:
    """The console human text goes to (stderr when stdout carries JSON).

    Piped into a file or a CI log there is no terminal width: use a wide one rather than rich's 80
    columns, so tables keep whole image IDs and hashes instead of cutting them with an ellipsis.
    """
    if _recorder and not as_json:
        return _recorder[0]
    stream = sys.stderr if as_json else sys.stdout
    width = None if stream.isatty() else 200
    return Console(stderr=as_json, highlight=False, soft_wrap=False, width=width)


_recorder: list[Console] = []  # while set: the one console human text goes to (record_into)


def record_into(recording: Console | None) -> None:
    """Send every command's human text to `recording` (a Console made with record=True), or stop with None:
    how `scripts/capture_svgs.py` turns what a person sees into the pictures in docs/img/."""
    _recorder.clear()
    if recording is not None:
        _recorder.append(recording)


_documents = [0]  # JSON documents printed on stdout by this command (cli.main resets it per command)


def reset_documents() -> None:
    _documents[0] = 0
    _said.clear()


def documents_emitted() -> int:
    return _documents[0]


def warn_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def emit_json(doc: Any) -> None:
    """The document on stdout: indented for a terminal; one compact line for a pipe or a file (json's
    C encoder: the indented one is pure Python, a few ms per node of a large `check --json`)."""
    text = json.dumps(doc, indent=2, default=str) if sys.stdout.isatty() else \
        json.dumps(doc, separators=(",", ":"), default=str)
    _documents[0] += 1
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def emit_json_line(doc: Any) -> None:
    """One document of a stream (`status --watch --json`: one per line, keys sorted)."""
    _documents[0] += 1
    sys.stdout.write(json.dumps(doc, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def finish(as_json: bool, doc: dict[str, Any], failure: SparkctlError | None = None) -> None:
    """The end of a command with a report: with --json its document when it succeeded; when it failed,
    `failure` is raised carrying the report (`extra`), and cli.main prints the one failure document."""
    if failure is not None:
        if as_json:
            failure.extra = {**doc, **(failure.extra or {})}
        raise failure
    if as_json:
        emit_json(doc)


_said: list[str] = []  # the last warning printed by this command (cli.main's last word on a bare exit status)


def last_said() -> str | None:
    return _said[-1] if _said else None


def warn(lines: list[str]) -> None:
    c = warn_console()
    for line in lines:
        c.print(f"[yellow]warning:[/] {line}", markup=True)
        _said[:] = [line]
