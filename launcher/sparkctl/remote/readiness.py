"""Readiness of a started service: the head's HTTP API and `wait`.

`wait` is done only when /health is 200, /v1/models lists the served name and one real chat
completion comes back ("/health lies" in practice). Every poll also inspects every rank's container,
so a rank that dies fails the wait at once, with its last log lines. Kept apart from service.py so
that `up` and `down` do not import an HTTP client.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_exponential

from ..cluster import Cluster, Node
from ..errors import CheckFailed, Failure
from ..facts.engine_lines import (
    FAILURE_MARKERS,
    failure_in,
    gloo_family_mismatch,
    master_listening,
    phase_patterns,
    unreachable_master,
)
from ..spec.settings import Settings
from .headapi import MAX_JSON_ANSWER, MAX_METRICS_ANSWER, BadAnswer, HeadApi  # noqa: F401 - readiness.HeadApi: status, wait, watch
from .service import ContainerState, inspect_cluster, log_tail, why_dead

# The lines of vLLM 0.33 that mark each phase (engine_lines.PHASE_MARKERS says where vLLM writes each).
PHASES: list[tuple[str, re.Pattern[str]]] = phase_patterns()


def phase_of(lines: Sequence[str]) -> str:
    """The furthest phase these log lines have reached ("starting" before any)."""
    best = -1
    for line in lines:
        for i, (_, rx) in enumerate(PHASES):
            if i > best and rx.search(line):
                best = i
    return PHASES[best][0] if best >= 0 else "starting"


@dataclass
class RankWatch:
    rank: int
    node: str
    phase: str = "starting"
    phase_since: float = field(default_factory=time.monotonic)
    history: list[tuple[str, float]] = field(default_factory=list)


class RankDied(CheckFailed):
    pass


# The failures whose cause is the rank's MODEL folder (engine_lines.FAILURE_MARKERS' first two).
_FOLDER_FAILURES = {m.phase for m in FAILURE_MARKERS[:2]}


def rank_died(rank: int, node: str, state: ContainerState | None, lines: list[str], after_s: float,
              gloo_ifname: str | None = None, kernel: tuple[str | None, list[str]] = (None, [])) -> RankDied:
    """A dead rank, with the cause in vLLM's words when its log says it (however many lines follow).
    `gloo_ifname`: the GLOO_SOCKET_IFNAME the rank ran with, named when Gloo's words are about its socket.
    `kernel`: what its node's kernel lines say of its death (service.why_dead), shown with its log."""
    status = f"{state.status}, exit code {state.exit_code}" if state else "no container"
    why, klines = kernel
    if why:
        status += f": {why}"
    tail = "\n    ".join(lines[-15:]) or "(no log output)"
    if klines:
        tail += f"\n  the kernel's lines on {node}:\n    " + "\n    ".join(klines[-10:])
    found = failure_in(lines)
    cause = f": {found[0]}: {found[1]}" if found else ""
    fix = f"read `sparkctl logs --rank {rank}`; then `sparkctl down` and fix the cause"
    if found and found[0] in _FOLDER_FAILURES:
        fix = (f"MODEL on {node} is incomplete: `sparkctl verify-model` names what is missing there, "
               "`sparkctl model sync` copies it from the head; then `sparkctl down` and `sparkctl up`")
    families = gloo_family_mismatch(found[1]) if found else None
    if families:
        mine, peer = families
        where = f"GLOO_SOCKET_IFNAME={gloo_ifname}" if gloo_ifname else "the interface GLOO_SOCKET_IFNAME names"
        cause = (f": Gloo could not connect: {where} has no {peer} address on {node} (Gloo's socket there is "
                 f"{mine}, the peer's {peer}); in Gloo's words: {found[1] if found else ''}")
        fix = (f"pin rank {rank}'s GLOO_SOCKET_IFNAME to the netdev that carries {node}'s fabric {peer} address: "
               "`sparkctl check` discovers it per rank (RANKn_CX7_IF); a recipe's [container.env] "
               "GLOO_SOCKET_IFNAME overrides the discovered pin for every rank, so remove it there; then "
               "`sparkctl down` and `sparkctl up`")
    return RankDied(f"rank {rank} on {node} died ({status}) after {after_s:.1f}s{cause}\n"
                    f"  its last log lines:\n    {tail}", fix=fix, node=node,
                    failures=[Failure(node, "rank-died", f"rank {rank} died ({status}){cause}", fix)])


