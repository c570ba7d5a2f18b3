"""`sparkctl model pull` and `sparkctl model sync`: the checkpoint onto the cluster.

    sparkctl model pull [--json]                        MODEL_REPO@MODEL_REVISION -> MODEL on the head
    sparkctl model sync [--from NODE] [--to NODE]... [--json]
                                                        MODEL from the head to the ranks, node to node

The flows: pull is orchestrate/model_pull.py (probes/hf_pull.py on the head with its own python,
HF_PYTHON, which needs huggingface_hub; the token follows the script on stdin), sync is
orchestrate/model_sync.py (its pure parts: sparkctl.checkpoint.sync_plan). Here: the flags, the progress board, the report.
"""

from __future__ import annotations

import threading
import time
from contextlib import closing
from typing import Any

import click

from ..errors import CheckFailed, Failure, UsageError
from ..orchestrate.model_pull import pull_on_head, raise_for_status, verify_head
from ..output import console, finish
from ..progress import feed_of

PERIOD = 5.0  # seconds between progress lines when the output is not a terminal


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Board:
    """One progress line per node: updated in place on a terminal, plain lines every PERIOD seconds
    (and on every change of state) otherwise. Always on stderr when stdout carries JSON."""

    def __init__(self, as_json: bool, quiet: bool = False) -> None:
        self.out = console(as_json)
        self.quiet = quiet
        self.tty = self.out.is_terminal and not quiet
        self.lines: dict[str, str] = {}
        self.states: dict[str, str] = {}
        self.last: dict[str, float] = {}
        self.lock = threading.Lock()
        self.live: Any = None

    def __enter__(self) -> Board:
        if self.tty:
            from rich.live import Live

            self.live = Live("", console=self.out, refresh_per_second=4, transient=False)
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()

    def update(self, node: str, state: str, text: str) -> None:
        with self.lock:
            self.lines[node] = f"{node:<12} {state:<11} {text}"
            if self.quiet:
                return
            if self.live is not None:
                from rich.text import Text

                self.live.update(Text("\n".join(self.lines.values())))
                return
            now = time.monotonic()
            if self.states.get(node) != state or now - self.last.get(node, 0.0) >= PERIOD:
                self.states[node], self.last[node] = state, now
                self.out.print(self.lines[node], markup=False, highlight=False)


def _rate_text(done: int, total: int, seconds: float) -> str:
    rate = done / seconds if seconds > 0 else 0.0
    eta = (total - done) / rate if rate > 0 and total > done else 0.0
    pct = 100.0 * done / total if total else 100.0
    return f"{_fmt_bytes(done)} / {_fmt_bytes(total)} ({pct:.0f}%)  {_fmt_bytes(rate)}/s  ETA {eta:.0f}s"


# ------------------------------------------------------------------------------------------- pull
@click.group("model")
def group() -> None:
    """Get the checkpoint onto the cluster: pull it to the head, sync it to the ranks."""


