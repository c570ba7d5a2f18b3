"""The cluster lock on every node a command changes, and who each node is.

  who_is_who(cluster, names)       one round on those nodes: /etc/machine-id and the identity record
                                   the last `up` left there (identity.WHOAMI)
  lock_cluster(cluster, names)     who_is_who, then lock.nodes_lock on every one of them, in
                                   lock.lock_order (by machine, not by NODES' order)
  record_identities(cluster, ...)  after `up` started a service: every node's identity, on every node
  read_locks(s, ssh_config)        `sparkctl lock status`: every node's lock state
  break_locks(s, ssh_config)       `sparkctl lock --force-unlock`: break it on every node, audited (a lock
                                   another SSH user owns stays: `Broken.kept`)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..cluster import Cluster, NodeError, raise_failed
from ..facts.machine_identity import (
    RECORD_NAME,
    NodeIdentity,
    Seen,
    parse_whoami,
    record_doc,
    whoami_argv,
    write_record_argv,
)
from ..remote.lockdir import (
    LockOwner,
    LockState,
    audit_append_argv,
    audit_line,
    force_unlock,
    lock_order,
    lock_state,
    nodes_lock,
    now_iso,
    state_dir,
)
from ..spec.settings import Settings


def record_path(cluster_name: str) -> str:
    return f"{state_dir(cluster_name)}/{RECORD_NAME}"


def who_is_who(cluster: Cluster, names: Sequence[str], cluster_name: str) -> dict[str, Seen]:
    """What each connected node of `names` is now, and what the last `up` recorded (one round, in parallel).
    A node that does not answer is known by its host key only."""
    names = [n for n in names if n in cluster.connected]
    results = cluster.run_all(whoami_argv(record_path(cluster_name)), nodes=names, timeout=20)
    seen: dict[str, Seen] = {}
    for n, r in results.items():
        ident = cluster.node(n).identity()
        seen[n] = Seen(ident, None) if isinstance(r, NodeError) else parse_whoami(ident, r.stdout)
    return seen


@contextmanager
def lock_cluster(cluster: Cluster, names: Sequence[str], cluster_name: str,
                 command: str) -> Iterator[tuple[LockOwner, dict[str, Seen]]]:
    """The cluster lock on every connected node of `names`, taken in the one global order (remote/lockdir.py);
    yields the owner and who each node is (read first, to order them)."""
    seen = who_is_who(cluster, names, cluster_name)
    order = lock_order(list(seen), {n: (s.identity.machine_id, s.identity.host_key) for n, s in seen.items()})
    with nodes_lock([(n, cluster.node(n)) for n in order], cluster_name, command) as owner:
        yield owner, seen


def lock_states(cluster: Cluster, names: Sequence[str], cluster_name: str) -> dict[str, LockState]:
    """The lock on each connected node of `names` that holds one."""
    res = cluster.run_all(lambda node: lock_state(node, cluster_name),
                          nodes=[n for n in names if n in cluster.connected])
    return {n: st for n, st in res.ok.items() if st is not None}


def record_identities(cluster: Cluster, names: Sequence[str], cluster_name: str,
                      seen: dict[str, Seen]) -> list[str]:
    """Leave every node's identity (as read now) on every node: what `status` and `down` compare against.
    Returns the nodes where it could not be written."""
    idents: list[NodeIdentity] = [seen[n].identity for n in names if n in seen]
    doc = (record_doc(idents, now_iso()) + "\n").encode()
    res = cluster.run_all(write_record_argv(record_path(cluster_name)), nodes=[n for n in names if n in seen],
                          stdin=doc, timeout=20)
    return [n for n, r in res.items() if isinstance(r, NodeError) or not r.ok]


def refuse_unreachable(errors: dict[str, NodeError]) -> None:
    """A node that did not answer may hold the lock: the answer is incomplete, exit 1 naming it."""
    if not errors:
        return
    if len(errors) == 1:
        raise next(iter(errors.values()))
    raise_failed("the lock could not be read", errors)


def read_locks(s: Settings, ssh_config: Any) -> dict[str, LockState]:
    """Every node's lock state; refused (refuse_unreachable) when a node did not answer."""
    with Cluster(s.nodes, ssh_config) as cluster:
        refuse_unreachable(cluster.errors)
        return lock_states(cluster, s.nodes, s.cluster_name)


@dataclass
class Broken:
    """What `lock --force-unlock` did: node -> the owner it broke, node -> the SSH user whose lock stayed
    (this SSH user may not remove it), and the nodes that did not answer."""

    broken: dict[str, LockOwner] = field(default_factory=dict)
    kept: dict[str, tuple[LockState, str]] = field(default_factory=dict)
    unreachable: dict[str, NodeError] = field(default_factory=dict)


def break_locks(s: Settings, ssh_config: Any) -> Broken:
    """Break the lock on every node that answers (a lock is held on each node a command changes), with an
    audit line where one was broken."""
    out = Broken()
    with Cluster(s.nodes, ssh_config) as cluster:
        for node in cluster.connected:
            held, kept = force_unlock(cluster.node(node), s.cluster_name)
            if held is not None and kept is not None:
                out.kept[node] = (held, kept)
            elif held is not None:
                out.broken[node] = held.owner
                cluster.node(node).run(audit_append_argv(s.cluster_name, [audit_line(
                    action="lock-broken", detail=f"by --force-unlock; it was held by {held.describe()}")]),
                    timeout=20)
    out.unreachable = dict(cluster.errors)
    return out
