"""`sparkctl exec`'s flow: one command (argv, no shell) in a rank's container, over one SSH connection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..cluster import Cluster, RunResult
from ..spec.builders import CONTAINER, rank_docker_argv


def run_in_rank(ssh_config: Any, node_name: str, cluster_name: str, rank: int, argv: Sequence[str],
                timeout: float) -> RunResult:
    """`docker exec CONTAINER ARGV...` in rank `rank`'s container of `cluster_name` on `node_name`; its exit
    code, stdout and stderr."""
    with Cluster([node_name], ssh_config) as cluster:
        return cluster.node(node_name).run(rank_docker_argv(cluster_name, rank, ["docker", "exec", CONTAINER, *argv]),
                                           timeout=timeout)
