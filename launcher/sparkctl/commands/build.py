"""`sparkctl build [--ship] [--only LAYER] [--no-cache] [--dry-run]`: the image chain on every rank.

The flags, the progress board and the report; the flow itself (probe, plan, build, ship, verify,
retain) is `orchestrate/build.py`, whose docstring says what each mode does. Exit 1 if any rank failed.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ..completion import layer_names
from ..errors import CheckFailed, Failure, UsageError
from ..orchestrate.build import RankResult, build
from ..output import finish
from ..progress import Feed, feed_of

# ------------------------------------------------------------------------------------ display


class Board:
    """Per-rank, per-layer progress on stderr: a live table on a terminal, one line per event otherwise."""

    STYLE = {"skip": "dim", "built": "green", "shipped": "green", "failed": "bold red", "building": "yellow",
             "pulling": "yellow", "shipping": "yellow", "keep": "dim", "stale": "magenta", "blocked": "red"}

    def __init__(self, nodes: Sequence[str], layers: Sequence[str], *, quiet: bool, feed: Feed | None = None) -> None:
        self.nodes, self.layers = list(nodes), list(layers)
        self.feed = feed  # --events: one line per change of a layer's state per rank
        self.cells: dict[tuple[str, str], str] = {}
        self.notes: dict[str, str] = {}
        self.lock = threading.Lock()
        self.console = Console(stderr=True, highlight=False)
        self.quiet = quiet
        self.live: Live | None = None
        if not quiet and self.console.is_terminal:
            self.live = Live(self._table(), console=self.console, refresh_per_second=8, transient=False)

    def __enter__(self) -> Board:
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live:
            self.live.update(self._table())
            self.live.stop()

    def set(self, node: str, layer: str, text: str, *, event: bool = True) -> None:
        if self.feed is not None and event:
            self.feed.event("build", f"{layer} {text.split(' ')[0]}", text, node=node, rank=self._rank(node))
        with self.lock:
            self.cells[(node, layer)] = text
            if self.live:
                self.live.update(self._table())
            elif event and not self.quiet:
                self.console.print(f"{node} {layer}: {text}", markup=False)

    def _rank(self, node: str) -> int | None:
        return self.nodes.index(node) if node in self.nodes else None

    def note(self, node: str, text: str) -> None:
        if self.feed is not None:
            self.feed.event("build", "note", text, node=node, rank=self._rank(node))
        with self.lock:
            self.notes[node] = text
            if self.live:
                self.live.update(self._table())
            elif not self.quiet:
                self.console.print(f"{node}: {text}", markup=False)

    def _table(self) -> Table:
        t = Table(box=None, pad_edge=False, header_style="bold")
        t.add_column("rank")
        for layer in self.layers:
            t.add_column(layer)
        t.add_column("")
        for node in self.nodes:
            row = []
            for layer in self.layers:
                text = self.cells.get((node, layer), "·")
                style = self.STYLE.get(text.split(" ")[0], "")
                row.append(f"[{style}]{text}[/]" if style else text)
            t.add_row(node, *row, self.notes.get(node, ""))
        return t


# ------------------------------------------------------------------------------------ the command


@click.command(name="build")
@click.option("--ship", is_flag=True, help="Build once on the head, then send each rank only the layers it lacks.")
@click.option("--only", "only", metavar="LAYER", help="Build just this layer (its parent must be on the node).",
              shell_complete=layer_names)
@click.option("--no-cache", is_flag=True, help="Rebuild even when the content hash matches (docker build --no-cache).")
@click.option("--dry-run", is_flag=True, help="Print the plan (what builds, skips or ships where, and why); change nothing.")
@click.pass_context
def command(ctx: click.Context, ship: bool, only: str | None, no_cache: bool, dry_run: bool) -> None:
    """Build the image chain on every rank (or once on the head with --ship)."""
    g = ctx.obj
    settings = g.settings()
    recipe = settings.recipe
    if recipe.prebuilt is not None and (only is not None or no_cache):
        raise UsageError(f"--only and --no-cache name chain layers, and recipe {recipe.name} builds none: "
                         f"it runs a prebuilt image ({recipe.prebuilt.source})",
                         fix="run `sparkctl build` (it gives every rank the head's copy of IMAGE)")
    quiet = g.verbosity < 0 or g.json
    feed = feed_of(g, "build")
    try:
        done = build(settings, g.ssh_config_path(), ship=ship, only=only, no_cache=no_cache, dry_run=dry_run,
                     progress=lambda nodes, layers: Board(nodes, layers, quiet=quiet, feed=feed))
    finally:
        feed.close()
    _finish(g, done.out, done.results, print_plan=done.plan_only)


def _finish(g: Any, out: dict[str, Any], results: dict[str, RankResult], *, print_plan: bool = False) -> None:
    failed = [r for r in results.values() if not r.ok]
    out["ok"] = not failed
    out["ranks"] = [r.as_dict() for r in results.values()]
    con = Console(stderr=g.json, highlight=False)
    if g.json:
        pass
    elif print_plan:
        for node, p in out["plan"].items():
            if "error" in p:
                con.print(f"[bold]{node}[/]: [red]cannot build: {p['error']}[/]")
            elif "steps" in p:
                for s in p["steps"]:
                    con.print(f"[bold]{node}[/] {s['layer']:6} {s['action']:7} {s['reason']}", markup=True)
            elif "image" in p:
                con.print(f"[bold]{node}[/] image  {p['image']}", markup=True)
            else:
                con.print(f"[bold]{node}[/] ship   {p['ship']}")
        if out.get("transport"):
            con.print(f"how: {out['transport']['how']}: {out['transport']['why']}", markup=False)
    elif g.verbosity >= 0:
        for r in results.values():
            built = [x.layer for x in r.layers.values() if x.action == "built"]
            skipped = [x.layer for x in r.layers.values() if x.action == "skip"]
            parts = []
            if built:
                parts.append("built " + " ".join(built))
            if skipped:
                parts.append("up to date " + " ".join(skipped))
            if r.ship_note:
                parts.append(r.ship_note if r.ship_note.startswith(("up", "pulled")) else "shipped " + r.ship_note)
            status = "[green]ok[/]" if r.ok else f"[red]FAILED[/] {r.error}"
            ident = f" {r.image_id[:19]}" if r.image_id and r.ok else ""
            con.print(f"[bold]{r.node}[/] {status}{ident}  {'; '.join(parts)}", markup=True)
            if r.fix and not r.ok:
                con.print(f"  fix: {r.fix}", markup=False)
    failure = None
    if failed:
        names = ", ".join(f"{r.node} ({(r.error or '').splitlines()[0] if r.error else ''})" for r in failed)
        failure = CheckFailed(f"build failed on {len(failed)} of {len(results)} rank(s): {names}",
                              node=failed[0].node if len(failed) == 1 else None,
                              failures=[Failure(r.node, "build", r.error or "failed",
                                                r.fix or f"`sparkctl build --dry-run` shows the plan for {r.node}")
                                        for r in failed])
    finish(g.json, out, failure)
    if sys.stdout.isatty():
        sys.stdout.flush()
