"""Per-rank fabric pins: found on each node, never assumed.

On each node: the CX7 netdev that is up and carries an IPv4 address (in FABRIC_SUBNET when given),
its RDMA device (sysfs device/net/<netdev>) and the RoCE v2 GID index whose GID is ::ffff:<that IP>.
Names differ between nodes (a rank whose address sits on the second port has its own pins) and the
GID index drifts at runtime, so `up` resolves them again every time. A RANK<n>_CX7_IF knob chooses
the netdev on that rank; everything else about it is still read from the node.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from dataclasses import dataclass

from .cluster import Cluster, Node, NodeError
from .errors import CheckFailed
from .facts import NodeFacts, hca_for_netdev, node_facts_from_probe, probe_args
from .resources import probe_script
from .settings import RankPins, Settings

# ConnectX-7 netdev names: enp1s0f0np0, enp1s0f1np1, enP2p1s0f0np0, enP2p1s0f1np1, ...
CX7_NAME = re.compile(r"^en[pP]\d+(?:p\d+)?s\d+f\d+(?:np\d+)?$")


@dataclass(frozen=True)
class PinFinding:
    pins: RankPins | None
    problem: str | None = None
    fix: str | None = None
    note: str | None = None


def discover(facts: NodeFacts, subnet: str | None = None, want_netdev: str | None = None) -> PinFinding:
    """Pick this node's fabric netdev, RDMA device and RoCE v2 GID index from its facts."""
    if facts.netdevs is None:
        return PinFinding(None, f"could not read network interfaces ({facts.problems.get('ip-addr', 'no data')})",
                          "check that `ip -j addr` works on the node (iproute2)")
    net = ipaddress.IPv4Network(subnet, strict=False) if subnet else None
    where = f" in {net}" if net else ""
    if want_netdev:
        named = [d for d in facts.netdevs if d.name == want_netdev]
        if not named:
            return PinFinding(None, f"netdev {want_netdev} (from RANK*_CX7_IF) does not exist",
                              "fix or remove the RANK<n>_CX7_IF pin; `ip -br addr` on the node lists its netdevs")
        candidates = named
    else:
        candidates = [d for d in facts.netdevs if CX7_NAME.match(d.name)]
        if not candidates:
            return PinFinding(None, "no ConnectX-7 netdev (enp1s0f0np0-style name) on this node",
                              "check the CX7 driver (mlx5_core) and cabling, or pin RANK<n>_CX7_IF")
    usable = []
    for d in candidates:
        addrs = [a for a in d.ipv4 if net is None or a.ip in net]
        if d.is_up and addrs:
            usable.append((d, addrs[0]))
    if not usable:
        states = ", ".join(f"{d.name} {'up' if d.is_up else 'down'}"
                           f"{' ' + str(d.ipv4[0]) if d.ipv4 else ' no IPv4'}" for d in candidates)
        return PinFinding(None, f"no fabric netdev is up with an IPv4 address{where} ({states})",
                          "bring the fabric port up (`ip link set DEV up`) and give it its address, "
                          "or set FABRIC_SUBNET to the fabric network")
    if len(usable) > 1:
        names = ", ".join(f"{d.name} {a}" for d, a in usable)
        return PinFinding(None, f"several fabric netdevs qualify{where}: {names}",
                          "set FABRIC_SUBNET to the fabric network, or pin RANK<n>_CX7_IF on this rank")
    dev, addr = usable[0]
    if facts.hcas is None:
        return PinFinding(None, f"could not read RDMA devices ({facts.problems.get('infiniband', 'no data')})",
                          "check /sys/class/infiniband (rdma-core, mlx5_ib)")
    hca = hca_for_netdev(facts.hcas, dev.name)
    if hca is None:
        return PinFinding(None, f"no RDMA device is bound to {dev.name}",
                          "check that mlx5_ib is loaded: `ls /sys/class/infiniband/*/device/net/`")
    gids = hca.roce_v2_gid_candidates(addr.ip)
    if not gids:
        return PinFinding(None, f"{hca.name} has no RoCE v2 GID for {addr.ip} on {dev.name}",
                          f"check `cat /sys/class/infiniband/{hca.name}/ports/1/gid_attrs/types/*`; "
                          "the address may have just changed — run again")
    port, index = gids[0]
    return PinFinding(RankPins(fabric_ip=str(addr.ip), netdev=dev.name, rdma_dev=hca.name, gid_index=index))


def probe_node(node: Node, settings: Settings, *, with_model: bool = False,
               images: list[str] | None = None, df_paths: list[str] | None = None) -> NodeFacts:
    """Run node_facts.sh once on the node and parse it (one round trip)."""
    nonce = secrets.token_hex(8)
    args = probe_args(model=str(settings.model) if with_model else None, cluster=settings.cluster_name,
                      images=images or [], df_paths=df_paths or [])
    r = node.run_script(probe_script("node_facts.sh"), [nonce, *args], timeout=60)
    return node_facts_from_probe(r.stdout, nonce, expect_model=with_model)


def pins_from_facts(settings: Settings, facts: dict[str, NodeFacts | NodeError]) -> list[RankPins]:
    subnet = settings.get("FABRIC_SUBNET")
    pins: list[RankPins] = []
    problems: list[str] = []
    for rank, node in enumerate(settings.nodes):
        f = facts[node]
        if isinstance(f, NodeError):
            problems.append(f"rank {rank} ({node}): {f.message}")
            pins.append(RankPins())
            continue
        found = discover(f, subnet, settings.get(f"RANK{rank}_CX7_IF"))
        if found.pins is None:
            problems.append(f"rank {rank} ({node}): {found.problem}" + (f"\n    fix: {found.fix}" if found.fix else ""))
            pins.append(RankPins())
        else:
            pins.append(found.pins)
    if problems:
        raise CheckFailed("fabric pins could not be resolved:\n  " + "\n  ".join(problems))
    return pins


def live_pins(cluster: Cluster, settings: Settings) -> list[RankPins]:
    facts = cluster.run_all(lambda n: probe_node(n, settings), nodes=settings.nodes)
    return pins_from_facts(settings, facts)
