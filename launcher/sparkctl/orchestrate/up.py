"""`sparkctl up`, top to bottom.

  up(settings)                           connect to every node (one SSH connection each); all must answer
    lock_cluster on every node           (locking.py: in one global order) held until the service runs
                                         or is rolled back
    [several replicas]                   preflight_all once, then start_service per replica view, side
                                         by side; a failed replica is rolled back alone (up_replicas)
    start_service(cluster, settings)     the body, shared with `watch` restarts and `rollback`:
      preflight, on every node at once   node_probe.probe_node (fabric facts), service.node_state (its
                                         containers, its image ID); on the head also the checkpoint
      plan_for                           the memory plan for the nodes' GPU generation; must fit
      nic_pins.pins_from_facts               the same discovery rule as `check` (nic_pins.discover_fabric)
      render.render_all                  every rank's argv and env (builders), the config hash
      judge_argv                         the serving image's own vLLM judges every argv on the head
                                         (argvjudge; cached): a refusal refuses with vLLM's words
      before_start                       `up --fabric-test`: fabric_gate, an all-reduce first
      write env/env.tp4                  the rendered pins and settings, for the record
      service.up                         diff against what runs; replace, start workers then the
                                         head (builders.docker_run_argv over Node.run); roll back on
                                         any failure
      history.record_release             only a started service is recorded
    record_identities                    a started service: every node's machine-id and host key, on
                                         every node (what `status` and `down` compare against)

A failure before service.up changes nothing on any node.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..cluster import Cluster, Node, NodeError, parallel
from ..errors import CheckFailed, Failure, SparkctlError
from ..output import warn
from ..remote import service
from ..rules import memory
from ..rules.nic_pins import pins_from_facts
from ..spec.planner import (
    CheckpointInfo,
    Plan,
    drafter_dir,
    make_plan,
    nodes_compute_capability,
    require_fit,
)
from ..spec.renderer import Rendered, env_tp4_path, render_all, write_env_tp4
from ..spec.settings import Settings
from . import require_all
from .checkpoint_scan import read_checkpoint_on
from .locking import lock_cluster, record_identities
from .node_probe import probe_node

ENV_TP4 = Path("env/env.tp4")


@dataclass
class ReplicaUp:
    """One replica's `up`: its outcome, or why it failed (then service.up rolled back what it started)."""

    replica: int
    head: str
    outcome: service.UpOutcome | None = None
    error: SparkctlError | None = None


def up(s: Settings, ssh_config: str | Path | None, *, recreate: bool, say: Callable[[str], None],
       fabric_say: Callable[[str], None] | None = None) -> service.UpOutcome:
    """Start the service, or leave an identical one alone. fabric_say given: `up --fabric-test`
    (the all-reduce must pass first; it reports through fabric_say). One replica only: see up_replicas."""
    (result,) = up_replicas(s, ssh_config, recreate=recreate, say=say, fabric_say=fabric_say)
    assert result.outcome is not None  # one replica: its failure is raised as it is
    return result.outcome


def up_replicas(s: Settings, ssh_config: str | Path | None, *, recreate: bool, say: Callable[[str], None],
                fabric_say: Callable[[str], None] | None = None) -> list[ReplicaUp]:
    """`up` of every replica: one Cluster (one connection per host) for all of them, the cluster lock on
    every host (locking.lock_cluster), one preflight of every host (any failure: nothing changed), then each
    replica's start_service on its own view, side by side. A replica that fails is rolled back alone (by
    service.up) and reported in its ReplicaUp; the others keep running. One replica: its error is raised,
    exactly as before replicas existed."""
    topo = s.topology
    with Cluster(list(topo.nodes), ssh_config) as cluster:
        require_all(cluster, "up refused")
        with lock_cluster(cluster, list(topo.nodes), s.cluster_name, "up") as (_, seen):
            views = s.replicas()
            many = len(views) > 1
            gathered = preflight_all(cluster, s) if many else None

            def one(view: Settings) -> ReplicaUp:
                tag = f"replica {view.replica_index}: " if many else ""

                def said(m: str) -> None:
                    say(tag + m)

                gate = None
                if fabric_say is not None:
                    report = fabric_say

                    def gate(pins: list[Any], states: dict[str, Any]) -> None:
                        fabric_gate(cluster, view, pins, states, lambda m: report(tag + m))

                result = ReplicaUp(view.replica_index, view.head)
                try:
                    result.outcome = start_service(cluster, view, recreate=recreate, say=said, before_start=gate,
                                                   gathered=gathered)
                except SparkctlError as exc:
                    if not many:
                        raise
                    result.error = exc
                return result

            if not many:
                results = [one(views[0])]
            else:
                jobs: list[Callable[[], ReplicaUp]] = [functools.partial(one, v) for v in views]
                # The replicas start on pool threads; a signal reaches only this thread. Let every start
                # settle first (each is bounded by its own timeouts): leaving now would release the lock
                # and close the connections under starts in flight, so neither they nor their rollbacks
                # could finish. A replica that reaches its point of no return (signals.commit) makes the
                # signal a note; one that fails rolls itself back; a signal before any is raised once all
                # settled.
                results = service.settled(lambda: parallel(jobs))
            if any(r.outcome is not None and r.outcome.changed for r in results):
                remember_identities(cluster, list(topo.nodes), s.cluster_name, seen)
            return results


