"""`up`, `wait`, `status`, `logs`, `down`, `lock`, `audit`: the service lifecycle's command line.

These parse flags and print; each command's flow is in `sparkctl.orchestrate` (`up`, `down`,
`status`, `wait` (→ `readiness.wait_ready`), `locking.read_locks` / `break_locks` (`lock`), `audit`);
`logs` is `service.stream_logs`. Each command opens one Cluster (one SSH connection per
node) for its whole run. Mutating commands (`up`, `down`) hold the cluster lock on every node they
change (remote/lockdir.py) and write one audit line per action on every node.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from contextlib import closing
from typing import Any

import click
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..cluster import Cluster, NodeError, parallel, raise_failed
from ..completion import rank_numbers
from ..errors import CheckFailed, Failure, UsageError
from ..options import Globals
from ..orchestrate.audit import read_audit
from ..orchestrate.down import down
from ..orchestrate.locking import break_locks, read_locks, refuse_unreachable
from ..orchestrate.status import collect_status
from ..orchestrate.up import up, up_replicas
from ..output import console, emit_json, emit_json_line, finish, warn
from ..progress import feed_of
from ..remote import service, watchstate
from ..remote.lockdir import (
    FORCE_UNLOCK,
    LockState,
    only_its_user,
)
from ..spec.builders import open_api_warning
from ..spec.settings import Settings
from .common import globals_of, open_cluster, settings_of

DEFAULT_WAIT_TIMEOUT = 3600  # a 308 GB checkpoint over NFS plus graph capture fits well inside an hour


# ------------------------------------------------------------------------------------------- up


@click.command("up")
@click.option("--recreate", is_flag=True, help="Replace the containers even when nothing changed.")
@click.option("--image", "image_ref", metavar="REF",
              help="Run this chain image (a tag, or a content hash: its `<IMAGE>-<hash12>` tag).")
@click.option("--fabric-test", is_flag=True,
              help="Before starting, run an all-reduce across the ranks in the serving image (check --fabric).")
@click.pass_context
def up_cmd(ctx: click.Context, recreate: bool, image_ref: str | None, fabric_test: bool) -> None:
    """Start the service: workers, then the head. Changes nothing if an identical service runs."""
    g = globals_of(ctx)
    if image_ref:
        from ..remote.releases import image_override

        g.extra_overrides = {**g.extra_overrides, "IMAGE": image_override(g.settings(), image_ref)}
    s = settings_of(g)
    warn([w for w in [open_api_warning(s)] if w])
    out = console(g.json)
    t0 = time.monotonic()
    if len(s.topology.replicas) > 1:
        _up_replicas(g, s, recreate=recreate, fabric_test=fabric_test)
        return
    feed = feed_of(g, "up")

    def say(m: str) -> None:
        out.print(m, markup=False, soft_wrap=True)
        feed.event("up", "up", m)

    with closing(feed):
        outcome = up(s, g.ssh_config_path(), recreate=recreate, say=say,
                     fabric_say=(lambda m: out.print(m, markup=False)) if fabric_test else None)
        feed.event("up", "changed" if outcome.changed else "unchanged", f"config {outcome.config_hash}")
    doc = {"changed": outcome.changed, "reasons": outcome.reasons, "started": outcome.started,
           "config_hash": outcome.config_hash, "seconds": round(time.monotonic() - t0, 3)}
    if g.json:
        emit_json(doc)
    elif outcome.changed:
        out.print(f"up: {len(outcome.started)} ranks started (config {outcome.config_hash}) in {doc['seconds']}s; "
                  "next: `sparkctl wait`", markup=False)
    else:
        out.print(f"up: the service is already running with config {outcome.config_hash}; nothing changed",
                  markup=False)


def _up_replicas(g: Globals, s: Settings, *, recreate: bool, fabric_test: bool) -> None:
    """`up` of several replicas: per replica what it did; exit 1 when any failed (it was rolled back alone)."""
    out = console(g.json)
    lock = threading.Lock()

    def say(m: str) -> None:
        with lock:
            out.print(m, markup=False, soft_wrap=True)

    t0 = time.monotonic()
    results = up_replicas(s, g.ssh_config_path(), recreate=recreate, say=say,
                          fabric_say=say if fabric_test else None)
    seconds = round(time.monotonic() - t0, 3)
    failed = [r for r in results if r.error is not None]
    runs = [r for r in results if r.error is None]
    rows: list[dict[str, Any]] = []
    for r in results:
        row: dict[str, Any] = {"replica": r.replica, "head": r.head, "ok": r.error is None}
        if r.outcome is not None:
            row.update(changed=r.outcome.changed, reasons=r.outcome.reasons, started=r.outcome.started,
                       config_hash=r.outcome.config_hash)
        if r.error is not None:
            row.update(error=r.error.message, fix=r.error.fix, rolled_back=True)
        rows.append(row)
    doc = {"ok": not failed, "changed": any(r.get("changed") for r in rows), "replicas": rows, "seconds": seconds}
    if not g.json:
        for r in results:
            if r.outcome is None:
                continue
            o = r.outcome
            out.print(f"up: replica {r.replica} (head {r.head}): " + (
                f"{len(o.started)} ranks started (config {o.config_hash})" if o.changed
                else f"already running with config {o.config_hash}; nothing changed"), markup=False)
    if failed:
        running = (f"replica {runs[0].replica} runs" if len(runs) == 1 else
                   f"replicas {', '.join(str(r.replica) for r in runs)} run" if runs else "no replica runs")
        verdict = "; ".join(f"replica {r.replica} failed and was rolled back" for r in failed)
        detail = "\n".join(f"replica {r.replica} (head {r.head}): {r.error.message}"
                           for r in failed if r.error is not None)
        finish(g.json, doc, CheckFailed(
            f"{verdict}; {running}\n{detail}",
            fix=next((r.error.fix for r in failed if r.error is not None and r.error.fix), None),
            failures=[Failure(r.head, "replica", f"replica {r.replica}: {r.error.message.splitlines()[0]}",
                              r.error.fix or "see the error above; `sparkctl logs --replica "
                                              f"{r.replica}` shows what its ranks said")
                      for r in failed if r.error is not None]))
    finish(g.json, doc)
    if not g.json:
        out.print(f"up: {len(results)} replicas in {seconds}s; next: `sparkctl wait`", markup=False)


# ----------------------------------------------------------------------------------------- wait


@click.command("wait")
@click.option("--timeout", type=float, default=DEFAULT_WAIT_TIMEOUT, show_default=True, help="Seconds to wait.")
@click.option("--url", help="The API's base URL (default: http://<head HostName>:PORT).")
@click.option("--prompt", default="Say hello in five words.", show_default=True, help="The test completion.")
@click.pass_context
def wait_cmd(ctx: click.Context, timeout: float, url: str | None, prompt: str) -> None:
    """Wait until /health is 200, the model is listed and a real chat completion comes back."""
    from ..orchestrate.wait import wait
    from ..remote import readiness  # the HTTP client is imported only by the commands that talk HTTP

    g = globals_of(ctx)
    s = settings_of(g)
    if timeout <= 0:
        raise UsageError("--timeout must be positive")
    out = console(g.json)
    if len(s.topology.replicas) > 1:
        if url:
            raise UsageError("--url names one head, but there are several replicas",
                             fix="leave --url out: wait asks every replica's head")
        _wait_replicas(g, s, timeout, prompt)
        return
    feed = feed_of(g, "wait")

    def on_phase(w: readiness.RankWatch) -> None:
        took = f" ({w.history[-1][0]} took {w.history[-1][1]:.1f}s)" if w.history else ""
        out.print(f"rank {w.rank} ({w.node}): {w.phase}{took}", markup=False)
        feed.event("wait", w.phase, f"{w.phase}{took}", node=w.node, rank=w.rank)

    with closing(feed):
        base_url, result = wait(s, g.ssh_config_path(), url=url, timeout=timeout, prompt=prompt, on_phase=on_phase)
        feed.event("wait", "ready", f"{base_url} serves {', '.join(result['models'])}")
    if g.json:
        emit_json({"ready": True, **result})
        return
    out.print(f"ready after {result['elapsed_s']:.1f}s: {base_url} serves {', '.join(result['models'])}",
              markup=False)
    out.print(f"completion ({result['latency_s']:.2f}s): {result['completion'].strip()}", markup=False)


def _wait_replicas(g: Globals, s: Settings, timeout: float, prompt: str) -> None:
    """`wait` of several replicas (orchestrate.wait.wait_replicas): one line per rank's phase, then each
    replica's answer."""
    from ..orchestrate.wait import wait_replicas
    from ..remote import readiness

    out = console(g.json)
    lock = threading.Lock()

    def on_phase(view: Settings, w: readiness.RankWatch) -> None:
        took = f" ({w.history[-1][0]} took {w.history[-1][1]:.1f}s)" if w.history else ""
        with lock:
            out.print(f"replica {view.replica_index} rank {w.rank} ({w.node}): {w.phase}{took}", markup=False)

    results = wait_replicas(s, g.ssh_config_path(), timeout=timeout, prompt=prompt, on_phase=on_phase)
    if g.json:
        emit_json({"ready": True, **{k: v for k, v in results[0].items() if k not in ("replica", "head", "url")},
                   "replicas": results})
        return
    for r in results:
        out.print(f"replica {r['replica']} ready after {r['elapsed_s']:.1f}s: {r['url']} serves "
                  f"{', '.join(r['models'])}; completion ({r['latency_s']:.2f}s): {r['completion'].strip()}",
                  markup=False)


