"""`sparkctl down`, top to bottom.

  down(settings)                         connect to every node that answers
    lock_cluster on every node that answers  (locking.py; an unreachable node is reported, as before)
      identity.swaps                     a node name that now reaches another machine than at the last
                                         `up` refuses `down` (unless --force): nothing removed
      stop_supervisor_unit               a deliberate `down` stays down: the `export systemd` unit
      service.down                       head first, then the workers; audited on every node
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..cluster import Cluster, NodeError
from ..facts.machine_identity import refuse_swaps, swaps
from ..output import warn
from ..remote import service
from ..spec.settings import Settings
from .locking import lock_cluster


def down(s: Settings, ssh_config: str | Path | None, say: Callable[[str], None], *,
         force: bool = False) -> dict[str, NodeError]:
    """Remove this cluster's containers everywhere; the nodes that could not be cleaned, with why."""
    with Cluster(s.nodes, ssh_config) as cluster:
        if not cluster.connected:
            return service.down(cluster, s, say=say)
        with lock_cluster(cluster, s.nodes, s.cluster_name, "down") as (_, seen):
            found = swaps(seen)
            if found and not force:
                refuse_swaps(found, "down", cluster.ssh_config_path)
            if found:
                warn(["--force: acting on the machines the names reach now: " + "; ".join(x.describe() for x in found)])
            if s.head in cluster.connected:
                stop_supervisor_unit(cluster, s)
            else:
                warn([f"the head {s.head} is unreachable: its supervisor unit (if any) was not stopped"])
            return service.down(cluster, s, say=say)


def stop_supervisor_unit(cluster: Cluster, s: Settings) -> None:
    """A deliberate `down` stays down: the `export systemd` unit (if any) is stopped and disabled first."""
    from ..spec.systemd_unit import disable_argv, unit_name

    r = cluster.node(s.head).run(disable_argv(s.cluster_name), timeout=90)
    if not r.ok:
        warn([f"could not stop and disable {unit_name(s.cluster_name)} on {s.head}: "
              f"{(r.stderr.strip() or r.stdout.strip())[:200]}"])
