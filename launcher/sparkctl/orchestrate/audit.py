"""`sparkctl audit`'s flow: the audit lines sparkctl wrote on every node, merged by time."""

from __future__ import annotations

from typing import Any

from ..cluster import Cluster, NodeError
from ..facts.parsing import ParseError, parse_json
from ..remote.lockdir import audit_tail_argv
from ..spec.settings import Settings


def read_audit(s: Settings, ssh_config: Any, tail: int) -> tuple[list[dict[str, Any]], dict[str, NodeError]]:
    """(every node's last `tail` audit lines, each with its node, sorted by time; the nodes that did not
    answer, in NODES' order, each with why)."""
    entries: list[dict[str, Any]] = []
    with Cluster(s.nodes, ssh_config) as cluster:
        results = cluster.run_all(audit_tail_argv(s.cluster_name, tail), nodes=cluster.connected)
    for node, r in results.ok.items():
        for line in r.stdout.splitlines():
            try:
                doc = parse_json(line)
            except ParseError:
                continue
            if isinstance(doc, dict):
                entries.append({"node": node, **doc})
    entries.sort(key=lambda e: (str(e.get("when", "")), e["node"]))
    missing = {**cluster.errors, **results.failed}
    return entries, {n: missing[n] for n in s.nodes if n in missing}