def remember_identities(cluster: Cluster, names: list[str], cluster_name: str, seen: Any) -> None:
    """Record who every node is, for `status` and `down` to compare against; a miss is a warning."""
    missed = record_identities(cluster, names, cluster_name, seen)
    if missed:
        warn([f"the service runs, but which machine each node is was not recorded on {', '.join(missed)}: "
              "`status` cannot tell there whether a node name now reaches another machine"])


def start_service(cluster: Cluster, s: Settings, *, recreate: bool, say: Any,
                  source: str = "sparkctl up",
                  before_start: Callable[[list[Any], dict[str, Any]], None] | None = None,
                  gathered: dict[str, Preflight] | None = None) -> service.UpOutcome:
    """The body of `up` under the cluster lock (the caller holds it): preflight every node, plan,
    render, start; a started service is recorded in the head's history. `watch` and `rollback`
    come through here too, so they start exactly what `up` would. before_start(pins, containers per
    node) runs after rendering and before anything starts (`up --fabric-test`); it raises to refuse.
    gathered: every node's preflight_all round, when the caller (`up` of several replicas) read it."""
    ok = preflight_all(cluster, s) if gathered is None else {n: gathered[n] for n in s.nodes}
    refuse_foreign_gpu_processes(s, ok)
    plan = plan_for(cluster, s, ok[s.head].checkpoint, {n: r.facts for n, r in ok.items()})
    pins = pins_from_facts(s, {n: r.facts for n, r in ok.items()})
    rendered = render_all(s, plan, pins, source=source)
    judge_argv(cluster, s, rendered, say)
    if before_start is not None:
        before_start(pins, {n: r.state[0] for n, r in ok.items()})
    env_tp4 = env_tp4_path(ENV_TP4, s.replica_index)  # one file per replica (one replica: env/env.tp4)
    try:
        kept = write_env_tp4(env_tp4, rendered.env_tp4, s, fix="the service starts from what it says")
    except OSError as exc:
        kept = f"could not write {env_tp4}: {exc}"
    warn([kept] if kept else [])
    outcome = service.up(cluster, s, rendered.specs, rendered.config_hash, recreate=recreate, say=say,
                         gathered={n: r.state for n, r in ok.items()}, memory=node_memory(s, plan, ok),
                         look=lambda node: probe_node(node, s))
    if outcome.changed:
        from ..remote.releases import record_release  # only a started service is recorded

        try:
            record_release(cluster, s, rendered, source=source)
        except (NodeError, CheckFailed) as exc:  # the service runs: a lost record is a warning, not a failure
            warn([f"the service runs, but its history entry was not recorded: {exc}"])
    return outcome


def judge_argv(cluster: Cluster, s: Settings, rendered: Rendered, say: Callable[[str], None]) -> None:
    """The serving image's own vLLM judges every rank's argv on the head (argvjudge) before anything starts:
    a refusal refuses `up` with vLLM's words; what it could not judge is a warning."""
    from ..remote import argv_verdict as argvjudge

    j = argvjudge.judge(cluster.node(s.head), s, rendered.specs, say=say)
    refused = argvjudge.refusal(j, s)
    if refused:
        raise CheckFailed(refused, fix=argvjudge.FIX)
    warn(argvjudge.warnings(j))
    if not j.not_judged:
        say(f"argv: accepted by vLLM {j.verdicts[0].vllm or '?'} in {s.image} for every rank "
            f"({'cached' if j.cached else f'{j.seconds:.1f}s'})")


class Preflight(NamedTuple):
    """One node's preflight round (preflight_all)."""

    facts: Any  # its fabric facts (probe_node)
    state: Any  # its containers and image (service.node_state)
    checkpoint: CheckpointInfo | None  # the checkpoint as it reads it (replica heads only)


def refuse_foreign_gpu_processes(s: Settings, ok: dict[str, Preflight]) -> None:
    """A live process outside this cluster's containers holding GPU memory on a rank node: up refuses
    before anything changes, naming it (its container, another sparkctl cluster's); never stops it."""
    problems, fixes, failures = [], [], []
    for n in s.nodes:
        facts, state = ok[n].facts, ok[n].state
        own = {c.id for c in (state[0] if state else [])}
        held = memory.foreign(getattr(facts, "gpu_apps", None) or [], s.cluster_name, own)
        if held:
            problems.append(f"{n}: GPU memory is held by {memory.describe(held)}")
            fixes.append(memory.foreign_fix(n, held))
            failures.append(Failure(n, "gpu-held", f"GPU memory is held by {memory.describe(held)}", fixes[-1]))
    if problems:
        raise CheckFailed("up refused, nothing was changed: another process holds GPU memory on a rank node\n  "
                          + "\n  ".join(problems), fix="; ".join(fixes), failures=failures)


