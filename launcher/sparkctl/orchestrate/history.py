"""`sparkctl history`'s flow: the releases `up` recorded in the head's history, newest first."""

from __future__ import annotations

from typing import Any

from ..cluster import Cluster
from ..remote.releases import Release, read_history
from ..spec.settings import Settings


def releases(s: Settings, ssh_config: Any, limit: int) -> list[Release]:
    """The newest `limit` releases of this cluster, read on its head over one SSH connection."""
    with Cluster(s.nodes, ssh_config) as cluster:
        return read_history(cluster.node(s.head), s.cluster_name)[:limit]
