"""What `up` (and `model sync`) read of each node just before they act: node_facts.sh's fabric sections, one
round trip per node, judged by the same rule as `check` (`nic_pins.pins_from_facts`)."""

from __future__ import annotations

import secrets

from ..cluster import Cluster, Node
from ..facts.node_facts import NodeFacts, node_facts_from_probe, probe_args
from ..rules.nic_pins import pins_from_facts
from ..spec.resources import probe_script
from ..spec.settings import RankPins, Settings


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


def live_pins(cluster: Cluster, settings: Settings) -> list[RankPins]:
    facts = cluster.run_all(lambda n: probe_node(n, settings), nodes=settings.nodes)
    return pins_from_facts(settings, facts)
