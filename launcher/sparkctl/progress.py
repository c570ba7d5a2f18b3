"""Progress of long work, for a person and for a machine: one front door, `Feed.event(...)`.

`--events FILE` (or `--events -`, stdout) writes one JSON object per line per event: time, command,
step, node, rank, phase, bytes_done, bytes_total, message, level. The shape is the JSON Schema
sparkctl/data/events.schema.json (validated in tests/unit/test_progress.py). Every command that does
long work takes the option (`deploy`, `model pull`, `model sync`, `build`, `up`, `wait`): it is a global
option, so `sparkctl --events run.jsonl build` and `sparkctl build --events run.jsonl` are the same.

On a terminal `Feed` can also drive a rich progress display (`Display`): a bar with rate and ETA for
work counted in bytes (the download, the copy per rank), a line per node for phases (the layers built
per rank, the engine's load phases per rank). Not on a terminal it prints one plain line per change of
phase (never per byte), and nothing at all when quiet.

A sink that cannot be written (a full disk, a closed pipe) is a warning once, then dropped: the events
never fail the work they describe.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

LEVELS = ("debug", "info", "warning", "error")
SCHEMA_PATH = Path(__file__).resolve().parent / "data" / "events.schema.json"


def schema() -> dict[str, Any]:
    """The events' JSON Schema (the file shipped in the package)."""
    doc: dict[str, Any] = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return doc


def make_event(command: str, step: str, phase: str, message: str = "", *, node: str | None = None,
               rank: int | None = None, bytes_done: int | None = None, bytes_total: int | None = None,
               level: str = "info", now: float | None = None) -> dict[str, Any]:
    """One event, every key present (null when it does not apply)."""
    if level not in LEVELS:
        raise ValueError(f"event level {level!r} is not one of {', '.join(LEVELS)}")
    return {"time": round(time.time() if now is None else now, 3), "command": command, "step": step,
            "node": node, "rank": None if rank is None else int(rank), "phase": phase,
            "bytes_done": _count(bytes_done), "bytes_total": _count(bytes_total),
            "message": message, "level": level}


def _count(v: Any) -> int | None:
    """A byte count as an event carries it: a whole number >= 0, or null (a node's odd answer included)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        return None
    return max(0, int(v))


class Display:
    """The person's view of the events: rich bars on a terminal, plain lines otherwise, nothing when quiet."""

    def __init__(self, console: Any, *, quiet: bool = False) -> None:
        self.console = console
        self.quiet = quiet
        self.tty = bool(console.is_terminal) and not quiet
        self.lock = threading.Lock()
        self.phases: dict[tuple[str, str | None, int | None], str] = {}
        self.tasks: dict[tuple[str, str | None, int | None], Any] = {}
        self.bars: Any = None

    def __enter__(self) -> Display:
        if self.tty:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=self.console,
                                 transient=False)
            self.bars.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None

    def show(self, ev: dict[str, Any]) -> None:
        if self.quiet:
            return
        key = (ev["step"], ev["node"], ev["rank"])
        who = " ".join(x for x in (ev["step"], ev["node"] or "", "" if ev["rank"] is None else f"rank {ev['rank']}")
                       if x)
        with self.lock:
            counted = ev["bytes_total"] is not None
            if self.bars is not None and counted:
                if key not in self.tasks:
                    self.tasks[key] = self.bars.add_task(f"{who}: {ev['phase']}", total=ev["bytes_total"] or None)
                self.bars.update(self.tasks[key], completed=ev["bytes_done"] or 0, total=ev["bytes_total"] or None,
                                 description=f"{who}: {ev['phase']}")
                return
            if self.phases.get(key) == ev["phase"] and counted:
                return  # plain output: one line per change of phase, never one per byte
            self.phases[key] = ev["phase"]
            text = f"{who}: {ev['phase']}" + (f": {ev['message']}" if ev["message"] else "")
            style = {"error": "red", "warning": "yellow"}.get(ev["level"])
            if self.bars is not None:
                self.bars.console.print(text, markup=False, style=style)
            else:
                self.console.print(text, markup=False, style=style, soft_wrap=True)


class Feed:
    """Where a command's events go: the `--events` sink (a JSON line each) and the display (a person)."""

    def __init__(self, command: str, stream: IO[str] | None = None, *, display: Display | None = None,
                 owns_stream: bool = False) -> None:
        self.command = command
        self.stream = stream
        self.display = display
        self.owns_stream = owns_stream
        self.lock = threading.Lock()
        self.count = 0
        self.broken: str | None = None

    def event(self, step: str, phase: str, message: str = "", **kw: Any) -> None:
        ev = make_event(self.command, step, phase, message, **kw)
        with self.lock:
            if self.stream is not None and self.broken is None:
                try:
                    self.stream.write(json.dumps(ev, separators=(",", ":"), sort_keys=True) + "\n")
                    self.stream.flush()
                    self.count += 1
                except (OSError, ValueError) as exc:
                    self.broken = str(exc)
                    from .output import warn

                    warn([f"--events: cannot write ({exc}); no more events are written"])
        if self.display is not None:
            self.display.show(ev)

    def close(self) -> None:
        if self.owns_stream and self.stream is not None:
            try:
                self.stream.close()
            except OSError:
                pass
        self.stream = None


def open_feed(dest: str | None, command: str, *, as_json: bool, display: Display | None = None) -> Feed:
    """The feed of `--events DEST`: a file (created or appended to), `-` (stdout, one line per event;
    refused with --json, whose one document owns stdout), or None (no sink; the display only)."""
    from .errors import UsageError

    if dest is None or dest == "":
        return Feed(command, None, display=display)
    if dest == "-":
        if as_json:
            raise UsageError("--events - and --json both want stdout",
                             fix="write the events to a file (--events FILE), or leave --json out")
        return Feed(command, sys.stdout, display=display)
    try:
        stream = open(dest, "a", encoding="utf-8")  # noqa: SIM115 (closed by Feed.close)
    except OSError as exc:
        raise UsageError(f"--events {dest}: cannot open it for writing ({exc.strerror or exc})",
                         fix="name a file in a folder you can write") from None
    return Feed(command, stream, display=display, owns_stream=True)


def feed_of(g: Any, command: str, *, display: Display | None = None) -> Feed:
    """The feed a command's globals ask for (`--events`), with `display` for the person."""
    return open_feed(getattr(g, "events", None), command, as_json=bool(getattr(g, "json", False)), display=display)
