"""`sparkctl deploy [--plan | --yes] [--supervise] [--no-bench] [--events FILE|-] [--json]`: from configured
nodes to a serving model, doing only what is not done.

Without --yes (or with --plan) every step says what it would do and why, nothing changes, and the plan
is saved ($XDG_STATE_HOME/sparkctl/<cluster>/deploy-plan.json); --yes runs the steps that have something to
do and says, first, what differs from the saved plan's inputs. The flow: orchestrate/deploy.py; the pure
parts (plan, inputs, their difference): spec/deploy_plan.py; docs/deploy.md.
"""

from __future__ import annotations

import time
from typing import Any

import click
from rich.table import Table

from ..errors import UsageError, failure_document
from ..orchestrate import deploy as flow
from ..output import console, emit_json, finish, warn
from ..progress import Display, feed_of
from ..spec import deploy_plan as dp
from .common import globals_of, settings_of

PLAN_FILE = "deploy-plan.json"
STATE_FILE = "deploy-state.json"


@click.command("deploy")
@click.option("--plan", "plan_only", is_flag=True, help="Say what every step would do and why; change nothing "
              "(the default without --yes).")
@click.option("--yes", is_flag=True, help="Apply: run the steps that have something to do.")
@click.option("--supervise", is_flag=True, help="Also install the supervisor on the head (`export systemd`).")
@click.option("--no-bench", is_flag=True, help="Leave the short bench out of the report.")
@click.option("--timeout", "wait_timeout", type=click.FloatRange(min=1), default=3600, show_default=True,
              help="Seconds the wait step waits for the engine.")
@click.option("--sparkctl", "program", metavar="PATH",
              help="With --supervise: the sparkctl on the head, an absolute path there (default: `sparkctl`, "
                   "as systemd finds it; `export systemd --sparkctl`).")
@click.pass_context
def command(ctx: click.Context, plan_only: bool, yes: bool, supervise: bool, no_bench: bool, wait_timeout: float,
            program: str | None) -> None:
    """Pull, sync, check, build, up, wait, then the API address, one completion and a short bench: only
    the steps that have something to do."""
    if plan_only and yes:
        raise UsageError("--plan and --yes: pick one", fix="`sparkctl deploy` shows the plan, "
                         "`sparkctl deploy --yes` applies it")
    g = globals_of(ctx)
    s = settings_of(g)
    if len(s.topology.replicas) > 1:
        raise UsageError("deploy brings up one service; these settings name several replicas",
                         fix="run the steps by hand (`sparkctl up` and `sparkctl wait` handle replicas)")
    out = console(g.json)
    # the person's progress on stderr when stdout carries the document or the events (`--events -`)
    display = Display(console(True) if g.json or g.events == "-" else out, quiet=g.verbosity < 0 or not yes)
    feed = feed_of(g, "deploy", display=display)
    supervisor = None
    if supervise:
        from .export import unit_for

        def supervisor() -> tuple[str, Any]:
            return s.head, unit_for(s, program)

    where = dp.state_dir(s.cluster_name)
    state = dp.read_doc(where / STATE_FILE) or {}
    c = flow.Context(s, g.ssh_config_path(), feed, supervise=supervise, bench=not no_bench,
                     wait_timeout=wait_timeout, supervisor=supervisor, state=state)
    t0 = time.monotonic()
    try:
        with display:
            if not yes:
                _plan(g, c, where, out, t0)
            else:
                _apply(g, c, where, out, t0)
    finally:
        c.close()
        feed.close()


def _plan(g: Any, c: flow.Context, where: Any, out: Any, t0: float) -> None:
    steps = flow.plan_steps(c, flow.STEPS)
    ins = flow.current_inputs(c)
    doc = dp.plan_doc(c.settings.cluster_name, ins, steps)
    saved = where / PLAN_FILE
    try:
        dp.write_doc(saved, doc)
    except OSError as exc:
        warn([f"the plan was not saved to {saved}: {exc}"])
    if g.json:
        emit_json({"ok": True, "mode": "plan", "changed": False, "plan_file": str(saved), **doc,
                   "seconds": round(time.monotonic() - t0, 3)})
        return
    t = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("step", "", "why"):
        t.add_column(col)
    for st in steps:
        t.add_row(st["step"], "[yellow]runs[/]" if st["todo"] else "[dim]skip[/]", _esc(st["why"]))
        for line in st["would"]:
            t.add_row("", "", f"  - {_esc(line)}")
    out.print(t)
    todo = [st["step"] for st in steps if st["todo"]]
    out.print(f"plan saved to {saved}; nothing was changed. "
              + ("`sparkctl deploy --yes` runs: " + ", ".join(todo) if todo else "nothing to do"), markup=False)


