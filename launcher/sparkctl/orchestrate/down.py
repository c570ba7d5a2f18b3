"""`sparkctl down`, top to bottom.

  down(settings)                         connect to every node that answers
    cluster_lock on the head             (when the head is unreachable: the rest, without the lock)
      stop_supervisor_unit               a deliberate `down` stays down: the `export systemd` unit
      service.down                       head first, then the workers; audited on every node
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .. import service
from ..cluster import Cluster, NodeError
from ..lock import cluster_lock
from ..output import warn
from ..settings import Settings


def down(s: Settings, ssh_config: str | Path | None, say: Callable[[str], None]) -> dict[str, NodeError]:
    """Remove this cluster's containers everywhere; the nodes that could not be cleaned, with why."""
    with Cluster(s.nodes, ssh_config) as cluster:
        if s.head in cluster.connected:
            with cluster_lock(cluster.node(s.head), s.head, s.cluster_name, "down"):
                stop_supervisor_unit(cluster, s)
                return service.down(cluster, s, say=say)
        warn([f"the head {s.head} is unreachable: tearing down the other nodes without the cluster lock"])
        return service.down(cluster, s, say=say)


def stop_supervisor_unit(cluster: Cluster, s: Settings) -> None:
    """A deliberate `down` stays down: the `export systemd` unit (if any) is stopped and disabled first."""
    from ..systemd_unit import disable_argv, unit_name

    r = cluster.node(s.head).run(disable_argv(s.cluster_name), timeout=90)
    if not r.ok:
        warn([f"could not stop and disable {unit_name(s.cluster_name)} on {s.head}: "
              f"{(r.stderr.strip() or r.stdout.strip())[:200]}"])
