"""Removing a cluster's containers and saying exactly what was removed and what was left, and where;
and telling the containers a successful `up` started from orphans a crashed run left behind.

A sweep (the rollback of a failed `up`, and `down`) reports per node: the containers it removed, or
why it could not and which containers may still be there (the ones it saw before, plus the ones the
interrupted `up` was starting there). It runs shielded (signals.py): a second signal is noted and the
sweep goes on; a third aborts it, and the report then names the nodes whose removal had not finished.

An orphan is a container with this cluster's label whose ID no successful-`up` audit line on its node
names: `up` audits every container it started (its ID) only once all of them run, so a run killed
before that (`kill -9`, a power cut) leaves orphans. `up` replaces them and `down` removes them, both
audited.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import signals
from ..cluster import Cluster, Node, NodeError
from ..facts.parsing import ParseError, parse_json
from ..spec.builders import LABEL_CLUSTER
from .lockdir import audit_file, state_dir

# Lists "ID NAME" of each of the cluster's containers, removes them, then prints the names it removed.
# IDs are hex and names [a-zA-Z0-9_.-]: both are single words.
_REMOVE = r'''list=$(docker ps -a --no-trunc --filter "label=$1" --format '{{.ID}} {{.Names}}') || exit $?
if [ -n "$list" ]; then
  docker rm -f $(printf '%s\n' "$list" | cut -d' ' -f1) >/dev/null || { printf '%s\n' "$list"; exit 1; }
  printf '%s\n' "$list"
fi
rm -f -- "$2"/rank*.env'''
# The successful-`up` lines of a node's audit log (the newest 2000 are plenty).
_UP_RECORDS = r'''f="$1"; [ -f "$f" ] || exit 0; grep -F '"action": "up"' -- "$f" | tail -n 2000'''


def _names(stdout: str) -> list[str]:
    return [ln.split(" ", 1)[1] for ln in stdout.splitlines() if " " in ln.strip()][:100]


class RemoveFailed(NodeError):
    """`docker rm` failed on a node; `left` names the containers that were there."""

    def __init__(self, node: str, reason: str, left: list[str]) -> None:
        super().__init__(node, "docker", reason)
        self.left = left


def remove_cluster(node: Node, cluster: str) -> list[str]:
    """Remove every container labelled with this cluster on the node; the names it removed."""
    r = node.run(["sh", "-c", _REMOVE, "sparkctl-remove", f"{LABEL_CLUSTER}={cluster}", state_dir(cluster)],
                 timeout=60)
    if not r.ok:
        first = next((ln for ln in r.stderr.splitlines() if ln.strip()), f"exit status {r.exit_code}")
        raise RemoveFailed(node.name, f"cannot remove containers: {first[:300]}", _names(r.stdout))
    return _names(r.stdout)


@dataclass
class NodeSweep:
    removed: list[str] = field(default_factory=list)
    error: str | None = None  # why this node is not known to be clean
    left: list[str] = field(default_factory=list)  # containers that may still be there

    @property
    def clean(self) -> bool:
        return self.error is None

    def line(self, node: str) -> str:
        if self.clean:
            return f"{node}: removed {', '.join(self.removed)}" if self.removed else f"{node}: nothing to remove"
        left = f"; may still be there: {', '.join(self.left)}" if self.left else ""
        done = f"removed {', '.join(self.removed)}; " if self.removed else ""
        return f"{node}: {done}NOT clean ({self.error}){left}"


def sweep(cluster: Cluster, cluster_name: str, groups: Sequence[Sequence[str]], *,
          expected: Mapping[str, Sequence[str]] | None = None,
          say: Callable[[str], None] = lambda s: None, deliver: bool = True) -> dict[str, NodeSweep]:
    """Remove the cluster's containers, group after group (the head first, then the workers at once).

    expected: per node, the containers that may be there (seen before, or being started): named as
    left behind on a node that cannot be cleaned. Runs to its end despite a second signal; a third
    raises signals.CleanupAborted after saying which nodes were not finished. deliver: a first signal
    that arrived meanwhile is raised once the sweep is done (False inside a rollback: it is the
    rollback)."""
    expected = expected or {}
    report: dict[str, NodeSweep] = {}

    def one(node: Node) -> None:
        try:
            report[node.name] = NodeSweep(removed=remove_cluster(node, cluster_name))
        except NodeError as exc:
            left = exc.left if isinstance(exc, RemoveFailed) and exc.left else list(expected.get(node.name, []))
            report[node.name] = NodeSweep(error=exc.reason, left=left)

    try:
        with signals.shielded(deliver=deliver):
            for group in groups:
                for name, err in cluster.run_all(one, nodes=list(group)).failed.items():
                    if name not in report:  # unreachable: never ran
                        report[name] = NodeSweep(error=err.reason, left=list(expected.get(name, [])))
    except signals.CleanupAborted:
        for group in groups:
            for name in group:
                if name not in report:
                    report[name] = NodeSweep(error="removal not finished: aborted by a third signal",
                                         left=list(expected.get(name, [])) or ["(unknown: not inspected)"])
        say("aborted: the cleanup did not finish; per node:")
        for name in [n for g in groups for n in g]:
            say("  " + report[name].line(name))
        say("run `sparkctl down` to remove what is left")
        raise
    return report


def sweep_lines(report: Mapping[str, NodeSweep]) -> list[str]:
    return [s.line(n) for n, s in report.items()]


# ---------------------------------------------------------------------------------------- orphans


@dataclass(frozen=True)
class UpRecords:
    """What a node's audit log says successful `up`s started there."""

    ids: frozenset[str] = frozenset()
    legacy: frozenset[tuple[int, str]] = frozenset()  # (rank, config hash) of lines older sparkctl wrote


def parse_up_records(text: str) -> UpRecords:
    ids: set[str] = set()
    legacy: set[tuple[int, str]] = set()
    for line in text.splitlines()[-2000:]:
        try:
            doc = parse_json(line[:4096])
        except ParseError:
            continue
        if not isinstance(doc, dict) or doc.get("action") != "up":
            continue
        cid, rank, cfg = doc.get("container"), doc.get("rank"), doc.get("config_hash")
        if isinstance(cid, str) and cid:
            ids.add(cid[:128])
        elif isinstance(rank, int) and isinstance(cfg, str):
            legacy.add((rank, cfg[:128]))
    return UpRecords(frozenset(ids), frozenset(legacy))


def up_records(node: Node, cluster: str) -> UpRecords:
    r = node.run(["sh", "-c", _UP_RECORDS, "sparkctl-up-records", audit_file(cluster)], timeout=30)
    return parse_up_records(r.stdout if r.ok else "")


def orphans(states: Sequence[Any], records: UpRecords) -> list[Any]:
    """The containers (service.ContainerState) no successful `up` recorded."""
    return [c for c in states
            if c.id not in records.ids and (c.rank, c.config_hash or "") not in records.legacy]
