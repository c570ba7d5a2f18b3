"""`sparkctl check`: preflight every node in parallel, then write env.tp4 with the discovered pins.

Output: a table (nodes × checks, ✓/✗/! and a short reason), then every failure and warning with its
fix. `--json`: the same findings as one JSON document. Exit 0 when nothing failed (warnings allowed),
1 when something did, 2 on bad input. On success (or with --render) env/env.tp4 is written with each
rank's discovered netdev, RDMA device, GID index and fabric IP, and the planned KV bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table

from ..cluster import Cluster
from ..errors import CheckFailed, Failure, UsageError
from ..options import Globals
from ..orchestrate.check import CheckReport, run_check
from ..orchestrate.fabric_test import FabricReport
from ..output import console, finish, warn
from ..rules.check_rules import CHECKS
from ..rules.findings import CLUSTER_ROW, FAIL, OK, SKIP, SYMBOL, WARN, Finding
from ..spec.renderer import OUT_FIX, env_tp4_path, render_all, resolve_pins, write_env_tp4

DEFAULT_OUT = Path("env/env.tp4")
STYLE = {OK: "green", FAIL: "bold red", WARN: "yellow"}
NODES_PER_TABLE = 5


@click.command("check")
@click.option("--render", "force_render", is_flag=True, help="Write env.tp4 even when a check failed.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True,
              help="Where to write env.tp4.")  # fmt: skip
@click.option(
    "--connect-timeout", type=float, default=10.0, show_default=True, help="Per-node SSH connect timeout, s."
)
@click.option("--timeout", "command_timeout", type=float, default=60.0, show_default=True,
              help="Per-node timeout of each probe, s.")  # fmt: skip
@click.option("--no-verify", is_flag=True, help="Skip the header-level checkpoint verification on the head.")
@click.option("--fabric", is_flag=True,
              help="Also run an all-reduce across the ranks in the serving image, with the pins `up` would set.")
@click.option("--fabric-timeout", type=float, default=None,
              help="Bound of the fabric test, s (default: the recipe's [fabric] timeout_s).")
@click.pass_obj
def command(
    g: Globals, force_render: bool, out: Path, connect_timeout: float, command_timeout: float, no_verify: bool,
    fabric: bool, fabric_timeout: float | None,
) -> None:
    """Check every node: SSH, Docker, GPU, memory, limits, fabric (found per node), reachability,
    ports, disk, model folder, checkpoint headers, image, stale containers, memory plan."""
    if connect_timeout <= 0 or command_timeout <= 0 or (fabric_timeout is not None and not 5 <= fabric_timeout <= 600):
        raise UsageError("timeouts must be positive (--fabric-timeout: 5 to 600 s)")
    s = g.settings()
    warn(s.warnings)
    with Cluster(s.nodes, g.ssh_config_path(), connect_timeout=connect_timeout,
                 command_timeout=command_timeout) as cluster:  # one connection per node, for both
        report = run_check(
            s,
            g.ssh_config_path(),
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
            verify=not no_verify,
            cluster=cluster,
        )
        fabric_report = _fabric(g, s, report, cluster, fabric_timeout) if fabric else None
    env_path, render_error = None, None
    if report.ok or force_render:
        env_path, render_error = _write_env(s, report, out)
    doc = _as_json(report, env_path, render_error) | ({"fabric": fabric_report.to_dict()} if fabric_report else {})
    if not g.json:
        _print(report, env_path, render_error, g.verbosity, tried=report.ok or force_render)
        if fabric_report:
            _print_fabric(fabric_report)
    finish(g.json, doc, _failure(report, render_error))


def _failure(report: CheckReport, render_error: str | None) -> CheckFailed | None:
    """check's exit 1: the problems (each failed finding, with its fix), or env.tp4 that could not be written."""
    if not report.ok:
        nodes = sorted({f.node for f in report.failed}, key=lambda n: [*report.nodes, CLUSTER_ROW].index(n))
        first = report.failed[0]
        return CheckFailed(f"check failed: {len(report.failed)} problem(s) on {', '.join(nodes)} "
                           f"(first: {first.node}: {first.check}: {first.short})",
                           node=nodes[0] if len(nodes) == 1 and nodes[0] in report.nodes else None,
                           failures=[Failure(f.node, f.check, f.text, f.fix or None) for f in report.failed])
    if render_error:
        return CheckFailed(f"env.tp4 not written: {render_error}",
                           fix="fix what the line says and run `sparkctl check` again")
    return None


def _fabric(g: Globals, s: Any, report: CheckReport, cluster: Cluster,
            fabric_timeout: float | None) -> FabricReport | None:
    """Run the fabric test with the pins this check found, over check's own connections; its findings
    join the report's."""
    from ..orchestrate.fabric_test import run_fabric_test, skipped

    pins = resolve_pins(s, report.pins)
    missing = [f"rank {r}" for r, p in enumerate(pins) if p.missing()]
    if missing:
        report.findings.extend(skipped(report.nodes, f"fabric pins unknown for {', '.join(missing)}"))
        return None
    say = console(g.json).print
    head = report.facts.get(s.head)
    busy = [lst.port for lst in (head.listeners or [])] if head is not None else []
    fr = run_fabric_test(cluster, s, pins, timeout_s=fabric_timeout, say=lambda m: say(m, markup=False),
                         busy_ports=busy)
    report.findings.extend(fr.findings)
    report.timing["fabric"] = fr.seconds
    return fr


