"""`up`, `wait`, `status`, `logs`, `down`, `lock`, `audit`: the service lifecycle.

Each command opens one Cluster (one SSH connection per node) for its whole run. Mutating commands
(`up`, `down`) hold the cluster lock on the head and write one audit line per action on every node.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from .. import service
from ..builders import open_api_warning
from ..cli import Globals
from ..cluster import Cluster, Node, NodeError
from ..errors import CheckFailed, UsageError
from ..lock import (
    FORCE_UNLOCK,
    LockState,
    audit_append_argv,
    audit_line,
    audit_tail_argv,
    cluster_lock,
    lock_state,
)
from ..lock import force_unlock as break_lock
from ..output import console, emit_json, warn, warn_console
from ..pins import live_pins, pins_from_facts, probe_node
from ..plan import CheckpointInfo, Plan, make_plan, read_checkpoint_on, require_fit
from ..render import Rendered, render_all, write_private
from ..settings import Settings

DEFAULT_WAIT_TIMEOUT = 3600  # a 308 GB checkpoint over NFS plus graph capture fits well inside an hour
ENV_TP4 = Path("env/env.tp4")


def _globals(ctx: click.Context) -> Globals:
    g = ctx.find_object(Globals)
    assert g is not None
    return g


def _settings(g: Globals) -> Settings:
    s = g.settings()
    warn(s.warnings)
    return s


def _cluster(g: Globals, s: Settings) -> Cluster:
    return Cluster(s.nodes, g.ssh_config_path())


def _require_all(cluster: Cluster, what: str) -> None:
    if cluster.errors:
        lines = [f"{n}: {e.reason}" + (f"\n    fix: {e.fix}" if e.fix else "") for n, e in cluster.errors.items()]
        raise CheckFailed(f"{what}: {len(cluster.errors)} node(s) unreachable, nothing was changed:\n  "
                          + "\n  ".join(lines))


def _plan(cluster: Cluster, s: Settings, ckpt: CheckpointInfo | None = None) -> Plan:
    """The memory plan from the checkpoint as the head sees it (the nodes' view is the one that runs)."""
    plan = make_plan(s, ckpt or read_checkpoint_on(cluster.node(s.head), s.model))
    require_fit(plan)
    return plan


def _render(cluster: Cluster, s: Settings, source: str) -> Rendered:
    plan = _plan(cluster, s)
    pins = live_pins(cluster, s)
    return render_all(s, plan, pins, source=source)


# ------------------------------------------------------------------------------------------- up


@click.command("up")
@click.option("--recreate", is_flag=True, help="Replace the containers even when nothing changed.")
@click.pass_context
def up_cmd(ctx: click.Context, recreate: bool) -> None:
    """Start the service: workers, then the head. Changes nothing if an identical service runs."""
    g = _globals(ctx)
    s = _settings(g)
    warn([w for w in [open_api_warning(s)] if w])
    out = console(g.json)
    t0 = time.monotonic()
    with _cluster(g, s) as cluster:
        _require_all(cluster, "up refused")
        head = cluster.node(s.head)
        with cluster_lock(head, s.head, s.cluster_name, "up"):
            # One round on every node at once: its fabric facts (pins are resolved at every `up`, the
            # GID index drifts), its containers and its image; the head also reads the checkpoint.
            image = str(s.get("IMAGE"))

            def preflight(node: Node) -> tuple[Any, Any, CheckpointInfo | None]:
                # Channels on the node's one connection run side by side: probe, docker, checkpoint.
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    state = pool.submit(service.node_state, node, s.cluster_name, image)
                    reader = pool.submit(read_checkpoint_on, node, s.model) if node.name == s.head else None
                    facts = probe_node(node, s)
                    return facts, state.result(), reader.result() if reader else None

            rounds = cluster.run_all(preflight, nodes=s.nodes)
            failed = {n: r for n, r in rounds.items() if isinstance(r, NodeError)}
            if failed:
                raise CheckFailed("up refused, nothing was changed:\n  " + "\n  ".join(
                    f"{n}: {e.reason}" + (f" (fix: {e.fix})" if e.fix else "") for n, e in failed.items()))
            ok = {n: r for n, r in rounds.items() if not isinstance(r, NodeError)}
            plan = _plan(cluster, s, ok[s.head][2])
            pins = pins_from_facts(s, {n: r[0] for n, r in ok.items()})
            rendered = render_all(s, plan, pins, source="sparkctl up")
            try:
                write_private(ENV_TP4, rendered.env_tp4)
            except OSError as exc:
                warn([f"could not write {ENV_TP4}: {exc}"])
            outcome = service.up(cluster, s, rendered.specs, rendered.config_hash, recreate=recreate,
                                 say=lambda m: out.print(m, markup=False, soft_wrap=True),
                                 gathered={n: r[1] for n, r in ok.items()})
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


# ----------------------------------------------------------------------------------------- wait


@click.command("wait")
@click.option("--timeout", type=float, default=DEFAULT_WAIT_TIMEOUT, show_default=True, help="Seconds to wait.")
@click.option("--url", help="The API's base URL (default: http://<head HostName>:PORT).")
@click.option("--prompt", default="Say hello in five words.", show_default=True, help="The test completion.")
@click.pass_context
def wait_cmd(ctx: click.Context, timeout: float, url: str | None, prompt: str) -> None:
    """Wait until /health is 200, the model is listed and a real chat completion comes back."""
    from .. import readiness  # the HTTP client is imported only by the commands that talk HTTP

    g = _globals(ctx)
    s = _settings(g)
    if timeout <= 0:
        raise UsageError("--timeout must be positive")
    out = console(g.json)
    with _cluster(g, s) as cluster:
        _require_all(cluster, "wait")
        api = readiness.HeadApi(url or service.head_base_url(cluster, s), s.get("VLLM_API_KEY"))

        def on_phase(w: readiness.RankWatch) -> None:
            took = f" ({w.history[-1][0]} took {w.history[-1][1]:.1f}s)" if w.history else ""
            out.print(f"rank {w.rank} ({w.node}): {w.phase}{took}", markup=False)

        result = readiness.wait_ready(cluster, s, api, timeout=timeout, on_phase=on_phase, prompt=prompt)
    if g.json:
        emit_json({"ready": True, **result})
        return
    out.print(f"ready after {result['elapsed_s']:.1f}s: {api.base_url} serves {', '.join(result['models'])}",
              markup=False)
    out.print(f"completion ({result['latency_s']:.2f}s): {result['completion'].strip()}", markup=False)


# --------------------------------------------------------------------------------------- status


def _metrics_summary(text: str | None) -> dict[str, float]:
    wanted = {"vllm:num_requests_running": "requests_running", "vllm:num_requests_waiting": "requests_waiting",
              "vllm:kv_cache_usage_perc": "kv_cache_usage", "vllm:generation_tokens_total": "generation_tokens"}
    found: dict[str, float] = {}
    for line in (text or "").splitlines()[:20000]:
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            try:
                found[wanted[name]] = found.get(wanted[name], 0.0) + float(line.rsplit(" ", 1)[-1])
            except ValueError:
                continue
    return found


@click.command("status")
@click.option("--url", help="The API's base URL (default: http://<head HostName>:PORT).")
@click.pass_context
def status_cmd(ctx: click.Context, url: str | None) -> None:
    """Every rank's container (state, uptime, restarts, image, config) and the head's health."""
    from .. import readiness

    g = _globals(ctx)
    s = _settings(g)
    problems: list[str] = []
    with _cluster(g, s) as cluster:
        states = cluster.run_all(lambda n: service.inspect_cluster(n, s.cluster_name), nodes=s.nodes)
        current: str | None = None
        try:
            current = _render(cluster, s, "sparkctl status").config_hash if not cluster.errors else None
        except (UsageError, CheckFailed) as exc:
            problems.append(f"current config unknown: {exc.message}")
        api = readiness.HeadApi(url or service.head_base_url(cluster, s), s.get("VLLM_API_KEY"), timeout=3)
        health = api.health()
        models: list[str] = []
        if health == 200:
            try:
                models = api.models()
            except Exception as exc:  # an odd answer is a finding, not a crash
                problems.append(f"/v1/models failed: {exc}"[:200])
        metrics = _metrics_summary(api.metrics() if health == 200 else None)
    ranks: list[dict[str, Any]] = []
    image_ids = set()
    for rank, node in enumerate(s.nodes):
        st = states[node]
        if isinstance(st, NodeError):
            ranks.append({"rank": rank, "node": node, "state": "unreachable", "error": st.reason})
            problems.append(f"rank {rank} ({node}) unreachable: {st.reason}" + (f" (fix: {st.fix})" if st.fix else ""))
            continue
        mine = [c for c in st if c.rank == rank]
        if not mine:
            ranks.append({"rank": rank, "node": node, "state": "absent"})
            problems.append(f"rank {rank} ({node}): no container")
            continue
        c = mine[0]
        image_ids.add(c.image_identity)
        up_s = c.uptime_s()
        row: dict[str, Any] = {"rank": rank, "node": node, "state": c.status, "uptime_s": None if up_s is None else round(up_s),
               "restarts": c.restarts, "image_id": c.image_id, "image_content_hash": c.content_hash,
               "config_hash": c.config_hash,
               "config_current": None if current is None else c.config_hash == current}
        ranks.append(row)
        if not c.running:
            problems.append(f"rank {rank} ({node}): {c.status} (exit {c.exit_code})")
        if current is not None and c.config_hash != current:
            problems.append(f"rank {rank} ({node}): config {c.config_hash} is not the current {current} "
                            "(run `sparkctl up` to apply)")
    if len(image_ids) > 1:
        problems.append("ranks run different images (content hash or ID): "
                        + ", ".join(sorted(i[:19] for i in image_ids)))
    if health != 200:
        problems.append(f"head /health: {health if health is not None else 'no answer'}")
    elif str(s.get("SERVED_MODEL_NAME")) not in models:
        problems.append(f"/v1/models does not list {s.get('SERVED_MODEL_NAME')}")
    doc = {"cluster": s.cluster_name, "ranks": ranks, "head": {"url": api.base_url, "health": health,
                                                               "models": models, "metrics": metrics},
           "current_config_hash": current, "problems": problems, "ok": not problems}
    if g.json:
        emit_json(doc)
    else:
        out = console(False)
        t = Table(title=f"cluster {s.cluster_name}", title_justify="left")
        for col in ("rank", "node", "state", "uptime", "restarts", "image", "config"):
            t.add_column(col)
        for r in ranks:
            cfg = r.get("config_hash") or ""
            if r.get("config_current") is False:
                cfg += " (stale)"
            t.add_row(str(r["rank"]), r["node"], r["state"],
                      "" if r.get("uptime_s") is None else f"{r['uptime_s']}s", str(r.get("restarts", "")),
                      str(r.get("image_id", ""))[7:19], cfg)
        out.print(t)
        out.print(f"head {api.base_url}: /health {health if health is not None else 'no answer'}; models: "
                  f"{', '.join(models) or '-'}; " + ", ".join(f"{k} {v:g}" for k, v in metrics.items()),
                  markup=False)
        for p in problems:
            out.print(f"✗ {p}", markup=False)
    if problems:
        sys.exit(1)


# ----------------------------------------------------------------------------------------- logs


@click.command("logs")
@click.option("--rank", "ranks", type=int, multiple=True, help="Only this rank (repeatable).")
@click.option("-f", "--follow", is_flag=True, help="Follow all selected ranks at once.")
@click.option("--tail", type=int, default=100, show_default=True, help="Lines per rank to start with.")
@click.pass_context
def logs_cmd(ctx: click.Context, ranks: tuple[int, ...], follow: bool, tail: int) -> None:
    """The ranks' logs, each line prefixed by its rank and node."""
    g = _globals(ctx)
    s = _settings(g)
    chosen = list(ranks) or list(range(len(s.nodes)))
    bad = [r for r in chosen if not 0 <= r < len(s.nodes)]
    if bad:
        raise UsageError(f"--rank {bad[0]}: ranks are 0..{len(s.nodes) - 1}")
    lock = threading.Lock()
    width = max(len(n) for n in s.nodes)

    def emit(rank: int, node: str, line: str) -> None:
        with lock:
            sys.stdout.write(f"[{rank} {node:<{width}}] {line}\n")
            sys.stdout.flush()

    with _cluster(g, s) as cluster:
        errors = service.stream_logs(cluster, s, chosen, tail=tail, follow=follow, emit=emit,
                                     stop=threading.Event())
        errors |= {n: e for n, e in cluster.errors.items() if s.nodes.index(n) in chosen}
    for node, err in errors.items():
        warn_console().print(f"{node}: {err.reason}", markup=False)
    if errors:
        sys.exit(1)


# ----------------------------------------------------------------------------------------- down


@click.command("down")
@click.pass_context
def down_cmd(ctx: click.Context) -> None:
    """Stop the service: head first, then workers. Only this cluster's labelled containers."""
    g = _globals(ctx)
    s = _settings(g)
    out = console(g.json)
    t0 = time.monotonic()
    with _cluster(g, s) as cluster:
        if s.head in cluster.connected:
            with cluster_lock(cluster.node(s.head), s.head, s.cluster_name, "down"):
                failed = service.down(cluster, s, say=lambda m: out.print(m, markup=False, soft_wrap=True))
        else:
            warn([f"the head {s.head} is unreachable: tearing down the other nodes without the cluster lock"])
            failed = service.down(cluster, s, say=lambda m: out.print(m, markup=False, soft_wrap=True))
    seconds = round(time.monotonic() - t0, 3)
    if g.json:
        emit_json({"ok": not failed, "failed": {n: e.as_dict() for n, e in failed.items()}, "seconds": seconds})
    else:
        down_nodes = [n for n in s.nodes if n not in failed]
        out.print(f"down: {len(down_nodes)}/{len(s.nodes)} nodes clean in {seconds}s", markup=False)
        for n, e in failed.items():
            out.print(f"✗ {n}: {e.reason}" + (f" (fix: {e.fix})" if e.fix else ""), markup=False)
    if failed:
        sys.exit(1)


# ----------------------------------------------------------------------------------- lock, audit


@click.group("lock", invoke_without_command=True)
@click.option("--force-unlock", is_flag=True, help="Break the lock (only when its holder is gone).")
@click.pass_context
def lock_cmd(ctx: click.Context, force_unlock: bool) -> None:
    """Show the cluster lock (`sparkctl lock status`) or break it (`--force-unlock`)."""
    force = force_unlock
    if ctx.invoked_subcommand is not None and not force:
        return
    g = _globals(ctx)
    s = _settings(g)
    with _cluster(g, s) as cluster:
        head = cluster.node(s.head)
        if force:
            held = break_lock(head, s.cluster_name)
            if held:
                head.run(audit_append_argv(s.cluster_name, [audit_line(
                    action="lock-broken", detail=f"by --force-unlock; it was held by {held.describe()}")]), timeout=20)
            warn([f"lock broken; it was held by {held.describe()}" if held else "there was no lock"])
            if g.json:
                emit_json({"broken": held.public() if held else None})
            return
        _show_lock(g, s, lock_state(head, s.cluster_name))


def _show_lock(g: Globals, s: Settings, held: LockState | None) -> None:
    if g.json:
        emit_json({"locked": held is not None, "holder": held.as_dict() if held else None})
        return
    out = console(False)
    out.print(f"locked by {held.describe()}" if held else f"cluster {s.cluster_name}: not locked", markup=False)
    if held and held.dead:
        out.print("the next `up` or `down` breaks it automatically (audited)", markup=False)
    elif held and held.stale:
        out.print(f"if that run is really gone: `{FORCE_UNLOCK}`", markup=False)


@lock_cmd.command("status")
@click.pass_context
def lock_status_cmd(ctx: click.Context) -> None:
    """Who holds the cluster lock, since when, running what."""
    g = _globals(ctx)
    s = _settings(g)
    with _cluster(g, s) as cluster:
        _show_lock(g, s, lock_state(cluster.node(s.head), s.cluster_name))


@click.command("audit")
@click.option("--tail", type=int, default=50, show_default=True, help="Lines per node.")
@click.pass_context
def audit_cmd(ctx: click.Context, tail: int) -> None:
    """The audit lines sparkctl wrote on every node, merged by time."""
    g = _globals(ctx)
    s = _settings(g)
    entries: list[dict[str, Any]] = []
    with _cluster(g, s) as cluster:
        results = cluster.run_all(audit_tail_argv(s.cluster_name, tail), nodes=cluster.connected)
    for node, r in results.items():
        if isinstance(r, NodeError):
            continue
        for line in r.stdout.splitlines():
            try:
                doc = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict):
                entries.append({"node": node, **doc})
    entries.sort(key=lambda e: (str(e.get("when", "")), e["node"]))
    if g.json:
        emit_json({"entries": entries, "unreachable": sorted(cluster.errors)})
        return
    out = console(False)
    for e in entries:
        rank = f" rank {e['rank']}" if "rank" in e else ""
        cfg = f" config {e['config_hash']}" if e.get("config_hash") else ""
        out.print(f"{e.get('when')} {e['node']} {e.get('who')} {e.get('action')}{rank}{cfg} {e.get('detail', '')}",
                  markup=False)
    for n in cluster.errors:
        warn([f"{n}: unreachable, its audit log is not shown"])


COMMANDS = {
    "up": up_cmd,
    "wait": wait_cmd,
    "status": status_cmd,
    "logs": logs_cmd,
    "down": down_cmd,
    "lock": lock_cmd,
    "audit": audit_cmd,
}
