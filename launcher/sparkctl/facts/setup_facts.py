"""What `sparkctl setup` reads of a node (probes/setup_facts.sh, one round trip): its ConnectX-7 ports
(netdev, RDMA device, carrier, speed, MTU, MAC, addresses, the neighbours each port sees), the interface
that carries the SSH session, the SSH user (uid, groups, sudo without a password), limits, earlyoom,
the NVIDIA container toolkit, machine-id, and the hash of every file setup manages.

Untrusted input: `setup_facts_from_probe` never raises; what could not be read goes to `.problems`
(each parser below returns its fact or raises ParseError).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from .node_facts import UNLIMITED, parse_fabric_record, parse_ip_addr, parse_probe_sections, parse_ulimit
from .parsing import ParseError, guard, parse_json

MAC_RE = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_NAME_RE = re.compile(r"^[\w.:@-]{1,64}$")


@dataclass(frozen=True)
class Port:
    """One CX7 netdev: its RDMA device, state, speed (Mb/s, None when unknown), MTU, MAC, IPv4 addresses."""

    name: str
    hca: str
    mac: str | None = None
    mtu: int | None = None
    admin_up: bool = False
    carrier: bool = False
    speed: int | None = None
    ipv4: tuple[str, ...] = ()


@dataclass
class SetupFacts:
    user: str | None = None
    uid: int | None = None
    groups: tuple[str, ...] = ()
    sudo: bool = False
    nofile: int | None = None
    memlock: int | None = None
    machine_id: str | None = None
    client_ip: str | None = None
    ssh_iface: str | None = None
    ssh_nets: tuple[str, ...] = ()  # the IPv4 networks of the interface that carries the SSH session
    ports: list[Port] = field(default_factory=list)
    neighbours: dict[str, tuple[str, ...]] = field(default_factory=dict)  # port -> peer MACs it saw
    earlyoom: bool = False
    ctk: bool = False
    docker_group: bool = False
    files: dict[str, str] = field(default_factory=dict)  # path -> sha256 | "absent" | "unreadable"
    fabric_doc: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def port(self, name: str) -> Port | None:
        return next((p for p in self.ports if p.name == name), None)


@guard
def parse_ib_walk(text: str) -> list[tuple[str, str, int | None]]:
    """`hca NAME` / `netdev HCA DEV SPEED` records: (hca, netdev, speed Mb/s or None), in order."""
    out = []
    for line in text.splitlines():
        f = line.split("\t")
        if not line.strip() or f[0] == "hca":
            continue
        if f[0] != "netdev" or len(f) != 4 or not _NAME_RE.match(f[1]) or not _NAME_RE.match(f[2]):
            raise ParseError(f"unexpected RDMA record: {line[:80]!r}")
        speed = int(f[3]) if re.fullmatch(r"\d{1,9}", f[3].strip()) else None
        out.append((f[1], f[2], speed if speed else None))
    return out


@guard
def parse_mtus(text: str) -> dict[str, int]:
    """`ip -j addr show`: netdev -> MTU."""
    data = parse_json(text)
    if not isinstance(data, list):
        raise ParseError("`ip -j addr` did not print a list")
    return {str(i["ifname"]): int(i["mtu"]) for i in data
            if isinstance(i, dict) and isinstance(i.get("ifname"), str) and isinstance(i.get("mtu"), int)}


def ports_of(ib_text: str, addr_text: str) -> list[Port]:
    """The CX7 ports: every netdev under an RDMA device, with what `ip -j addr` says of it."""
    devs = {d.name: d for d in parse_ip_addr(addr_text)}
    mtus = parse_mtus(addr_text)
    ports = []
    for hca, name, speed in parse_ib_walk(ib_text):
        d = devs.get(name)
        mac = d.mac.lower() if d and d.mac and MAC_RE.match(d.mac.lower()) else None
        ports.append(Port(name=name, hca=hca, mac=mac, mtu=mtus.get(name),
                          admin_up=bool(d and "UP" in d.flags), carrier=bool(d and d.is_up), speed=speed,
                          ipv4=tuple(str(a) for a in d.ipv4) if d else ()))
    return ports


@guard
def parse_ssh_route(text: str) -> tuple[str | None, str | None]:
    """`client ADDR` then `ip -j route get ADDR`: (the client's address, the interface it routes through)."""
    first, _, rest = text.partition("\n")
    kind, _, client = first.partition("\t")
    if kind != "client":
        raise ParseError("no client line")
    client = client.strip()
    if not client:
        return None, None
    ipaddress.ip_address(client)
    if not rest.strip():
        return client, None
    data = parse_json(rest)
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ParseError("`ip -j route get` did not print a route")
    dev = data[0].get("dev")
    return client, dev if isinstance(dev, str) and _NAME_RE.match(dev) else None


def _replier(line: str) -> str | None:
    """The address of one `bytes from ADDR` line of ping (`fe80::1%dev:` in iputils, `fe80::1:` before)."""
    word = line.removeprefix("bytes from ").strip().split("%", 1)[0].rstrip(":")
    try:
        return str(ipaddress.IPv6Address(word))
    except ValueError:
        return None


@guard
def parse_neighbours(text: str) -> dict[str, tuple[str, ...]]:
    """`@@dev DEV`, `ip -j -6 neigh show dev DEV`, then `@@replied` and ping's `bytes from ADDR` lines, per port:
    port -> the MACs of the neighbours that answered the ping (sorted). Without `@@replied` (no ping on the
    node) every neighbour entry counts."""
    out: dict[str, tuple[str, ...]] = {}
    for chunk in text.split("@@dev\t")[1:]:
        dev, _, body = chunk.partition("\n")
        if not _NAME_RE.match(dev):
            raise ParseError(f"bad netdev name {dev[:40]!r}")
        body, marked, replied = body.partition("@@replied\n")
        repliers = {a for a in map(_replier, replied.splitlines()) if a}
        macs: set[str] = set()
        if body.strip():
            data = parse_json(body)
            if not isinstance(data, list):
                raise ParseError("`ip -j neigh` did not print a list")
            for n in data:
                mac = n.get("lladdr") if isinstance(n, dict) else None
                if not (isinstance(mac, str) and MAC_RE.match(mac.lower())):
                    continue
                if marked and _replier(str(n.get("dst", ""))) not in repliers:
                    continue  # in the table, but silent now: a cable since moved, a host since gone
                macs.add(mac.lower())
        out[dev] = tuple(sorted(macs))
    return out


@guard
def parse_file_hashes(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        path, _, h = line.partition("\t")
        if not path.startswith("/") or not (SHA_RE.match(h) or h in ("absent", "unreadable")):
            raise ParseError(f"unexpected file line: {line[:80]!r}")
        out[path] = h
    return out


@guard
def parse_machine_id(text: str) -> str:
    mid = text.strip()
    if not re.fullmatch(r"[0-9a-f]{32}", mid):
        raise ParseError("not a machine-id")
    return mid


@guard
def parse_iperf3(text: str) -> float:
    """`iperf3 -c ... -J`: the bits per second the receiving end counted (ParseError with iperf3's own error)."""
    doc = parse_json(text)
    if not isinstance(doc, dict):
        raise ParseError("iperf3 did not print a JSON object")
    if doc.get("error"):
        raise ParseError(f"iperf3: {str(doc['error'])[:200]}")
    bps = doc["end"]["sum_received"]["bits_per_second"]
    if not isinstance(bps, (int, float)) or isinstance(bps, bool) or not 0 <= bps < 1e15:
        raise ParseError("iperf3 reported no bandwidth")
    return float(bps)


def setup_facts_from_probe(text: str, nonce: str, stderr: str = "") -> SetupFacts:
    """Parse setup_facts.sh's output. Never raises: a fact that cannot be read is a line in .problems."""
    facts = SetupFacts()
    try:
        sec = parse_probe_sections(text, nonce, stderr)
    except ParseError as exc:
        facts.problems.append(f"the setup probe's output could not be read: {exc}")
        return facts

    def ok(name: str) -> str | None:
        s = sec.get(name)
        return s.stdout if s is not None and s.rc == 0 else None

    def read(name: str, what: str, fn: Any) -> Any:
        s = sec.get(name)
        if s is None:
            facts.problems.append(f"{what}: not reported (the probe was cut off)")
            return None
        if s.rc != 0:
            facts.problems.append(f"{what}: exit {s.rc} {s.stderr.strip()[:200]}".rstrip())
            return None
        try:
            return fn(s.stdout)
        except ParseError as exc:
            facts.problems.append(f"{what}: {exc}")
            return None

    user = (ok("user") or "").strip()
    facts.user = user if _NAME_RE.match(user) else None
    uid = (ok("uid") or "").strip()
    facts.uid = int(uid) if re.fullmatch(r"\d{1,10}", uid) else None
    facts.groups = tuple(g for g in (ok("groups") or "").split() if _NAME_RE.match(g))
    s = sec.get("sudo")
    facts.sudo = s is not None and s.rc == 0
    facts.nofile = read("nofile", "ulimit -Hn", parse_ulimit)
    facts.memlock = read("memlock", "ulimit -Hl", parse_ulimit)
    facts.machine_id = read("machine-id", "/etc/machine-id", parse_machine_id)
    route = read("ssh-route", "the SSH session's route", parse_ssh_route)
    if route:
        facts.client_ip, facts.ssh_iface = route
    ib, addr = ok("infiniband"), sec.get("ip-addr")
    if ib is not None and addr is not None:
        try:
            facts.ports = ports_of(ib, addr.stdout)
            facts.ssh_nets = tuple(str(a.network) for d in parse_ip_addr(addr.stdout) if d.name == facts.ssh_iface
                                   for a in d.ipv4)
        except ParseError as exc:
            facts.problems.append(f"CX7 ports: {exc}")
    facts.neighbours = read("neigh", "IPv6 neighbours", parse_neighbours) or {}
    facts.earlyoom = ok("earlyoom") is not None
    facts.ctk = ok("ctk") is not None
    facts.docker_group = ok("docker-group") is not None
    facts.files = read("files", "the files setup manages", parse_file_hashes) or {}
    doc = ok("fabric-doc")
    if doc is not None and doc.strip():
        try:
            facts.fabric_doc = parse_fabric_record(doc)
        except ParseError as exc:
            facts.problems.append(f"the fabric document: {exc}")
    return facts


__all__ = ["UNLIMITED", "Port", "SetupFacts", "setup_facts_from_probe"]
