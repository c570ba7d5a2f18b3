"""`sparkctl verify-model`: the checkpoint's layout and EXL3 ABI, from its headers, in about a second.

    sparkctl verify-model --local DIR [--deep] [--json] [--layout NAME]   this machine's folder
    sparkctl verify-model [--deep] [--json]                               MODEL on every node

Cluster mode ships probes/ckpt_scan.py to every node over its SSH connection: the head sends its
shards' summaries (cached there: an unchanged checkpoint is not re-read), the others only
fingerprints; the head's scan is verified against the recipe's layout and every node's fingerprints
are compared. When the summaries show a problem, the head sends its full headers (compressed) so
the finding names the tensor and the shard (the flow: orchestrate/verify_model.py; here the flags, the
layout's resolution and the report). Exit 1 if any finding is an error.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import click

from ..checkpoint.verify import Report, issue
from ..errors import CheckFailed, Failure, UsageError
from ..orchestrate import verify_model
from ..orchestrate.verify_model import verify_local
from ..output import console, finish
from ..rules.findings import INFO
from ..spec.recipes import load_layout


def resolve_layout(g: Any, name: str | None) -> tuple[dict[str, Any] | None, str, Any]:
    """(layout, where it came from, settings or None). --layout wins; else the recipe's."""
    if name:
        try:
            return load_layout(name), f"--layout {name}", None
        except ValueError as exc:
            raise UsageError(str(exc), fix="pass a name from recipes/layouts/ or a path to a .json file") from None
    try:
        settings = g.settings()
        layout = settings.recipe.checkpoint_layout
        return dict(layout), f"recipe {settings.recipe.name}", settings
    except Exception:  # no cluster settings (e.g. NODES unset): fall back to the recipe alone
        pass
    try:
        import os

        from ..spec.recipes import DEFAULT_RECIPE, load_recipe

        recipe = load_recipe(g.recipe or os.environ.get("RECIPE") or DEFAULT_RECIPE)
        return dict(recipe.checkpoint_layout), f"recipe {recipe.name}", None
    except Exception:
        return None, "none", None


def _progress(total: int, enabled: bool) -> tuple[Any, Any]:
    """A rich progress bar on stderr, fed from the hashing threads (rich's Progress is thread-safe)."""
    if not enabled:
        return None, None
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress("deep sha256", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                   console=console(True), transient=True)
    task = bar.add_task("hash", total=total)
    lock = threading.Lock()

    def tick(n: int) -> None:
        with lock:
            bar.update(task, advance=n)

    return bar, tick


def _verify_local(directory: Path, layout: dict[str, Any] | None, deep: bool, workers: int | None,
                  max_header: int, show_progress: bool) -> tuple[Report, dict[str, Any]]:
    total = sum(p.stat().st_size for p in directory.glob("**/*.safetensors")) if deep and directory.is_dir() else 0
    bar, tick = _progress(total, deep and show_progress)
    if bar is not None:
        bar.start()
    try:
        return verify_local(directory, layout, deep, workers, max_header, tick)
    finally:
        if bar is not None:
            bar.stop()


def verify_cluster(g: Any, settings: Any, layout: dict[str, Any] | None, deep: bool,
                   max_header: int) -> tuple[Report, dict[str, Any]]:
    """MODEL on every node (orchestrate/verify_model.py); settings None: the global ones."""
    if settings is None:
        settings = g.settings()  # raises the UsageError that says which setting is missing
    return verify_model.verify_cluster(settings, g.ssh_config_path(), layout, deep, max_header)


