"""Typed facts parsed from what a node printed (pyinfra style: given this output, expect this fact).

Every parser here is a pure function from text to a small frozen dataclass. Node output is untrusted
(a broken tool, a truncated stream, a hostile host): a parser returns its fact, or raises ParseError
with a short reason, and never any other exception. Missing values a real tool prints as "[N/A]" or
"Not Supported" (the GB10's unified memory) become None, not errors.

The fixtures these are tested on are real output: tests/fixtures/ (nvidia-smi from an H200, the rest
captured on a Debian 12 host) plus a derived GB10 set that says what was changed.
"""

from __future__ import annotations

import csv
import functools
import ipaddress
import json
import re
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, ParamSpec, TypeVar

MAX_INPUT_CHARS: Final = 8 * 1024 * 1024
"""Anything longer is refused: no real probe output comes near it, and parsing it would cost memory."""

UNLIMITED: Final = 2**64 - 1
"""How an "unlimited" ulimit is represented (RLIM_INFINITY on Linux), so plain `>=` comparisons work."""

GPU_QUERY_FIELDS: Final = ("name", "driver_version", "memory.total", "compute_cap", "count")
"""The fields `check` asks `nvidia-smi --query-gpu=` for, in this order."""

_MISSING = {"", "[n/a]", "n/a", "not supported", "[not supported]", "unknown", "[unknown error]"}

P = ParamSpec("P")
R = TypeVar("R")


class ParseError(ValueError):
    """The output was not what the tool prints; the message says what was wrong with it."""


