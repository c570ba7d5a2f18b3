"""Typed facts parsed from what a node printed (pyinfra style: given this output, expect this fact).

Every parser here is a pure function from text to a small frozen dataclass. Node output is untrusted
(a broken tool, a truncated stream, a hostile host): a parser returns its fact, or raises ParseError
with a short reason, and never any other exception. Missing values a real tool prints as "[N/A]" or
"Not Supported" (the GB10's unified memory) become None, not errors. Docker's output is parsed in
`docker_parse` (its names are re-exported here too).

The fixtures these are tested on are real output: tests/fixtures/ (nvidia-smi from an H200, the rest
captured on a Debian 12 host) plus a derived GB10 set that says what was changed.

Each node fact is declared once, as a field of NodeFacts: the probe section that carries it, its
parser, the shell that prints it, and for an optional fact the switch that asks for it. From those
declarations come node_facts.sh's facts() (the section calls and their conditions), the parse
dispatch of node_facts_from_probe, the SWITCH=no flags probe_args takes and the expect_SWITCH
arguments of node_facts_from_probe. Adding a fact, say the uptime:

    uptime_s: float | None = fact("uptime", parse_uptime, "read_file /proc/uptime", switch="uptime")

beside its parser (and its test), then `PYTHONPATH=launcher python -m sparkctl.facts.node_facts` rewrites the
probe's generated part (tests/unit/facts/test_fact_registry.py fails until it is done). That replaces the
edits it took before: the section call in node_facts.sh, for an optional fact its argument there
(`uptime=no) UPTIME=no`, a default, the guard), the NodeFacts field, the _PARSERS entry, _PARTIAL_OK,
and for an optional fact a probe_args flag and an expect_* argument with its place in the "asked"
logic -- 4 to 8 edits in 2 files and 2 languages, now one line in one. A command longer than a line
is a shell function in node_facts.sh's library part, called by the declaration.

Why the probe is generated into node_facts.sh rather than assembled at each run: the script that
goes to the nodes stays one complete file, byte for byte what is reviewed and tested, that a person
can run by hand (`sh -s < probes/node_facts.sh`, as check's own advice says), with its
shell helpers next to the calls that use them; the registry test keeps the generated part equal to
the declarations, so the two cannot drift.
"""

from __future__ import annotations

import csv
import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final, TypeVar

from .docker_parse import (
    DOCKER_SECTIONS,
    Container,
    DockerFacts,
    DockerVersion,
    Image,
    docker_api_paths,
    parse_docker_api,
    parse_docker_ps,
    parse_docker_version,
    parse_image_inspect,
)

# Re-exported: these were defined here before docker_parse and parsing held them.
from .docker_parse import docker_version_from_headers as docker_version_from_headers
from .docker_parse import find_image as find_image
from .docker_parse import normalize_image_ref as normalize_image_ref
from .parsing import MAX_INPUT_CHARS as MAX_INPUT_CHARS
from .parsing import ParseError, guard, parse_json

UNLIMITED: Final = 2**64 - 1
"""How an "unlimited" ulimit is represented (RLIM_INFINITY on Linux), so plain `>=` comparisons work."""

GPU_QUERY_FIELDS: Final = ("name", "driver_version", "memory.total", "compute_cap", "count")
"""The fields `check` asks `nvidia-smi --query-gpu=` for, in this order."""

T = TypeVar("T")

_MISSING = {"", "[n/a]", "n/a", "not supported", "[not supported]", "unknown", "[unknown error]"}

def _missing(value: str) -> bool:
    return value.strip().lower() in _MISSING


def _int_or_none(value: str) -> int | None:
    """'143771', '143771 MiB' -> 143771; '[N/A]' / 'Not Supported' -> None; anything else -> ParseError."""
    if _missing(value):
        return None
    m = re.fullmatch(r"\s*(\d{1,18})(?:\s*[A-Za-z]+)?\s*", value)
    if not m:
        raise ParseError(f"not a number: {value[:40]!r}")
    return int(m.group(1))


def _str_or_none(value: str) -> str | None:
    return None if _missing(value) else value.strip()


# --------------------------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str | None
    driver_version: str | None
    memory_total_mib: int | None  # None on GB10 (unified memory): use /proc/meminfo instead
    compute_cap: str | None
    count: int | None = None


