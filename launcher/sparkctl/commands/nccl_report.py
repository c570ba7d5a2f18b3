"""`sparkctl nccl-report LOG...`: what NCCL chose, per rank, from NCCL_DEBUG=INFO output.

Reads any log that holds NCCL's INFO lines: a rank's `docker logs`, `sparkctl logs` output (ranks
interleaved, `[1 spark2] ` prefixes), a file from `check --fabric`; `-` reads stdin. Prints per rank
the NCCL version, the network plugin and devices it chose, the transport per channel and the
interfaces, then the findings. Exit 1 when a finding fails (e.g. NCCL_IB_HCA set but NCCL fell back to
sockets), 0 otherwise, 2 when a file cannot be read or holds no NCCL line at all.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..errors import CheckFailed, Failure, UsageError
from ..options import Globals
from ..output import console, finish
from ..rules import nccl
from ..rules.findings import FAIL, OK, SYMBOL, WARN

MAX_BYTES = 256 * 1024 * 1024
STYLE = {OK: "green", FAIL: "bold red", WARN: "yellow"}


def _read(path: str) -> str:
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_BYTES)
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_BYTES)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read ({exc.strerror or exc})", fix="give a log file NCCL_DEBUG=INFO wrote to") from None
    return data.decode("utf-8", errors="replace")


@click.command("nccl-report")
@click.argument("logs", nargs=-1, required=True)
@click.option("--expect-rdma/--no-expect-rdma", default=None,
              help="Treat NET/Socket as a failure even without NCCL_IB_HCA in the log (default: only when "
                   "NCCL_IB_HCA was set).")
@click.option("--floor", "floor_gbps", type=float, default=None,
              help="busbw floor, GB/s, for sparkctl fabric-test figures found in the log.")
@click.pass_obj
def command(g: Globals, logs: tuple[str, ...], expect_rdma: bool | None, floor_gbps: float | None) -> None:
    """Explain NCCL_DEBUG=INFO output: per rank NCCL version, net plugin and device, transport per channel."""
    if floor_gbps is not None and floor_gbps < 0:
        raise UsageError("--floor must be 0 or more")
    merged = nccl.NcclLog()
    for path in logs:
        one = nccl.parse(_read(path), source="" if len(logs) == 1 else Path(path).name)
        merged.ranks += one.ranks
        merged.events += one.events
        merged.lines += one.lines
        merged.nccl_lines += one.nccl_lines
    if not merged.ranks and not merged.events:
        raise UsageError(f"no NCCL_DEBUG=INFO line in {', '.join(logs)} ({merged.lines} lines read)",
                         fix="run the job with NCCL_DEBUG=INFO and give its output (docker logs, sparkctl logs)")
    findings = nccl.report(merged, expect_rdma=expect_rdma, floor_gbps=floor_gbps)
    failed = [f for f in findings if f.status == FAIL]
    if not g.json:
        _print(merged, findings)
    first = failed[0] if failed else None
    finish(g.json, _doc(merged, findings), CheckFailed(
        f"nccl-report: {len(failed)} finding(s) failed (first: {first.node}: {first.check}: {first.short})",
        failures=[Failure(f.node, f.check, f.text, f.fix or None) for f in failed]) if first else None)


def _doc(log: nccl.NcclLog, findings: list[Any]) -> dict[str, Any]:
    return {
        "ok": not any(f.status == FAIL for f in findings),
        "ranks": [r.to_dict() for r in log.ranks],
        "fabric_events": log.events,
        "findings": [f.to_dict() for f in findings],
        "lines": log.lines,
        "nccl_lines": log.nccl_lines,
    }


def _print(log: nccl.NcclLog, findings: list[Any]) -> None:
    c = console(False)
    for r in log.ranks:
        c.print(f"{r.label}: NCCL {r.version or '?'}", markup=False)
        c.print(f"  network: {r.network or '?'}" + (" (NET/IB: no device found)" if r.ib_missing else "")
                + (f"; IB devices {', '.join(r.ib_devices)}" if r.ib_devices else "")
                + (f"; sockets {', '.join(r.socket_ifaces)}" if r.socket_ifaces else ""), markup=False)
        pins = {k: v for k, v in r.env.items() if k in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX",
                                                         "NCCL_IB_DISABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")}
        if pins:
            c.print("  env: " + " ".join(f"{k}={v}" for k, v in pins.items()), markup=False)
        if r.transports:
            c.print("  channels: " + ", ".join(f"{t} ×{n}" for t, n in sorted(r.transports.items())), markup=False)
    for e in log.events:
        if e.get("event") == "result":
            c.print(f"rank {e.get('rank')}: {e.get('bytes')} B busbw {e.get('busbw_gbps')} GB/s", markup=False)
    c.print("")
    for f in findings:
        c.print(f"[{STYLE.get(f.status, 'dim')}]{SYMBOL.get(f.status, '?')}[/] " + f.text.replace("[", r"\["))
        if f.fix and f.status != OK:
            c.print("    fix: " + f.fix.replace("[", r"\["))
