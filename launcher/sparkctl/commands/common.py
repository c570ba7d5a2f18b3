"""What every cluster command starts with: the global options, the settings, one Cluster."""

from __future__ import annotations

import click

from ..cli import Globals
from ..cluster import Cluster
from ..output import warn
from ..settings import Settings


def globals_of(ctx: click.Context) -> Globals:
    g = ctx.find_object(Globals)
    assert g is not None
    return g


def settings_of(g: Globals) -> Settings:
    """The settings, their warnings printed once."""
    s = g.settings()
    warn(s.warnings)
    return s


def open_cluster(g: Globals, s: Settings) -> Cluster:
    return Cluster(s.nodes, g.ssh_config_path())
