"""Per-rank NIC pins (netdev, RDMA device, RoCE v2 GID index, fabric address): the one discovery rule,
used by `check` and `up` alike. Pure: facts in, pins and findings out.

`discover_fabric` turns one node's facts into its pins and the `fabric` finding `check` shows. The GID
index drifts at runtime and a port can go down between `check` and `up`, so `up` re-reads every node
(`orchestrate.node_probe.probe_node`: one node_facts.sh round trip each) and applies the same rule
(`pins_from_facts`). A rank whose pins cannot be resolved stops `up` before anything starts.
"""

from __future__ import annotations

from ..errors import CheckFailed, NodeError
from ..facts import node_facts as F
from ..facts.node_facts import NodeFacts
from ..spec.settings import RankPins, Settings
from .findings import FAIL, OK, WARN, Finding, Needs, finding, unknown


def discover_fabric(
    node: str, rank: int, facts: F.NodeFacts, needs: Needs
) -> tuple[Finding, RankPins | None]:
    """Find this rank's fabric pins: the RDMA-backed netdev that is up with an IPv4 address (in
    FABRIC_SUBNET when set; the one RANKn_CX7_IF / RANKn_FABRIC_IP names when pinned), its RDMA device,
    and the RoCE v2 GID index of that address. Names differ across nodes: nothing is assumed."""
    if facts.netdevs is None:
        return unknown(node, "fabric", facts, "ip-addr"), None
    if facts.hcas is None or not facts.hcas:
        why = facts.problems.get("infiniband", "no RDMA devices")
        return finding(
            node,
            "fabric",
            FAIL,
            "no RDMA device",
            f"{node}: no RDMA devices: {why}",
            f"install the CX7 driver (mlx5) on {node}; /sys/class/infiniband must list its ports",
        ), None
    given = needs.given_pins[rank] if rank < len(needs.given_pins) else RankPins()
    rdma_backed = {nd for h in facts.hcas for nd in h.netdevs}
    candidates = []  # (netdev, address)
    for dev in facts.netdevs:
        if dev.name not in rdma_backed or (given.netdev and dev.name != given.netdev):
            continue
        for addr in dev.ipv4:
            if needs.fabric_subnet and addr.ip not in needs.fabric_subnet:
                continue
            if given.fabric_ip and str(addr.ip) != given.fabric_ip:
                continue
            candidates.append((dev, addr))
    where = f" in FABRIC_SUBNET={needs.fabric_subnet}" if needs.fabric_subnet else ""
    pinned = [
        f"RANK{rank}_{k}={v}" for k, v in (("CX7_IF", given.netdev), ("FABRIC_IP", given.fabric_ip)) if v
    ]
    if pinned:
        where += f" matching the pinned {' '.join(pinned)}"
    up = [(d, a) for d, a in candidates if d.is_up]
    if not up:
        if candidates:
            dev, addr = candidates[0]
            return finding(
                node,
                "fabric",
                FAIL,
                f"{dev.name} down",
                f"{node}: fabric netdev {dev.name} ({addr}) is {dev.operstate}",
                f"bring it up on {node} (`ip link set {dev.name} up`) and check its cable/QSFP link",
            ), None
        have = (
            ", ".join(
                f"{d.name} {'/'.join(str(a) for a in d.ipv4) or 'no IPv4'}"
                for d in facts.netdevs
                if d.name in rdma_backed
            )
            or "none"
        )
        return finding(
            node,
            "fabric",
            FAIL,
            "no fabric IP",
            f"{node}: no RDMA-backed netdev is up with an IPv4 address{where} (CX7 netdevs: {have})",
            f"give {node}'s CX7 port its fabric address (e.g. `ip addr add ADDR/24 dev IFACE`), or fix "
            "FABRIC_SUBNET",
        ), None
    dev, addr = up[0]
    hca = F.hca_for_netdev(facts.hcas, dev.name)
    assert hca is not None  # candidates are RDMA-backed
    gids = hca.roce_v2_gid_candidates(addr.ip)
    if not gids:
        return finding(
            node,
            "fabric",
            FAIL,
            "no RoCE v2 GID",
            f"{node}: {hca.name} has no RoCE v2 GID for {addr.ip} "
            f"({dev.name}); an empty NCCL_IB_GID_INDEX would silently mean index 0",
            f"check {node}'s RoCE configuration (`show_gids`); the address must be on {dev.name} itself",
        ), None
    _, gid = gids[0]
    pins = RankPins(fabric_ip=str(addr.ip), netdev=dev.name, rdma_dev=hca.name, gid_index=gid)
    desc = f"{dev.name} {addr} {hca.name} GID {gid}"
    notes = []
    if len(up) > 1:
        notes.append(
            f"also up with a fabric address: {', '.join(d.name for d, _ in up[1:])} (using {dev.name})"
        )
    if given.gid_index is not None and given.gid_index != gid:
        notes.append(
            f"RANK{rank}_GID_INDEX={given.gid_index} is set but the GID is now {gid} (it drifts); "
            f"env.tp4 gets {gid}"
        )
    if given.rdma_dev and given.rdma_dev != hca.name:
        notes.append(f"RANK{rank}_CX7_IB={given.rdma_dev} is set but {dev.name} belongs to {hca.name}")
    if notes:
        return finding(
            node,
            "fabric",
            WARN,
            dev.name,
            f"{node}: {desc}; " + "; ".join(notes),
            "remove stale RANK<n>_* pins from the env file; check writes the discovered ones",
        ), pins
    return finding(node, "fabric", OK, dev.name, f"{node}: {desc}"), pins


def pins_from_facts(settings: Settings, facts: dict[str, NodeFacts | NodeError]) -> list[RankPins]:
    needs = Needs.from_settings(settings)
    pins: list[RankPins] = []
    problems: list[str] = []
    for r in settings.service.ranks:  # one service: a replica view, or the only replica
        rank, node = r.rank, r.node
        f = facts[node]
        if isinstance(f, NodeError):
            problems.append(f"rank {rank} ({node}): {f.reason}")
            pins.append(RankPins())
            continue
        finding, found = discover_fabric(node, rank, f, needs)
        if found is None or finding.status == FAIL:
            problems.append(f"rank {rank}: {finding.text}" + (f"\n    fix: {finding.fix}" if finding.fix else ""))
            pins.append(RankPins())
        else:
            pins.append(found)
    if problems:
        raise CheckFailed("fabric pins could not be resolved, nothing was started:\n  " + "\n  ".join(problems))
    return pins
