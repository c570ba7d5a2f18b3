"""`up`, `wait`, `status`, `logs`, `down`, `lock`, `audit`: the service lifecycle.

Each command opens one Cluster (one SSH connection per node) for its whole run. Mutating commands
(`up`, `down`) hold the cluster lock on the head and write one audit line per action on every node.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .. import service, watchstate
from ..builders import open_api_warning
from ..cli import Globals
from ..cluster import Cluster, Node, NodeError, parallel
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
from ..pins import pins_from_facts, probe_node
from ..plan import (
    CheckpointInfo,
    Plan,
    drafter_dir,
    make_plan,
    nodes_compute_capability,
    read_checkpoint_on,
    require_fit,
)
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


def _plan(cluster: Cluster, s: Settings, ckpt: CheckpointInfo | None = None,
          facts: dict[str, Any] | None = None) -> Plan:
    """The memory plan from the checkpoint as the head sees it (the nodes' view is the one that runs),
    for the GPU generation the nodes report (it decides vLLM's KV-cache backend and bytes)."""
    caps = {n: (f.gpus[0].compute_cap if getattr(f, "gpus", None) else None) for n, f in (facts or {}).items()}
    cc, problem = nodes_compute_capability(caps)
    if problem:
        raise CheckFailed(f"up refused, nothing was changed: {problem}")
    plan = make_plan(s, ckpt or read_checkpoint_on(cluster.node(s.head), s.model, drafter_dir(s)),
                     compute_capability=cc)
    require_fit(plan)
    return plan


def _render(cluster: Cluster, s: Settings, source: str) -> Rendered:
    """What `up` would render now: the same probe per node (pins, GPU generation) and the same plan."""
    facts = cluster.run_all(lambda n: probe_node(n, s), nodes=s.nodes)
    pins = pins_from_facts(s, facts)
    plan = _plan(cluster, s, facts=facts.ok)
    return render_all(s, plan, pins, source=source)


# ------------------------------------------------------------------------------------------- up


def start_service(cluster: Cluster, s: Settings, *, recreate: bool, say: Any,
                  source: str = "sparkctl up",
                  before_start: Callable[[list[Any], dict[str, Any]], None] | None = None) -> service.UpOutcome:
    """The body of `up` under the cluster lock (the caller holds it): preflight every node, plan,
    render, start; a started service is recorded in the head's history. `watch` and `rollback`
    come through here too, so they start exactly what `up` would. before_start(pins, containers per
    node) runs after rendering and before anything starts (`up --fabric-test`); it raises to refuse."""
    # One round on every node at once: its fabric facts (pins are resolved at every `up`, the
    # GID index drifts), its containers and its image; the head also reads the checkpoint.
    image = s.image

    def preflight(node: Node) -> tuple[Any, Any, CheckpointInfo | None]:
        # Channels on the node's one connection run side by side: probe, docker, checkpoint.
        jobs: list[Callable[[], Any]] = [lambda: probe_node(node, s),
                                         lambda: service.node_state(node, s.cluster_name, image)]
        if node.name == s.head:
            jobs.append(lambda: read_checkpoint_on(node, s.model, drafter_dir(s)))
        facts, state, *ckpt = parallel(jobs)
        return facts, state, ckpt[0] if ckpt else None

    rounds = cluster.run_all(preflight, nodes=s.nodes)
    failed = rounds.failed
    if failed:
        raise CheckFailed("up refused, nothing was changed:\n  " + "\n  ".join(
            f"{n}: {e.reason}" + (f" (fix: {e.fix})" if e.fix else "") for n, e in failed.items()))
    ok = rounds.ok
    plan = _plan(cluster, s, ok[s.head][2], {n: r[0] for n, r in ok.items()})
    pins = pins_from_facts(s, {n: r[0] for n, r in ok.items()})
    rendered = render_all(s, plan, pins, source=source)
    if before_start is not None:
        before_start(pins, {n: r[1][0] for n, r in ok.items()})
    try:
        write_private(ENV_TP4, rendered.env_tp4)
    except OSError as exc:
        warn([f"could not write {ENV_TP4}: {exc}"])
    outcome = service.up(cluster, s, rendered.specs, rendered.config_hash, recreate=recreate, say=say,
                         gathered={n: r[1] for n, r in ok.items()})
    if outcome.changed:
        from ..history import record_release  # only a started service is recorded

        try:
            record_release(cluster, s, rendered, source=source)
        except (NodeError, CheckFailed) as exc:  # the service runs: a lost record is a warning, not a failure
            warn([f"the service runs, but its history entry was not recorded: {exc}"])
    return outcome


@click.command("up")
@click.option("--recreate", is_flag=True, help="Replace the containers even when nothing changed.")
@click.option("--image", "image_ref", metavar="REF",
              help="Run this chain image (a tag, or a content hash: its `<IMAGE>-<hash12>` tag).")
@click.option("--fabric-test", is_flag=True,
              help="Before starting, run an all-reduce across the ranks in the serving image (check --fabric).")
@click.pass_context
def up_cmd(ctx: click.Context, recreate: bool, image_ref: str | None, fabric_test: bool) -> None:
    """Start the service: workers, then the head. Changes nothing if an identical service runs."""
    g = _globals(ctx)
    if image_ref:
        from ..history import image_override

        g.extra_overrides = {**g.extra_overrides, "IMAGE": image_override(g.settings(), image_ref)}
    s = _settings(g)
    warn([w for w in [open_api_warning(s)] if w])
    out = console(g.json)
    t0 = time.monotonic()
    with _cluster(g, s) as cluster:
        _require_all(cluster, "up refused")
        head = cluster.node(s.head)
        with cluster_lock(head, s.head, s.cluster_name, "up"):
            gate = (lambda pins, states: _fabric_gate(cluster, s, pins, states, out)) if fabric_test else None
            outcome = start_service(cluster, s, recreate=recreate, say=lambda m: out.print(m, markup=False, soft_wrap=True),
                                    before_start=gate)
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


def _fabric_gate(cluster: Cluster, s: Settings, pins: list[Any], states: dict[str, Any], out: Any) -> None:
    """`up --fabric-test`: the collective must pass before any container of the service starts."""
    from ..fabric import run_fabric_test, size_label

    if any(c.running for cs in states.values() for c in cs):
        out.print("fabric test skipped: this cluster's service is running (it holds the GPUs and "
                  "MASTER_PORT); `sparkctl down` first to test the fabric", markup=False)
        return
    report = run_fabric_test(cluster, s, pins, say=lambda m: out.print(m, markup=False))
    bad = [f for f in report.findings if f.status == "fail"]
    if bad:
        raise CheckFailed("up refused: the fabric test failed, nothing was started:\n  " + "\n  ".join(
            f.text + (f"\n    fix: {f.fix}" if f.fix else "") for f in bad))
    sizes = ", ".join(f"{size_label(k)} {v:g}" for k, v in report.busbw_by_size().items())
    out.print(f"fabric test passed in {report.seconds:.1f}s (busbw GB/s: {sizes})", markup=False)


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
    from ..engine_lines import GENERATION_TOKENS, KV_CACHE_USAGE, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING

    wanted = {NUM_REQUESTS_RUNNING: "requests_running", NUM_REQUESTS_WAITING: "requests_waiting",
              KV_CACHE_USAGE: "kv_cache_usage", GENERATION_TOKENS: "generation_tokens"}
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


def _collect_status(cluster: Cluster, s: Settings, api: Any) -> dict[str, Any]:
    """Every rank's container, the head's health/models/metrics and the supervisor's state, as one doc."""
    problems: list[str] = []
    states = cluster.run_all(lambda n: service.inspect_cluster(n, s.cluster_name), nodes=s.nodes)
    current: str | None = None
    try:
        current = _render(cluster, s, "sparkctl status").config_hash if not cluster.errors else None
    except (UsageError, CheckFailed) as exc:
        problems.append(f"current config unknown: {exc.message}")
    health = api.health()
    models: list[str] = []
    if health == 200:
        try:
            models = api.models()
        except Exception as exc:  # an odd answer is a finding, not a crash
            problems.append(f"/v1/models failed: {exc}"[:200])
    metrics = _metrics_summary(api.metrics() if health == 200 else None)
    supervisor = watchstate.read_state(cluster.node(s.head), s.cluster_name) \
        if s.head in cluster.connected else None
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
    return {"cluster": s.cluster_name, "ranks": ranks, "head": {"url": api.base_url, "health": health,
                                                                "models": models, "metrics": metrics},
            "current_config_hash": current, "supervisor": supervisor, "problems": problems, "ok": not problems}


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
    from .. import readiness

    g = _globals(ctx)
    s = _settings(g)
    with _cluster(g, s) as cluster:
        api = readiness.HeadApi(url or service.head_base_url(cluster, s), s.get("VLLM_API_KEY"), timeout=3)
        if live:
            _status_live(g, cluster, s, api, interval)
            return
        doc = _collect_status(cluster, s, api)
    if g.json:
        emit_json(doc)
    else:
        console(False).print(_status_view(doc))
    if doc["problems"]:
        sys.exit(1)


def _status_live(g: Globals, cluster: Cluster, s: Settings, api: Any, interval: float) -> None:
    """`status --watch`: a rich live view, or NDJSON (one status document per line) with --json."""
    from rich.live import Live

    prev_tokens: tuple[float, float] | None = None

    def tick() -> dict[str, Any]:
        nonlocal prev_tokens
        doc = _collect_status(cluster, s, api)
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
                sys.stdout.write(json.dumps(tick(), sort_keys=True) + "\n")
                sys.stdout.flush()
                time.sleep(interval)
        with Live(_status_view(tick()), console=console(False), auto_refresh=False) as view:
            while True:
                time.sleep(interval)
                view.update(_status_view(tick()), refresh=True)
    except KeyboardInterrupt:
        return


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

    # Only the chosen ranks' nodes: `logs --rank 2` needs no connection to the others.
    with Cluster([s.nodes[r] for r in sorted(set(chosen))], g.ssh_config_path()) as cluster:
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
                _stop_supervisor_unit(cluster, s)
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


def _stop_supervisor_unit(cluster: Cluster, s: Settings) -> None:
    """A deliberate `down` stays down: the `export systemd` unit (if any) is stopped and disabled first."""
    from ..systemd_unit import disable_argv, unit_name

    r = cluster.node(s.head).run(disable_argv(s.cluster_name), timeout=90)
    if not r.ok:
        warn([f"could not stop and disable {unit_name(s.cluster_name)} on {s.head}: "
              f"{(r.stderr.strip() or r.stdout.strip())[:200]}"])


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
    for node, r in results.ok.items():
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
