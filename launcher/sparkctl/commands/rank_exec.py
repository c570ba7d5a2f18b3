"""`sparkctl exec --rank N -- CMD ARGS...`: run a command in a rank's container (the flow:
orchestrate/rank_exec.py); its output and exit code are the command's."""

from __future__ import annotations

import sys

import click

from ..completion import rank_numbers
from ..errors import CheckFailed, UsageError
from ..orchestrate.rank_exec import run_in_rank
from ..output import finish
from .common import globals_of, settings_of


@click.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--rank", type=int, default=0, show_default=True, help="The rank whose container runs it.",
              shell_complete=rank_numbers)
@click.option("--replica", type=int, default=0, show_default=True, help="The replica of that rank.")
@click.option("--timeout", type=float, default=600, show_default=True, help="Seconds before it is stopped.")
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, required=True)
@click.pass_context
def exec_cmd(ctx: click.Context, rank: int, replica: int, timeout: float, argv: tuple[str, ...]) -> None:
    """Run a command in a rank's container: `sparkctl exec --rank 2 -- nvidia-smi -L` (argv, no shell)."""
    g = globals_of(ctx)
    s = settings_of(g).replica(replica)  # one replica: the settings themselves
    words = list(argv)
    if not words:
        raise UsageError("give the command after `--`: sparkctl exec --rank N -- CMD ARGS...")
    ranks = s.service.ranks
    if not 0 <= rank < len(ranks):
        raise UsageError(f"--rank {rank}: ranks are 0..{len(ranks) - 1}")
    node_name = ranks[rank].node
    r = run_in_rank(g.ssh_config_path(), node_name, s.cluster_name, rank, words, timeout)
    doc = {"rank": rank, "node": node_name, "exit_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}
    if not g.json:
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
    code = r.exit_code if 0 <= r.exit_code < 256 else 1
    last = next((ln.strip() for ln in reversed(r.stderr.splitlines()) if ln.strip()), "")
    # The command's own status is exec's: with --json, its document is the failure's (its own exit code
    # stays in `command_exit_code`; its stderr, in full, in `stderr`).
    finish(g.json, doc, CheckFailed(
        f"`{' '.join(words)[:200]}` exited {r.exit_code} in rank {rank}'s container on {node_name}"
        + (f": {last[:300]}" if last else ""), node=node_name, shown=True, exit_code=code,
        fix=f"see its stderr; `sparkctl logs --rank {rank}` shows the rank's own log",
        extra={"command_exit_code": r.exit_code}) if code else None)


COMMANDS = {"exec": exec_cmd}
