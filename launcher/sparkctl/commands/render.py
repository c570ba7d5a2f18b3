"""`sparkctl render`: env.tp4 (mode 0600) and the exact per-rank command lines, offline; or, with
`--target lws`, the same service as Kubernetes manifests (a LeaderWorkerSet and its Service: lws.py)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from ..output import console, emit_json, warn
from ..spec import lws
from ..spec.planner import make_plan, require_fit
from ..spec.renderer import (
    OUT_FIX,
    Rendered,
    env_tp4_path,
    render_all,
    resolve_pins,
    write_env_tp4,
    write_private,
)
from ..spec.settings import REDACTED, Settings, is_secret
from ._checkpoint import checkpoint_for

DEFAULT_OUT = Path("env/env.tp4")
DEFAULT_LWS_OUT = Path("env/lws.yaml")


@click.command("render")
@click.option("--target", type=click.Choice(["docker", "lws"]), default="docker", show_default=True,
              help="docker: env.tp4 and each rank's `docker run`; lws: Kubernetes manifests (LeaderWorkerSet).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"Where to write env.tp4 (default {DEFAULT_OUT}) or the manifests (default {DEFAULT_LWS_OUT}).")
@click.option("--print-env", is_flag=True, help="Also print env.tp4 itself (docker target).")
@click.option("--local", "local_only", is_flag=True, help="Read MODEL on this machine only (never over SSH).")
@click.pass_obj
def command(g: object, target: str, out: Path | None, print_env: bool, local_only: bool) -> None:
    """Render env.tp4 and print each rank's `docker run ... vllm serve ...` (pins from the env file);
    with --target lws, write the LeaderWorkerSet and Service manifests instead."""
    from ..options import Globals

    assert isinstance(g, Globals)
    s = g.settings()
    warn(s.warnings)
    plan = make_plan(s, checkpoint_for(g, s, local_only=local_only))
    require_fit(plan)
    if target == "lws":
        views = s.replicas()
        every = [render_all(v, plan, resolve_pins(v)) for v in views]
        # One LeaderWorkerSet of len(views) groups: the pins go into one pod template, so they must
        # agree across every rank of every replica.
        lws.require_uniform_pins(s, [spec for r in every for spec in r.specs])
        _write_lws(g.json, views[0], every[0], out or DEFAULT_LWS_OUT, replicas=len(views))
        return
    out = out or DEFAULT_OUT
    replicas: list[dict[str, Any]] = []
    texts: list[str] = []
    for view in s.replicas():  # one replica: the settings themselves, rendered as always
        rendered = render_all(view, plan, resolve_pins(view))
        path = env_tp4_path(out, view.replica_index)
        kept = write_env_tp4(path, rendered.env_tp4, s, fix=OUT_FIX)
        warn([kept] if kept else [])
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
        replicas.append({"replica": view.replica_index, "head": view.head, "env_tp4": None if kept else str(path),
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
        if rep["env_tp4"]:
            c.print(f"wrote {rep['env_tp4']} (mode 0600, config hash {rep['config_hash']})", markup=False)
        else:
            c.print(f"config hash {rep['config_hash']} (env.tp4 not written: see the warning)", markup=False)
        for r in rep["ranks"]:
            role = "head" if r["rank"] == 0 else "worker"
            c.print(f"\n# rank {r['rank']} on {r['node']} ({role})", markup=False)
            c.print(shlex.join(r["docker_argv"]), markup=False, soft_wrap=True)
        if print_env:
            c.print("\n" + text, markup=False)


def _write_lws(as_json: bool, s: Settings, rendered: Rendered, out: Path, *, replicas: int) -> None:
    # One group per replica (REPLICAS): the groups are alike but for the nodes they land on.
    docs = lws.render_lws(s, rendered.specs, rendered.config_hash, replicas=replicas)
    write_private(out, lws.manifests_yaml(s, docs, rendered.config_hash))
    objects = [{"kind": d["kind"], "name": d["metadata"]["name"]} for d in docs]
    secret = {"name": lws.secret_name(s), "keys": lws.secret_keys(s)}
    if as_json:
        emit_json({"manifests": str(out), "config_hash": rendered.config_hash, "objects": objects,
                   "secret": secret})
        return
    c = console(False)
    group = docs[0]["spec"]["leaderWorkerTemplate"]["size"]
    c.print(f"wrote {out} (config hash {rendered.config_hash}): LeaderWorkerSet {objects[0]['name']} "
            f"({docs[0]['spec']['replicas']} × {group} pods), Service {objects[1]['name']} "
            f"(port {s.getint('PORT')})", markup=False)
    if secret["keys"]:
        c.print(f"create Secret {secret['name']} with keys {', '.join(secret['keys'])} before applying "
                "(their values are not in the file)", markup=False)
    c.print(f"kubectl apply -f {out}   (needs the LeaderWorkerSet controller)", markup=False)