@guard
def parse_nvidia_smi_query(text: str, fields: Iterable[str] = GPU_QUERY_FIELDS) -> list[Gpu]:
    """`nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits]`, one GPU per row.

    With a header row (format=csv) the columns are taken from it, units and all
    ("memory.total [MiB]", "143771 MiB"); without one, `fields` says what the columns are.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise ParseError("nvidia-smi printed nothing")
    names = [f.strip() for f in fields]
    first = [c.strip() for c in next(csv.reader([lines[0]], skipinitialspace=True))]
    if first and first[0] in ("name", "gpu_name", "index"):
        names = [re.sub(r"\s*\[.*\]$", "", c) for c in first]
        lines = lines[1:]
    gpus = []
    for i, row in enumerate(csv.reader(lines, skipinitialspace=True)):
        if len(row) != len(names):
            raise ParseError(
                f"row {i + 1} has {len(row)} columns, expected {len(names)} ({', '.join(names)})"
            )
        cols = dict(zip(names, row, strict=True))
        gpus.append(
            Gpu(
                index=i,
                name=_str_or_none(cols.get("name", cols.get("gpu_name", ""))),
                driver_version=_str_or_none(cols.get("driver_version", "")),
                memory_total_mib=_int_or_none(cols.get("memory.total", "")),
                compute_cap=_compute_cap(cols.get("compute_cap", "")),
                count=_int_or_none(cols.get("count", "")),
            )
        )
    return gpus


def _compute_cap(value: str) -> str | None:
    if _missing(value):
        return None
    if not re.fullmatch(r"\d{1,3}\.\d{1,3}", value.strip()):
        raise ParseError(f"not a compute capability: {value[:20]!r}")
    return value.strip()


@dataclass(frozen=True)
class NvidiaSmiBanner:
    driver_version: str | None
    cuda_version: str | None


@guard
def parse_nvidia_smi_banner(text: str) -> NvidiaSmiBanner:
    """The header of plain `nvidia-smi`: the only place the driver's CUDA version is printed."""
    driver = re.search(r"Driver Version:\s*([0-9][0-9.]*)", text)
    cuda = re.search(r"CUDA Version:\s*([0-9][0-9.]*)", text)
    if not driver and not cuda:
        raise ParseError("no 'Driver Version' / 'CUDA Version' in nvidia-smi's table")
    return NvidiaSmiBanner(driver.group(1) if driver else None, cuda.group(1) if cuda else None)


@dataclass(frozen=True)
class GpuListEntry:
    index: int
    name: str
    uuid: str | None


@guard
def parse_nvidia_smi_list(text: str) -> list[GpuListEntry]:
    """`nvidia-smi -L`: 'GPU 0: NVIDIA H200 (UUID: GPU-...)' per line (MIG lines are indented; skipped)."""
    out = []
    for line in text.splitlines():
        m = re.fullmatch(r"GPU (\d+): (.+?)(?: \(UUID: ([^)]*)\))?\s*", line)
        if m:
            out.append(GpuListEntry(int(m.group(1)), m.group(2), m.group(3)))
        elif line.strip() and not line.startswith((" ", "\t")):
            raise ParseError(f"unexpected line from nvidia-smi -L: {line[:80]!r}")
    return out


# ------------------------------------------------------------------------------------ memory, limits


@dataclass(frozen=True)
class MemInfo:
    total_bytes: int
    available_bytes: int | None  # absent on very old kernels
    free_bytes: int | None = None  # MemFree: what an allocation gets without reclaiming anything
    # The page cache the kernel can drop (drop_caches): Cached − Shmem (tmpfs is not dropped) + Buffers
    # + SReclaimable. MemAvailable counts it as available; on a GB10 CUDA does not get it back in time.
    cache_bytes: int | None = None
    swap_used_bytes: int | None = None  # SwapTotal − SwapFree
    cma_total_bytes: int | None = None  # CmaTotal: the contiguous-memory pool (absent: a kernel without CMA)


_MEMINFO_LINE = re.compile(r"(\w+(?:\(\w+\))?):\s+(\d{1,18})(?:\s+kB)?\s*")


@guard
def parse_meminfo(text: str) -> MemInfo:
    """/proc/meminfo ('MemTotal:  131072000 kB'); on unified-memory nodes this is the GPU's memory too."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        m = _MEMINFO_LINE.fullmatch(line)
        if m:
            values[m.group(1)] = int(m.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    if "MemTotal" not in values:
        raise ParseError("no MemTotal line in /proc/meminfo")
    cache = None
    if "Cached" in values:
        cache = max(0, values["Cached"] - values.get("Shmem", 0))
        cache += values.get("Buffers", 0) + values.get("SReclaimable", 0)
    swap = None
    if "SwapTotal" in values and "SwapFree" in values:
        swap = max(0, values["SwapTotal"] - values["SwapFree"])
    return MemInfo(values["MemTotal"], values.get("MemAvailable"), values.get("MemFree"), cache, swap,
                   values.get("CmaTotal"))


# ------------------------------------------------------------------------------------ the kernel


@dataclass(frozen=True)
class KernelInfo:
    """The running kernel: its release (`uname -r`) and its command line (/proc/cmdline)."""

    release: str
    cmdline: str = ""

    @property
    def cma_param(self) -> str | None:
        """The `cma=` boot parameter ('0', '512M'), None when the command line does not set it."""
        found = [w.partition("=")[2] for w in self.cmdline.split() if w.startswith("cma=")]
        return found[-1] if found else None


_RELEASE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]{0,127}")


@guard
def parse_kernel(text: str) -> KernelInfo:
    """The probe's kernel_info: `release<TAB>R` and `cmdline<TAB>C` lines."""
    rows = dict(line.split("\t", 1) for line in text.splitlines() if "\t" in line)
    release = rows.get("release", "").strip()
    if not _RELEASE.fullmatch(release):
        raise ParseError(f"not a kernel release: {release[:60]!r}")
    return KernelInfo(release, rows.get("cmdline", "").strip()[:4096])