@group.command("pull")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON document on stdout.")
@click.option("--layout", "layout_name", metavar="NAME", help="Layout rules for the check after the download.")
@click.pass_context
def pull(ctx: click.Context, as_json: bool, layout_name: str | None) -> None:
    """Download MODEL_REPO at MODEL_REVISION into MODEL on the head (run there, over SSH), then verify it."""
    g = ctx.obj
    as_json = as_json or bool(getattr(g, "json", False))
    s = g.settings()
    repo, revision = s.get("MODEL_REPO"), s.get("MODEL_REVISION")
    if not repo:
        raise UsageError("no Hub repo to pull: MODEL_REPO is unset (the recipe names none)",
                         fix="set MODEL_REPO=org/name in the env file")
    if not revision:
        raise UsageError(f"MODEL_REVISION is unset: which revision of {repo} to pull?",
                         fix="set MODEL_REVISION to the commit id to pin (or a branch, e.g. main, resolved and "
                             "recorded at pull time)")
    out = console(as_json)
    feed = feed_of(g, "model pull")

    def progress(done: int, total: int, secs: float) -> None:
        board.update(s.head, "downloading", _rate_text(done, total, secs))
        feed.event("pull", "downloading", node=s.head, bytes_done=done, bytes_total=total)

    with Board(as_json, quiet=g.verbosity < 0) as board, closing(feed):
        doc = pull_on_head(s, g.ssh_config_path(), str(repo), str(revision),
                           started=lambda head: board.update(head, "starting", f"{repo}@{revision}"),
                           progress=progress)
        feed.event("pull", str(doc.get("status")), str(doc.get("message") or ""), node=s.head,
                   bytes_done=doc.get("downloaded_bytes"), bytes_total=doc.get("total_bytes"))
        status = doc.get("status")
        board.update(s.head, str(status), f"{_fmt_bytes(int(doc.get('downloaded_bytes') or 0))} downloaded "
                     f"in {doc.get('seconds', 0)}s")
    head = s.head
    raise_for_status(doc, s, str(repo), str(revision))
    report_doc: dict[str, Any] = {"ok": True, "node": head, "dir": str(s.model), **doc}
    if status == "downloaded":
        report = _verify_head(g, s, layout_name)
        report_doc.update(ok=report.ok, verify=report.to_dict())
    if not as_json:
        pinned = "" if doc.get("commit") == revision else f" (resolved {revision} -> {doc.get('commit')}; pin it)"
        if status == "up-to-date":
            out.print(f"{head}:{s.model} already holds {repo}@{doc.get('commit')}{pinned}: nothing to download "
                      f"({doc.get('files')} files, {_fmt_bytes(int(doc.get('total_bytes') or 0))}, "
                      f"{doc.get('seconds')}s)", markup=False, highlight=False)
        else:
            out.print(f"{head}:{s.model} now holds {repo}@{doc.get('commit')}{pinned}: "
                      f"{_fmt_bytes(int(doc.get('downloaded_bytes') or 0))} downloaded; verify-model: "
                      f"{'OK' if report_doc['ok'] else 'FAILED'}", markup=False, highlight=False)
            for f in report_doc.get("verify", {}).get("findings", []):
                if f["severity"] != "info":
                    out.print(f"  {f['severity']} {f['code']}: {f['message']}", markup=False, highlight=False)
    errors = [f for f in report_doc.get("verify", {}).get("findings", []) if f["severity"] == "error"]
    finish(as_json, report_doc, None if report_doc["ok"] else CheckFailed(
        f"{head}:{s.model} was downloaded but fails verify-model: {len(errors)} error(s)"
        + (f", first {errors[0]['code']}: {errors[0]['message']}" if errors else ""), node=head, shown=True,
        fix=next((f["fix"] for f in errors if f.get("fix")), None) or "`sparkctl verify-model` says what is wrong",
        failures=[Failure(head, f["code"], f["message"], f.get("fix") or None) for f in errors]))


def _verify_head(g: Any, s: Any, layout_name: str | None) -> Any:
    from .verify_model import resolve_layout

    layout, _, settings = resolve_layout(g, layout_name)
    return verify_head(settings or s, g.ssh_config_path(), layout)


# ------------------------------------------------------------------------------------------- sync
@group.command("sync")
@click.option("--from", "source_node", metavar="NODE", help="Copy from this node (default: the head).")
@click.option("--to", "only", metavar="NODE", multiple=True, help="Only these ranks (repeatable; default: all).")
@click.option("--topology", type=click.Choice(["chain", "star"]), default="chain", show_default=True,
              help="chain: the source sends once, each rank forwards to the next as it receives; star: one copy "
                   "per rank from the source.")
@click.option("--streams", type=click.IntRange(1, 8), default=2, show_default=True,
              help="Batches in flight per hop of the chain.")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON document on stdout.")
