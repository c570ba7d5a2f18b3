"""`sparkctl check`'s flow: gather every node's facts over SSH, judge them with `check`'s rules.

`run_check` opens one SSH connection per node (or uses the caller's) and does two parallel round trips:

  1. every node runs probes/node_facts.sh (all read-only facts at once, the Docker engine's over
     its API with one curl); the head also runs probes/ckpt_scan.py on a second channel of the
     same connection (header-level verification);
  2. every node tries to reach every other rank's discovered fabric address (probes/reach.sh).
Both rounds start as few processes per node as they can: on the lab all nodes share one machine.
Then the `argv` row: every rank's argv judged on the head by the serving image's own vLLM (`judge_argv`).
The rules themselves (pure) are `sparkctl.rules.check_rules`.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..cluster import Cluster, Node, NodeError, Session, parallel
from ..errors import SparkctlError
from ..facts import node_facts as F
from ..rules.check_rules import (
    CHECKS,
    DF_PATHS,
    REACH_BY_HAND,
    evaluate,
    node_compute_cap,
    parse_reach,
    rule_gpu_memory_utilization,
    rule_identity,
    rule_open_api,
    rule_reach,
)
from ..rules.findings import CLUSTER_ROW, FAIL, OK, SKIP, WARN, Finding, Needs
from ..rules.findings import finding as _f
from ..spec.builders import open_api_warning
from ..spec.planner import (
    CheckpointInfo,
    Plan,
    checkpoint_from_scan,
    drafter_dir,
    make_plan,
    nodes_compute_capability,
)
from ..spec.resources import probe_script
from ..spec.settings import RankPins, Settings
from .checkpoint_scan import read_drafter_config_on, scan_on


@dataclass
class CheckReport:
    nodes: list[str]
    findings: list[Finding]
    pins: dict[int, RankPins]
    plan: Plan | None
    facts: dict[str, F.NodeFacts] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FAIL]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.status == WARN]

    @property
    def ok(self) -> bool:
        return not self.failed

    def cell(self, node: str, check: str) -> Finding | None:
        worst = None
        rank = {FAIL: 3, WARN: 2, OK: 1, SKIP: 0}
        for f in self.findings:
            if f.node == node and f.check == check and (worst is None or rank[f.status] > rank[worst.status]):
                worst = f
        return worst


class Probes:
    """Every node's node_facts.sh, in two rounds on one channel each (cluster.Session): round 1 the
    facts; round 2, once every node's facts are in and the fabric addresses known, the reach test.
    Close it (or use it as a context manager) so that no probe is left waiting for its second round."""

    def __init__(self, nonce: str) -> None:
        self.nonce = nonce
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()

    def __enter__(self) -> Probes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self.lock:
            sessions, self.sessions = self.sessions, {}
        for sess in sessions.values():
            sess.close()


def gather(
    cluster: Cluster,
    needs: Needs,
    *,
    head: str,
    heads: Sequence[str] = (),
    layout: bool = True,
    timeout: float = 60.0,
    probes: Probes,
) -> dict[str, tuple[F.NodeFacts | NodeError, Any]]:
    """Round 1, at once on every node's one connection:
      - node_facts.sh: every read-only fact, Docker's too (one curl to the engine's API over its
        local socket: version, this cluster's containers, the image; the docker CLI where that
        cannot be done). Plain `nvidia-smi`, for the CUDA version that the driver decides, runs on
        the head only; the listening ports on every replica's head (`heads`, default the head). Few processes per node: on the lab, every node shares
        one machine's CPUs. Each node's probe stays open (in `probes`) for round 2: reach().
      - on the head, ckpt_scan.py on a second channel (header-level verification from the shards'
        summaries, cached there; the planner's input).
    Returns node -> (facts or NodeError, head scan dict / error string / None)."""
    # reach_test (probes/reach.sh) is defined ahead of the probe, which runs it in round 2
    facts_script = probe_script("reach.sh") + b"\n" + probe_script("node_facts.sh")
    nonce = probes.nonce
    ready = f"@@sparkctl {nonce} ready\n".encode()

    api_heads = set(heads) or {head}

    def args(banner: bool, listening: bool) -> list[str]:  # the CUDA banner: the head's; ports: every API head's
        return F.probe_args(model=needs.model, cluster=needs.cluster, images=[needs.image, *([needs.base_image] if needs.base_image else [])], df_paths=(*DF_PATHS, needs.model),
                            api=True, banner=banner, listening=listening)  # fmt: skip

    reach_arg = [f"reach={needs.master_port}"]

    def node_facts(node: Node) -> F.NodeFacts:
        on_head, serves = node.name == head, node.name in api_heads
        sess = node.start(["sh", "-s", "--", nonce, *args(on_head, serves), *reach_arg],
                          timeout=timeout)  # fmt: skip
        if sess.read_until(ready, facts_script):
            with probes.lock:
                probes.sessions[node.name] = sess
            out, err = sess.out.decode("utf-8", errors="replace"), sess.err.decode("utf-8", errors="replace")
        else:  # it ended before round 2: no shell, or it broke; what it printed is still its facts
            res = sess.finish()
            out, err = res.stdout, res.stderr
        return F.node_facts_from_probe(out, nonce, err, expect_banner=on_head, expect_listening=serves)

    def scan(node: Node) -> dict[str, Any] | str:
        try:  # summaries: what the rules need, cached on the head (the full headers only when they ask)
            return scan_on(node, needs.model, headers="summary", timeout=timeout)
        except (NodeError, SparkctlError) as exc:
            return exc.message

    def guarded(name: str, job: Callable[[Node], Any]) -> Any:
        try:
            return job(cluster.node(name))
        except NodeError as exc:
            return exc
        except Exception as exc:  # a bug here must cost one node's facts, not the whole check
            return NodeError(name, "error", f"{type(exc).__name__}: {exc}", "run with -vv and report this bug")

    names = cluster.names
    jobs = [functools.partial(guarded, n, node_facts) for n in names]
    if layout and head in names:  # the head's checkpoint scan, beside its probe
        jobs.append(functools.partial(guarded, head, scan))
    done = parallel(jobs, limit=min(128, len(names) + 1))
    scanned = done[len(names)] if len(done) > len(names) else None
    if isinstance(scanned, NodeError):
        scanned = scanned.message
    return {n: (facts, scanned if n == head else None) for n, facts in zip(names, done[: len(names)], strict=True)}


def reach(
    cluster: Cluster, probes: Probes, pins: Mapping[int, RankPins], nodes: Sequence[str]
) -> dict[str, dict[str, str] | NodeError]:
    """Round 2: every node with a fabric address tries every other rank's fabric address; every other
    open probe is told to end (an empty line)."""
    ips = {nodes[r]: str(ipaddress.IPv4Address(p.fabric_ip)) for r, p in pins.items() if p.fabric_ip}
    with probes.lock:
        sessions, probes.sessions = probes.sessions, {}

    def one(node: Node) -> dict[str, str] | None:
        name = node.name
        peers = [ip for n, ip in ips.items() if n != name] if name in ips else []
        res = sessions[name].finish((" ".join(peers) + "\n").encode())
        if name not in ips or not peers:
            return {} if name in ips else None
        sec = F.parse_probe_sections(res.stdout, probes.nonce, res.stderr).get("reach")
        if sec is None:
            raise NodeError(name, "output", f"{name}: the reach test printed no result (exit {res.exit_code})",
                            f"run check again; if it repeats, run the reach test on {name} by hand: "
                            f"{REACH_BY_HAND}")  # fmt: skip
        return parse_reach(sec.stdout)

    got: dict[str, dict[str, str] | NodeError | None] = cluster.run_all(one, nodes=list(sessions))
    for name in ips:  # its probe ended before round 2 (it printed no "ready"): say so, do not guess
        if name not in sessions:
            got[name] = NodeError(name, "output", f"{name}: its probe ended before the reach test could run",
                                  f"run check again; if it repeats, run the reach test on {name} by hand: "
                                  f"{REACH_BY_HAND}")  # fmt: skip
    return {n: r for n, r in got.items() if r is not None}


def _verifier(settings: Settings, cluster: Cluster, head: str, model: str,
              timeout: float) -> Callable[[Mapping[str, Any]], Any] | None:
    """The checkpoint verdict from the head's scan: from its summaries, and when they show a problem,
    from the full headers (one more scan on the head) so the finding names the tensor and shard."""
    try:
        from ..checkpoint import verify as V

        layout = settings.recipe.checkpoint_layout
    except Exception:  # no verifier or no layout: the check says so instead of failing
        return None

    def verifier(scan: Mapping[str, Any]) -> Any:
        try:
            return V.verify_scan(scan, layout)
        except V.NeedHeaders:
            return V.verify_scan(scan_on(cluster.node(head), model, headers="zlib", timeout=timeout), layout)

    return verifier


def run_check(
    settings: Settings,
    ssh_config: str | Path | None,
    *,
    connect_timeout: float = 10.0,
    command_timeout: float = 60.0,
    verify: bool = True,
    cluster: Cluster | None = None,
) -> CheckReport:
    """Check every node of `settings` (one SSH connection each) and return the findings. With
    `cluster` (connected, left open) the caller goes on using the same connections afterwards."""
    nodes = list(settings.topology.nodes)
    head = settings.topology.head  # replica 0's: it reads the checkpoint (the model rule compares the rest)
    needs = Needs.from_settings(settings)
    timing: dict[str, float] = {}
    start = time.monotonic()
    verifier: Callable[[Mapping[str, Any]], Any] | None = None
    if cluster is None:  # its own connections, open until the argv judge has run on the head
        with Cluster(nodes, ssh_config, connect_timeout=connect_timeout, command_timeout=command_timeout) as own:
            return run_check(settings, ssh_config, connect_timeout=connect_timeout,
                             command_timeout=command_timeout, verify=verify, cluster=own)
    with contextlib.ExitStack() as stack:
        if verify:
            verifier = _verifier(settings, cluster, head, needs.model, command_timeout)
        timing["connect"] = cluster.connect_seconds
        t = time.monotonic()
        probes = stack.enter_context(Probes(secrets.token_hex(8)))
        gathered = gather(cluster, needs, head=head, heads=settings.topology.heads, layout=verifier is not None,
                          timeout=command_timeout, probes=probes)  # fmt: skip
        timing["probe"] = time.monotonic() - t
        head_scan = gathered.get(head, (None, None))[1]
        ckpt: CheckpointInfo | None = None
        ckpt_why = "the head's checkpoint scan did not run"
        if isinstance(head_scan, dict):
            try:
                ckpt = checkpoint_from_scan(head_scan, Path(needs.model), head)
            except SparkctlError as exc:
                ckpt_why = exc.message
        elif isinstance(head_scan, str):
            ckpt_why = head_scan
        drafter = drafter_dir(settings)
        if ckpt is not None and drafter is not None and head not in cluster.errors:
            try:
                ckpt = replace(ckpt, drafter_config=read_drafter_config_on(cluster.node(head), drafter))
            except Exception:  # noqa: BLE001 - the plan row says the drafter's config could not be read
                pass

        def plan_for_node(facts: F.NodeFacts) -> tuple[Plan | None, str]:
            if ckpt is None:
                return None, ckpt_why
            if facts.meminfo is None:
                return None, "node memory unknown"
            try:
                return make_plan(settings, ckpt, facts.meminfo.total_bytes, node_compute_cap(facts)), ""
            except Exception as exc:  # a config.json the planner cannot use: say so, keep checking
                return None, str(exc)

        findings, pins = evaluate(nodes, needs, gathered, cluster.errors, plan_for_node, verifier,
                                  heads=settings.topology.heads)
        t = time.monotonic()
        reached = reach(cluster, probes, pins, nodes)
        timing["reach"] = time.monotonic() - t
    peers = {p.fabric_ip: nodes[r] for r, p in pins.items() if p.fabric_ip}
    unreached = {f.node for f in findings if f.check == "ssh" and f.status == FAIL}
    topology = settings.topology
    for n in nodes:
        if n in unreached:
            continue
        rank = topology.locate(n)[1].position  # pins are keyed by position in NODES
        findings.append(
            rule_reach(n, reached.get(n), {ip: pn for ip, pn in peers.items() if pn != n})
            if rank in pins
            else rule_reach(n, None, {})
        )
    # The cluster plan: the smallest node decides (all ranks get the same KV bytes).
    facts_ok = {n: f for n, (f, _) in gathered.items() if isinstance(f, F.NodeFacts)}
    mems = [
        f.meminfo.total_bytes for n, (f, _) in gathered.items() if isinstance(f, F.NodeFacts) and f.meminfo
    ]
    cc, cc_problem = nodes_compute_capability({n: node_compute_cap(f) for n, f in facts_ok.items()})
    if cc_problem:
        findings.append(_f(CLUSTER_ROW, "plan", FAIL, "mixed GPUs", cc_problem,
                           "serve the model on nodes of one GPU generation"))
    plan = None
    if ckpt is not None and mems:
        try:
            plan = make_plan(settings, ckpt, min(mems), cc)
        except Exception:  # noqa: BLE001 - each node's plan row already says why
            plan = None
    util = rule_gpu_memory_utilization(plan)
    if util is not None:
        findings.append(util)
    api = rule_open_api(open_api_warning(settings))
    if api is not None:
        findings.append(api)
    findings += rule_identity(nodes, {n: f.machine_id for n, (f, _) in gathered.items() if isinstance(f, F.NodeFacts)},
                              {n: cluster.target(n).hostname for n in nodes})
    facts = facts_ok
    t = time.monotonic()
    findings += judge_argv(settings, cluster, plan, pins, unreached)
    timing["argv"] = time.monotonic() - t
    timing["total"] = time.monotonic() - start
    order = {c: i for i, c in enumerate((*CHECKS, "checkpoint", "api"))}
    node_order = {n: i for i, n in enumerate([*nodes, CLUSTER_ROW])}
    findings.sort(key=lambda f: (node_order.get(f.node, 999), order.get(f.check, 999)))
    return CheckReport(list(nodes), findings, pins, plan, facts, timing)


def judge_argv(settings: Settings, cluster: Cluster, plan: Plan | None, pins: Mapping[int, RankPins],
               unreached: set[str]) -> list[Finding]:
    """The `argv` row: every replica's every rank argv, rendered as `up` renders it, judged on the head by
    the serving image's own vLLM (argvjudge). What stops it is said on every rank's node, as a skip."""
    from ..remote import argv_verdict as argvjudge
    from ..spec.renderer import render_all, resolve_pins

    nodes = list(settings.topology.nodes)
    head = settings.topology.head

    def skip(why: str) -> list[Finding]:
        return [_f(n, argvjudge.CHECK, SKIP, "not judged", f"{n}: argv not judged: {why}") for n in nodes
                if n not in unreached]

    if argvjudge.timeout_s(settings) <= 0:
        return skip("ARGV_JUDGE_TIMEOUT_S=0 turns the judge off")
    if head in unreached or head in cluster.errors:
        return skip(f"the head {head} did not answer")
    if plan is None:
        return skip("no memory plan (see the plan row)")
    specs = []
    try:
        for view in settings.replicas():
            found = {k: pins[view.rank_offset + k] for k in range(len(view.nodes)) if view.rank_offset + k in pins}
            specs += render_all(view, plan, resolve_pins(view, found), source="sparkctl check").specs
    except SparkctlError as exc:
        return skip(f"the argv could not be rendered ({exc.message})")
    return argvjudge.findings(argvjudge.judge(cluster.node(head), settings, specs), settings)

