"""`sparkctl setup`'s pure part: the exact files it wants on each node, and the plan (what is already right,
what will change) from what each node reported (facts/setup_facts.py) and the cabling (rules/cabling.py).

The files setup may write on a node (and nothing else; each validated by the real tool before it is renamed
into place):
  /etc/netplan/60-sparkctl-fabric.yaml     addresses and MTU 9000 on the cabled CX7 ports (never the SSH
                                           interface), validated by `netplan generate --root-dir`
  /etc/sudoers.d/sparkctl                  exactly the drop-caches line for the SSH user, `visudo -cf`
  /etc/security/limits.d/60-sparkctl.conf  the SSH user's nofile and memlock (ULIMIT_NOFILE, ULIMIT_MEMLOCK)
  /etc/default/earlyoom                    earlyoom prefers the engine, avoids sshd, dockerd, containerd, systemd
  /etc/sparkctl/<cluster>/fabric.json      the fabric document: the cabling and addresses setup found and set
and the commands: `usermod -aG docker USER`, `apt-get install -y earlyoom` (keeping the file above), `systemctl restart earlyoom`,
`netplan apply` (with try semantics: orchestrate/setup.py).

Addresses come from FABRIC_SUBNET (default DEFAULT_FABRIC_SUBNET): one segment (a switch, or one cable)
takes the whole subnet; several take one aligned block each, in the order of their first port (node's
position in NODES, then port name), the smallest block that holds its ports (a cable: a /30). A port's
address is its segment's block + 1 + its position in the segment. A node gets one address per segment: a
second port of the node on the same segment (both cabled to one switch) stays without one, since two
addresses of one subnet on two ports of one host make Linux answer and route through either (the lab's
ranks could not reach the head). The same cabling gives the same addresses on every run.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..facts.setup_facts import SetupFacts
from ..rules.cabling import Cabling, End

DEFAULT_FABRIC_SUBNET = "192.168.100.0/24"
FABRIC_MTU = 9000
NETPLAN_PATH = "/etc/netplan/60-sparkctl-fabric.yaml"
SUDOERS_PATH = "/etc/sudoers.d/sparkctl"
LIMITS_PATH = "/etc/security/limits.d/60-sparkctl.conf"
EARLYOOM_PATH = "/etc/default/earlyoom"
# The one command `up` runs through sudo to drop the page cache (remote/service.py's drop_caches).
DROP_CACHES_SUDOERS = "USER ALL=(root) NOPASSWD: /usr/bin/tee /proc/sys/vm/drop_caches"
# earlyoom matches these against the process name: the engine's processes first, never the node's lifelines.
EARLYOOM_PREFER = "^(vllm|VLLM.*|python3?|pt_main_thread|ray::.*)$"
EARLYOOM_AVOID = "^(sshd|dockerd|containerd.*|systemd.*)$"
HEADER = "# Written by `sparkctl setup` (cluster {cluster}); it rewrites this file: edit the env file, not this.\n"


class SetupInputError(ValueError):
    """Input setup refuses before touching anything (exit 2): the message is one line for a person."""


def fabric_doc_path(cluster: str) -> str:
    return f"/etc/sparkctl/{cluster}/fabric.json"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------- addresses


def check_subnet(subnet: str, management: Iterable[str]) -> ipaddress.IPv4Network:
    """FABRIC_SUBNET as a network; refused when it overlaps a management network (a node's SSH interface,
    or this machine's address as the nodes see it)."""
    try:
        net = ipaddress.IPv4Network(subnet, strict=False)
    except ValueError:
        raise SetupInputError(f"FABRIC_SUBNET={subnet!r} is not an IPv4 network (e.g. {DEFAULT_FABRIC_SUBNET})") from None
    for m in management:
        try:
            other = ipaddress.ip_network(m, strict=False)
        except ValueError:
            continue
        if other.version == 4 and net.overlaps(other):
            raise SetupInputError(f"FABRIC_SUBNET={net} overlaps the management network {other}: choose another "
                                  f"private network, e.g. {DEFAULT_FABRIC_SUBNET if not ipaddress.IPv4Network(DEFAULT_FABRIC_SUBNET).overlaps(other) else '10.99.0.0/24'}")
    return net


def allocate(cabling: Cabling, net: ipaddress.IPv4Network) -> dict[End, ipaddress.IPv4Interface]:
    """Every cabled port's address (see the module's docstring); SetupInputError when the subnet is too small."""
    segs = cabling.segments
    out: dict[End, ipaddress.IPv4Interface] = {}
    if not segs:
        return out
    if len(segs) == 1:
        blocks = [net]
    else:
        blocks, start = [], int(net.network_address)
        for s in segs:
            size = 4
            while size < len(s.ends) + 2:
                size *= 2
            start = -(-start // size) * size
            prefix = 32 - size.bit_length() + 1
            block = ipaddress.IPv4Network((start, prefix))
            if not block.subnet_of(net):
                raise SetupInputError(f"FABRIC_SUBNET={net} is too small for {len(segs)} cable segments "
                                      f"({sum(len(s.ends) for s in segs)} ports): use a /24 or larger")
            blocks.append(block)
            start += size
    for s, block in zip(segs, blocks, strict=True):
        if block.num_addresses < len(s.ends) + 2:
            raise SetupInputError(f"FABRIC_SUBNET={net} is too small for {len(s.ends)} ports on one segment: "
                                  "use a /24 or larger")
        placed: set[str] = set()
        for end in s.ends:
            if end[0] in placed:  # the node's other port on this segment: no second address in one subnet
                continue
            placed.add(end[0])
            out[end] = ipaddress.IPv4Interface((int(block.network_address) + 1 + len(placed) - 1, block.prefixlen))
    return out


# ---------------------------------------------------------------------------------------- the files


def render_netplan(cluster: str, addrs: Mapping[str, ipaddress.IPv4Interface | None]) -> str:
    """The netplan file of one node: each cabled port (name -> address) with MTU 9000. A port without an address
    (a node's second port on a segment that already has its first) still gets MTU 9000: a peer's jumbo frame
    that reaches it (Linux answers ARP for any of its addresses on any port) is not dropped."""
    lines = [HEADER.format(cluster=cluster).rstrip("\n"), "network:", "  version: 2", "  ethernets:"]
    for port in sorted(addrs):
        a = addrs[port]
        lines += [f"    {port}:", "      dhcp4: false"] + ([f"      addresses: [{a}]"] if a else []) + \
            [f"      mtu: {FABRIC_MTU}"]
    return "\n".join(lines) + "\n"


def render_sudoers(cluster: str, user: str) -> str:
    return HEADER.format(cluster=cluster) + DROP_CACHES_SUDOERS.replace("USER", user, 1) + "\n"


def render_limits(cluster: str, user: str, nofile: int, memlock_bytes: int) -> str:
    mem = "unlimited" if memlock_bytes < 0 else str(-(-memlock_bytes // 1024))
    return HEADER.format(cluster=cluster) + "".join(
        f"{user} {kind} {item} {value}\n" for item, value in (("nofile", nofile), ("memlock", mem))
        for kind in ("soft", "hard"))


def render_earlyoom(cluster: str) -> str:
    return (HEADER.format(cluster=cluster)
            + f'EARLYOOM_ARGS="-r 3600 -m 4 -s 100 --prefer {EARLYOOM_PREFER} --avoid {EARLYOOM_AVOID}"\n')


def render_fabric_doc(cluster: str, nodes: Sequence[str], cabling: Cabling,
                      addrs: Mapping[End, ipaddress.IPv4Interface], facts: Mapping[str, SetupFacts]) -> str:
    """What setup found and set, the same on every node (no time in it: the same cabling, the same bytes)."""
    ports: dict[str, dict[str, Any]] = {}
    for n in nodes:
        f = facts.get(n)
        for p in f.ports if f else ():
            if (n, p.name) not in addrs:
                continue
            ports.setdefault(n, {})[p.name] = {
                "address": str(addrs[(n, p.name)]), "mac": p.mac, "hca": p.hca, "mtu": FABRIC_MTU,
                "peers": [f"{m}:{q}" for m, q in cabling.peers(n, p.name)]}
    doc = {"cluster": cluster, "version": 1, "layout": cabling.layout, "nodes": list(nodes),
           "machine_ids": {n: facts[n].machine_id for n in nodes if n in facts},
           "segments": [[f"{n}:{p}" for n, p in s.ends] for s in cabling.segments], "ports": ports}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


# ---------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class DesiredFile:
    path: str
    content: str
    mode: str  # octal, as chmod takes it
    check: str  # the real tool that validates it: netplan, sudoers, or none
    what: str


@dataclass(frozen=True)
class Change:
    node: str
    what: str
    path: str | None = None
    command: str | None = None
    before: str | None = None  # the file's sha256 now, "absent", or "unreadable"
    after: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"node": self.node, "what": self.what}
        if self.path:
            d.update(path=self.path, sha256_before=self.before, sha256_after=self.after)
        if self.command:
            d["command"] = self.command
        return d


@dataclass
class NodePlan:
    node: str
    right: list[str] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    files: list[DesiredFile] = field(default_factory=list)  # those that change
    commands: list[tuple[str, str]] = field(default_factory=list)  # (action, argument) for setup_apply.sh
    privileged: bool = True  # root, or sudo without a password
    warnings: list[str] = field(default_factory=list)

    def by_hand(self) -> list[str]:
        """The exact commands that make this node's changes, for an SSH user whose sudo asks a password."""
        out = []
        for f in self.files:
            out.append(f"printf '%s' {shlex.quote(f.content)} | sudo install -D -m {f.mode} /dev/stdin {f.path}")
            if f.check == "sudoers":
                out.append(f"sudo visudo -cf {f.path} || sudo rm -f {f.path}")
        out += [c.command for c in self.changes if c.command]
        return [f"sudo {c}" if c and not c.startswith(("printf", "sudo")) else c for c in out]


COMMANDS = {
    "docker-group": "usermod -aG docker {arg}",
    "install-earlyoom": "DEBIAN_FRONTEND=noninteractive apt-get install -y -o Dpkg::Options::=--force-confold earlyoom",
    "restart-earlyoom": "systemctl restart earlyoom",
    "netplan-apply": "netplan apply",
}


@dataclass(frozen=True)
class Wanted:
    """What the settings ask of every node."""

    cluster: str
    nodes: tuple[str, ...]
    nofile: int
    memlock_bytes: int


def plan_node(node: str, f: SetupFacts, want: Wanted, cabling: Cabling,
              addrs: Mapping[End, ipaddress.IPv4Interface], doc: str) -> NodePlan:
    plan = NodePlan(node, privileged=f.is_root or f.sudo)
    user = f.user or "root"
    mine: dict[str, ipaddress.IPv4Interface | None] = {
        p: a for (n, p), a in addrs.items() if n == node and p != f.ssh_iface}
    for p in cabling.cabled(node):  # a second port on an addressed segment: MTU 9000, no address
        if p != f.ssh_iface and p not in mine and cabling.peers(node, p):
            mine[p] = None
    if f.ssh_iface and (node, f.ssh_iface) in addrs:
        plan.warnings.append(f"{node}: {f.ssh_iface} carries the SSH session: setup leaves it as it is")
    files: list[DesiredFile] = []
    if mine:
        files.append(DesiredFile(NETPLAN_PATH, render_netplan(want.cluster, mine), "600", "netplan",
                                 "fabric addresses and MTU 9000 on " + ", ".join(sorted(mine))))
    if not f.is_root:
        files.append(DesiredFile(SUDOERS_PATH, render_sudoers(want.cluster, user), "440", "sudoers",
                                 "sudoers: the drop-caches line"))
    files.append(DesiredFile(LIMITS_PATH, render_limits(want.cluster, user, want.nofile, want.memlock_bytes),
                             "644", "none", "limits: nofile and memlock"))
    files.append(DesiredFile(EARLYOOM_PATH, render_earlyoom(want.cluster), "644", "none",
                             "earlyoom: prefer the engine, avoid sshd/dockerd/containerd/systemd"))
    files.append(DesiredFile(fabric_doc_path(want.cluster), doc, "644", "none", "the fabric document"))
    netplan_changes = False
    for d in files:
        before = f.files.get(d.path, "absent")
        after = sha256(d.content)
        if before == after:
            plan.right.append(f"{d.path}: as setup wrote it")
            continue
        plan.files.append(d)
        plan.changes.append(Change(node, d.what, path=d.path, before=before, after=after))
        netplan_changes = netplan_changes or d.check == "netplan"

    def command(action: str, arg: str = "") -> None:
        plan.commands.append((action, arg))
        plan.changes.append(Change(node, action, command=COMMANDS[action].format(arg=arg)))

    live_ok = all((live := f.port(name)) is not None and (a is None or str(a) in live.ipv4)
                  and live.mtu == FABRIC_MTU for name, a in mine.items())
    if mine and (netplan_changes or not live_ok):
        command("netplan-apply")
    elif mine:
        plan.right.append("fabric addresses and MTU 9000: live on " + ", ".join(sorted(mine)))
    if not f.is_root and "docker" not in f.groups:
        if f.docker_group:
            command("docker-group", user)
        else:
            plan.warnings.append(f"{node}: no docker group: install Docker (the engine) first")
    elif not f.is_root:
        plan.right.append(f"{user} is in the docker group")
    if not f.earlyoom:
        command("install-earlyoom")
    if not f.earlyoom or any(d.path == EARLYOOM_PATH for d in plan.files):
        command("restart-earlyoom")
    else:
        plan.right.append("earlyoom installed and configured")
    if not f.ctk:
        plan.warnings.append(f"{node}: the NVIDIA container toolkit (nvidia-ctk) is missing: install "
                             "nvidia-container-toolkit (DGX OS ships it)")
    return plan


def plan_setup(want: Wanted, facts: Mapping[str, SetupFacts], cabling: Cabling,
               addrs: Mapping[End, ipaddress.IPv4Interface]) -> dict[str, NodePlan]:
    doc = render_fabric_doc(want.cluster, want.nodes, cabling, addrs, facts)
    return {n: plan_node(n, facts[n], want, cabling, addrs, doc) for n in want.nodes if n in facts}


def refuse_bad_nodes(nodes: Sequence[str], facts: Mapping[str, SetupFacts]) -> None:
    """Nodes setup cannot plan for: no CX7 port, one machine-id on two nodes (the same machine twice)."""
    for n in nodes:
        if not facts[n].ports:
            raise SetupInputError(f"{n}: no ConnectX-7 port (no netdev under /sys/class/infiniband): is {n} a "
                                  "DGX Spark, and is NODES right?")
    seen: dict[str, str] = {}
    for n in nodes:
        mid = facts[n].machine_id
        if mid and mid in seen:
            raise SetupInputError(f"{seen[mid]} and {n} have one machine-id ({mid}): they are the same machine, "
                                  "or one was cloned (`systemd-machine-id-setup` after removing /etc/machine-id)")
        if mid:
            seen[mid] = n