# --------------------------------------------------------------------------------------- status


def _status_view(doc: dict[str, Any]) -> Group:
    t = Table(title=f"cluster {doc['cluster']}", title_justify="left")
    for col in ("rank", "node", "state", "uptime", "restarts", "image", "config"):
        t.add_column(col)
    for r in doc["ranks"]:
        cfg = r.get("config_hash") or ""
        if r.get("config_current") is False:
            cfg += " (stale)"
        t.add_row(str(r["rank"]), r["node"], r["state"],
                  "" if r.get("uptime_s") is None else f"{r['uptime_s']}s", str(r.get("restarts", "")),
                  str(r.get("image_id", ""))[7:19], cfg)
    head = doc["head"]
    health = head["health"]
    lines = [Text(f"head {head['url']}: /health {health if health is not None else 'no answer'}; models: "
                  f"{', '.join(head['models']) or '-'}; "
                  + ", ".join(f"{k} {v:g}" for k, v in head["metrics"].items())),
             Text(watchstate.describe(doc["supervisor"]))]
    lines += [Text(f"✗ {p}") for p in doc["problems"]]
    return Group(t, *lines)


@click.command("status")
@click.option("--url", help="The API's base URL (default: http://<head HostName>:PORT).")
@click.option("--watch", "live", is_flag=True, help="Keep refreshing (a live view; with --json one JSON line each).")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=2.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.pass_context
def status_cmd(ctx: click.Context, url: str | None, live: bool, interval: float) -> None:
    """Every rank's container (state, uptime, restarts, image, config), the head's health and metrics, and
    the supervisor's state. `--watch` keeps refreshing until Ctrl-C."""
    from ..remote import readiness

    g = globals_of(ctx)
    s = settings_of(g)
    if len(s.topology.replicas) > 1:
        if url or live:
            raise UsageError("--url and --watch show one service, but there are several replicas",
                             fix="`sparkctl status` (every replica, once)")
        _status_replicas(g, s)
        return
    with open_cluster(g, s) as cluster:
        api = readiness.HeadApi(url or service.head_base_url(cluster, s), s.get("VLLM_API_KEY"), timeout=3)
        if live:
            _status_live(g, cluster, s, api, interval)
            return
        doc = collect_status(cluster, s, api)
    if not g.json:
        console(False).print(_status_view(doc))
    finish(g.json, doc, _status_failure(doc["problems"]))


