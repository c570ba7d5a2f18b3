"""The service lifecycle on the nodes: up, status, logs, down (what `orchestrate` runs; wait is
readiness.py).

Everything here runs over one `Cluster` (one SSH connection per node for the whole command). Only
containers labelled `sparkctl.cluster=<CLUSTER_NAME>` are ever inspected, replaced or removed.

`up` is all-or-nothing: it starts workers, then the head, and if anything fails — a node, a
container, a Ctrl-C — it removes every container of this cluster it can reach before exiting 1.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import signals
from ..cluster import Cluster, Node, NodeError, Results, raise_failed
from ..errors import CheckFailed, Failure
from ..facts.docker_parse import ContainerState, parse_container_inspect, parse_format_value
from ..facts.engine_lines import failure_in
from ..facts.node_facts import NodeFacts
from ..facts.parsing import ParseError
from ..rules import death
from ..rules.memory import DEFAULT_WAIT_S, NodeMemory, not_back
from ..spec.builders import (
    CONTAINER,
    LABEL_CLUSTER,
    RankSpec,
    container_name,
    docker_run_argv,
    env_file_text,
    rank_docker_argv,
    remote_env_file,
)
from ..spec.settings import Settings
from ..spec.setup_plan import DROP_CACHES_SUDOERS as DROP_CACHES_SUDOERS
from ..threads import spawn, wait_all
from . import cleanup
from .lockdir import audit_append_argv, audit_line, state_dir

T = TypeVar("T")

# All containers of a cluster on a node, inspected in one round trip. $ids is split on purpose:
# `docker ps -q` prints only hex container IDs.
_INSPECT = r'''ids=$(docker ps -aq --no-trunc --filter "label=$1") || exit $?
if [ -z "$ids" ]; then echo '[]'; else docker inspect $ids; fi'''


def inspect_cluster(node: Node, cluster: str) -> list[ContainerState]:
    r = node.run(["sh", "-c", _INSPECT, "sparkctl-inspect", f"{LABEL_CLUSTER}={cluster}"], timeout=30)
    if not r.ok:
        first = next((ln for ln in r.stderr.splitlines() if ln.strip()), f"exit status {r.exit_code}")
        raise NodeError(node.name, "docker", f"cannot list containers: {first[:300]}",
                        f"check the Docker engine on {node.name} (`docker version` there)")
    try:
        return parse_container_inspect(r.stdout)
    except ParseError as exc:
        raise NodeError(node.name, "output", str(exc)) from None


def image_id(node: Node, ref: str) -> str | None:
    r = node.docker(["image", "inspect", "--format", "{{.Id}}", ref], timeout=30)
    return parse_format_value(r.stdout) if r.ok else None


def node_state(node: Node, cluster: str, image: str) -> tuple[list[ContainerState], str | None]:
    """This cluster's containers on the node and the ID of the image the service runs there."""
    return inspect_cluster(node, cluster), image_id(node, image)


def audit(cluster: Cluster, names: Sequence[str], cluster_name: str, lines: dict[str, list[str]]) -> None:
    """Append audit lines on each node; an audit failure never hides the action's own result."""
    def one(node: Node) -> None:
        if lines.get(node.name):
            node.run(audit_append_argv(cluster_name, lines[node.name]), timeout=20)

    cluster.run_all(one, nodes=[n for n in names if n in cluster.connected])


# ------------------------------------------------------------------------------------------- up


@dataclass
class UpOutcome:
    changed: bool
    reasons: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # "rank N on NODE"
    config_hash: str = ""


def diff_running(
    specs: Sequence[RankSpec], cfg_hash: str, states: dict[str, list[ContainerState]], images: dict[str, str | None]
) -> list[str]:
    """Why the running service is not the wanted one (empty: it is exactly the wanted one)."""
    reasons = []
    for spec in specs:
        mine = [c for c in states.get(spec.node, []) if c.rank == spec.rank]
        others = [c for c in states.get(spec.node, []) if c.rank != spec.rank]
        for c in others:
            reasons.append(f"{spec.node}: container {c.name} (rank {c.rank}) does not belong to rank {spec.rank}")
        if not mine:
            reasons.append(f"rank {spec.rank} ({spec.node}): not running")
            continue
        c = mine[0]
        if len(mine) > 1:
            reasons.append(f"rank {spec.rank} ({spec.node}): {len(mine)} containers")
        if not c.running:
            reasons.append(f"rank {spec.rank} ({spec.node}): container {c.status} (exit {c.exit_code})")
        if c.config_hash != cfg_hash:
            reasons.append(f"rank {spec.rank} ({spec.node}): config changed ({c.config_hash} → {cfg_hash})")
        if images.get(spec.node) and c.image_id != images[spec.node]:
            reasons.append(f"rank {spec.rank} ({spec.node}): image changed ({c.image_id[:19]} → "
                           f"{str(images[spec.node])[:19]})")
    return reasons


