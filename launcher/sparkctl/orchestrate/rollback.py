"""`sparkctl rollback`'s flow: a previous release back up, through `up`'s own path (`start_service`).

Connect every node (all must answer), pick the history entry on the head, resolve the settings with
that entry's knobs (`history.rollback_overrides`: its image, by content-hash tag when the head still
has that content), then, under the cluster lock, `orchestrate.up.start_service`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cluster import Cluster
from ..errors import UsageError
from ..remote import service
from ..remote.releases import Release, content_hash_on, pick, read_history, rollback_overrides
from ..spec.settings import Settings
from . import require_all
from .locking import lock_cluster
from .up import start_service


@dataclass
class RolledBack:
    target: Release  # the history entry brought back
    settings: Settings  # the settings it ran with (the entry's knobs over the current ones)
    outcome: service.UpOutcome


def rollback(s0: Settings, ssh_config: Any, to: str | None, *, resolve: Callable[[dict[str, str]], Settings],
             say: Callable[[str], None]) -> RolledBack:
    """`to`: a history entry number (1 = newest) or a config/content hash; None: the one before the newest.
    `resolve(overrides)` gives the settings with the entry's knobs over the current ones."""
    with Cluster(s0.nodes, ssh_config) as cluster:
        require_all(cluster, "rollback refused")
        head = cluster.node(s0.head)
        target = pick(read_history(head, s0.cluster_name), to)
        now = content_hash_on(head, target.image)
        s = resolve(rollback_overrides(target, now))
        if s.nodes != s0.nodes or s.cluster_name != s0.cluster_name:
            raise UsageError(f"history entry {target.n} ran on other nodes or another cluster name",
                             fix="roll back by hand with `up` and the knobs it shows in `sparkctl history --json`")
        say(f"rolling back to entry {target.n}: {target.when} by {target.who}, image "
            f"{s.get('IMAGE')}, config {target.config_hash}")
        with lock_cluster(cluster, s.nodes, s.cluster_name, "rollback"):
            outcome = start_service(cluster, s, recreate=False, say=say, source="sparkctl rollback")
    return RolledBack(target, s, outcome)