def _guard(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn any failure while parsing untrusted text into ParseError (and refuse oversized input)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        text = args[0] if args else None
        if isinstance(text, str) and len(text) > MAX_INPUT_CHARS:
            raise ParseError(f"output too large ({len(text)} characters)")
        if text is not None and not isinstance(text, str):
            raise ParseError(f"expected text, got {type(text).__name__}")
        try:
            return fn(*args, **kwargs)
        except ParseError:
            raise
        except (
            ValueError,
            KeyError,
            TypeError,
            IndexError,
            AttributeError,
            RecursionError,
            OverflowError,
        ) as exc:
            raise ParseError(
                f"{fn.__name__}: unexpected output ({type(exc).__name__}: {exc})"[:300]
            ) from None

    return wrapper


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


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ParseError(f"not JSON: {exc.msg} at character {exc.pos}") from None


# --------------------------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str | None
    driver_version: str | None
    memory_total_mib: int | None  # None on GB10 (unified memory): use /proc/meminfo instead
    compute_cap: str | None
    count: int | None = None


@_guard
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


@_guard
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


@_guard
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


@_guard
def parse_meminfo(text: str) -> MemInfo:
    """/proc/meminfo ('MemTotal:  131072000 kB'); on unified-memory nodes this is the GPU's memory too."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"(\w+(?:\(\w+\))?):\s+(\d{1,18})(?:\s+kB)?\s*", line)
        if m:
            values[m.group(1)] = int(m.group(2)) * (1024 if line.rstrip().endswith("kB") else 1)
    if "MemTotal" not in values:
        raise ParseError("no MemTotal line in /proc/meminfo")
    return MemInfo(values["MemTotal"], values.get("MemAvailable"))


@_guard
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

    @property
    def is_up(self) -> bool:
        """Administratively up with carrier. (operstate UNKNOWN with LOWER_UP counts: veths, tun.)"""
        return "UP" in self.flags and "LOWER_UP" in self.flags and self.operstate in ("UP", "UNKNOWN")


@_guard
def parse_ip_addr(text: str) -> list[NetDev]:
    """`ip -j addr show`: every netdev with its state and IPv4 addresses (prefix kept)."""
    data = _json(text)
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
            )
        )
    return devs


@dataclass(frozen=True)
class Listener:
    address: str
    port: int


@_guard
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


@_guard
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


# ------------------------------------------------------------------------------------------- docker


@dataclass(frozen=True)
class DockerVersion:
    client_version: str | None
    server_version: str | None  # None when the engine could not be reached
    api_version: str | None
    os: str | None
    arch: str | None


@_guard
def parse_docker_version(text: str) -> DockerVersion:
    """`docker version --format '{{json .}}'` (Server is null when the engine is down)."""
    data = _json(text.strip().splitlines()[0] if text.strip() else "")
    if not isinstance(data, dict):
        raise ParseError("docker version did not print a JSON object")
    server = _dict(data.get("Server"))  # {} when the engine could not be reached
    return DockerVersion(
        client_version=_opt_str(_dict(data.get("Client")).get("Version")),
        server_version=_opt_str(server.get("Version")),
        api_version=_opt_str(server.get("ApiVersion")),
        os=_opt_str(server.get("Os")),
        arch=_opt_str(server.get("Arch")),
    )


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else []


@dataclass(frozen=True)
class Image:
    id: str
    repo_tags: tuple[str, ...]
    labels: dict[str, str]
    layers: tuple[str, ...]
    architecture: str | None = None
    repo_digests: tuple[str, ...] = ()  # `repo@sha256:...` it was pulled as (none after save | load or a build)


@_guard
def parse_image_inspect(text: str) -> list[Image]:
    """`docker image inspect A B ...`: the images found (missing ones appear only on stderr)."""
    if not text.strip():
        return []
    data = _json(text)
    if not isinstance(data, list):
        raise ParseError("docker image inspect did not print a list")
    out = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("Id"), str):
            raise ParseError("docker image inspect entry without Id")
        out.append(
            Image(
                id=item["Id"],
                repo_tags=tuple(t for t in _list(item.get("RepoTags")) if isinstance(t, str)),
                labels={str(k): str(v) for k, v in _dict(_dict(item.get("Config")).get("Labels")).items()},
                layers=tuple(str(x) for x in _list(_dict(item.get("RootFS")).get("Layers"))),
                architecture=_opt_str(item.get("Architecture")),
                repo_digests=tuple(d for d in _list(item.get("RepoDigests")) if isinstance(d, str)),
            )
        )
    return out


def normalize_image_ref(ref: str) -> str:
    """How docker names a reference in RepoTags: 'x' -> 'x:latest', 'docker.io/library/x:1' -> 'x:1'."""
    name, tag = ref, "latest"
    if "@" in ref:
        return ref
    last = ref.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = ref.rsplit(":", 1)
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "index.docker.io/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return f"{name}:{tag}"


def find_image(images: Iterable[Image], ref: str) -> Image | None:
    """The inspected image that `ref` names (by tag, by `repo@sha256:` digest, or by full/short ID)."""
    want = normalize_image_ref(ref)
    for img in images:
        if want in img.repo_tags or ref in img.repo_digests or ref in (img.id, img.id.removeprefix("sha256:")):
            return img
        if len(ref) >= 12 and img.id.removeprefix("sha256:").startswith(ref.removeprefix("sha256:")):
            return img
    return None


@dataclass(frozen=True)
class Container:
    id: str
    names: str
    image: str
    state: str  # created, running, exited, ...
    status: str
    labels: dict[str, str]


@_guard
def parse_docker_ps(text: str) -> list[Container]:
    """`docker ps -a --format '{{json .}}'`: one JSON object per line; Labels is 'k=v,k2=v2'."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        item = _json(line)
        if not isinstance(item, dict) or not isinstance(item.get("ID"), str):
            raise ParseError("docker ps line without ID")
        labels = {}
        for pair in str(item.get("Labels") or "").split(","):
            if pair:
                k, _, v = pair.partition("=")
                labels[k] = v
        out.append(
            Container(
                id=item["ID"],
                names=str(item.get("Names", "")),
                image=str(item.get("Image", "")),
                state=str(item.get("State", "")),
                status=str(item.get("Status", "")),
                labels=labels,
            )
        )
    return out


# ------------------------------------------------------------- docker API (the probe's docker-api)

DOCKER_SECTIONS: Final = ("docker-version", "docker-ps", "docker-images")
"""The problem keys of the three Docker facts, whether they came from the CLI or from the API."""


def docker_api_paths(cluster: str, image: str | None, *more: str) -> list[str]:
    """Engine API paths the probe asks (with curl over the engine's unix socket): this cluster's
    containers, then each image (IMAGE, and BASE_IMAGE when asked). (The engine's version comes with
    every answer's headers.) Percent-encoded here, so nothing in them is URL syntax."""
    filters = urllib.parse.quote(json.dumps({"label": [f"sparkctl.cluster={cluster}"]}), safe="")
    paths = [f"/containers/json?all=1&filters={filters}"]
    for ref in (image, *more):
        if ref:
            paths.append(f"/images/{urllib.parse.quote(ref, safe='/:@')}/json")
    return paths


def _http_reply(raw: str) -> tuple[dict[str, str], str]:
    """curl -D - output of one answer: (headers with lower-case names, body)."""
    if not raw.startswith("HTTP/"):
        return {}, raw
    head, sep, body = raw.partition("\r\n\r\n")
    if not sep:
        head, _, body = raw.partition("\n\n")
    headers: dict[str, str] = {}
    for line in head.splitlines()[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()[:200]
    return headers, body


_SERVER = re.compile(r"Docker/([0-9A-Za-z.+~_-]+)(?:\s*\(([^)]*)\))?")


def docker_version_from_headers(headers: Mapping[str, str]) -> DockerVersion:
    """The engine's version from the headers it puts on every answer: "Server: Docker/27.5.1
    (linux)", "Api-Version: 1.47". An engine that answers without them is still an engine."""
    server = headers.get("server", "")
    m = _SERVER.fullmatch(server.strip())
    version = m.group(1) if m else (server or "unknown (no Server header)")
    os_name = (m.group(2) if m else None) or headers.get("ostype") or None
    return DockerVersion(None, version, headers.get("api-version") or None, os_name, None)


@dataclass(frozen=True)
class DockerFacts:
    version: DockerVersion | None
    containers: list[Container] | None
    images: list[Image] | None
    problems: dict[str, str]


def docker_facts_from_api(sec: Section, nonce: str) -> DockerFacts:
    """The probe's docker-api section: 'socket unix://PATH', then per request curl's headers and body
    followed by '@@sparkctl NONCE http CODE' (000: no answer): the containers, then the image.
    Never raises: what went wrong goes to .problems."""
    head, _, rest = sec.stdout.partition("\n")
    where = head.removeprefix("socket ").strip()[:200] or "its socket"
    parts = re.split(rf"\n?@@sparkctl {re.escape(nonce)} http (\d{{3}})\n", rest)
    replies = [(int(code), *_http_reply(raw)) for raw, code in zip(parts[0::2], parts[1::2], strict=False)]
    if not replies or any(code == 0 for code, _, _ in replies):
        err = next((ln.strip() for ln in sec.stderr.splitlines() if ln.strip()), f"exit status {sec.rc}")
        why = f"cannot connect to the Docker engine at {where} ({err[:200]})"
        return DockerFacts(None, None, None, dict.fromkeys(DOCKER_SECTIONS, why))
    problems: dict[str, str] = {}

    def body_json(i: int, key: str) -> Any:
        code, _, body = replies[i] if i < len(replies) else (0, {}, "")
        if code != 200:
            problems[key] = _api_message(code, body)
            return None
        try:
            return _json(body)
        except ParseError as exc:
            problems[key] = str(exc)
            return None

    version = docker_version_from_headers(replies[0][1])
    containers: list[Container] | None = None
    c = body_json(0, "docker-ps")
    if c is not None:
        try:
            containers = _containers_from_api(c)
        except ParseError as exc:
            problems["docker-ps"] = str(exc)
    images: list[Image] | None = None
    for n in range(1, len(replies)):  # one answer per image asked; 404: not on the node
        if replies[n][0] == 404:
            images = images if images is not None else []
            continue
        i = body_json(n, "docker-images")
        if i is not None:
            try:
                images = (images or []) + parse_image_inspect(json.dumps([i]))
            except ParseError as exc:
                problems["docker-images"] = str(exc)
    if "docker-images" in problems:
        images = None
    return DockerFacts(version, containers, images, problems)


def _api_message(code: int, body: str) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    msg = doc.get("message") if isinstance(doc, dict) else None
    return f"HTTP {code}: {str(msg)[:300]}" if msg else f"HTTP {code}"


def _containers_from_api(data: Any) -> list[Container]:
    """GET /containers/json: [{"Id", "Names": ["/name"], "Image", "State", "Status", "Labels": {}}]."""
    if not isinstance(data, list):
        raise ParseError("the container list is not a list")
    out = []
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("Id"), str):
            raise ParseError("container without Id")
        out.append(
            Container(
                id=item["Id"],
                names=",".join(str(n).lstrip("/") for n in _list(item.get("Names"))),
                image=str(item.get("Image", "")),
                state=str(item.get("State", "")),
                status=str(item.get("Status", "")),
                labels={str(k): str(v) for k, v in _dict(item.get("Labels")).items()},
            )
        )
    return out


# ------------------------------------------------------------------------------------------- disks


@dataclass(frozen=True)
class DiskUsage:
    filesystem: str
    size_bytes: int
    used_bytes: int
    available_bytes: int
    mountpoint: str


@_guard
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


@_guard
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


@_guard
def parse_machine_id(text: str) -> str:
    from .identity import parse_machine_id as parse

    value = parse(text)
    if value is None:
        raise ParseError("/etc/machine-id is not 32 hex digits")
    return value


# ------------------------------------------------------------------------------------- model folder


@dataclass(frozen=True)
class ModelListing:
    exists: bool
    files: dict[str, int]  # path relative to the model folder -> size in bytes

    @property
    def shards(self) -> dict[str, int]:
        return {k: v for k, v in self.files.items() if "/" not in k and k.endswith(".safetensors")}


@_guard
def parse_model_listing(text: str) -> ModelListing:
    """The probe's listing of $MODEL: 'missing' alone, or 'SIZE<TAB>RELATIVE/PATH' per file."""
    if text.strip() == "missing":
        return ModelListing(False, {})
    files = {}
    for line in text.splitlines():
        if not line:
            continue
        size, sep, path = line.partition("\t")
        if not sep or not size.isdigit() or not path:
            raise ParseError(f"unexpected model listing line: {line[:80]!r}")
        files[path] = int(size)
    return ModelListing(True, files)


# ------------------------------------------------------------------ the node_facts.sh probe, whole


@dataclass(frozen=True)
class Section:
    name: str
    stdout: str
    stderr: str
    rc: int


STDERR_LINES = 20  # of each section's stderr, kept (the first one is what a finding quotes)


@_guard
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


@dataclass
class NodeFacts:
    """Everything node_facts.sh found on one node. A fact that could not be read is None, and
    `problems` says why (section name -> one line), so a rule can tell "absent" from "unknown"."""

    hostname: str | None = None
    arch: str | None = None
    meminfo: MemInfo | None = None
    nofile_hard: int | None = None
    memlock_hard_kib: int | None = None
    gpus: list[Gpu] | None = None
    gpu_banner: NvidiaSmiBanner | None = None
    netdevs: list[NetDev] | None = None
    hcas: list[Hca] | None = None
    listeners: list[Listener] | None = None
    disks: list[DiskUsage] | None = None
    disk_paths: list[DiskPath] | None = None  # disks[i] measures disk_paths[i]
    machine_id: str | None = None
    docker: DockerVersion | None = None
    containers: list[Container] | None = None
    images: list[Image] | None = None
    model: ModelListing | None = None
    problems: dict[str, str] = field(default_factory=dict)


def _problem(sec: Section) -> str:
    lines = [ln.strip() for ln in sec.stderr.splitlines() if ln.strip()]
    if sec.rc == 127:
        return f"command not found ({lines[0] if lines else 'exit 127'})"[:300]
    if sec.rc == 124:
        return "timed out on the node"
    return (lines[0] if lines else f"exit status {sec.rc}")[:300]


# section name -> (NodeFacts attribute, parser). Sections whose parser wants stdout even after a
# non-zero exit (docker prints what it found, and the error on stderr) are listed in _PARTIAL_OK.
_PARSERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "meminfo": ("meminfo", parse_meminfo),
    "nofile": ("nofile_hard", parse_ulimit),
    "memlock": ("memlock_hard_kib", parse_ulimit),
    "gpu": ("gpus", parse_nvidia_smi_query),
    "gpu-banner": ("gpu_banner", parse_nvidia_smi_banner),
    "ip-addr": ("netdevs", parse_ip_addr),
    "infiniband": ("hcas", parse_infiniband),
    "listening": ("listeners", parse_listening_ports),
    "df": ("disks", parse_df),
    "disk-paths": ("disk_paths", parse_disk_paths),
    "machine-id": ("machine_id", parse_machine_id),
    "docker-version": ("docker", parse_docker_version),
    "docker-ps": ("containers", parse_docker_ps),
    "docker-images": ("images", parse_image_inspect),
    "model": ("model", parse_model_listing),
}
_PARTIAL_OK = {"docker-version", "docker-images"}


