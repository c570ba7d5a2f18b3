"""`sparkctl status`'s document: every rank's container, the head's health, models and metrics, the
supervisor's state and whether what runs is what `up` would render now."""

from __future__ import annotations

from typing import Any

from ..cluster import Cluster, NodeError
from ..errors import CheckFailed, UsageError
from ..facts import promtext
from ..facts.machine_identity import swaps
from ..remote import cleanup, service, watchstate
from ..rules.check_rules import REACH_BY_HAND
from ..spec.settings import Settings
from .locking import who_is_who
from .up import render_now_and_master


def metrics_summary(text: str | None) -> dict[str, float]:
    """The head's load from its /metrics text (promtext: the first 20,000 lines), summed over label sets."""
    from ..facts.engine_lines import (
        GENERATION_TOKENS,
        KV_CACHE_USAGE,
        NUM_REQUESTS_RUNNING,
        NUM_REQUESTS_WAITING,
    )

    wanted = {NUM_REQUESTS_RUNNING: "requests_running", NUM_REQUESTS_WAITING: "requests_waiting",
              KV_CACHE_USAGE: "kv_cache_usage", GENERATION_TOKENS: "generation_tokens"}
    found: dict[str, float] = {}
    for s in promtext.samples(text or "", max_lines=20000):
        if s.name in wanted:
            found[wanted[s.name]] = found.get(wanted[s.name], 0.0) + s.value
    return found


def collect_status(cluster: Cluster, s: Settings, api: Any) -> dict[str, Any]:
    """Every rank's container, the head's health/models/metrics and the supervisor's state, as one doc."""
    problems: list[str] = []
    states = cluster.run_all(lambda n: service.inspect_cluster(n, s.cluster_name), nodes=s.nodes)
    current: str | None = None
    master: str | None = None
    try:
        if not cluster.errors:
            rendered, master = render_now_and_master(cluster, s, "sparkctl status")
            current = rendered.config_hash
    except (UsageError, CheckFailed) as exc:
        problems.append(f"current config unknown: {exc.message}")
    # A partition after the rendezvous: from each other rank's node, a TCP connect to the head's master
    # port (probes/reach.sh: an answer of any kind, a refusal included, proves the path).
    paths = master_paths(cluster, s, master, s.getint("MASTER_PORT")) if master else []
    for p in paths:
        if not p["ok"]:
            problems.append(f"rank {p['rank']} ({p['node']}) cannot reach the head's master {p['addr']}:{p['port']} "
                            f"on {p['head']}: {p['reason']}: the path {p['node']} → {p['head']} is cut (a "
                            f"firewall, a route, or the pinned interface; test it by hand: {REACH_BY_HAND})")
    health = api.health()
    models: list[str] = []
    if health == 200:
        try:
            models = api.models()
        except Exception as exc:  # an odd answer is a finding, not a crash
            problems.append(f"/v1/models failed: {exc}"[:200])
    metrics = metrics_summary(api.metrics() if health == 200 else None)
    # Orphans: containers labelled for this cluster that no successful `up` recorded (the audit `down`
    # and `up` use to find them); `down` removes them, `up` replaces them.
    seen = {n: st for n, st in states.items() if not isinstance(st, NodeError)}
    records = cluster.run_all(lambda n: cleanup.up_records(n, s.cluster_name), nodes=list(seen)).ok
    orphans = [{"node": n, "name": c.name, "rank": c.rank, "id": c.id, "state": c.status}
               for n, st in seen.items() if n in records for c in cleanup.orphans(st, records[n])]
    for o in orphans:
        problems.append(f"{o['node']}: orphan container {o['name']} (rank {o['rank']}, {o['state']}): no successful "
                        "`up` recorded it (`sparkctl down` removes it, `sparkctl up` replaces it)")
    # A node name that reaches another machine than at the last `up` (an ssh config whose HostNames were
    # swapped: known_hosts is keyed by address, so the connection verifies): name it, as `down` does.
    swapped = swaps(who_is_who(cluster, s.nodes, s.cluster_name))
    for sw in swapped:
        problems.append(sw.describe())
    supervisor = watchstate.read_state(cluster.node(s.head), s.cluster_name) \
        if s.head in cluster.connected else None
    ranks: list[dict[str, Any]] = []
    image_ids = set()
    for r in s.service.ranks:  # one service: a replica view, or the only replica
        rank, node = r.rank, r.node
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
            why, klines = service.why_dead(cluster.node(node), c)
            row["why"], row["kernel_lines"] = why, klines[-10:]
            problems.append(f"rank {rank} ({node}): {c.status} (exit {c.exit_code})" + (f": {why}" if why else "")
                            + "".join(f"\n    kernel: {ln}" for ln in klines[-5:]))
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
            "current_config_hash": current, "supervisor": supervisor, "orphans": orphans,
            "master_paths": paths, "swapped": [sw.as_dict() for sw in swapped], "problems": problems,
            "ok": not problems}


def master_paths(cluster: Cluster, s: Settings, addr: str, port: int) -> list[dict[str, Any]]:
    """From the node of every rank but the head's, whether a TCP connect reaches ADDR:PORT (reach.sh's
    test, as `check` runs it): one line per rank, ok or the reason."""
    from ..rules.check_rules import parse_reach
    from ..spec.resources import probe_script

    ranks = [r for r in s.service.ranks if r.node != s.head and r.node in cluster.connected]
    if not ranks:
        return []
    script = probe_script("reach.sh") + b'\nreach_test "$@"\n'
    res = cluster.run_all(["sh", "-s", str(port), addr], stdin=script, timeout=30,
                          nodes=sorted({r.node for r in ranks}))
    out = []
    for r in ranks:
        got = res[r.node]
        why = got.reason if isinstance(got, NodeError) else parse_reach(got.stdout).get(addr, "no answer from the test")
        out.append({"rank": r.rank, "node": r.node, "head": s.head, "addr": addr, "port": port,
                    "ok": why == "ok", "reason": None if why == "ok" else why})
    return out