@click.pass_context
def sync_cmd(ctx: click.Context, source_node: str | None, only: tuple[str, ...], topology: str, streams: int,
             as_json: bool) -> None:
    """Copy MODEL from the head to every rank that lacks it or differs, node to node over the fabric."""
    from ..checkpoint import sync_plan as modelsync
    from ..orchestrate.model_sync import sync

    g = ctx.obj
    as_json = as_json or bool(getattr(g, "json", False))
    s = g.settings()
    if only:
        unknown = [n for n in only if n not in s.nodes]
        if unknown:
            raise UsageError(f"--to {' '.join(unknown)}: not in NODES ({' '.join(s.nodes)})", fix="name nodes of NODES")
    out = console(as_json)
    stop = threading.Event()
    feed = feed_of(g, "model sync")
    ranks = {n: i for i, n in enumerate(s.nodes)}
    with Board(as_json, quiet=g.verbosity < 0) as board, closing(feed):

        def progress(r: modelsync.RankSync) -> None:
            feed.event("sync", "copying" if r.status == "pending" else r.status, r.message, node=r.node,
                       rank=ranks.get(r.node), bytes_done=r.bytes_done, bytes_total=r.need_bytes)
            if r.status in ("pending",):
                board.update(r.node, "copying", _rate_text(r.bytes_done, r.need_bytes, r.seconds))
            else:
                board.update(r.node, r.status, r.message or _fmt_bytes(r.need_bytes))

        try:
            report = sync(s, g.ssh_config_path(), source_node=source_node, progress=progress, stop=stop,
                          only=list(only) or None, topology=topology, streams=streams)
        except KeyboardInterrupt:
            raise click.exceptions.Exit(130) from None
    doc = report.as_dict()
    if not as_json:
        for r in report.ranks.values():
            sent = "" if r.bytes_sent is None else f", {_fmt_bytes(r.bytes_sent)} sent"
            sent += f" from {', then '.join(r.via)}" if r.via else ""
            what = {"up-to-date": "up to date, nothing sent", "complete": f"complete: {len(r.files)} file(s){sent}",
                    "resumable": f"NOT complete, resumable (run `sparkctl model sync` again): {r.message}",
                    "unreachable": f"unreachable, nothing copied: {r.message}",
                    "failed": f"failed: {r.message}"}.get(r.status, f"{r.status}: {r.message}")
            out.print(f"{r.node}: {what} ({r.seconds:.1f}s)", markup=False, highlight=False)
        for f in report.findings:
            out.print(f"{f.severity} {f.code}: {f.reason}", markup=False, highlight=False)
            if f.fix:
                out.print(f"    fix: {f.fix}", markup=False, highlight=False)
        out.print(("OK" if report.ok else ("INTERRUPTED" if report.interrupted else "FAILED"))
                  + f" in {report.seconds:.1f}s", markup=False, highlight=False)
    finish(as_json, doc, None if report.ok else _sync_failure(report))


def _sync_failure(report: Any) -> CheckFailed:
    """model sync's failure: each rank that is not up to date (and each error finding), with its fix."""
    if report.interrupted:
        return CheckFailed("model sync was interrupted; what was copied is kept", exit_code=130, shown=True,
                           fix="run `sparkctl model sync` again: it resumes")
    fixes = {"resumable": "run `sparkctl model sync` again: it resumes",
             "unreachable": "check that the node is up and reachable over SSH, then `sparkctl model sync`",
             "refused": "free space on the node (or fix what the message says), then `sparkctl model sync`"}
    bad = [Failure(r.node, r.status, r.message or r.status,
                   fixes.get(r.status, "see the message; then `sparkctl model sync` again"))
           for r in report.ranks.values() if r.status not in ("up-to-date", "complete")]
    bad += [Failure(f.where if f.where in report.ranks else None, f.code, f.reason, f.fix or None) for f in report.findings
            if f.severity == "error"]
    first = bad[0] if bad else None
    return CheckFailed(f"model sync did not complete on {len(bad)} rank(s)"
                       + (f": {first.node or first.kind}: {first.reason}" if first else ""),
                       node=first.node if len(bad) == 1 and first else None, failures=bad, shown=True)


COMMANDS = {"model": group}