@guard
def parse_firmware(text: str) -> dict[str, str]:
    """The probe's fw_walk: `HCA<TAB>FW_VERSION` per RDMA device (sysfs fw_ver: what `ethtool -i` prints
    as firmware-version for an mlx5 port), e.g. 'rocep1s0f0\t28.45.1020'."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        name, sep, fw = line.partition("\t")
        if not sep or not _IB_RECORD.fullmatch(name) or not re.fullmatch(r"[A-Za-z0-9._ ()-]{0,64}", fw.strip()):
            raise ParseError(f"unexpected firmware line: {line[:80]!r}")
        out[name] = fw.strip()
    return out


# ---------------------------------------------------------------------------- other GPU processes

COMPUTE_APPS_FIELDS: Final = ("pid", "process_name", "used_memory")
"""The fields `check` asks `nvidia-smi --query-compute-apps=` for, in this order."""


@dataclass(frozen=True)
class GpuApp:
    """A process holding a compute context on a GPU (`nvidia-smi --query-compute-apps`)."""

    pid: int
    name: str | None
    used_mib: int | None  # None: "[N/A]" (a GB10 may not say)
    container_id: str | None = None  # the Docker container whose cgroup holds the pid (64 hex), if any
    container_name: str | None = None  # that container's name (docker inspect), when the probe could read it
    container_cluster: str | None = None  # its sparkctl.cluster label: another sparkctl cluster's container
    # The process has exited (no /proc/PID, or a zombie) but nvidia-smi still lists it: the driver has
    # not given its memory back yet (GB10: seconds to a minute after a kill). Not a foreign process.
    ended: bool = False

    @property
    def used_bytes(self) -> int | None:
        return None if self.used_mib is None else self.used_mib * 1024 * 1024


_CGROUP_LINE = re.compile(r"@@cgroup (\d{1,10}) ([0-9a-f]{64})")
_CONTAINER_LINE = re.compile(r"@@container ([0-9a-f]{64})\t/?([A-Za-z0-9][A-Za-z0-9_.-]{0,254})\t([^\t]{0,200})")
_ENDED_LINE = re.compile(r"@@ended (\d{1,10})")


@guard
def parse_compute_apps(text: str, fields: Iterable[str] = COMPUTE_APPS_FIELDS) -> list[GpuApp]:
    """`nvidia-smi --query-compute-apps=FIELDS --format=csv[,noheader][,nounits]` (no rows: no
    process), then the probe's lines (gpu_apps in node_facts.sh): `@@ended PID` (the process has exited,
    its memory not yet given back), `@@cgroup PID CONTAINER_ID` (a container's cgroup holds it) and
    `@@container CONTAINER_ID<TAB>NAME<TAB>SPARKCTL_CLUSTER_LABEL` (docker inspect's name and label).

    With a header row (format=csv) the columns are taken from it ("used_gpu_memory [MiB]"); without
    one, `fields` says what they are. A process name may hold commas: the surplus columns are its.
    """
    names = [f.strip() for f in fields]
    rows: list[tuple[int, str | None, int | None]] = []
    containers: dict[int, str] = {}
    named: dict[str, tuple[str, str | None]] = {}
    ended: set[int] = set()
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _CGROUP_LINE.fullmatch(line.strip())
        if m:
            containers[int(m.group(1))] = m.group(2)
            continue
        m = _CONTAINER_LINE.fullmatch(line.strip(" \r\n"))
        if m:
            label = m.group(3).strip()
            named[m.group(1)] = (m.group(2), None if label in ("", "<no value>") else label)
            continue
        m = _ENDED_LINE.fullmatch(line.strip())
        if m:
            ended.add(int(m.group(1)))
            continue
        raw = line.split(",")
        cols = [c.strip() for c in raw]
        if cols[0] == "pid" and not rows:
            names = [re.sub(r"\s*\[.*\]$", "", c) for c in cols]
            continue
        names = [{"name": "process_name", "used_gpu_memory": "used_memory"}.get(n, n) for n in names]
        extra = len(cols) - len(names)
        if extra > 0 and "process_name" in names:
            i = names.index("process_name")
            cols[i : i + extra + 1] = [",".join(raw[i : i + extra + 1]).strip()]
        if len(cols) != len(names) or "pid" not in names:
            raise ParseError(f"unexpected line from nvidia-smi --query-compute-apps: {line[:80]!r}")
        row = dict(zip(names, cols, strict=True))
        if not re.fullmatch(r"\d{1,10}", row["pid"]):
            raise ParseError(f"not a pid: {row['pid'][:20]!r}")
        name = _str_or_none(row.get("process_name", ""))
        rows.append((int(row["pid"]), name[:200] if name else None, _int_or_none(row.get("used_memory", ""))))
    out = []
    for pid, name, used in rows:
        cid = containers.get(pid)
        cname, ccluster = named.get(cid, (None, None)) if cid else (None, None)
        out.append(GpuApp(pid, name, used, cid, cname, ccluster, pid in ended))
    return out


@guard
def parse_ulimit(text: str) -> int:
    """`ulimit -Hn` / `ulimit -Hl` output: a number or 'unlimited' (UNLIMITED). -l counts KiB."""
    value = text.strip()
    if value == "unlimited":
        return UNLIMITED
    if not re.fullmatch(r"\d{1,20}", value):
        raise ParseError(f"not a limit: {value[:40]!r}")
    return min(int(value), UNLIMITED)


def format_limit(value: int) -> str:
    return "unlimited" if value >= UNLIMITED else str(value)


# ------------------------------------------------------------------------------------------ network


@dataclass(frozen=True)
class NetDev:
    name: str
    operstate: str  # UP, DOWN, UNKNOWN (loopback, some virtual links), ...
    flags: tuple[str, ...]
    ipv4: tuple[ipaddress.IPv4Interface, ...]
    mac: str | None = None
    mtu: int | None = None

    @property
    def is_up(self) -> bool:
        """Administratively up with carrier. (operstate UNKNOWN with LOWER_UP counts: veths, tun.)"""
        return "UP" in self.flags and "LOWER_UP" in self.flags and self.operstate in ("UP", "UNKNOWN")


@guard
def parse_ip_addr(text: str) -> list[NetDev]:
    """`ip -j addr show`: every netdev with its state and IPv4 addresses (prefix kept)."""
    data = parse_json(text)
    if not isinstance(data, list):
        raise ParseError("`ip -j addr` did not print a list")
    devs = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("ifname"), str):
            raise ParseError("`ip -j addr` entry without ifname")
        ipv4 = []
        for a in item.get("addr_info") or []:
            if isinstance(a, dict) and a.get("family") == "inet":
                ipv4.append(ipaddress.IPv4Interface(f"{a['local']}/{int(a['prefixlen'])}"))
        flags = item.get("flags") or []
        devs.append(
            NetDev(
                name=item["ifname"],
                operstate=str(item.get("operstate", "UNKNOWN")),
                flags=tuple(str(f) for f in flags) if isinstance(flags, list) else (),
                ipv4=tuple(ipv4),
                mac=item.get("address") if isinstance(item.get("address"), str) else None,
                mtu=item["mtu"] if isinstance(item.get("mtu"), int) and 0 < item["mtu"] < 1 << 20 else None,
            )
        )
    return devs


@dataclass(frozen=True)
class Listener:
    address: str
    port: int


@guard
def parse_listening_ports(text: str) -> list[Listener]:
    """`ss -Hltn`: 'LISTEN 0 4096 127.0.0.1:631 0.0.0.0:*' (the local address is the 4th column)."""
    out = []
    for line in text.splitlines():
        cols = line.split()
        if not cols:
            continue
        if len(cols) < 5:
            raise ParseError(f"unexpected ss line: {line[:80]!r}")
        addr, _, port = cols[3].rpartition(":")
        if not port.isdigit() or int(port) > 65535:
            raise ParseError(f"no port in ss address {cols[3][:60]!r}")
        out.append(Listener(addr.strip("[]"), int(port)))
    return out


def ports_in_use(listeners: Iterable[Listener], ports: Iterable[int]) -> list[int]:
    """Which of `ports` something already listens on (on any address)."""
    taken = {lst.port for lst in listeners}
    return sorted(p for p in set(ports) if p in taken)


# ------------------------------------------------------------------------------------- InfiniBand


@dataclass(frozen=True)
class Gid:
    index: int
    gid: str  # as sysfs prints it: 0000:0000:0000:0000:0000:ffff:c0a8:6401
    type: str | None  # "RoCE v2", "IB/RoCE v1", or None when types/<n> was empty or unreadable
    ndev: str | None = None  # gid_attrs/ndevs/<n>, when the kernel offers it

    @property
    def ipv4(self) -> ipaddress.IPv4Address | None:
        try:
            return ipaddress.IPv6Address(self.gid).ipv4_mapped
        except ValueError:
            return None


@dataclass(frozen=True)
class IbPort:
    port: int
    state: str | None  # "ACTIVE", "DOWN", ... (sysfs prints "4: ACTIVE")
    link_layer: str | None
    gids: tuple[Gid, ...]


@dataclass(frozen=True)
class Hca:
    name: str  # the RDMA device: rocep1s0f0, mlx5_0, ...
    netdevs: tuple[str, ...]  # from device/net/*
    ports: tuple[IbPort, ...] = field(default=())

    def roce_v2_gid_candidates(self, ipv4: ipaddress.IPv4Address | str) -> list[tuple[int, int]]:
        """(port, gid index) pairs whose GID is ::ffff:ipv4 and whose type reads "RoCE v2", in order.

        The index drifts between boots (3 -> 4 has been seen), so it is resolved every time, never
        assumed. Entries whose type could not be read are not candidates: an empty value would be
        taken as index 0 by NCCL, which is exactly the silent misconfiguration to avoid.
        """
        want = ipaddress.IPv4Address(ipv4)
        return [
            (p.port, g.index)
            for p in self.ports
            for g in p.gids
            if g.ipv4 == want and (g.type or "").strip().lower() == "roce v2"
        ]


_IB_RECORD = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@guard
def parse_infiniband(text: str) -> list[Hca]:
    """The probe's walk of /sys/class/infiniband (or $SPARKCTL_SYSFS_ROOT), one tab-separated record
    per line:  hca NAME | netdev NAME DEV | port NAME N STATE LINK_LAYER | gid NAME N INDEX GID TYPE NDEV.
    Missing values are empty fields. Records for an HCA follow its `hca` line in any order.
    """
    hcas: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        f = line.split("\t")
        kind, args = f[0], f[1:]
        if kind not in ("hca", "netdev", "port", "gid"):
            raise ParseError(f"unexpected infiniband record: {line[:80]!r}")
        name = args[0] if args else ""
        if not _IB_RECORD.fullmatch(name):
            raise ParseError(f"bad RDMA device name {name[:40]!r}")
        h = hcas.setdefault(name, {"netdevs": [], "ports": {}})
        if kind == "netdev":
            h["netdevs"].append(_field(args, 1, required=True))
        elif kind == "port":
            port = int(_field(args, 1, required=True))
            state = _field(args, 2).split(":", 1)[-1].strip()  # "4: ACTIVE" -> ACTIVE
            h["ports"].setdefault(port, {"gids": []}).update(
                state=state or None, link_layer=_field(args, 3) or None
            )
        elif kind == "gid":
            port, index = int(_field(args, 1, required=True)), int(_field(args, 2, required=True))
            gid = Gid(index, _field(args, 3, required=True), _field(args, 4) or None, _field(args, 5) or None)
            h["ports"].setdefault(port, {"gids": []})["gids"].append(gid)
    return [
        Hca(
            name=name,
            netdevs=tuple(sorted(set(h["netdevs"]))),
            ports=tuple(
                IbPort(
                    n, p.get("state"), p.get("link_layer"), tuple(sorted(p["gids"], key=lambda g: g.index))
                )
                for n, p in sorted(h["ports"].items())
            ),
        )
        for name, h in sorted(hcas.items())
    ]


def _field(args: list[str], i: int, *, required: bool = False) -> str:
    if i < len(args):
        return args[i].strip()
    if required:
        raise ParseError("truncated infiniband record")
    return ""


def hca_for_netdev(hcas: Iterable[Hca], netdev: str) -> Hca | None:
    """The RDMA device whose device/net/ holds `netdev` (enp1s0f0np0 -> rocep1s0f0)."""
    return next((h for h in hcas if netdev in h.netdevs), None)


# ------------------------------------------------------------------------------------------- disks


@dataclass(frozen=True)
class DiskUsage:
    filesystem: str
    size_bytes: int
    used_bytes: int
    available_bytes: int
    mountpoint: str


@guard
def parse_df(text: str) -> list[DiskUsage]:
    """`df -PB1 PATH...`: a header, then one line per path (mount points may contain spaces)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("Filesystem"):
        raise ParseError("df printed no header")
    out = []
    for line in lines[1:]:
        cols = line.split()
        if len(cols) < 6 or not all(c.isdigit() for c in cols[1:4]) or not cols[4].endswith("%"):
            raise ParseError(f"unexpected df line: {line[:80]!r}")
        out.append(DiskUsage(cols[0], int(cols[1]), int(cols[2]), int(cols[3]), " ".join(cols[5:])))
    return out


@dataclass(frozen=True)
class DiskPath:
    """One df= argument of the probe: what was asked (a path, or @docker-root), the path it stands
    for (the engine's DockerRootDir), and the existing path df measured (the nearest that exists)."""

    asked: str
    path: str
    measured: str


DOCKER_ROOT = "@docker-root"  # df= token: the filesystem holding the engine's DockerRootDir


@guard
def parse_disk_paths(text: str) -> list[DiskPath]:
    out = []
    for line in text.splitlines()[:64]:
        if not line.strip():
            continue
        cols = line.split("\t")
        if len(cols) != 3 or not all(cols):
            raise ParseError(f"unexpected disk-paths line: {line[:80]!r}")
        out.append(DiskPath(*(c[:4096] for c in cols)))
    return out


@guard
def parse_fabric_record(text: str) -> dict[str, Any] | None:
    """The fabric document `sparkctl setup` left on the node (/etc/sparkctl/<cluster>/fabric.json); None: none."""
    if not text.strip():
        return None
    doc = parse_json(text)
    if not isinstance(doc, dict):
        raise ParseError("the fabric document is not a JSON object")
    return doc


@guard
def parse_machine_id(text: str) -> str:
    from .machine_identity import parse_machine_id as parse

    value = parse(text)
    if value is None:
        raise ParseError("/etc/machine-id is not 32 hex digits")
    return value


# ------------------------------------------------------------------------------------- model folder


@dataclass(frozen=True)
class ModelListing:
    exists: bool
    files: dict[str, int]  # path relative to the model folder -> size in bytes
    unlisted: int = 0  # files whose path holds a newline: withheld by the probe, never entries

    @property
    def shards(self) -> dict[str, int]:
        return {k: v for k, v in self.files.items() if "/" not in k and k.endswith(".safetensors")}


@guard
def parse_model_listing(text: str) -> ModelListing:
    """The probe's listing of $MODEL: 'missing' alone, or one line per file: 'SIZE<TAB>RELATIVE/PATH', or
    'unlisted' for a file whose path holds a newline (the probe withholds it: a name like
    `x<LF>5000<TAB>model-00001-of-00002.safetensors` could otherwise forge another file's entry). Lines
    end at a newline only (not at the other breaks `str.splitlines` knows: \r, \x1c, \x85, ... are name
    bytes); a tab inside a name is the name's (the size, digits, ends at the first tab)."""
    if text.strip() == "missing":
        return ModelListing(False, {})
    files = {}
    unlisted = 0
    for line in text.split("\n"):
        if not line:
            continue
        if line == "unlisted":
            unlisted += 1
            continue
        size, sep, path = line.partition("\t")
        if not sep or not size.isdigit() or not path:
            raise ParseError(f"unexpected model listing line: {line[:80]!r}")
        files[path] = int(size)
    return ModelListing(True, files, unlisted)


# ------------------------------------------------------------------ the node_facts.sh probe, whole


@dataclass(frozen=True)
class Section:
    name: str
    stdout: str
    stderr: str
    rc: int


STDERR_LINES = 20  # of each section's stderr, kept (the first one is what a finding quotes)


@guard
def parse_probe_sections(text: str, nonce: str, stderr: str = "") -> dict[str, Section]:
    """Split node_facts.sh output into its sections (see the framing described in the script):
    stdout carries "begin NAME" ... "end NAME RC", stderr "stderr NAME" before each one's errors.

    Only lines carrying `nonce` frame a section, so output that imitates the markers is just data.
    A section cut off by a dropped connection is left out; the caller reports it as missing.
    """
    if not re.fullmatch(r"[0-9a-f]{8,64}", nonce):
        raise ParseError("bad nonce")
    mark = f"@@sparkctl {nonce} "
    errors: dict[str, str] = {}
    chunks = stderr.split(f"{mark}stderr ")
    for chunk in chunks[1:]:
        name, _, body = chunk.partition("\n")
        lines = body.splitlines(keepends=True)[:STDERR_LINES]
        errors[name] = "".join(lines)
    out: dict[str, Section] = {}
    pos = 0
    while True:
        start = text.find(mark + "begin ", pos)
        if start < 0:
            return out
        name_end = text.find("\n", start)
        if name_end < 0:
            return out
        name = text[start + len(mark) + len("begin ") : name_end]
        end_mark = f"\n{mark}end {name} "
        e = text.find(end_mark, name_end)
        if e < 0:
            return out
        rc_start = e + len(end_mark)
        rc_end = text.find("\n", rc_start)
        rc_text = text[rc_start : rc_end if rc_end >= 0 else len(text)]
        if not rc_text.strip().isdigit():
            raise ParseError(f"section {name[:40]!r} has no exit code")
        out[name] = Section(name, text[name_end + 1 : e], errors.get(name, ""), int(rc_text))
        pos = rc_start


# ------------------------------------------------------------------------ the declarations, whole


@dataclass(frozen=True)
class Fact:
    """One node fact: the probe section that carries it, the shell that prints it, its parser.

    sh: the section's command, run on the node as `section NAME SH` inside node_facts.sh (where the
    probe's helper functions and $T, the timeout prefix, are defined); None: the fact reads a section
    another fact runs (uname's one line gives both hostname and arch).
    switch: an optional fact's name for "asked or not": probe_args(SWITCH=False) leaves the section
    out (the probe argument SWITCH=no) and node_facts_from_probe(expect_SWITCH=False) then does not
    report it missing. only_if: the shell condition for it instead (default: `on SWITCH`, i.e. no
    SWITCH=no argument was given), e.g. a value argument that was given.
    partial_ok: parse stdout even after a non-zero exit (docker prints what it found, the error on
    stderr). quiet: a fact that cannot be read is left None without a problem (hostname, arch).
    """

    section: str
    parser: Callable[[str], Any]
    sh: str | None
    switch: str | None = None
    only_if: str | None = None
    partial_ok: bool = False
    quiet: bool = False

    @property
    def condition(self) -> str | None:
        """The shell condition the probe runs the section under (None: always)."""
        if self.only_if is not None:
            return self.only_if
        return f"on {self.switch}" if self.switch else None


def fact(
    section: str,
    parser: Callable[[str], T],
    sh: str | None,
    *,
    switch: str | None = None,
    only_if: str | None = None,
    partial_ok: bool = False,
    quiet: bool = False,
) -> T | None:
    """Declare a NodeFacts field as a fact (typed by its parser's result; None until it is read)."""
    return field(
        default=None,
        metadata={"fact": Fact(section, parser, sh, switch, only_if, partial_ok, quiet)},
    )


@dataclass(frozen=True)
class Alternative:
    """A section that, when its condition holds on the node, stands in for several facts' sections:
    the Docker engine's API answers the three Docker facts with one curl."""

    section: str
    sh: str
    only_if: str
    replaces: tuple[str, ...]
    read: Callable[[Section, str], DockerFacts]  # (the section, the nonce) -> the facts it stands for


def _docker_from_api(sec: Section, nonce: str) -> DockerFacts:
    return parse_docker_api(sec.stdout, sec.stderr, sec.rc, nonce)


docker_facts_from_api = _docker_from_api  # the probe's docker-api section -> the three Docker facts

DOCKER_API: Final = Alternative(
    "docker-api",
    "docker_api",
    '[ -n "$API_PATHS" ] && command -v curl >/dev/null 2>&1 && engine_socket',
    DOCKER_SECTIONS,
    _docker_from_api,
)
ALTERNATIVES: Final = (DOCKER_API,)


@guard
def _uname_words(text: str) -> list[str]:
    """`uname -nm`: 'HOSTNAME ARCH'."""
    words = text.split()
    if not words:
        raise ParseError("uname printed nothing")
    return words


def _hostname(text: str) -> str:
    return _uname_words(text)[0][:255]


def _arch(text: str) -> str | None:
    words = _uname_words(text)
    return words[1][:32] if len(words) > 1 else None


_GPU_QUERY = f"--query-gpu={','.join(GPU_QUERY_FIELDS)} --format=csv,noheader,nounits"
_DOCKER_PS = """--filter "label=sparkctl.cluster=$CLUSTER" --format '{{json .}}'"""


@dataclass
class NodeFacts:
    """Everything node_facts.sh found on one node. A fact that could not be read is None, and
    `problems` says why (section name -> one line), so a rule can tell "absent" from "unknown".

    Each field is a fact's whole declaration, in the order the probe runs them (disk-paths before
    df: df measures what disk-paths resolved). See the module's docstring for adding one.
    """

    hostname: str | None = fact("host", _hostname, "uname -nm", quiet=True)
    arch: str | None = fact("host", _arch, None, quiet=True)
    meminfo: MemInfo | None = fact("meminfo", parse_meminfo, "read_file /proc/meminfo")
    nofile_hard: int | None = fact("nofile", parse_ulimit, "ulimit -Hn")
    memlock_hard_kib: int | None = fact("memlock", parse_ulimit, "ulimit -Hl")
    gpus: list[Gpu] | None = fact("gpu", parse_nvidia_smi_query, f"$T nvidia-smi {_GPU_QUERY}")
    # The banner only carries the CUDA version, which the driver version decides: check asks the
    # head for it (banner=no on the other nodes), one nvidia-smi run per node less.
    gpu_banner: NvidiaSmiBanner | None = fact(
        "gpu-banner", parse_nvidia_smi_banner, "$T nvidia-smi", switch="banner"
    )
    # Other processes' GPU memory counts against what the engine can get (on a GB10, against MemFree).
    gpu_apps: list[GpuApp] | None = fact("gpu-apps", parse_compute_apps, "gpu_apps")
    netdevs: list[NetDev] | None = fact("ip-addr", parse_ip_addr, "ip -j addr show")
    hcas: list[Hca] | None = fact("infiniband", parse_infiniband, "ib_walk")
    # Only the head's ports matter (the API, the rendezvous): check asks the head alone.
    listeners: list[Listener] | None = fact(
        "listening", parse_listening_ports, "ss -Hltn", switch="listening"
    )
    machine_id: str | None = fact("machine-id", parse_machine_id, "read_file /etc/machine-id")
    # What must agree across the ranks (check's parity row): the kernel, the CX7s' firmware.
    kernel: KernelInfo | None = fact("kernel", parse_kernel, "kernel_info")
    firmware: dict[str, str] | None = fact("firmware", parse_firmware, "fw_walk")
    # What `sparkctl setup` found and set (None: setup never ran there); check compares the ports against it.
    fabric_record: dict[str, Any] | None = fact("fabric-record", parse_fabric_record, "fabric_record")
    disk_paths: list[DiskPath] | None = fact("disk-paths", parse_disk_paths, "disk_paths")
    disks: list[DiskUsage] | None = fact("df", parse_df, "df_paths")  # disks[i] measures disk_paths[i]
    # The Docker facts: from the engine's API over its socket when the probe can (DOCKER_API),
    # else from the docker CLI, three runs.
    docker: DockerVersion | None = fact(
        "docker-version", parse_docker_version, "$T docker version --format '{{json .}}'",
        switch="docker", partial_ok=True,
    )  # fmt: skip
    containers: list[Container] | None = fact(
        "docker-ps", parse_docker_ps, f"$T docker ps -a --no-trunc {_DOCKER_PS}", switch="docker"
    )
    images: list[Image] | None = fact(
        "docker-images", parse_image_inspect, 'images "$@"', switch="docker", partial_ok=True
    )
    model: ModelListing | None = fact(
        "model", parse_model_listing, "model_listing", switch="model", only_if='[ -n "$MODEL" ]'
    )
    problems: dict[str, str] = field(default_factory=dict)


def declared(kind: type[NodeFacts] = NodeFacts) -> list[tuple[str, Fact]]:
    """(NodeFacts attribute, its Fact), in declaration order: the order the probe runs them."""
    return [(f.name, f.metadata["fact"]) for f in fields(kind) if "fact" in f.metadata]


def switches(kind: type[NodeFacts] = NodeFacts) -> dict[str, bool]:
    """Every optional fact's switch -> whether it is a flag (SWITCH=no turns it off) rather than a
    value the caller gives (model=DIR)."""
    out: dict[str, bool] = {}
    for _, f in declared(kind):
        if f.switch:
            out[f.switch] = out.get(f.switch, True) and f.only_if is None
    return out


def _problem(sec: Section) -> str:
    lines = [ln.strip() for ln in sec.stderr.splitlines() if ln.strip()]
    if sec.rc == 127:
        return f"command not found ({lines[0] if lines else 'exit 127'})"[:300]
    if sec.rc == 124:
        return "timed out on the node"
    return (lines[0] if lines else f"exit status {sec.rc}")[:300]


def node_facts_from_probe(
    text: str, nonce: str, stderr: str = "", *, kind: type[NodeFacts] = NodeFacts, **expect: bool
) -> NodeFacts:
    """Parse the whole probe output (its stdout and stderr) into NodeFacts. Never raises: what went
    wrong goes to .problems.
    expect_SWITCH=False (expect_docker, expect_banner, expect_listening, expect_model: one per
    switch declared): the probe ran with probe_args(SWITCH=False) or without the value, so those
    sections are not missing, just not asked for."""
    known = switches(kind)
    unknown = [k for k in expect if not k.startswith("expect_") or k.removeprefix("expect_") not in known]
    if unknown:
        raise TypeError(f"node_facts_from_probe() got unexpected keyword arguments: {', '.join(unknown)}")
    facts = kind()
    try:
        sections = parse_probe_sections(text, nonce, stderr)
    except ParseError as exc:
        facts.problems["probe"] = str(exc)
        return facts
    stood_in: set[str] = set()  # sections an alternative answered: not run, so not missing
    for alt in ALTERNATIVES:
        sec = sections.get(alt.section)
        if sec is not None:
            d = alt.read(sec, nonce)
            for attr, f in declared(kind):
                if f.section in alt.replaces:
                    setattr(facts, attr, getattr(d, _ALT_FIELDS[f.section]))
            facts.problems.update(d.problems)
            stood_in.update(alt.replaces)
    for attr, f in declared(kind):
        name = f.section
        if name in stood_in:
            continue
        sec = sections.get(name)
        if sec is None:
            if not f.quiet and (not f.switch or expect.get(f"expect_{f.switch}", True)):
                facts.problems[name] = "no output (the probe was cut short)"
            continue
        if sec.rc != 0:
            if not f.quiet:
                facts.problems[name] = _problem(sec)
            if not f.partial_ok or not sec.stdout.strip():
                continue
        try:
            setattr(facts, attr, f.parser(sec.stdout))
        except ParseError as exc:
            if not f.quiet:
                facts.problems.setdefault(name, str(exc))
    return facts


_ALT_FIELDS: Final = {"docker-version": "version", "docker-ps": "containers", "docker-images": "images"}
"""Which DockerFacts field answers which Docker section, when the engine's API stood in for them."""


def probe_args(
    *,
    model: str | None = None,
    cluster: str = "sparkctl",
    images: Iterable[str] = (),
    df_paths: Iterable[str] = (),
    api: bool = False,
    kind: type[NodeFacts] = NodeFacts,
    **switched: bool,
) -> list[str]:
    """The key=value arguments node_facts.sh takes (after its nonce); each becomes one quoted word.
    SWITCH=False, for each optional fact's flag (docker, banner, listening: see NodeFacts), leaves
    its section(s) out (SWITCH=no): docker=False the Docker sections, banner=False plain
    `nvidia-smi` (its CUDA version; check asks the head only), listening=False the listening ports
    (only the head's matter). api=True asks the engine's API over its local socket with one curl (the
    three docker CLI runs where that cannot be done)."""
    flags = [s for s, is_flag in switches(kind).items() if is_flag]
    unknown = [k for k in switched if k not in flags]
    if unknown:
        raise TypeError(f"probe_args() got unexpected keyword arguments: {', '.join(unknown)}")
    images = list(images)
    args = [f"cluster={cluster}"] + [f"{s}=no" for s in flags if not switched.get(s, True)]
    if switched.get("docker", True) and api:
        args += [f"api={p}" for p in docker_api_paths(cluster, images[0] if images else None, *images[1:])]
    if model:
        args.append(f"model={model}")
    args += [f"df={p}" for p in df_paths]
    args += [f"image={ref}" for ref in images]
    return args


# ------------------------------------------------------------- the probe's facts(), generated here

PROBE: Final = Path(__file__).resolve().parent.parent / "probes" / "node_facts.sh"
_BEGIN: Final = "# ---- generated by `python -m sparkctl.facts.node_facts` from NodeFacts' declarations: edit those, not this\n"
_END: Final = "# ---- end of the generated part\n"


def probe_body(kind: type[NodeFacts] = NodeFacts) -> str:
    """node_facts.sh's facts(): one `section NAME SH` per declared fact, in declaration order, under
    its condition (consecutive facts with the same one share an `if`), with an Alternative's section
    standing in for the sections it replaces when its own condition holds on the node."""
    runs = [f for _, f in declared(kind) if f.sh is not None]
    out = ["facts() {\n"]
    i = 0
    while i < len(runs):
        cond = runs[i].condition
        j = i
        while j < len(runs) and runs[j].condition == cond:
            j += 1
        group, i = runs[i:j], j
        pad = "    " if cond is None or len(group) == 1 else "        "
        body = _with_alternatives(group, pad)
        if cond is None:
            out += body
        elif len(body) == 1:
            out.append(f"    {cond} && {body[0].lstrip()}")
        else:
            out += [f"    if {cond}; then\n", *body, "    fi\n"]
    out.append("}\n")
    return "".join(out)


def _with_alternatives(group: list[Fact], pad: str) -> list[str]:
    lines: list[str] = []
    k = 0
    while k < len(group):
        alt = next((a for a in ALTERNATIVES if group[k].section == a.replaces[0]), None)
        n = len(alt.replaces) if alt else 0
        if alt and tuple(f.section for f in group[k : k + n]) == alt.replaces:
            lines += [f"{pad}if {alt.only_if}; then\n", f"{pad}    section {alt.section} {alt.sh}\n",
                      f"{pad}else\n", *(f"{pad}    section {f.section} {f.sh}\n" for f in group[k : k + n]),
                      f"{pad}fi\n"]  # fmt: skip
            k += n
        else:
            lines.append(f"{pad}section {group[k].section} {group[k].sh}\n")
            k += 1
    return lines


def probe_script_text(kind: type[NodeFacts] = NodeFacts, script: str | None = None) -> str:
    """node_facts.sh with its generated part (between the marker lines) made from the declarations."""
    text = PROBE.read_text() if script is None else script
    head, sep, rest = text.partition(_BEGIN)
    _, sep2, tail = rest.partition(_END)
    if not sep or not sep2:
        raise ValueError(f"{PROBE.name} has lost its generated-part markers")
    return head + _BEGIN + probe_body(kind) + _END + tail


if __name__ == "__main__":  # python -m sparkctl.facts.node_facts: write the declarations into node_facts.sh
    PROBE.write_text(probe_script_text())
    print(f"wrote {PROBE}")
