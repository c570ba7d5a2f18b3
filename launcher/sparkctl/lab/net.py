"""The lab's network: two bridges, one network namespace per host, veth pairs, FORWARD rules.

    root namespace                        host sparkN (netns sparkN)
    sparklab0 10.231.0.1/24  --slmN------ enP7s7       10.231.0.(10+N)/24   management, SSH
    sparklab1 (no address)   --slfNp0---- enp1s0f0np0  10.232.0.(10+N)/24   fabric port 1
                             --slfNp1---- enp1s0f1np1  (down, no address)   fabric port 2
spark3, spark7, ... are the other way round: the address sits on enp1s0f1np1 and enp1s0f0np0 is up
without an address, which is what trips launchers that assume "first port" on real clusters.
The fabric bridge has no address in the root namespace: only hosts talk on the fabric.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

from ..errors import CheckFailed, UsageError
from .proc import ok, out, run
from .state import (
    FABRIC_BRIDGE,
    FABRIC_NET,
    IPTABLES_COMMENT,
    MGMT_BRIDGE,
    MGMT_IF,
    MGMT_NET,
    NETNS_DIR,
    PORT_IFS,
    HostSpec,
)

BRIDGES = (MGMT_BRIDGE, FABRIC_BRIDGE)


def link_exists(name: str, netns: str | None = None) -> bool:
    argv = ["ip"] + (["-n", netns] if netns else []) + ["link", "show", "dev", name]
    return ok(argv)


def links_json(netns: str) -> list[dict[str, Any]]:
    return json.loads(out(["ip", "-n", netns, "-j", "addr", "show"]) or "[]")


def check_no_collision() -> None:
    """Refuse to build the lab over routes this machine already uses (other than our own bridges)."""
    routes = json.loads(out(["ip", "-j", "route", "show", "table", "all"]) or "[]")
    for route in routes:
        dst, dev = route.get("dst", ""), route.get("dev", "")
        if dev in BRIDGES or dst in ("", "default") or ":" in dst:
            continue
        try:
            net = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if net.prefixlen == 0 or net.is_loopback:
            continue
        for ours in (MGMT_NET, FABRIC_NET):
            if net.overlaps(ours):
                raise UsageError(
                    f"the lab's subnet {ours} overlaps this machine's route {dst} on {dev}",
                    fix="free that subnet or change MGMT_NET/FABRIC_NET in sparkctl/lab/state.py",
                )


# The fabric's "switch" carries jumbo frames, as the DGX Spark's cables and a RoCE switch do: the hosts' ports
# start at 1500 (a fresh node's), and `sparkctl setup` sets them to 9000 on both ends. With a 1500 bridge, an
# SSH handshake between two 9000 ports (model sync over the fabric) was dropped: an MTU black hole.
FABRIC_MTU = 9000


def ensure_bridges() -> None:
    for name in BRIDGES:
        if not link_exists(name):
            run(["ip", "link", "add", "name", name, "type", "bridge"])
        run(["ip", "link", "set", "dev", name, "up"])
    run(["ip", "link", "set", "dev", FABRIC_BRIDGE, "mtu", str(FABRIC_MTU)])
    addr = f"{MGMT_NET.network_address + 1}/{MGMT_NET.prefixlen}"
    if addr.split("/")[0] not in out(["ip", "-4", "-o", "addr", "show", "dev", MGMT_BRIDGE]):
        run(["ip", "addr", "add", addr, "dev", MGMT_BRIDGE])


def delete_bridges() -> None:
    for name in BRIDGES:
        if link_exists(name):
            run(["ip", "link", "delete", "dev", name])


# ------------------------------------------------------------------------------------------- iptables
def _rules() -> list[list[str]]:
    return [
        ["FORWARD", flag, br, "-m", "comment", "--comment", IPTABLES_COMMENT, "-j", "ACCEPT"]
        for br in BRIDGES
        for flag in ("-i", "-o")
    ]


def ensure_forward_rules() -> list[list[str]]:
    """If FORWARD drops by default, accept the lab bridges' traffic; return the rules we added."""
    added: list[list[str]] = []
    if "-P FORWARD DROP" not in out(["iptables", "-S", "FORWARD"]):
        return added
    for rule in _rules():
        if not ok(["iptables", "-C", *rule]):
            run(["iptables", "-I", *rule])
            added.append(rule)
    return added


