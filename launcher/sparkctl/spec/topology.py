"""Topology: which node is which rank of which replica (pure; no I/O).

NODES + TP + GPUS_PER_NODE + REPLICAS decide it. A replica is one independent vLLM service of TP GPUs
on n = TP / GPUS_PER_NODE nodes; replica r holds NODES[r*n : (r+1)*n], in that order, its first node the
head (rank 0). One replica is today's shape: rank = position in NODES, head = NODES[0].

A node's *position* is its index in NODES; the per-rank pin knobs `RANK<position>_*` are numbered by it,
so replica r's rank k reads `RANK<r*n + k>_*` (`Settings.replica(r)` does that mapping).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    rank: int  # within its replica (vLLM's --node-rank)
    position: int  # in NODES: the n of its RANK<n>_* pin knobs
    node: str


@dataclass(frozen=True)
class Replica:
    index: int
    ranks: tuple[Rank, ...]  # in rank order; ranks[0] is the head
    master_port: int

    @property
    def head(self) -> str:
        return self.ranks[0].node

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(r.node for r in self.ranks)

    @property
    def offset(self) -> int:
        """The position in NODES of this replica's rank 0."""
        return self.ranks[0].position


@dataclass(frozen=True)
class Topology:
    replicas: tuple[Replica, ...]
    tp: int
    gpus_per_node: int

    @property
    def nodes_per_replica(self) -> int:
        return self.tp // self.gpus_per_node

    @property
    def head(self) -> str:
        """The overall head: replica 0's head (it holds the cluster lock and the history)."""
        return self.replicas[0].head

    @property
    def heads(self) -> tuple[str, ...]:
        return tuple(r.head for r in self.replicas)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for r in self.replicas for n in r.nodes)

    def locate(self, node: str) -> tuple[Replica, Rank]:
        for rep in self.replicas:
            for rank in rep.ranks:
                if rank.node == node:
                    return rep, rank
        raise KeyError(node)


class TopologyError(ValueError):
    """A shape the nodes cannot take: `problem` names the values, `keys` the knobs behind them."""

    def __init__(self, problem: str, keys: tuple[str, ...]) -> None:
        super().__init__(problem)
        self.problem = problem
        self.keys = keys


def held_replicas(n_nodes: int, tp: int, gpus_per_node: int) -> int:
    """REPLICAS' default: as many whole TP groups as the nodes hold."""
    return n_nodes * gpus_per_node // tp


def build_topology(nodes: Sequence[str], tp: int, gpus_per_node: int, replicas: int | None,
                   master_port: int, *, first_index: int = 0, first_position: int = 0) -> Topology:
    """The topology, or TopologyError for a shape that does not split into whole TP groups.
    first_index/first_position: a replica view's own one-replica topology keeps its replica index and
    its nodes' positions in the full NODES."""
    if tp % gpus_per_node:
        raise TopologyError(f"TP={tp} must be a multiple of GPUS_PER_NODE={gpus_per_node} "
                            "(a rank is a whole node)", ("TP", "GPUS_PER_NODE"))
    per = tp // gpus_per_node
    held = len(nodes) // per
    leftover = list(nodes[held * per:])
    if leftover or held == 0:
        raise TopologyError(
            f"NODES ({len(nodes)} nodes) do not split into whole TP groups of {per} node(s) "
            f"(TP={tp} / GPUS_PER_NODE={gpus_per_node}): leftover nodes: {' '.join(leftover)}; "
            f"list a multiple of {per} nodes or change TP",
            ("NODES", "TP", "GPUS_PER_NODE"))
    if replicas is not None and replicas != held:
        raise TopologyError(
            f"REPLICAS={replicas} but NODES ({len(nodes)} nodes) hold {held} replica(s) of TP={tp} "
            f"({per} node(s) each at GPUS_PER_NODE={gpus_per_node}); list {replicas * per} nodes "
            "or leave REPLICAS unset", ("REPLICAS", "NODES", "TP"))
    # Every replica rendezvous on its own head, so one MASTER_PORT serves them all (different hosts).
    reps = tuple(
        Replica(first_index + r,
                tuple(Rank(k, first_position + r * per + k, nodes[r * per + k]) for k in range(per)), master_port)
        for r in range(held))
    return Topology(reps, tp, gpus_per_node)
