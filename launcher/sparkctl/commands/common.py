"""What every cluster command starts with: the global options, the settings, one Cluster."""

from __future__ import annotations

import click

from ..cluster import Cluster
from ..errors import UsageError
from ..options import Globals
from ..output import warn
from ..spec.settings import Settings


def globals_of(ctx: click.Context) -> Globals:
    g = ctx.find_object(Globals)
    assert g is not None
    return g


def settings_of(g: Globals) -> Settings:
    """The settings, their warnings printed once."""
    s = g.settings()
    warn(s.warnings)
    return s


def one_replica(s: Settings, what: str) -> Settings:
    """Commands that act on one service (the supervisor, rollback, its unit) refuse several replicas,
    naming the knobs, instead of treating every node as one service."""
    topo = s.topology
    if len(topo.replicas) > 1:
        raise UsageError(f"{what} handles one service, but NODES hold {len(topo.replicas)} replicas "
                         f"({s.describe('NODES')}, {s.describe('TP')})",
                         fix="run it with an env file of one replica (render writes env/env.tp4.replica<i>: "
                             "`sparkctl --env-file env/env.tp4.replica1 ...`), or set NODES to one TP group")
    return s


def open_cluster(g: Globals, s: Settings) -> Cluster:
    return Cluster(s.nodes, g.ssh_config_path())
