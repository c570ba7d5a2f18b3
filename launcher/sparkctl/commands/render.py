"""`sparkctl render`: env.tp4 (mode 0600) and the exact per-rank command lines, offline."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from ..output import console, emit_json, warn
from ..plan import make_plan, require_fit
from ..render import render_all, resolve_pins, write_private
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
    rendered = render_all(s, plan, resolve_pins(s))
    write_private(out, rendered.env_tp4)
    ranks: list[dict[str, Any]] = [
        {
            "rank": spec.rank,
            "node": spec.node,
            "docker_argv": argv,
            "env": {k: (REDACTED if is_secret(k) else v) for k, v in sorted(spec.env.items())},
        }
        for spec, argv in zip(rendered.specs, rendered.docker_argv, strict=True)
    ]
    if g.json:
        emit_json({"env_tp4": str(out), "config_hash": rendered.config_hash, "ranks": ranks})
        return
    c = console(False)
    c.print(f"wrote {out} (mode 0600, config hash {rendered.config_hash})", markup=False)
    for r in ranks:
        role = "head" if r["rank"] == 0 else "worker"
        c.print(f"\n# rank {r['rank']} on {r['node']} ({role})", markup=False)
        c.print(shlex.join(r["docker_argv"]), markup=False, soft_wrap=True)
    if print_env:
        c.print("\n" + rendered.env_tp4, markup=False)
