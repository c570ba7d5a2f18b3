"""`sparkctl render`: env.tp4 (mode 0600) and the exact per-rank command lines, offline."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from ..output import console, emit_json, warn
from ..plan import make_plan, require_fit
from ..render import env_tp4_path, render_all, resolve_pins, write_private
from ..settings import REDACTED, is_secret
from ._checkpoint import checkpoint_for

DEFAULT_OUT = Path("env/env.tp4")


@click.command("render")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True,
              help="Where to write env.tp4.")
@click.option("--print-env", is_flag=True, help="Also print env.tp4 itself.")
@click.option("--local", "local_only", is_flag=True, help="Read MODEL on this machine only (never over SSH).")
@click.pass_obj
def command(g: object, out: Path, print_env: bool, local_only: bool) -> None:
    """Render env.tp4 and print each rank's `docker run ... vllm serve ...` (pins from the env file)."""
    from ..cli import Globals

    assert isinstance(g, Globals)
    s = g.settings()
    warn(s.warnings)
    plan = make_plan(s, checkpoint_for(g, s, local_only=local_only))
    require_fit(plan)
    replicas: list[dict[str, Any]] = []
    texts: list[str] = []
    for view in s.replicas():  # one replica: the settings themselves, rendered as always
        rendered = render_all(view, plan, resolve_pins(view))
        path = env_tp4_path(out, view.replica_index)
        write_private(path, rendered.env_tp4)
        texts.append(rendered.env_tp4)
        ranks: list[dict[str, Any]] = [
            {
                "rank": spec.rank,
                "node": spec.node,
                "docker_argv": argv,
                "env": {k: (REDACTED if is_secret(k) else v) for k, v in sorted(spec.env.items())},
            }
            for spec, argv in zip(rendered.specs, rendered.docker_argv, strict=True)
        ]
        replicas.append({"replica": view.replica_index, "head": view.head, "env_tp4": str(path),
                         "config_hash": rendered.config_hash, "ranks": ranks})
    first = replicas[0]
    if g.json:  # the top-level keys are replica 0's, as before replicas existed
        emit_json({"env_tp4": first["env_tp4"], "config_hash": first["config_hash"], "ranks": first["ranks"],
                   "replicas": replicas})
        return
    c = console(False)
    many = len(replicas) > 1
    for rep, text in zip(replicas, texts, strict=True):
        if many:
            c.print(f"{'' if rep is first else chr(10)}## replica {rep['replica']} (head {rep['head']})", markup=False)
        c.print(f"wrote {rep['env_tp4']} (mode 0600, config hash {rep['config_hash']})", markup=False)
        for r in rep["ranks"]:
            role = "head" if r["rank"] == 0 else "worker"
            c.print(f"\n# rank {r['rank']} on {r['node']} ({role})", markup=False)
            c.print(shlex.join(r["docker_argv"]), markup=False, soft_wrap=True)
        if print_env:
            c.print("\n" + text, markup=False)
