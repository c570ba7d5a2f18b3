"""`sparkctl export systemd`: the supervisor (`sparkctl watch`) as a systemd unit on the head (or --node);
`--print` prints it. The install over SSH: orchestrate/export_systemd.py."""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

import click

from ..errors import UsageError
from ..orchestrate.export_systemd import install_unit
from ..output import console, emit_json, warn
from .common import globals_of, one_replica, settings_of


@click.group("export")
def export_cmd() -> None:
    """Export the supervisor for another manager (`export systemd`)."""


@export_cmd.command("systemd")
@click.option("--print", "print_only", is_flag=True, help="Print the unit instead of installing it.")
@click.option("--node", help="Install on this node (default: the head).")
@click.option("--sparkctl", "program", metavar="PATH",
              help="The sparkctl on that node (default: this one's Python, `-m sparkctl`).")
@click.pass_context
def export_systemd_cmd(ctx: click.Context, print_only: bool, node: str | None, program: str | None) -> None:
    """A systemd unit that runs `sparkctl watch` for this cluster, after docker and the network, with the
    recipe that ran pinned: its copy installed beside the unit (`--print`: the file's absolute path, or
    the shipped recipe's name)."""
    g = globals_of(ctx)
    s = one_replica(settings_of(g), "export systemd")
    target = node or s.head
    if target not in s.nodes:
        raise UsageError(f"--node {target}: not one of this cluster's nodes ({' '.join(s.nodes)})")
    name, text, copy, content = unit_for(g, s, program, print_only=print_only)
    if print_only:
        if g.json:
            emit_json({"unit": name, "text": text})
        else:
            sys.stdout.write(text)
        return
    install_unit(g.ssh_config_path(), target, s.cluster_name, name, text, (copy, content))
    if g.json:
        emit_json({"unit": name, "node": target, "installed": True, "recipe": copy})
    else:
        console(False).print(f"installed and started {name} on {target} (recipe {s.recipe.name} pinned as {copy}); "
                             "`sparkctl down` stops and disables it", markup=False)


def unit_for(g: Any, s: Any, program: str | None, *, print_only: bool = False) -> tuple[str, str, str, bytes]:
    """The unit export systemd installs: (its name, its text, the recipe copy's path there, the recipe's bytes).
    `deploy --supervise` installs the very same one."""
    from ..spec.recipes import is_recipe_file
    from ..spec.systemd_unit import pinned_environment, recipe_copy_path, unit_name, unit_text

    argv = shlex.split(program) if program else [sys.executable, "-m", "sparkctl"]
    if s.env_file is not None:
        argv += ["--env-file", str(s.env_file.resolve())]
    try:
        content = s.recipe.path.read_bytes()
    except OSError as exc:
        raise UsageError(f"recipe {s.recipe.path}: cannot be read ({exc.strerror or exc})") from None
    copy = recipe_copy_path(s.cluster_name, content)
    if print_only:
        given = is_recipe_file(s.values["RECIPE"].raw)
        argv += ["--recipe", str(s.recipe.path.resolve()) if given else s.recipe.name, "watch"]
    else:
        argv += ["--recipe", copy, "watch"]
    env, warnings = pinned_environment(s, os.path.abspath(g.ssh_config_path()))
    warn(warnings)
    return unit_name(s.cluster_name), unit_text(cluster=s.cluster_name, argv=argv, env=env), copy, content


COMMANDS = {"export": export_cmd}