def _apply(g: Any, c: flow.Context, where: Any, out: Any, t0: float) -> None:
    saved = dp.read_doc(where / PLAN_FILE)
    ins = flow.current_inputs(c)
    differs = dp.diff_inputs(saved.get("inputs") or {}, ins) if saved else []
    if differs:
        warn(["the inputs differ from the saved plan's (`sparkctl deploy --plan` shows the new plan):"]
             + [f"  {d}" for d in differs])
    results: list[dp.StepResult] = []
    failure: BaseException | None = None
    try:
        results = flow.apply_steps(c, flow.STEPS)
    except flow.DeployFailed as exc:
        results, failure = exc.results, exc
    except KeyboardInterrupt as exc:
        results = getattr(exc, "deploy_results", [])
        failure = exc
    finally:
        try:
            dp.write_doc(where / STATE_FILE, c.state)
        except OSError as exc:
            warn([f"deploy's state was not saved to {where / STATE_FILE}: {exc}"])
    report = next((r.changed for r in results if r.step == "report" and r.status == dp.DONE), {})
    noop = bool(results) and all(r.status == dp.SKIPPED for r in results if r.step != "report")
    doc: dict[str, Any] = {"ok": failure is None, "mode": "apply", "noop": noop,
                           "changed": any(r.status == dp.DONE and r.step != "report" for r in results),
                           "plan_differs": differs, "steps": [r.as_dict() for r in results],
                           "api": report or None, "seconds": round(time.monotonic() - t0, 3)}
    if failure is not None and not isinstance(failure, flow.DeployFailed):
        name = getattr(failure, "name", "SIGINT")
        doc = failure_document(f"interrupted ({name})", exit_code=getattr(failure, "exit_code", 130),
                               fix="run `sparkctl deploy --yes` again: it completes from where it stopped",
                               extra=doc)
    if not g.json:
        _print_steps(out, results, noop)
        if report:
            _print_report(out, report)
    if isinstance(failure, flow.DeployFailed):
        finish(g.json, doc, failure)
    if g.json:
        emit_json(doc)
    if failure is not None:
        raise failure


def _print_steps(out: Any, results: list[dp.StepResult], noop: bool) -> None:
    mark = {dp.DONE: "[green]done[/]", dp.SKIPPED: "[dim]skipped[/]", dp.FAILED: "[bold red]FAILED[/]",
            dp.NOT_RUN: "[yellow]not run[/]"}
    for r in results:
        line = f"{r.step:<10} {mark[r.status]}  {_esc(r.why or '')}"
        if r.status == dp.FAILED:
            line += f"  {_esc(r.error or '')}" + (f" (node {r.node})" if r.node else "")
        out.print(line)
        if r.status == dp.FAILED and r.fix:
            out.print(f"           fix: {r.fix}", markup=False)
    if noop:
        out.print("nothing to do: the service already runs this exact config", markup=False)


def _print_report(out: Any, rep: dict[str, Any]) -> None:
    out.print(f"API {rep['url']}  model {rep['model']}", markup=False)
    out.print(f"completion ({rep['latency_s']:.2f}s): {rep['completion']}", markup=False)
    b = rep.get("bench")
    if b:
        def num(k: str, unit: str, fmt: str = ".1f") -> str:
            v = b.get(k)
            return "?" if v is None else f"{v:{fmt}}{unit}"

        out.print(f"bench: C=1 {num('c1_tok_s', ' tok/s')}, C=4 {num('c4_tok_s', ' tok/s')} per stream; "
                  f"TTFT C=1 {num('c1_ttft_s', ' s', '.3f')}, C=4 {num('c4_ttft_s', ' s', '.3f')}", markup=False)


def _esc(text: str) -> str:
    from rich.markup import escape

    return escape(text)