def _human(report: Report, where: str, layout_src: str, as_json: bool) -> None:
    from rich.table import Table

    out = console(as_json)
    s = report.summary
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("checkpoint", where)
    t.add_row("rules", layout_src)
    exp = f" (layout expects {s.expected_shards})" if s.expected_shards and s.expected_shards != s.shards else ""
    t.add_row("shards", f"{s.shards}{exp}")
    t.add_row("bytes", f"{s.bytes:,} ({s.bytes / 1e9:.1f} GB, {s.bytes / 2**30:.1f} GiB)")
    t.add_row("tensors", f"{s.tensors:,}")
    t.add_row("quantized", s.quantized_line())
    t.add_row("codebook", s.codebooks or "-")
    for extra in s.optional_files:
        t.add_row("optional", extra)
    if s.deep:
        t.add_row("deep", f"{len(s.deep)} shards hashed (sha256)")
    out.print(t)
    style = {"error": "bold red", "warn": "yellow", "info": "dim"}
    for f in report.findings:
        out.print(f"[{style.get(f.severity, '')}]{f.severity}[/] [bold]{f.code}[/]: {f.reason}",
                  markup=True, highlight=False)
        if f.fix:
            out.print(f"    fix: {f.fix}", markup=False, highlight=False)
    errors = sum(f.severity == "error" for f in report.findings)
    warns = sum(f.severity == "warn" for f in report.findings)
    out.print("[bold green]OK[/]" if report.ok else f"[bold red]FAILED[/]: {errors} error(s)", markup=True,
              end="")
    out.print(f", {warns} warning(s)" if warns else "")


@click.command("verify-model")
@click.option("--local", "local_dir", metavar="DIR", type=click.Path(path_type=Path),
              help="Verify this folder on this machine (default: MODEL on every node).")
@click.option("--deep", is_flag=True, help="Also hash every shard in full (parallel, cached by file identity: path, size, mtime, inode, ctime).")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON document on stdout.")
@click.option("--layout", "layout_name", metavar="NAME",
              help="Checkpoint layout rules (recipes/layouts/NAME.json) instead of the recipe's.")
@click.option("--workers", type=click.IntRange(1, 64), default=None, help="Threads for --deep.")
@click.option("--max-header-mb", type=click.IntRange(1, 1024), default=100, show_default=True,
              help="Largest safetensors header accepted.")
@click.pass_context
def command(ctx: click.Context, local_dir: Path | None, deep: bool, as_json: bool, layout_name: str | None,
            workers: int | None, max_header_mb: int) -> None:
    """Verify the checkpoint's layout and EXL3 ABI from its safetensors headers."""
    g = ctx.obj
    as_json = as_json or bool(getattr(g, "json", False))
    layout, layout_src, settings = resolve_layout(g, layout_name)
    max_header = max_header_mb * 1024 * 1024
    if local_dir is not None:
        if not local_dir.is_dir():  # bad input, as `plan` says of a MODEL that is not a folder: exit 2
            raise UsageError(f"--local {local_dir}: {'not a folder' if local_dir.exists() else 'no such folder'}",
                             fix="pass the checkpoint folder on this machine")
        report, extra = _verify_local(local_dir, layout, deep, workers, max_header, show_progress=True)
        where = str(local_dir.resolve())
    else:
        report, extra = verify_cluster(g, settings, layout, deep, max_header)
        where = checked_where(extra.get("head"), settings.model if settings else g.settings().model,
                              len(extra.get("asked", [])))
    if layout is None:
        report.findings.append(issue(INFO, "no-layout", "no recipe layout: only structure and the EXL3 ABI "
                                       "were checked, not the recipe's scope and bits",
                                       "pass --layout NAME or set RECIPE"))
    if not as_json:
        _human(report, where, layout_src, as_json)
    extra = {k: v for k, v in extra.items() if k != "asked"}
    finish(as_json, {"ok": report.ok, "checkpoint": where, "rules": layout_src, **report.to_dict(), **extra},
           None if report.ok else _failure(report))


def checked_where(head: str | None, model: Any, asked: int) -> str:
    """What was checked: MODEL on the head, and how many other nodes were asked (those that did not
    answer are findings of their own)."""
    others = asked - 1
    return f"{head}:{model}" + (f" and {others} other node{'s' if others > 1 else ''}" if others > 0 else "")


def _failure(report: Report) -> CheckFailed:
    """verify-model's exit 1: its first error is the error, each error finding a failure (with its fix)."""
    errors = [f for f in report.findings if f.severity == "error"]
    first = errors[0] if errors else None
    return CheckFailed(f"the checkpoint failed verification: {len(errors)} error(s)"
                       + (f", first {first.code}: {first.reason}" if first else ""), shown=True,
                       node=_node_of(first) if len(errors) == 1 else None,
                       failures=[Failure(_node_of(f), f.code, f.reason, f.fix or None) for f in errors])


def _node_of(f: Any) -> str | None:
    """The node a checkpoint finding is about (the node-* findings name it in `where`), else None."""
    return str(f.where) if f is not None and f.code.startswith("node-") and f.where else None
