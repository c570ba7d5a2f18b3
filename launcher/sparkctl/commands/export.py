"""`sparkctl export systemd`: the supervisor (`sparkctl watch`) as a systemd unit on the head (or --node);
`--print` prints it. The install over SSH: orchestrate/export_systemd.py."""

from __future__ import annotations

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
              help="The sparkctl on that node, an absolute path there (default: `sparkctl`, which systemd looks "
                   "for in /usr/local/bin, /usr/bin and the like; the install refuses a node where it finds none).")
@click.option("--head-ssh-config", "head_ssh_config", metavar="PATH",
              help="An ssh_config on that node naming the nodes' aliases, for the unit's SPARKCTL_SSH_CONFIG "
                   "(default: the node's root's own, ~/.ssh/config).")
@click.pass_context
def export_systemd_cmd(ctx: click.Context, print_only: bool, node: str | None, program: str | None,
                       head_ssh_config: str | None) -> None:
    """A systemd unit that runs `sparkctl watch` for this cluster on the head, after docker and the network,
    with the recipe and the env file that ran pinned: the install copies them beside the unit
    (/etc/sparkctl/<cluster>/, by content), and every path the unit names is one on the head. `--print`
    prints the same unit, its comment saying which local file goes where."""
    g = globals_of(ctx)
    s = one_replica(settings_of(g), "export systemd")
    target = node or s.head
    if target not in s.nodes:
        raise UsageError(f"--node {target}: not one of this cluster's nodes ({' '.join(s.nodes)})")
    unit = unit_for(s, program, head_ssh_config)
    if print_only:
        if g.json:
            emit_json({"unit": unit.name, "text": unit.text, "files": [path for path, _ in unit.files]})
        else:
            sys.stdout.write(unit.text)
        return
    install_unit(g.ssh_config_path(), target, s.cluster_name, unit)
    if g.json:
        emit_json({"unit": unit.name, "node": target, "installed": True, "recipe": unit.recipe,
                   "files": [path for path, _ in unit.files]})
    else:
        console(False).print(f"installed and started {unit.name} on {target} (recipe {s.recipe.name} pinned as "
                             f"{unit.recipe}); `sparkctl down` stops and disables it", markup=False)


def unit_for(s: Any, program: str | None, head_ssh_config: str | None = None) -> Any:
    """The unit export systemd installs (a `systemd_unit.UnitInstall`): every path in it is one on the head
    (the copies the install writes there, `--sparkctl` or systemd's `sparkctl`), never this machine's.
    `--print` prints the very same text; `deploy --supervise` installs the very same unit."""
    from ..spec.systemd_unit import (
        DEFAULT_PROGRAM,
        UnitInstall,
        env_copy_path,
        pinned_environment,
        recipe_copy_path,
        unit_name,
        unit_text,
    )

    argv = shlex.split(program) if program else [DEFAULT_PROGRAM]
    if not argv or not (argv[0].startswith("/") or "/" not in argv[0]):
        raise UsageError(f"--sparkctl {program!r}: give an absolute path on the node, or a bare name systemd "
                         "finds in its search path", fix="e.g. --sparkctl /usr/local/bin/sparkctl")
    try:
        content = s.recipe.path.read_bytes()
    except OSError as exc:
        raise UsageError(f"recipe {s.recipe.path}: cannot be read ({exc.strerror or exc})") from None
    files = [(recipe_copy_path(s.cluster_name, content), content)]
    notes = [f"On the head it runs {argv[0]} and reads these copies, which the install writes (0600):",
             f"  {files[0][0]} <- {s.recipe.path.resolve()}"]
    if s.env_file is not None:
        try:
            env_bytes = s.env_file.read_bytes()
        except OSError as exc:
            raise UsageError(f"env file {s.env_file}: cannot be read ({exc.strerror or exc})") from None
        files.append((env_copy_path(s.cluster_name, env_bytes), env_bytes))
        notes.append(f"  {files[1][0]} <- {s.env_file.resolve()}")
        argv += ["--env-file", files[1][0]]
    argv += ["--recipe", files[0][0], "watch"]
    if not head_ssh_config:
        notes.append("It reaches the nodes with the head's root's ssh config (~/.ssh/config) and known_hosts.")
    env, warnings = pinned_environment(s, head_ssh_config)
    warn(warnings)
    text = unit_text(cluster=s.cluster_name, argv=argv, env=env, notes=notes)
    return UnitInstall(unit_name(s.cluster_name), text, tuple(files), argv[0])


COMMANDS = {"export": export_cmd}
