"""What NCCL chose, read from its NCCL_DEBUG=INFO output, and the findings that follow (facts style).

Input is untrusted text: a rank's container log, `sparkctl logs` output (`[1 spark2] ...`), `docker logs`
(maybe with timestamps), or anything else; several ranks may be interleaved. `parse` never raises: lines
it does not know are skipped. Every NCCL line carries `HOST:PID:TID [DEV]`; one process is one rank, told
apart by the line's prefix (which container or rank printed it) and HOST:PID (PIDs repeat across
containers, so the prefix matters). Shapes, as NCCL 2.28 prints them (tests/fixtures/nccl/):

    vm:693:693 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
    vm:693:693 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0
    vm:741:741 [0] NCCL INFO NCCL_IB_HCA set to mlx5_0
    vm:628:628 [0] NCCL INFO NET/IB : No device found.
    vm:693:693 [0] NCCL INFO NET/Socket : Using [0]eth0:192.0.2.2<0>
    vm:693:693 [0] NCCL INFO Using network Socket
    vm:693:693 [0] NCCL INFO ncclCommInitRankConfig comm 0x3205bd60 rank 0 nranks 2 cudaDev 0 ... Init START
    vm:694:694 [1] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [receive] via NET/Socket/0
    [2026-12-01 01:04:00] vm:573:573 [0] init.cc:904 NCCL WARN Duplicate GPU detected : ...

sparkctl's own fabric program prints `@@sparkctl-fabric {json}` lines beside them; those are collected
as `events` (see probes/fabric_allreduce.py).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..facts.parsing import ParseError, parse_json
from .findings import FAIL, OK, WARN, Finding

FABRIC_MARK = "@@sparkctl-fabric "
MAX_LINE = 4096  # a longer line is cut: a log is data, and a pathological one must not cost quadratic time
MAX_WARNINGS = 20

_LINE = re.compile(
    r"(?P<host>[A-Za-z0-9_.\-]{1,253}):(?P<pid>\d{1,10}):(?P<tid>\d{1,10}) \[(?P<dev>\d{1,4})\] "
    r"(?:(?P<loc>[\w./\-]{1,200}:\d{1,7}) )?NCCL (?P<level>INFO|WARN|TRACE|ABORT) ?(?P<msg>.*)$"
)
_TIMESTAMP = re.compile(r"^\s*(?:\d{4}-\d\d-\d\dT[\d:.]+Z?\s+|\[\d{4}-\d\d-\d\d [\d:]+\]\s*)")
_ENV = re.compile(r"^(NCCL_[A-Z0-9_]+|GLOO_[A-Z0-9_]+) set (?:by environment )?to (.*?)\.?$")
_VERSION = re.compile(r"^NCCL version (\S+)")
_INIT = re.compile(r"\bcomm 0x[0-9a-f]+ rank (\d+) n[Rr]anks (\d+)")
_CHANNEL = re.compile(r"^Channel (\d+)/\d+ : (\d+)\[\w+\] -> (\d+)\[\w+\](?: \[(send|receive)\])? via (\S+)")
_SOCKET_IFS = re.compile(r"^NET/Socket : Using (.*)$")
_IB_USING = re.compile(r"^NET/IB ?: Using (.*?)(?:; OOB (\S+))?$")
_IF_ITEM = re.compile(r"\[(\d+)\]([^\s:\[\]]+)(?::(\S+?))?(?=\s|\[|$)")
_GID = re.compile(r"\bGID (\d{1,4}) \(")
_NETWORK = re.compile(r"^Using network (\S+)")
_BOOTSTRAP = re.compile(r"^Bootstrap ?: Using (\S+?):")


@dataclass(frozen=True)
class Channel:
    channel: int
    src: int
    dst: int
    direction: str  # send | receive | "" (ring lines without one)
    via: str  # as printed: NET/IB/0/GDRDMA, NET/Socket/0, P2P/CUMEM, SHM/direct/direct

    @property
    def transport(self) -> str:
        """NET/IB, NET/Socket, NET/<plugin>, P2P or SHM."""
        parts = self.via.split("/")
        if parts[0] == "NET" and len(parts) > 1:
            return f"NET/{parts[1]}"
        return parts[0]


@dataclass
class RankLog:
    """One NCCL process as its lines tell it."""

    source: str  # the line prefix (e.g. `[1 spark2]`), a file name, or ""
    host: str
    pid: int
    rank: int | None = None
    nranks: int | None = None
    version: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    network: str | None = None  # "Using network X": the net plugin NCCL assigned (IB, Socket, ...)
    ib_devices: list[str] = field(default_factory=list)  # "NET/IB : Using [0]mlx5_0:1/RoCE ..."
    ib_missing: bool = False  # "NET/IB : No device found."
    socket_ifaces: list[str] = field(default_factory=list)  # "NET/Socket : Using [0]eth0:192.0.2.2<0>"
    bootstrap_iface: str | None = None
    gids: set[int] = field(default_factory=set)
    channels: list[Channel] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "rank ?"
        where = f"{self.source} " if self.source else ""
        return f"{who} ({where}{self.host}:{self.pid})"

    @property
    def transports(self) -> dict[str, int]:
        return dict(Counter(c.transport for c in self.channels))

    @property
    def net_transport(self) -> str | None:
        """The network transport this rank used or was given: from its channels, else its net plugin."""
        if self.channels:  # the channels say what was used (P2P/SHM inside a host need no network)
            nets = [t for t in self.transports if t.startswith("NET/")]
            return ("NET/IB" if "NET/IB" in nets else nets[0]) if nets else None
        if self.network:
            return f"NET/{self.network}"
        return None

    @property
    def rdma_asked(self) -> bool:
        return bool(self.env.get("NCCL_IB_HCA")) and self.env.get("NCCL_IB_DISABLE", "0") not in ("1",)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "host": self.host, "pid": self.pid, "rank": self.rank, "nranks": self.nranks,
            "nccl_version": self.version, "network": self.network, "net_transport": self.net_transport,
            "ib_devices": self.ib_devices, "ib_missing": self.ib_missing, "socket_ifaces": self.socket_ifaces,
            "bootstrap_iface": self.bootstrap_iface, "gid_index": sorted(self.gids), "env": self.env,
            "transports": self.transports, "channels": [c.__dict__ | {"transport": c.transport} for c in self.channels],
            "warnings": self.warnings,
        }  # fmt: skip


@dataclass
class NcclLog:
    ranks: list[RankLog] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # sparkctl's fabric program's lines
    lines: int = 0
    nccl_lines: int = 0


def _source_of(prefix: str, default: str) -> str:
    prefix = _TIMESTAMP.sub("", prefix).strip()
    prefix = _TIMESTAMP.sub("", prefix).strip()
    return prefix[:80] or default


def _ifaces(text: str) -> list[str]:
    return [m.group(2) + (f":{m.group(3)}" if m.group(3) else "") for m in _IF_ITEM.finditer(text)]


def parse(text: str, source: str = "") -> NcclLog:
    """Every NCCL process in `text`, in order of first appearance; never raises on any text."""
    out = NcclLog()
    by_key: dict[tuple[str, str, int], RankLog] = {}
    for raw in text.splitlines():
        out.lines += 1
        line = raw[:MAX_LINE]
        mark = line.find(FABRIC_MARK)
        if mark >= 0:
            try:
                doc = parse_json(line[mark + len(FABRIC_MARK):])
            except ParseError:
                continue
            if isinstance(doc, dict) and isinstance(doc.get("event"), str):
                doc.setdefault("source", _source_of(line[:mark], source))
                out.events.append(doc)
            continue
        if "NCCL " not in line:
            continue
        m = _LINE.search(line)
        if m is None:
            continue
        out.nccl_lines += 1
        src = _source_of(line[: m.start()], source)
        key = (src, m.group("host"), int(m.group("pid")))
        r = by_key.get(key)
        if r is None:
            r = by_key[key] = RankLog(source=src, host=key[1], pid=key[2])
            out.ranks.append(r)
        _apply(r, m.group("level"), m.group("msg").strip())
    return out


def _apply(r: RankLog, level: str, msg: str) -> None:
    if level in ("WARN", "ABORT"):
        if len(r.warnings) < MAX_WARNINGS:
            r.warnings.append(msg[:300])
        return
    if m := _VERSION.match(msg):
        r.version = m.group(1)
    elif m := _ENV.match(msg):
        r.env[m.group(1)] = m.group(2).strip()
    elif m := _CHANNEL.match(msg):
        r.channels.append(Channel(int(m.group(1)), int(m.group(2)), int(m.group(3)), m.group(4) or "", m.group(5)))
    elif m := _NETWORK.match(msg):
        r.network = m.group(1)
    elif m := _SOCKET_IFS.match(msg):
        r.socket_ifaces = _ifaces(m.group(1))
    elif msg.startswith("NET/IB") and "No device found" in msg:
        r.ib_missing = True
    elif m := _IB_USING.match(msg):
        r.ib_devices = _ifaces(m.group(1))
    elif m := _BOOTSTRAP.match(msg):
        r.bootstrap_iface = m.group(1)
    elif r.rank is None and (m := _INIT.search(msg)):
        r.rank, r.nranks = int(m.group(1)), int(m.group(2))
    if m := _GID.search(msg):
        r.gids.add(int(m.group(1)))


def _base_version(version: str) -> str:
    return version.split("+", 1)[0]


# ----------------------------------------------------------------------------------------- rules

SOCKET_FALLBACK_FIX = (
    "NCCL found no usable RDMA device in the container: check the rank's NCCL_IB_HCA names a device that "
    "`ibv_devices` lists on that node, that the container gets it (--device /dev/infiniband, IPC_LOCK, "
    "memlock unlimited), NCCL_IB_DISABLE=0, and the GID index (`sparkctl check` re-reads it)"
)


def rank_findings(r: RankLog, *, expect_rdma: bool | None = None, check: str = "nccl") -> list[Finding]:
    """One rank's findings: RDMA asked for (or expected) but sockets used; NCCL's own warnings."""
    who = r.label
    out: list[Finding] = []
    wants_rdma = r.rdma_asked if expect_rdma is None else expect_rdma
    net = r.net_transport
    if wants_rdma and net is not None and net != "NET/IB":
        asked = f"NCCL_IB_HCA={r.env['NCCL_IB_HCA']}" if r.env.get("NCCL_IB_HCA") else "RDMA expected"
        why = " (NET/IB: no device found)" if r.ib_missing else ""
        out.append(Finding(who, check, FAIL, "sockets",
                           f"{who}: {asked} but NCCL fell back to {net}{why}: the fabric runs 5-10x slower",
                           SOCKET_FALLBACK_FIX))
    for w in r.warnings:
        out.append(Finding(who, check, WARN, "NCCL WARN", f"{who}: NCCL WARN {w}"))
    if not out:
        out.append(Finding(who, check, OK, net or (r.transports and "/".join(sorted(r.transports))) or "ok",
                           f"{who}: NCCL {r.version or '?'}, {describe(r)}"))
    return out


def describe(r: RankLog) -> str:
    parts = []
    if r.net_transport == "NET/IB":
        gid = f" GID {','.join(map(str, sorted(r.gids)))}" if r.gids else (
            f" GID {r.env['NCCL_IB_GID_INDEX']}" if "NCCL_IB_GID_INDEX" in r.env else "")
        parts.append(f"NET/IB on {', '.join(r.ib_devices) or '?'}{gid}")
    elif r.net_transport:
        parts.append(f"{r.net_transport} on {', '.join(r.socket_ifaces) or '?'}")
    if r.transports:
        parts.append("channels " + ", ".join(f"{t}×{n}" for t, n in sorted(r.transports.items())))
    return "; ".join(parts) or "no transport chosen yet"


def version_findings(ranks: list[RankLog], *, check: str = "nccl", node: str = "(cluster)") -> list[Finding]:
    versions = {r.label: _base_version(r.version) for r in ranks if r.version}
    if len(set(versions.values())) > 1:
        listing = ", ".join(f"{who}: {v}" for who, v in versions.items())
        return [Finding(node, check, FAIL, "NCCL differs",
                        f"NCCL versions differ across ranks ({listing}): mixed builds can hang or corrupt collectives",
                        "build every rank's image from the same chain (`sparkctl build`, then `sparkctl check`)")]
    return []


def floor_findings(events: list[dict[str, Any]], floor_gbps: float | None, *, check: str = "nccl",
                   node: str = "(cluster)") -> list[Finding]:
    """busbw below the floor at the largest size measured (the one that reaches the link's speed)."""
    if not floor_gbps:
        return []
    results = [e for e in events if is_result(e)]
    if not results:
        return []
    top = max(float(e["bytes"]) for e in results)
    worst = min(float(e["busbw_gbps"]) for e in results if float(e["bytes"]) == top)
    if worst < floor_gbps:
        return [Finding(node, check, FAIL, f"{worst:g} GB/s",
                        f"all-reduce busbw {worst:g} GB/s at {int(top)} bytes is below the recipe's floor of "
                        f"{floor_gbps:g} GB/s",
                        "look at the transport per rank (`sparkctl nccl-report`): sockets instead of RDMA, a "
                        "wrong GID index or an MTU mismatch are the usual causes")]
    return []


def _num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0


def is_result(event: dict[str, Any]) -> bool:
    """A fabric program's `result` event with its figures (a rank's output is untrusted: a garbled one is none)."""
    return event.get("event") == "result" and _num(event.get("bytes")) and _num(event.get("busbw_gbps"))


def report(log: NcclLog, *, expect_rdma: bool | None = None, floor_gbps: float | None = None) -> list[Finding]:
    """Every finding of a log (nccl-report): per rank, versions across ranks, the busbw floor."""
    out: list[Finding] = []
    for r in log.ranks:
        out += rank_findings(r, expect_rdma=expect_rdma)
    out += version_findings(log.ranks)
    out += floor_findings(log.events, floor_gbps)
    for e in log.events:
        if e.get("event") in ("error", "timeout"):
            who = f"rank {e.get('rank', '?')}" + (f" ({e['source']})" if e.get("source") else "")
            stage = str(e.get("stage", "?"))[:80]
            text = str(e.get("error", "did not finish within the time bound"))[:400]
            out.append(Finding(who, "nccl", FAIL, str(e["event"]), f"{who}: {e['event']} at {stage}: {text}"))
    return out