def _status_replicas(g: Globals, s: Settings) -> None:
    """`status` of several replicas: each replica's document (its ranks, its head's health) and the total;
    exit 1 when any replica has a problem."""
    from ..remote import readiness

    with open_cluster(g, s) as cluster:
        def one(view: Settings) -> dict[str, Any]:
            api = readiness.HeadApi(service.head_base_url(cluster, view), view.get("VLLM_API_KEY"), timeout=3)
            return {"replica": view.replica_index, **collect_status(cluster, view, api)}

        jobs: list[Callable[[], dict[str, Any]]] = [functools.partial(one, v) for v in s.replicas()]
        docs = parallel(jobs)
    problems = [f"replica {d['replica']}: {p}" for d in docs for p in d["problems"]]
    serving = sum(1 for d in docs if d["ok"])
    doc = {"cluster": s.cluster_name, "replicas": docs, "serving": serving, "total": len(docs),
           "problems": problems, "ok": not problems}
    if not g.json:
        c = console(False)
        for d in docs:
            c.print(f"replica {d['replica']}", markup=False)
            c.print(_status_view(d))
        c.print(f"{serving}/{len(docs)} replicas serving", markup=False)
    finish(g.json, doc, _status_failure(problems))


def _status_failure(problems: list[str]) -> CheckFailed | None:
    """status's exit 1: the first problem is the error, each one a failure (its view already showed them)."""
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckFailed(f"{problems[0]}{more}", shown=True,
                       fix="`sparkctl logs` shows what the ranks said; `sparkctl up` starts what is missing",
                       failures=[Failure(None, "status", p, None) for p in problems])