def gloo_ifname(settings: Settings, rank: int) -> str | None:
    """The GLOO_SOCKET_IFNAME rank `rank` runs with (builders.rank_env): the recipe's, which wins over every
    rank's pin, else the rank's pinned netdev; None when neither is known."""
    pinned = settings.recipe.container.env.get("GLOO_SOCKET_IFNAME") or settings.get(settings.rank_key(rank, "CX7_IF"))
    return str(pinned) if pinned else None


class RankCutOff(CheckFailed):
    """A rank still running that cannot reach the master: the network path between two nodes."""


# How long a rank may say it cannot reach the master while the master listens before `wait` blames the
# path: the head's world_size line comes a moment before torch opens the port, and a rank that started
# first retries until then.
UNREACHABLE_GRACE_S = 10.0


def rank_cut_off(rank: int, node: str, position: int, head: str, addr: str, port: int, words: str,
                 for_s: float) -> RankCutOff:
    """Rank `rank` on `node` cannot reach the master ADDR:PORT on `head`: the path between the two."""
    err = RankCutOff(
        f"rank {rank} on {node} cannot reach the master {addr}:{port} on {head} (rank 0): it has said so for "
        f"{for_s:.1f}s while the master listens, in its own words: {words}",
        fix=(f"the network path from {node} to {head} is cut for TCP to {addr}:{port}: check the firewall and the "
             f"routes between {node} and {head} (from {node}: `nc -vz {addr} {port}`), and that rank {rank}'s pinned "
             f"interface (RANK{position}_CX7_IF, its GLOO_SOCKET_IFNAME) is the one that routes to {addr} "
             "(`sparkctl check` runs the reach test between the ranks); then `sparkctl down` and `sparkctl up`. "
             "Raising --timeout does not help"),
        node=node)
    err.failures = [Failure(node, "rank-cut-off", f"rank {rank} cannot reach the master {addr}:{port} on {head}",
                            err.fix)]
    return err