def up(
    cluster: Cluster,
    settings: Settings,
    specs: list[RankSpec],
    cfg_hash: str,
    *,
    recreate: bool = False,
    say: Callable[[str], None] = lambda s: None,
    settle_s: float = 0.25,
    gathered: Mapping[str, tuple[list[ContainerState], str | None] | NodeError],
    memory: Mapping[str, NodeMemory] | None = None,
    look: Callable[[Node], NodeFacts] | None = None,
) -> UpOutcome:
    """Start the service (workers, then the head) or leave an identical one alone. gathered: each
    node's node_state, read by the caller's preflight (orchestrate.up.start_service). memory: each
    rank node's need (memory.NodeMemory); with look (a node's facts now) `up` waits, after the old
    containers are gone, until every rank node's memory is back (MEMORY_WAIT_S), then drops the
    page cache where NodeMemory says so. Without them: DROP_CACHES=1 drops it on every rank node."""
    name = settings.cluster_name
    nodes = settings.nodes
    image = settings.image
    got = Results(gathered)
    got.raise_if_failed("cannot start: nodes not ready")
    ok_states = {n: g[0] for n, g in got.ok.items()}
    ok_images = {n: g[1] for n, g in got.ok.items()}
    missing = [n for n in nodes if ok_images[n] is None]
    if missing:
        raise CheckFailed(f"image {image} is not on {', '.join(missing)}",
                          fix="run `sparkctl build` (or `sparkctl check` to see every node's images)")
    reasons = diff_running(specs, cfg_hash, ok_states, ok_images)
    records = cluster.run_all(lambda n: cleanup.up_records(n, name), nodes=nodes)
    orphaned = {n: cleanup.orphans(ok_states[n], r) for n, r in records.ok.items()}
    for n in records.failed:  # an audit log that cannot be read: nothing there is known to be ours
        orphaned[n] = list(ok_states[n])
    for n, cs in orphaned.items():
        reasons += [f"{n}: orphan container {c.name} (rank {c.rank}): no successful `up` recorded it "
                    "(left by a crashed or killed run)" for c in cs]
    if not reasons and not recreate:
        return UpOutcome(changed=False, config_hash=cfg_hash)
    if recreate and not reasons:
        reasons = ["--recreate"]
    outcome = UpOutcome(changed=True, reasons=reasons, config_hash=cfg_hash)
    started: list[str] = []
    ids: dict[str, str] = {}
    # Per node, what may be there if the rollback cannot reach it: what was there, what we start.
    expected: dict[str, list[str]] = {n: [c.name for c in ok_states[n]] for n in nodes}
    try:
        if any(ok_states.values()):
            say("replacing the running service: " + "; ".join(reasons))
            orphan_lines = {n: [audit_line(action="orphan-removed", rank=c.rank, config_hash=c.config_hash,
                                           container=c.id, detail=f"replaced orphan {c.name}") for c in cs]
                            for n, cs in orphaned.items()}
            failed_down = _down_all(cluster, settings, say)
            audit(cluster, [n for n in nodes if n not in failed_down], name, orphan_lines)
            raise_failed("cannot remove the old containers", failed_down)
        by_rank = {s.rank: s for s in specs}
        workers = [s for s in specs if s.rank > 0]
        for s in specs:
            if container_name(name, s.rank) not in expected[s.node]:
                expected[s.node].append(f"{container_name(name, s.rank)} (rank {s.rank}, being started)")
        rank_nodes = sorted({sp.node for sp in specs})
        if memory is not None and look is not None and float(settings.get("MEMORY_WAIT_S", DEFAULT_WAIT_S)) > 0:
            wait_for_memory(cluster, settings, {n: memory[n] for n in rank_nodes if n in memory}, look, say)
        if memory is not None:
            drop_on = [n for n in rank_nodes if n in memory and memory[n].drop_caches]
        else:
            drop_on = rank_nodes if str(settings.get("DROP_CACHES", "auto")) == "1" else []
        if drop_on:
            drop_caches(cluster, settings, drop_on, say)
        _start(cluster, settings, workers, cfg_hash, started, say, ids)
        _start(cluster, settings, [by_rank[0]], cfg_hash, started, say, ids)
        _confirm_running(cluster, settings, specs, settle_s)
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        why = (f"interrupted ({exc.name})" if isinstance(exc, signals.Interrupted) else "interrupted") \
            if interrupted else str(exc).splitlines()[0][:300]
        with signals.shielded(deliver=False):  # a second signal must not cut the rollback short
            say(f"rolling back: removing this cluster's containers ({why})")
            report = _rollback(cluster, settings, expected, say)
            lines = cleanup.sweep_lines(report)
            for ln in lines:
                say("  " + ln)
            try:
                audit(cluster, nodes, name, {n: [audit_line(action="up-rolled-back", config_hash=cfg_hash,
                                                            detail=f"{why}; {report[n].line(n)}")]
                                             for n in nodes if n in report})
            except Exception:  # the audit must never hide the failure being reported
                pass
        if interrupted:
            raise
        fix = exc.fix if isinstance(exc, CheckFailed) else None
        msg = exc.message if isinstance(exc, CheckFailed) else str(exc)
        raise CheckFailed(f"{msg}\nrolled back:\n  " + "\n  ".join(lines), fix=fix,
                          node=exc.node if isinstance(exc, CheckFailed) else None,
                          failures=exc.failures if isinstance(exc, CheckFailed) else None,
                          extra={"rolled_back": lines}) from None
    outcome.started = started
    # The point of no return: every rank runs. A signal from here on is noted and changes nothing, so
    # the `up` lines (what tells this run's containers from orphans) are always written.
    with signals.shielded():
        signals.commit()
        audit(cluster, nodes, name, {
            s.node: [audit_line(action="up", rank=s.rank, config_hash=cfg_hash, container=ids.get(s.node),
                                detail=f"started {container_name(name, s.rank)} ({image})")] for s in specs
        })
    return outcome