def _status_live(g: Globals, cluster: Cluster, s: Settings, api: Any, interval: float) -> None:
    """`status --watch`: a rich live view, or NDJSON (one status document per line) with --json."""
    from rich.live import Live

    prev_tokens: tuple[float, float] | None = None

    def tick() -> dict[str, Any]:
        nonlocal prev_tokens
        doc = collect_status(cluster, s, api)
        doc["at"] = time.time()
        tokens = doc["head"]["metrics"].get("generation_tokens")
        if tokens is not None and prev_tokens is not None and doc["at"] > prev_tokens[0]:
            doc["head"]["metrics"]["tokens_per_s"] = round(max(0.0, tokens - prev_tokens[1])
                                                           / (doc["at"] - prev_tokens[0]), 1)
        prev_tokens = None if tokens is None else (doc["at"], tokens)
        return doc

    try:
        if g.json:
            while True:
                emit_json_line(tick())
                time.sleep(interval)
        with Live(_status_view(tick()), console=console(False), auto_refresh=False) as view:
            while True:
                time.sleep(interval)
                view.update(_status_view(tick()), refresh=True)
    except KeyboardInterrupt:
        return


# ----------------------------------------------------------------------------------------- logs


@click.command("logs")
@click.option("--rank", "ranks", type=int, multiple=True, help="Only this rank (repeatable).",
              shell_complete=rank_numbers)
@click.option("--replica", type=int, default=0, show_default=True, help="The replica whose ranks to show.")
@click.option("-f", "--follow", is_flag=True, help="Follow all selected ranks at once.")
@click.option("--tail", type=int, default=100, show_default=True, help="Lines per rank to start with.")
@click.pass_context
def logs_cmd(ctx: click.Context, ranks: tuple[int, ...], replica: int, follow: bool, tail: int) -> None:
    """The ranks' logs (of one replica), each line prefixed by its rank and node."""
    g = globals_of(ctx)
    s = settings_of(g).replica(replica)  # one replica: the settings themselves
    node_of = {r.rank: r.node for r in s.service.ranks}
    chosen = list(ranks) or list(node_of)
    bad = [r for r in chosen if r not in node_of]
    if bad:
        raise UsageError(f"--rank {bad[0]}: ranks are 0..{len(node_of) - 1}")
    lock = threading.Lock()
    width = max(len(n) for n in s.nodes)

    def emit(rank: int, node: str, line: str) -> None:
        with lock:
            sys.stdout.write(f"[{rank} {node:<{width}}] {line}\n")
            sys.stdout.flush()

    # Only the chosen ranks' nodes: `logs --rank 2` needs no connection to the others.
    with Cluster([node_of[r] for r in sorted(set(chosen))], g.ssh_config_path()) as cluster:
        errors = service.stream_logs(cluster, s, chosen, tail=tail, follow=follow, emit=emit,
                                     stop=threading.Event())
        errors |= {n: e for n, e in cluster.errors.items() if n in {node_of[r] for r in chosen}}
    raise_failed("logs", errors)


# ----------------------------------------------------------------------------------------- down


@click.command("down")
@click.option("--force", is_flag=True,
              help="Also when a node name now reaches another machine than at the last `up`.")
@click.pass_context
def down_cmd(ctx: click.Context, force: bool) -> None:
    """Stop the service: head first, then workers. Only this cluster's labelled containers."""
    g = globals_of(ctx)
    s = settings_of(g)
    out = console(g.json)
    t0 = time.monotonic()
    failed = down(s, g.ssh_config_path(), say=lambda m: out.print(m, markup=False, soft_wrap=True), force=force)
    seconds = round(time.monotonic() - t0, 3)
    doc = {"ok": not failed, "failed": {n: e.as_dict() for n, e in failed.items()}, "seconds": seconds}
    if not g.json:
        down_nodes = [n for n in s.nodes if n not in failed]
        out.print(f"down: {len(down_nodes)}/{len(s.nodes)} nodes clean in {seconds}s", markup=False)
        for n, e in failed.items():
            out.print(f"✗ {n}: {e.reason}" + (f" (fix: {e.fix})" if e.fix else ""), markup=False)
    finish(g.json, doc, CheckFailed(
        f"down did not finish on {len(failed)} node(s): " + "; ".join(f"{n}: {e.reason}" for n, e in failed.items()),
        node=next(iter(failed)) if len(failed) == 1 else None, shown=True,
        failures=[e.as_dict() for e in failed.values()]) if failed else None)


# ----------------------------------------------------------------------------------- lock, audit


