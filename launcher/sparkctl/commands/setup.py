"""`sparkctl setup`: make fresh nodes ready for `check` -- fabric addresses and MTU on the cabled CX7 ports, the
drop-caches sudoers line, limits, earlyoom, the docker group, the fabric document. Plans by default (changes
nothing); `--yes` applies. Exit 0: nothing failed; 1: a node failed (the others completed; each failure with
its fix); 2: bad input (nothing touched). `--json`: one document whose `changes` lists every change
({node, what, path or command}); an empty list means there is nothing to do.
"""

from __future__ import annotations

import click
from rich.table import Table

from ..errors import CheckFailed, Failure, UsageError
from ..options import Globals
from ..orchestrate.setup import SetupReport, apply, measure_cables, plan
from ..output import console, finish
from .common import open_cluster, settings_of


@click.command("setup")
@click.option("--plan", "plan_only", is_flag=True, help="Show the plan and change nothing (the default without --yes).")
@click.option("-y", "--yes", is_flag=True, help="Apply the plan (default: show it and change nothing).")
@click.option("--speed", is_flag=True,
              help="Then measure each cable (iperf3 over its fabric addresses) against the recipe's floor.")
@click.pass_obj
def command(g: Globals, plan_only: bool, yes: bool, speed: bool) -> None:
    """Discover every node (CX7 ports, cabling, SSH user, sudo, docker group, limits, earlyoom), plan the
    files and commands that make it ready, and with --yes apply them."""
    if plan_only and yes:
        raise UsageError("--plan and --yes: pick one", fix="`sparkctl setup` shows the plan, "
                         "`sparkctl setup --yes` applies it")
    s = settings_of(g)
    with open_cluster(g, s) as cluster:
        report = plan(cluster, s)
        if yes:
            apply(cluster, s, report, g.ssh_config_path())
        if speed:
            measure_cables(cluster, s, report)
    if not g.json:
        _print(report, applied=yes)
    outcomes = report.applied or {}
    finish(g.json, report.to_dict(), CheckFailed(
        f"setup failed on {', '.join(report.failed)}", fix="each node's fix is above; the other nodes completed",
        node=report.failed[0] if len(report.failed) == 1 else None,
        failures=[Failure(n, outcomes[n].status, outcomes[n].error or outcomes[n].status,
                          outcomes[n].fix or "fix what the message names, then run `sparkctl setup` again")
                  for n in report.failed]) if report.failed else None)


def _print(r: SetupReport, *, applied: bool) -> None:
    out = console(False)
    c = r.cabling
    out.print(f"[bold]fabric[/]: {c.layout}, FABRIC_SUBNET={r.subnet}")
    for seg in c.segments:
        out.print(f"  cable {seg.describe()}" if seg.is_cable else f"  segment {seg.describe()}")
    for m in c.moves:
        out.print(f"  [bold red]move[/]: {m}")
    for note in c.notes:
        out.print(f"  note: {note}")
    t = Table("node", "already right", "will change" if not applied else "changes")
    for n, p in r.plans.items():
        t.add_row(n, "\n".join(p.right) or "-",
                  "\n".join(f"{ch.path}  ({(ch.before or '')[:12]} -> {(ch.after or '')[:12]})" if ch.path
                            else f"$ {ch.command}" for ch in p.changes) or "nothing")
    out.print(t)
    for p in r.plans.values():
        for w in p.warnings:
            out.print(f"[yellow]![/] {w}")
        if not p.privileged and p.changes and not applied:
            out.print(f"[yellow]![/] {p.node}: sudo asks for a password: `setup --yes` cannot apply there; "
                          "run these by hand:")
            for line in p.by_hand():
                out.print(f"    {line}", markup=False, highlight=False)
    for cable, got in (r.speeds or {}).items():
        if isinstance(got, float):
            out.print(f"cable {cable}: {got:.1f} Gbit/s")
    for w in r.speed_warnings:
        out.print(f"[yellow]![/] {w}", highlight=False)
    if not applied:
        count = len(r.changes)
        out.print("nothing to change" if not count else
                  f"{count} change(s) planned; `sparkctl setup --yes` applies them")
        return
    for n, o in (r.applied or {}).items():
        if o.status == "applied":
            out.print(f"[green]✓[/] {n}: " + ", ".join(o.wrote + o.ran))
        elif o.status != "nothing":
            out.print(f"[bold red]✗[/] {o.error}", markup=True, highlight=False)
            out.print(f"  fix: {o.fix}", markup=False, highlight=False)
    if not r.changes:
        out.print("nothing to change")