def settled(call: Callable[[], T]) -> T:
    """Run a fan-out to its end even if Ctrl-C arrives meanwhile, then re-raise the interrupt.

    Otherwise a `docker run` still in flight on a pool thread could create a container after the
    rollback has already swept that node: an orphan. Every remote call has its own timeout, so this
    waits a bounded time.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    # Shielded from the thread's start to its end (a signal inside spawn() would leave the fan-out
    # running unseen); a signal meanwhile is raised once it has ended.
    with signals.shielded():
        wait_all([spawn(target, "settled")], poll=0.1)
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result


# Write the rank's env file (mode 0600, from stdin: secrets never touch a command line) and start its
# container, in one round trip. Every value is a positional argument.
_WRITE_AND_RUN = r'''d="$1"; f="$2"; shift 2
umask 077 && mkdir -p -- "$d" && chmod 700 -- "${d%/*}" "$d" && cat > "$f" || exit 97
exec "$@"'''


# DROP_CACHES: a GB10's CUDA does not get the page cache back in time, so the KV cache
# allocation fails after the weights load. Dropped as root, or through `sudo -n` writing only that
# file; never otherwise. Prints "dropped HOW MEMFREE_KB_BEFORE MEMFREE_KB_AFTER"; exit 4: no right.
_DROP_CACHES = r"""
free_kb() { awk '/^MemFree:/ {print $2; exit}' /proc/meminfo; }
before=$(free_kb)
sync
if [ "$(id -u)" -eq 0 ]; then
    how=root
    echo 3 > /proc/sys/vm/drop_caches || exit 3
elif printf '3\n' | sudo -n tee /proc/sys/vm/drop_caches >/dev/null 2>&1; then
    how=sudo
else
    echo "not root, and sudo -n cannot write /proc/sys/vm/drop_caches" >&2
    exit 4
fi
printf 'dropped %s %s %s\n' "$how" "$before" "$(free_kb)"
"""


@dataclass(frozen=True)
class Dropped:
    how: str  # root | sudo
    freed_bytes: int  # MemFree after − before (0 when it did not grow)


def parse_dropped(text: str) -> Dropped | None:
    """The script's last line 'dropped HOW BEFORE_KB AFTER_KB', or None when it is not there."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    m = re.fullmatch(r"dropped (root|sudo) (\d{1,18}) (\d{1,18})", lines[-1].strip()) if lines else None
    if not m:
        return None
    return Dropped(m.group(1), max(0, int(m.group(3)) - int(m.group(2))) * 1024)