def remove_forward_rules(rules: list[list[str]]) -> None:
    """Delete exactly the rules `ensure_forward_rules` added (recorded in lab.json), nothing else."""
    for rule in rules:
        while ok(["iptables", "-C", *rule]):
            run(["iptables", "-D", *rule])


# ------------------------------------------------------------------------------------------- hosts
def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists() and ok(["ip", "netns", "exec", name, "true"])


def host_net_ok(spec: HostSpec, lab_fabric: bool = True) -> list[str]:
    """What is wrong with a host's network (empty list = as designed). lab_fabric=False: the fabric port's
    address is not the lab's business (a lab made --fresh, addressed by `sparkctl setup`)."""
    if not netns_exists(spec.name):
        return ["network namespace missing"]
    problems = []
    addrs = {
        link["ifname"]: [a["local"] for a in link.get("addr_info", []) if a.get("family") == "inet"]
        for link in links_json(spec.name)
    }
    if spec.mgmt_ip not in addrs.get(MGMT_IF, []):
        problems.append(f"{MGMT_IF} lacks {spec.mgmt_ip}")
    if lab_fabric and spec.fabric_ip not in addrs.get(spec.fabric_if, []):
        problems.append(f"{spec.fabric_if} lacks {spec.fabric_ip}")
    if spec.idle_if not in addrs:
        problems.append(f"{spec.idle_if} missing")
    return problems


def create_host_net(spec: HostSpec) -> None:
    """Create the host's netns and its three links. The caller deletes a half-built one first."""
    ns = spec.name
    run(["ip", "netns", "add", ns])
    run(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
    pairs = [(spec.veth_mgmt, MGMT_IF, MGMT_BRIDGE)] + [
        (spec.veth_port(i), PORT_IFS[i], FABRIC_BRIDGE) for i in (0, 1)
    ]
    for outer, inner, bridge in pairs:
        if link_exists(outer):  # left behind by a crash
            run(["ip", "link", "delete", "dev", outer])
        run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns])
        if bridge == FABRIC_BRIDGE:  # the switch's side of the cable takes jumbo frames (the host's starts at 1500)
            run(["ip", "link", "set", "dev", outer, "mtu", str(FABRIC_MTU)])
        run(["ip", "link", "set", "dev", outer, "master", bridge, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{spec.mgmt_ip}/{MGMT_NET.prefixlen}", "dev", MGMT_IF])
    run(["ip", "-n", ns, "link", "set", "dev", MGMT_IF, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{spec.fabric_ip}/{FABRIC_NET.prefixlen}", "dev", spec.fabric_if])
    run(["ip", "-n", ns, "link", "set", "dev", spec.fabric_if, "up"])
    if spec.fabric_if != PORT_IFS[0]:
        # A second-port host: its first port has carrier but no address (the trap on real nodes).
        run(["ip", "-n", ns, "link", "set", "dev", spec.idle_if, "up"])


def delete_host_net(spec: HostSpec) -> None:
    if (NETNS_DIR / spec.name).exists():
        run(["ip", "netns", "delete", spec.name], check=False)
    for outer in (spec.veth_mgmt, spec.veth_port(0), spec.veth_port(1)):
        if link_exists(outer):
            run(["ip", "link", "delete", "dev", outer], check=False)


def iface_mac(spec: HostSpec, ifname: str) -> str:
    for link in json.loads(out(["ip", "-n", spec.name, "-j", "link", "show", "dev", ifname]) or "[]"):
        return str(link["address"])
    raise CheckFailed(f"{spec.name}: interface {ifname} not found")


def iface_up(spec: HostSpec, ifname: str) -> bool:
    for link in json.loads(out(["ip", "-n", spec.name, "-j", "link", "show", "dev", ifname]) or "[]"):
        return "UP" in link.get("flags", [])
    return False