def node_facts_from_probe(
    text: str,
    nonce: str,
    stderr: str = "",
    *,
    expect_model: bool = True,
    expect_docker: bool = True,
    expect_banner: bool = True,
    expect_listening: bool = True,
) -> NodeFacts:
    """Parse the whole probe output (its stdout and stderr) into NodeFacts. Never raises: what went
    wrong goes to .problems.
    expect_docker/expect_banner/expect_listening=False: the probe ran with probe_args(docker=False /
    banner=False / listening=False), so those sections are not missing, just not asked for."""
    facts = NodeFacts()
    try:
        sections = parse_probe_sections(text, nonce, stderr)
    except ParseError as exc:
        facts.problems["probe"] = str(exc)
        return facts
    api = sections.get("docker-api")
    if api is not None:  # the engine was asked over its socket: the CLI sections were not run
        expect_docker = False
        d = docker_facts_from_api(api, nonce)
        facts.docker, facts.containers, facts.images = d.version, d.containers, d.images
        facts.problems.update(d.problems)
    host = sections.get("host")
    if host and host.rc == 0 and host.stdout.split():
        words = host.stdout.split()
        facts.hostname, facts.arch = words[0][:255], (words[1][:32] if len(words) > 1 else None)
    for name, (attr, parser) in _PARSERS.items():
        sec = sections.get(name)
        if sec is None:
            optional = {"model": expect_model, "gpu-banner": expect_banner, "listening": expect_listening}
            asked = optional.get(name, True) and (
                name not in DOCKER_SECTIONS or expect_docker
            )
            if asked:
                facts.problems[name] = "no output (the probe was cut short)"
            continue
        if sec.rc != 0:
            facts.problems[name] = _problem(sec)
            if name not in _PARTIAL_OK or not sec.stdout.strip():
                continue
        try:
            setattr(facts, attr, parser(sec.stdout))
        except ParseError as exc:
            facts.problems.setdefault(name, str(exc))
    return facts


def probe_args(
    *,
    model: str | None = None,
    cluster: str = "sparkctl",
    images: Iterable[str] = (),
    df_paths: Iterable[str] = (),
    docker: bool = True,
    banner: bool = True,
    listening: bool = True,
    api: bool = False,
) -> list[str]:
    """The key=value arguments node_facts.sh takes (after its nonce); each becomes one quoted word.
    docker=False leaves out the Docker sections; api=True asks the engine's API over its local
    socket with one curl (the three docker CLI runs where that cannot be done); banner=False leaves
    out plain `nvidia-smi` (its CUDA version; check asks the head only); listening=False leaves out
    the listening ports (only the head's matter)."""
    images = list(images)
    args = [f"cluster={cluster}"] + ([] if docker else ["docker=no"]) + ([] if banner else ["banner=no"])
    args += [] if listening else ["listening=no"]
    if docker and api:
        args += [f"api={p}" for p in docker_api_paths(cluster, images[0] if images else None, *images[1:])]
    if model:
        args.append(f"model={model}")
    args += [f"df={p}" for p in df_paths]
    args += [f"image={ref}" for ref in images]
    return args
