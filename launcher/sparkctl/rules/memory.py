"""Memory rules for `up`: who holds a node's GPU memory, whether the memory is back after
a stop, whether to drop the page cache. Pure: facts (sparkctl.facts.node_facts) and numbers in, answers out.

On a GB10 the GPU and the CPU share the node's memory: what an engine can get now is MemFree, plus
the page cache once it is dropped. After a container is killed its memory can take seconds to a
minute to come back (the field's restart OOM), and a process that has ended may still be listed by
nvidia-smi until then. A live process outside this cluster's containers that holds GPU memory is not
sparkctl's to stop: `up` refuses, naming it.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..facts.node_facts import GpuApp, MemInfo, NodeFacts
from ..spec.planner import gb

DEFAULT_WAIT_S = 120.0  # the field: a killed engine's memory is back within seconds to a minute


@dataclass(frozen=True)
class NodeMemory:
    """What `up` needs of one node's memory: the plan's bytes there (per-rank total × its ranks),
    whether it is unified (GB10: nvidia-smi reports no memory.total), whether its page cache is dropped."""

    need_bytes: int
    unified: bool
    drop_caches: bool


def unified(facts: NodeFacts) -> bool:
    """A GB10: nvidia-smi reports GPUs but no memory.total ([N/A]): the GPU uses the node's memory."""
    return bool(facts.gpus) and all(g.memory_total_mib is None for g in facts.gpus or [])


def drop_caches_on(setting: str, is_unified: bool) -> bool:
    """DROP_CACHES: 1 everywhere, 0 nowhere, auto (default) on unified-memory nodes only."""
    value = str(setting or "auto").strip().lower()
    if value == "auto":
        return is_unified
    return value == "1"


def where(app: GpuApp) -> str:
    """', container NAME' / ', container NAME of sparkctl cluster C' / ', container ID12' / ''."""
    if app.container_id is None:
        return ""
    name = app.container_name or app.container_id[:12]
    if app.container_cluster:
        return f", container {name} of sparkctl cluster {app.container_cluster!r}"
    return f", container {name}"


def describe(apps: Sequence[GpuApp]) -> str:
    """'pid 446 python3 (11.3 GB, container trainer)' per process, the largest first."""
    ordered = sorted(apps, key=lambda a: -(a.used_bytes or 0))
    return ", ".join(
        f"pid {a.pid} {a.name or '?'} ({gb(a.used_bytes) if a.used_bytes is not None else 'size not reported'}"
        f"{where(a)}{'; it has exited' if a.ended else ''})"
        for a in ordered
    )


def foreign(apps: Sequence[GpuApp], cluster: str, own_ids: Collection[str] = ()) -> list[GpuApp]:
    """Live GPU processes that are not this cluster's: not in one of its containers (by ID, or by the
    sparkctl.cluster label), and not ended (an ended one is memory on its way back)."""
    return [a for a in apps if not a.ended and a.container_id not in own_ids and a.container_cluster != cluster]


def foreign_fix(node: str, apps: Sequence[GpuApp]) -> str:
    """How to free the GPU: sparkctl never stops what it did not start. A name or label the node reported is
    one shell-quoted word in each command named here (they get pasted into a shell)."""
    others = sorted({a.container_cluster for a in apps if a.container_cluster})
    named = [a.container_name or (a.container_id or "")[:12] for a in apps if a.container_id and not a.container_cluster]
    steps = [f"`CLUSTER_NAME={shlex.quote(c)} sparkctl down`" for c in others]
    steps += [f"`{shlex.join(['docker', 'stop', n])}` on {node}" for n in named]
    if any(a.container_id is None for a in apps):
        steps.append(f"stop pid {', '.join(str(a.pid) for a in apps if a.container_id is None)} on {node}")
    return ("free the GPU on " + node + " yourself (" + "; ".join(steps) + "), then run up again; sparkctl does "
            "not stop processes it did not start")


def not_back(facts: NodeFacts, mem: NodeMemory) -> str | None:
    """Why this node's memory is not back yet (None: it is): a process that has ended but is still
    listed with GPU memory, or (unified memory) MemFree + droppable page cache below the plan's need.
    The words name the numbers, for the wait's progress line and its refusal."""
    apps = facts.gpu_apps or []
    ended = [a for a in apps if a.ended]
    m: MemInfo | None = facts.meminfo
    reasons = []
    if ended:
        reasons.append(f"ended process(es) still hold GPU memory: {describe(ended)}")
    if mem.unified and m is not None:
        free = m.free_bytes if m.free_bytes is not None else (m.available_bytes or 0)
        cache = m.cache_bytes or 0
        if free + cache < mem.need_bytes:
            reasons.append(f"the plan needs {gb(mem.need_bytes)}, {gb(free)} is free and {gb(cache)} is page cache "
                           f"(MemTotal {gb(m.total_bytes)})")
    return "; ".join(reasons) or None
