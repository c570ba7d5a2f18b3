"""Every command's flow, top to bottom, one module per flow (Kamal's shape).

`commands/*` parse flags and print; a module here orchestrates one command (connect, lock, gather,
plan, render, act); `builders` build the argv; `service`, `cluster` and `lock` run it on the nodes.
`up.py` is `up` (and `start_service`, its body, which `watch` and `rollback` share), `down.py` is
`down`, `status.py` is `status`'s document, `check.py` is `check`, `build.py` is `build`, ...:
docs/internals.md ("Where each command's flow lives") has one row per command.
"""

from __future__ import annotations

from ..cluster import Cluster
from ..errors import CheckFailed


def require_all(cluster: Cluster, what: str) -> None:
    """Refuse (nothing changed) unless every node of the cluster is connected."""
    if cluster.errors:
        lines = [f"{n}: {e.reason}" + (f"\n    fix: {e.fix}" if e.fix else "") for n, e in cluster.errors.items()]
        raise CheckFailed(f"{what}: {len(cluster.errors)} node(s) unreachable, nothing was changed:\n  "
                          + "\n  ".join(lines), node=next(iter(cluster.errors)) if len(cluster.errors) == 1 else None,
                          failures=[e.as_dict() for e in cluster.errors.values()])