def drop_caches(cluster: Cluster, settings: Settings, nodes: Sequence[str], say: Callable[[str], None]) -> None:
    """`sync` and drop the page cache on each node (DROP_CACHES on there), audited per node with what it
    freed. A node where sparkctl has no right to (not root, `sudo -n` refused) is audited and refuses
    the start (CheckFailed: `up` rolls back, nothing of this release starts): the operator asked for
    the cache to be dropped, and a start on a full cache is the failure the knob exists to prevent."""
    name = settings.cluster_name

    def one(node: Node) -> Dropped | str:
        r = node.run(["sh", "-c", _DROP_CACHES, "sparkctl-drop-caches"], timeout=300)
        got = parse_dropped(r.stdout) if r.ok else None
        if got is None:
            first = next((ln for ln in r.stderr.splitlines() if ln.strip()), f"exit status {r.exit_code}")
            return first[:200]
        return got

    results = cluster.run_all(one, nodes=list(nodes))
    lines: dict[str, list[str]] = {}
    refused: dict[str, str] = {}
    for n, res in results.ok.items():
        if isinstance(res, Dropped):
            say(f"dropped the page cache on {n} ({res.how}): {res.freed_bytes / 1e9:.1f} GB freed")
            lines[n] = [audit_line(action="drop-caches", detail=f"{res.how}, {res.freed_bytes} B freed")]
        else:
            refused[n] = res
            lines[n] = [audit_line(action="drop-caches-refused", detail=res)]
    for n, err in results.failed.items():
        refused[n] = err.reason
    audit(cluster, list(lines), name, lines)
    if refused:
        raise CheckFailed(f"DROP_CACHES={settings.get('DROP_CACHES', 'auto')}, but the page cache could not be dropped on "
                          + "; ".join(f"{n} ({why})" for n, why in sorted(refused.items())),
                          fix="run sparkctl as root there, or allow exactly that write with a sudoers line: "
                              f"{DROP_CACHES_SUDOERS}; or set DROP_CACHES=0 to start on the cache as it is")