def node_memory(s: Settings, plan: Plan, ok: dict[str, Preflight]) -> dict[str, memory.NodeMemory]:
    """Each rank node's memory need (the plan's per-GPU total × GPUS_PER_NODE, as check judges it),
    whether it is unified
    (GB10), and whether its page cache is dropped before the start (DROP_CACHES: auto = unified)."""
    ranks: dict[str, int] = {}
    for r in s.service.ranks:
        ranks[r.node] = ranks.get(r.node, 0) + 1
    out = {}
    for n, count in ranks.items():
        is_unified = memory.unified(ok[n].facts) if n in ok and ok[n].facts is not None else False
        out[n] = memory.NodeMemory(plan.per_rank_total * s.topology.gpus_per_node * count, is_unified,
                                   memory.drop_caches_on(str(s.get("DROP_CACHES", "auto")), is_unified))
    return out


def preflight_all(cluster: Cluster, s: Settings) -> dict[str, Preflight]:
    """One round on every node at once: its fabric facts (pins are resolved at every `up`, the GID
    index drifts), its containers and its image; every replica's head also reads the checkpoint.
    Any node that fails refuses `up` with nothing changed."""
    image = s.image
    heads = set(s.topology.heads)

    def preflight(node: Node) -> Preflight:
        # Channels on the node's one connection run side by side: probe, docker, checkpoint.
        jobs: list[Callable[[], Any]] = [lambda: probe_node(node, s),
                                         lambda: service.node_state(node, s.cluster_name, image)]
        if node.name in heads:
            jobs.append(lambda: read_checkpoint_on(node, s.model, drafter_dir(s)))
        facts, state, *ckpt = parallel(jobs)
        return Preflight(facts, state, ckpt[0] if ckpt else None)

    rounds = cluster.run_all(preflight, nodes=list(s.topology.nodes))
    failed = rounds.failed
    if failed:
        raise CheckFailed("up refused, nothing was changed:\n  " + "\n  ".join(
            f"{n}: {e.reason}" + (f" (fix: {e.fix})" if e.fix else "") for n, e in failed.items()),
            node=next(iter(failed)) if len(failed) == 1 else None, failures=[e.as_dict() for e in failed.values()])
    return dict(rounds.ok)


def plan_for(cluster: Cluster, s: Settings, ckpt: CheckpointInfo | None = None,
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


def render_now(cluster: Cluster, s: Settings, source: str) -> Rendered:
    """What `up` would render now: the same probe per node (pins, GPU generation) and the same plan."""
    return render_now_and_master(cluster, s, source)[0]


def render_now_and_master(cluster: Cluster, s: Settings, source: str) -> tuple[Rendered, str]:
    """render_now, and the master address the ranks meet at (the head's fabric address, or MASTER_ADDR)."""
    from ..spec.builders import master_addr

    rendered, _, pins = render_with_plan(cluster, s, source)
    return rendered, master_addr(s, pins)


def render_with_plan(cluster: Cluster, s: Settings, source: str) -> tuple[Rendered, Plan, list[Any]]:
    """What `up` would render now, with the memory plan and the pins it rendered from (`deploy`'s probe
    reads the config hash to compare with what runs, and the memory each rank will wait for)."""
    facts = cluster.run_all(lambda n: probe_node(n, s), nodes=s.nodes)
    pins = pins_from_facts(s, facts)
    plan = plan_for(cluster, s, facts=facts.ok)
    return render_all(s, plan, pins, source=source), plan, pins


def fabric_gate(cluster: Cluster, s: Settings, pins: list[Any], states: dict[str, Any],
                say: Callable[[str], None]) -> None:
    """`up --fabric-test`: the collective must pass before any container of the service starts."""
    from .fabric_test import run_fabric_test, size_label

    if any(c.running for cs in states.values() for c in cs):
        say("fabric test skipped: this cluster's service is running (it holds the GPUs and "
            "MASTER_PORT); `sparkctl down` first to test the fabric")
        return
    report = run_fabric_test(cluster, s, pins, say=say)
    bad = [f for f in report.findings if f.status == "fail"]
    if bad:
        raise CheckFailed("up refused: the fabric test failed, nothing was started:\n  " + "\n  ".join(
            f.text + (f"\n    fix: {f.fix}" if f.fix else "") for f in bad),
            failures=[Failure(f.node, f.check, f.text, f.fix or "`sparkctl check --fabric` tests the fabric alone")
                      for f in bad])
    sizes = ", ".join(f"{size_label(k)} {v:g}" for k, v in report.busbw_by_size().items())
    say(f"fabric test passed in {report.seconds:.1f}s (busbw GB/s: {sizes})")
