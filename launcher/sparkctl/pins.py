"""Per-rank fabric pins at `up` time: found on each node again, never assumed.

The GID index drifts at runtime and a port can go down between `check` and `up`, so `up` re-reads
every node (one probe each, node_facts.sh) and applies the same discovery rule as `check`
(`check.discover_fabric`). A rank whose pins cannot be resolved stops `up` before anything starts.
"""

from __future__ import annotations

import secrets

from .check import FAIL, Needs, discover_fabric
from .cluster import Cluster, Node, NodeError
from .errors import CheckFailed
from .facts import NodeFacts, node_facts_from_probe, probe_args
from .resources import probe_script
from .settings import RankPins, Settings


def probe_node(node: Node, settings: Settings) -> NodeFacts:
    """node_facts.sh on one node (one round trip), only what pins need: no model listing, no Docker
    sections (`up` inspects its containers itself), no nvidia-smi banner, no listening ports."""
    nonce = secrets.token_hex(8)
    args = probe_args(cluster=settings.cluster_name, docker=False, banner=False, listening=False)
    r = node.run_script(probe_script("node_facts.sh"), [nonce, *args], timeout=60)
    return node_facts_from_probe(
        r.stdout,
        nonce,
        r.stderr,
        expect_model=False,
        expect_docker=False,
        expect_banner=False,
        expect_listening=False,
    )


def pins_from_facts(settings: Settings, facts: dict[str, NodeFacts | NodeError]) -> list[RankPins]:
    needs = Needs.from_settings(settings)
    pins: list[RankPins] = []
    problems: list[str] = []
    for rank, node in enumerate(settings.nodes):
        f = facts[node]
        if isinstance(f, NodeError):
            problems.append(f"rank {rank} ({node}): {f.reason}")
            pins.append(RankPins())
            continue
        finding, found = discover_fabric(node, rank, f, needs)
        if found is None or finding.status == FAIL:
            problems.append(f"rank {rank}: {finding.text}" + (f"\n    fix: {finding.fix}" if finding.fix else ""))
            pins.append(RankPins())
        else:
            pins.append(found)
    if problems:
        raise CheckFailed("fabric pins could not be resolved, nothing was started:\n  " + "\n  ".join(problems))
    return pins


def live_pins(cluster: Cluster, settings: Settings) -> list[RankPins]:
    facts = cluster.run_all(lambda n: probe_node(n, settings), nodes=settings.nodes)
    return pins_from_facts(settings, facts)