@click.group("lock", invoke_without_command=True)
@click.option("--force-unlock", is_flag=True, help="Break the lock (only when its holder is gone).")
@click.pass_context
def lock_cmd(ctx: click.Context, force_unlock: bool) -> None:
    """Show the cluster lock (`sparkctl lock status`) or break it (`--force-unlock`)."""
    force = force_unlock
    if ctx.invoked_subcommand is not None and not force:
        return
    g = globals_of(ctx)
    s = settings_of(g)
    if not force:
        _show_lock(g, s, read_locks(s, g.ssh_config_path()))
        return
    res = break_locks(s, g.ssh_config_path())
    broken = res.broken
    warn([f"lock broken on {', '.join(broken)}; it was held by "
          + "; ".join(sorted({h.describe() for h in broken.values()}))] if broken
         else [] if res.kept else ["there was no lock"])
    first = next(iter(broken.values()), None)
    doc = {"broken": first.public() if first else None, "nodes": sorted(broken),
           "kept": {n: user for n, (_, user) in res.kept.items()}}
    failure: CheckFailed | None = None
    if res.kept:  # another SSH user's lock: this user may not remove it (exit 1, naming each)
        node, (held, user) = next(iter(res.kept.items()))
        failure = CheckFailed(f"the lock stays on {', '.join(res.kept)}: held by {held.describe()}",
                              fix=only_its_user(node, user, s.cluster_name))
    else:
        try:
            refuse_unreachable(res.unreachable)  # a node that did not answer keeps its lock: exit 1, naming it
        except CheckFailed as exc:
            failure = exc
    finish(g.json, doc, failure)


def _show_lock(g: Globals, s: Settings, states: dict[str, LockState]) -> None:
    """One line per holder (normally one command, holding the lock on every node it changes)."""
    holders: dict[str, tuple[LockState, list[str]]] = {}
    for node, st in states.items():
        holders.setdefault(st.owner.token or f"unknown@{node}", (st, []))[1].append(node)
    held = next(iter(holders.values()))[0] if holders else None
    if g.json:
        emit_json({"locked": held is not None, "holder": held.as_dict() if held else None,
                   "nodes": {n: st.as_dict() for n, st in states.items()}})
        return
    out = console(False)
    if not holders:
        out.print(f"cluster {s.cluster_name}: not locked", markup=False)
    for st, nodes in holders.values():
        out.print(f"locked on {', '.join(nodes)} by {st.describe()}", markup=False)
        if st.others and (st.dead or st.stale):
            out.print(f"if that run is really gone: {only_its_user(nodes[0], st.ssh_user, s.cluster_name)}",
                      markup=False)
        elif st.dead:
            out.print("the next command that takes the lock breaks it automatically (audited)", markup=False)
        elif st.stale:
            out.print(f"if that run is really gone: `{FORCE_UNLOCK}`", markup=False)


@lock_cmd.command("status")
@click.pass_context
def lock_status_cmd(ctx: click.Context) -> None:
    """Who holds the cluster lock, on which nodes, since when, running what."""
    g = globals_of(ctx)
    s = settings_of(g)
    _show_lock(g, s, read_locks(s, g.ssh_config_path()))


@click.command("audit")
@click.option("--tail", type=int, default=50, show_default=True, help="Lines per node.")
@click.pass_context
def audit_cmd(ctx: click.Context, tail: int) -> None:
    """The audit lines sparkctl wrote on every node, merged by time."""
    g = globals_of(ctx)
    s = settings_of(g)
    entries, unreachable = read_audit(s, g.ssh_config_path(), tail)
    doc = {"entries": entries, "unreachable": list(unreachable)}
    if not g.json:
        out = console(False)
        for e in entries:
            rank = f" rank {e['rank']}" if "rank" in e else ""
            cfg = f" config {e['config_hash']}" if e.get("config_hash") else ""
            out.print(f"{e.get('when')} {e['node']} {e.get('who')} {e.get('action')}{rank}{cfg} "
                      f"{e.get('detail', '')}", markup=False)
    finish(g.json, doc, _audit_failure(s.nodes, unreachable))


def _audit_failure(nodes: list[str], unreachable: dict[str, NodeError]) -> CheckFailed | None:
    """audit is incomplete when a node did not answer (exit 1, naming each); no answer at all says so."""
    if not unreachable:
        return None
    missing = ", ".join(unreachable)
    what = (f"no node answered, so there is no audit to show ({missing})" if len(unreachable) == len(nodes)
            else f"the audit is incomplete: no answer from {missing} (the other nodes' lines are shown)")
    return CheckFailed(what, node=next(iter(unreachable)) if len(unreachable) == 1 else None,
                       failures=[e.as_dict() for e in unreachable.values()])


COMMANDS = {
    "up": up_cmd,
    "wait": wait_cmd,
    "status": status_cmd,
    "logs": logs_cmd,
    "down": down_cmd,
    "lock": lock_cmd,
    "audit": audit_cmd,
}