def wait_ready(
    cluster: Cluster,
    settings: Settings,
    api: HeadApi,
    *,
    timeout: float,
    on_phase: Callable[[RankWatch], None] = lambda w: None,
    poll_s: float = 0.5,
    prompt: str = "Say hello in five words.",
    unreachable_grace_s: float = UNREACHABLE_GRACE_S,
) -> dict[str, Any]:
    """Until /health is 200, /v1/models lists the served name and a real chat completion answers.

    Every poll also inspects every rank's container: a rank that died fails the wait at once, with
    its last log lines. A rank whose log says it cannot reach the master (engine_lines.UNREACHABLE_MARKERS)
    for more than `unreachable_grace_s` while the master listens fails it too, naming both nodes and the
    address. Polls back off from 0.2 s to `poll_s`; nothing busy-waits.
    """
    name = settings.cluster_name
    served = str(settings.get("SERVED_MODEL_NAME"))
    ranks = settings.service.ranks  # one service: a replica view, or the only replica
    watches = {r.rank: RankWatch(r.rank, r.node) for r in ranks}
    rank_of = {r.node: r.rank for r in ranks}
    position_of = {r.rank: r.position for r in ranks}
    head = ranks[0].node
    listening_since: list[float] = []  # when the master was first seen listening (global rank 0's line)
    stuck_since: dict[int, float] = {}  # rank -> when its log was first seen saying the master is unreachable
    start = time.monotonic()
    seen: dict[str, float] = {}  # when /health first answered 200 (wall clock, for benchmarks)

    def poll_rank(node: Node) -> tuple[list[ContainerState], list[str]]:
        rank = rank_of[node.name]
        states = inspect_cluster(node, name)
        lines = log_tail(node, name, rank, 200)
        return states, lines

    def once() -> dict[str, Any] | None:
        results = cluster.run_all(poll_rank, nodes=settings.nodes)
        results.raise_if_failed("lost contact while waiting")
        answered = results.ok
        for rank, w in watches.items():
            states, lines = answered[w.node]
            mine = [c for c in states if c.rank == rank]
            if not mine or not mine[0].running:
                state = mine[0] if mine else None
                raise rank_died(rank, w.node, state, lines, time.monotonic() - start,
                                gloo_ifname=gloo_ifname(settings, rank),
                                kernel=why_dead(cluster.node(w.node), state))
            phase = phase_of(lines)
            if phase != w.phase:
                now = time.monotonic()
                w.history.append((w.phase, now - w.phase_since))
                w.phase, w.phase_since = phase, now
                on_phase(w)
        now = time.monotonic()
        if not listening_since and master_listening(answered[head][1]):
            listening_since.append(now)
        for rank, w in watches.items():
            stuck = unreachable_master(answered[w.node][1]) if rank != 0 else None
            if stuck is None:
                stuck_since.pop(rank, None)
                continue
            since = stuck_since.setdefault(rank, now)
            if listening_since and now - max(since, listening_since[0]) > unreachable_grace_s:
                addr, port, words = stuck
                raise rank_cut_off(rank, w.node, position_of[rank], head, addr, port, words, now - since)
        if api.health() != 200:
            return None
        seen.setdefault("health_ok_at", time.time())
        models = api.models()
        if served not in models:
            return None
        text, latency = api.chat(served, prompt)
        return {"models": models, "completion": text, "latency_s": latency, "health_ok_at": seen["health_ok_at"],
                "elapsed_s": time.monotonic() - start,
                "phases": {w.rank: [*w.history, (w.phase, time.monotonic() - w.phase_since)]
                           for w in watches.values()}}

    retry = Retrying(
        stop=stop_after_delay(timeout),
        wait=wait_exponential(multiplier=0.1, min=0.2, max=poll_s),
        retry=retry_if_result(lambda r: r is None),
        retry_error_callback=lambda state: None,
        reraise=True,
    )
    result = retry(_guard_http(once))
    if result is None:
        phases = ", ".join(f"rank {w.rank}: {w.phase}" for w in watches.values())
        raise CheckFailed(f"the service was not ready within {timeout:g}s ({phases})",
                          fix="`sparkctl logs` shows what each rank is doing; raise --timeout for a slow load",
                          failures=[Failure(w.node, "not-ready", f"rank {w.rank} is still {w.phase}",
                                            f"`sparkctl logs --rank {w.rank}` shows what it is doing")
                                    for w in watches.values()])
    return result


def _guard_http(fn: Callable[[], dict[str, Any] | None]) -> Callable[[], dict[str, Any] | None]:
    """A refused/timed-out HTTP call while the head loads is 'not ready yet', not a failure."""
    def wrapped() -> dict[str, Any] | None:
        try:
            return fn()
        except (requests.ConnectionError, requests.Timeout):
            return None
        except requests.HTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            if status in (502, 503, 504):
                return None
            if status in (401, 403):
                raise CheckFailed(f"the head refused the API key (HTTP {status})",
                                  fix="set VLLM_API_KEY (env file or environment) to the key the service runs "
                                      "with") from None
            raise CheckFailed(f"the head answered HTTP {status}: {str(exc)[:200]}") from None
        except requests.RequestException:  # an answer cut off mid-body while the head restarts
            return None
    return wrapped