def _print_fabric(fr: FabricReport) -> None:
    from ..orchestrate.fabric_test import size_label

    c = console(False)
    sizes = ", ".join(f"{size_label(k)} {v:g}" for k, v in fr.busbw_by_size().items())
    c.print(f"\nfabric test ({fr.backend}, {fr.image}): {fr.seconds:.1f}s, all-reduce busbw GB/s (slowest rank): "
            f"{sizes or 'none measured'}", markup=False)


def _write_env(s: Any, report: CheckReport, out: Path) -> tuple[Path | None, str | None]:
    """env.tp4 for every replica (replica i > 0: env.tp4.replica<i>), each from the pins check found at its
    nodes' positions in NODES; all rendered before any is written. Returns replica 0's path."""
    if report.plan is None:
        return None, "no memory plan (the checkpoint could not be read on the head)"
    texts: list[tuple[Path, str]] = []
    try:
        for view in s.replicas():
            found = {k: report.pins[view.rank_offset + k] for k in range(len(view.nodes))
                     if view.rank_offset + k in report.pins}
            rendered = render_all(view, report.plan, resolve_pins(view, found), source="sparkctl check")
            texts.append((env_tp4_path(out, view.replica_index), rendered.env_tp4))
    except UsageError as exc:
        return None, exc.message
    kept = {path: note for path, text in texts if (note := write_env_tp4(path, text, s, fix=OUT_FIX))}
    warn(list(kept.values()))
    return (None if out in kept else out), None


def _as_json(report: CheckReport, env_path: Path | None, render_error: str | None) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "nodes": report.nodes,
        "findings": [f.to_dict() for f in report.findings],
        "pins": {
            str(rank): {
                "node": report.nodes[rank],
                "fabric_ip": p.fabric_ip,
                "netdev": p.netdev,
                "rdma_dev": p.rdma_dev,
                "gid_index": p.gid_index,
            }  # fmt: skip
            for rank, p in sorted(report.pins.items())
        },
        "plan": report.plan.to_dict() if report.plan else None,
        "env_tp4": str(env_path) if env_path else None,
        "render_error": render_error,
        "timing": {k: round(v, 3) for k, v in report.timing.items()},
    }


def _print(report: CheckReport, env_path: Path | None, render_error: str | None, verbosity: int, *,
           tried: bool) -> None:
    c = console(False)
    rows = [*report.nodes, *([CLUSTER_ROW] if any(f.node == CLUSTER_ROW for f in report.findings) else [])]
    columns = [*CHECKS, *(c for c in ("base", "versions", "pin-env", "image-pin", "checkpoint", "api", "collective", "identity") if any(f.check == c for f in report.findings))]
    # Checks down, nodes across (a few per table, so it fits a terminal with 16 nodes too).
    title = f"sparkctl check — {len(report.nodes)} node(s), {report.timing.get('total', 0):.1f}s"
    for i in range(0, len(rows), NODES_PER_TABLE):
        chunk = rows[i : i + NODES_PER_TABLE]
        t = Table(title=title if i == 0 else None, title_justify="left")
        t.add_column("check", style="bold")
        for node in chunk:
            t.add_column(_esc(node), overflow="fold")
        for col in columns:
            cells = [_cell(report.cell(node, col)) for node in chunk]
            if any(cells):
                t.add_row(col, *cells)
        c.print(t)
    for label, items in (("failed", report.failed), ("warnings", report.warnings)):
        if not items:
            continue
        c.print(f"\n[bold]{label}:[/]")
        for f in items:
            c.print(f"  [{STYLE[f.status]}]{SYMBOL[f.status]}[/] {_esc(f.node)} {f.check}: {_esc(f.text)}")
            if f.fix:
                c.print(f"      fix: {_esc(f.fix)}")
    if verbosity > 0:
        c.print("\n[bold]details:[/]")
        for f in report.findings:
            if f.status == OK:
                c.print(f"  {SYMBOL[OK]} {_esc(f.node)} {f.check}: {_esc(f.text)}")
    if env_path:
        pins = ", ".join(
            f"{report.nodes[r]}={p.netdev}/{p.rdma_dev}/gid{p.gid_index}"
            for r, p in sorted(report.pins.items())
        )
        c.print(
            f"\nwrote {env_path} (mode 0600): {pins}; KV {report.plan.kv_cache_memory_bytes if report.plan else '?'} B/rank"
        )
    elif render_error:
        c.print(f"\n[yellow]env.tp4 not written:[/] {_esc(render_error)}")
    elif not tried:  # tried and not written: it is the env file in use, and a warning said so
        c.print("\nenv.tp4 not written (a check failed; --render writes it anyway)")


def _cell(f: Finding | None) -> str:
    if f is None or f.status == SKIP and f.short == "-" and f.check != "ssh":
        return "" if f is None else f"[dim]{SYMBOL[SKIP]}[/]"
    return f"[{STYLE.get(f.status, 'dim')}]{SYMBOL[f.status]}[/] {_esc(f.short)}"


def _esc(text: str) -> str:
    """Node output and names are data: never let them act as rich markup."""
    return text.replace("[", r"\[")