def wait_for_memory(cluster: Cluster, settings: Settings, need: Mapping[str, NodeMemory],
                    look: Callable[[Node], NodeFacts], say: Callable[[str], None], *,
                    interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until each node's memory is back (memory.not_back: no ended process still listed with
    GPU memory; on unified memory, MemFree + page cache covers the plan), at most MEMORY_WAIT_S;
    said once per node with what it waits for, and when it is back. On time-out: CheckFailed with
    the numbers (the caller starts nothing). A node already back costs one look, nothing said."""
    wait_s = float(settings.get("MEMORY_WAIT_S", DEFAULT_WAIT_S))
    start = clock()
    deadline = start + wait_s
    pending = sorted(need)
    waited: dict[str, str] = {}
    lines: dict[str, list[str]] = {}
    while pending:
        looked = cluster.run_all(look, nodes=pending)
        short = {n: f"its memory cannot be read: {e.reason}" for n, e in looked.failed.items()}
        for n, facts in looked.ok.items():
            why = not_back(facts, need[n])
            if why:
                short[n] = why
        for n in pending:
            if n in waited and n not in short:
                say(f"memory back on {n} after {clock() - start:.1f} s")
                lines[n] = [audit_line(action="memory-wait", detail=f"back after {clock() - start:.1f} s: "
                                                                  f"{waited[n]}"[:400])]
        for n, why in sorted(short.items()):
            if n not in waited:
                say(f"waiting up to {wait_s:g} s (MEMORY_WAIT_S) for the memory on {n} to come back: {why}")
            waited[n] = why
        pending = sorted(short)
        if pending and clock() >= deadline:
            for n in pending:
                lines[n] = [audit_line(action="memory-wait-refused", detail=short[n][:400])]
            audit(cluster, list(lines), settings.cluster_name, lines)
            raise CheckFailed(
                f"the memory did not come back within {wait_s:g} s (MEMORY_WAIT_S); nothing of this release "
                "was started:\n  " + "\n  ".join(f"{n}: {short[n]}" for n in pending),
                failures=[Failure(n, "memory", short[n], f"see what holds the memory on {n} (nvidia-smi; "
                                  "ps aux --sort=-rss | head) and free it") for n in pending],
                fix="see what holds it there (nvidia-smi; ps aux --sort=-rss | head) and free it, or raise "
                    "MEMORY_WAIT_S if it is on its way back")
        if pending:
            sleep(max(0.0, min(interval_s, deadline - clock())))
    if lines:
        audit(cluster, list(lines), settings.cluster_name, lines)


def _start(cluster: Cluster, settings: Settings, specs: list[RankSpec], cfg_hash: str, started: list[str],
           say: Callable[[str], None], ids: dict[str, str]) -> None:
    name = settings.cluster_name
    argv = {s.node: ["sh", "-c", _WRITE_AND_RUN, "sparkctl-start", state_dir(name), remote_env_file(name, s.rank),
                     *docker_run_argv(settings, s, cfg_hash)] for s in specs}
    env_text = {s.node: env_file_text(s.env).encode() for s in specs}
    rank = {s.node: s.rank for s in specs}

    def one(node: Node) -> str:
        r = node.run(argv[node.name], stdin=env_text[node.name], timeout=120)
        if r.exit_code == 97:
            raise NodeError(node.name, "state", f"cannot write {remote_env_file(name, rank[node.name])}: "
                            f"{r.stderr.strip()[:200]}", f"check that the SSH user can write ~/{state_dir(name)}")
        if not r.ok:
            first = next((ln for ln in r.stderr.splitlines() if ln.strip()), f"exit status {r.exit_code}")
            raise NodeError(node.name, "docker-run", f"rank {rank[node.name]}'s container did not start: {first[:400]}",
                            "see the error above; `sparkctl render` prints the exact command line")
        return r.stdout.strip()

    results = settled(lambda: cluster.run_all(one, nodes=list(argv)))
    for node, res in results.ok.items():
        ids[node] = res.splitlines()[-1].strip()[:128] if res else ""  # docker run --detach prints the ID
        started.append(f"rank {rank[node]} on {node}")
        say(f"started rank {rank[node]} on {node}")
    results.raise_if_failed("start failed")


def _confirm_running(cluster: Cluster, settings: Settings, specs: list[RankSpec], settle_s: float) -> None:
    """A container that exits at once (a bad flag, a missing interface) fails `up`, not `wait`."""
    if settle_s > 0:
        time.sleep(settle_s)
    states = cluster.run_all(lambda n: inspect_cluster(n, settings.cluster_name), nodes=settings.nodes)
    states.raise_if_failed("lost nodes while starting")
    dead, failures = [], []
    running = states.ok
    for spec in specs:
        mine = [c for c in running[spec.node] if c.rank == spec.rank]
        if not mine or not mine[0].running:
            tail = log_tail(cluster.node(spec.node), settings.cluster_name, spec.rank, 50)
            status = f"{mine[0].status}, exit {mine[0].exit_code}" if mine else "gone"
            found = failure_in(tail)  # vLLM's words for the cause, even with lines after it
            said = f"{found[0]}: {found[1]}" if found else (tail[-1] if tail else "")
            dead.append(f"rank {spec.rank} ({spec.node}) {status}" + (f": {said}" if said else ""))
            failures.append(Failure(spec.node, "rank-died", dead[-1],
                                    f"`sparkctl logs --rank {spec.rank}` shows why; `sparkctl render` prints its "
                                    "command line"))
    if dead:
        raise CheckFailed("containers died right after start:\n  " + "\n  ".join(dead), failures=failures)


def _rollback(cluster: Cluster, settings: Settings, expected: dict[str, list[str]],
              say: Callable[[str], None]) -> dict[str, cleanup.NodeSweep]:
    return cleanup.sweep(cluster, settings.cluster_name, [settings.nodes], expected=expected, say=say,
                         deliver=False)


def _down_all(cluster: Cluster, settings: Settings, say: Callable[[str], None],
              expected: dict[str, list[str]] | None = None) -> dict[str, NodeError]:
    """Heads first (each serves its replica's API and holds its rendezvous), then the workers in parallel."""
    topo = settings.topology
    heads = list(topo.heads)
    workers = [n for n in topo.nodes if n not in heads]
    groups = [[n for n in g if n in cluster.connected] for g in (heads, workers)]
    report = cleanup.sweep(cluster, settings.cluster_name, groups, expected=expected, say=say)
    return {n: NodeError(n, "docker", r.line(n)) for n, r in report.items() if not r.clean}


# ------------------------------------------------------------------------------------------ down


def down(cluster: Cluster, settings: Settings, say: Callable[[str], None] = lambda s: None) -> dict[str, NodeError]:
    """Remove this cluster's containers everywhere; unreachable nodes are returned, the rest torn down.

    Once the removal starts it runs to its end (signals.commit: a signal is noted, not obeyed;
    a third one aborts, naming what is left). Orphans (cleanup.py) are named and audited as such."""
    name = settings.cluster_name
    failed = {n: e for n, e in cluster.errors.items() if n in settings.nodes}
    reachable = [n for n in settings.nodes if n in cluster.connected]
    before = cluster.run_all(lambda n: inspect_cluster(n, name), nodes=reachable)
    records = cluster.run_all(lambda n: cleanup.up_records(n, name), nodes=reachable)
    seen, recorded = before.ok, records.ok
    expected = {n: [c.name for c in st] for n, st in seen.items()}
    orphan_ids: set[str] = set()
    for n, st in seen.items():
        if n in recorded:
            for c in cleanup.orphans(st, recorded[n]):
                orphan_ids.add(c.id)
                say(f"{n}: removing orphan {c.name} (rank {c.rank}): no successful `up` recorded it")
    signals.commit()
    failed |= _down_all(cluster, settings, say, expected)
    lines = {}
    for n, states in seen.items():
        if n in failed:
            continue
        lines[n] = [audit_line(action="down", rank=c.rank, config_hash=c.config_hash, container=c.id,
                               detail=f"removed {c.name}" + (" (orphan: no successful up recorded it)"
                                                            if c.id in orphan_ids else ""))
                    for c in states] or [audit_line(action="down", detail="nothing running")]
    audit(cluster, reachable, name, lines)
    return failed


# ------------------------------------------------------------------------------------------ logs

def log_tail(node: Node, cluster: str, rank: int, n: int) -> list[str]:
    """The last `n` lines of rank `rank`'s container of `cluster` on `node` ([] when they cannot be read)."""
    try:
        r = node.run(rank_docker_argv(cluster, rank, ["docker", "logs", "--tail", str(int(n)), CONTAINER]), timeout=20)
    except NodeError:
        return []
    return (r.stdout + r.stderr).splitlines()[-n:]


def kernel_lines(node: Node, n: int = 20) -> list[str]:
    """The node's kernel lines about OOM kills, Xid errors, NVRM and mlx5, the last `n`
    (probes/kernel_lines.sh: dmesg, else journalctl -k); [] when they cannot be read."""
    from ..spec.resources import probe_script

    try:
        r = node.run(["sh", "-s", "--", str(int(n))], stdin=probe_script("kernel_lines.sh") + b'\nkernel_lines "$1"\n',
                     timeout=20)
    except NodeError:
        return []
    return death.relevant(r.stdout.splitlines(), n) if r.ok else []


def why_dead(node: Node, state: ContainerState | None) -> tuple[str | None, list[str]]:
    """(the cause a dead rank's exit code and its node's kernel lines point to, those lines)."""
    lines = kernel_lines(node)
    return death.why(state.exit_code if state else None, None, lines), lines


def log_argv(container: str, *, tail: int | None, follow: bool, since: str | None = None) -> list[str]:
    argv = ["docker", "logs"]
    if tail is not None:
        argv += ["--tail", str(int(tail))]
    if since:
        argv += ["--since", since]
    if follow:
        argv.append("--follow")
    return argv + [container]


def stream_logs(cluster: Cluster, settings: Settings, ranks: Sequence[int], *, tail: int | None, follow: bool,
                emit: Callable[[int, str, str], None], stop: threading.Event) -> dict[str, NodeError]:
    """Every selected rank's log lines to emit(rank, node, line), all ranks at once."""
    name = settings.cluster_name
    errors: dict[str, NodeError] = {}

    def one(rank: int) -> None:
        node_name = settings.service.ranks[rank].node
        try:
            node = cluster.node(node_name)
            argv = rank_docker_argv(name, rank, log_argv(CONTAINER, tail=tail, follow=follow))
            for line in node.stream(argv, stop=stop):
                emit(rank, node_name, line)
        except NodeError as exc:
            errors[node_name] = exc

    ended = [spawn(functools.partial(one, r), f"logs-rank{r}") for r in ranks]
    try:
        wait_all(ended, poll=0.2)
    except KeyboardInterrupt:
        stop.set()
    return errors


def api_base_url(hostname: str, port: int) -> str:
    """The head's OpenAI API: its ssh config HostName (an IPv6 address in brackets) and PORT."""
    if ":" in hostname:
        hostname = f"[{hostname}]"
    return f"http://{hostname}:{port}"


def head_base_url(cluster: Cluster, settings: Settings) -> str:
    return api_base_url(cluster.target(settings.head).hostname, settings.getint("PORT"))
