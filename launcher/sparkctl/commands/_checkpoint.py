"""Where `plan` and `render` read the checkpoint: here when MODEL is on this machine, else on the head.

The checkpoint lives on the nodes' shared storage; the machine sparkctl runs on often has no copy.
Reading it on the head costs one SSH connection and one round trip (config.json, the index and the
shard sizes; never the weights).
"""

from __future__ import annotations

from ..cluster import Cluster
from ..errors import CheckFailed
from ..options import Globals
from ..orchestrate.checkpoint_scan import read_checkpoint_on
from ..output import warn_console
from ..spec.planner import CheckpointInfo, drafter_dir, read_checkpoint
from ..spec.settings import Settings


def checkpoint_for(g: Globals, s: Settings, *, local_only: bool = False) -> CheckpointInfo:
    if local_only or (s.model / "config.json").exists():
        return read_checkpoint(s.model, drafter_dir(s))
    warn_console().print(f"{s.model} is not on this machine: reading it on the head, {s.head}", markup=False)
    with Cluster([s.head], g.ssh_config_path()) as cluster:
        if s.head in cluster.errors:
            err = cluster.errors[s.head]
            raise CheckFailed(f"MODEL={s.model} is not on this machine and the head is unreachable: {err.reason}",
                              fix="run sparkctl where the checkpoint is, or fix SSH to the head "
                                  f"({err.fix or 'see `sparkctl check`'}); --local forces reading it here",
                              node=s.head, failures=[err.as_dict()])
        return read_checkpoint_on(cluster.node(s.head), s.model, drafter_dir(s))
