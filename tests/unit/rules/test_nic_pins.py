from __future__ import annotations

import ipaddress
from types import SimpleNamespace

from sparkctl.facts.node_facts import Gid, Hca, IbPort, NetDev, NodeFacts
from sparkctl.rules.findings import FAIL, Needs
from sparkctl.rules.nic_pins import discover_fabric
from sparkctl.spec.settings import RankPins

UP = ("BROADCAST", "MULTICAST", "UP", "LOWER_UP")
DOWN = ("BROADCAST", "MULTICAST")


def dev(name: str, ip: str | None, up: bool = True) -> NetDev:
    return NetDev(name, "UP" if up else "DOWN", UP if up else DOWN,
                  (ipaddress.IPv4Interface(ip),) if ip else ())


def hca(name: str, netdev: str, ip: str, index: int, kind: str = "RoCE v2") -> Hca:
    mapped = "0000:0000:0000:0000:0000:ffff:" + "{:02x}{:02x}:{:02x}{:02x}".format(*map(int, ip.split(".")))
    gids = (Gid(0, "fe80:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1"),
            Gid(index - 1, mapped, "IB/RoCE v1"), Gid(index, mapped, kind))
    return Hca(name, (netdev,), (IbPort(1, "ACTIVE", "Ethernet", gids),))


def facts(devs: list[NetDev], hcas: list[Hca]) -> NodeFacts:
    return NodeFacts(netdevs=[dev("lo", "127.0.0.1/8"), dev("eth0", "10.0.0.5/24"), *devs], hcas=hcas)


def discover(f: NodeFacts, subnet: str | None = None, netdev: str | None = None):
    """nic_pins.discover_fabric as `up` and `check` both use it, for rank 0 of a one-node cluster."""
    needs = Needs(nofile=1024, memlock_bytes=-1, gpus_per_node=1, port=8888, master_port=29501,
                  fabric_subnet=ipaddress.IPv4Network(subnet) if subnet else None, image="i", cluster="c",
                  model="/m", given_pins=(RankPins(netdev=netdev),))
    finding, pins = discover_fabric("n1", 0, f, needs)
    return SimpleNamespace(
        pins=pins, problem=None if pins else finding.text, fix=finding.fix, failed=finding.status == FAIL)


def test_first_port_node():
    f = facts([dev("enp1s0f0np0", "192.168.100.1/24"), dev("enp1s0f1np1", None, up=False)],
              [hca("rocep1s0f0", "enp1s0f0np0", "192.168.100.1", 3), hca("rocep1s0f1", "enp1s0f1np1", "0.0.0.0", 3)])
    found = discover(f, "192.168.100.0/24")
    assert found.pins is not None
    assert (found.pins.netdev, found.pins.rdma_dev, found.pins.gid_index, found.pins.fabric_ip) == (
        "enp1s0f0np0", "rocep1s0f0", 3, "192.168.100.1")


def test_address_on_second_port_with_drifted_gid():
    f = facts([dev("enP2p1s0f0np0", None), dev("enP2p1s0f1np1", "192.168.100.3/24")],
              [hca("roceP2p1s0f0", "enP2p1s0f0np0", "0.0.0.0", 3), hca("roceP2p1s0f1", "enP2p1s0f1np1",
                                                                        "192.168.100.3", 5)])
    found = discover(f, None)
    assert found.pins is not None
    assert (found.pins.netdev, found.pins.rdma_dev, found.pins.gid_index) == ("enP2p1s0f1np1", "roceP2p1s0f1", 5)


def test_interface_down_is_a_problem_naming_it():
    f = facts([dev("enp1s0f0np0", "192.168.100.1/24", up=False)], [hca("rocep1s0f0", "enp1s0f0np0",
                                                                        "192.168.100.1", 3)])
    found = discover(f, "192.168.100.0/24")
    assert found.pins is None and "enp1s0f0np0" in (found.problem or "") and "DOWN" in (found.problem or "")
    assert "ip link set enp1s0f0np0 up" in found.fix


def test_two_candidates_need_a_subnet():
    f = facts([dev("enp1s0f0np0", "192.168.100.1/24"), dev("enp1s0f1np1", "192.168.200.1/24")],
              [hca("rocep1s0f0", "enp1s0f0np0", "192.168.100.1", 3), hca("rocep1s0f1", "enp1s0f1np1",
                                                                           "192.168.200.1", 3)])
    first = discover(f)  # both qualify: the first is taken, with a warning naming the other
    assert first.pins is not None and first.pins.netdev == "enp1s0f0np0" and not first.failed
    found = discover(f, "192.168.200.0/24")
    assert found.pins is not None and found.pins.netdev == "enp1s0f1np1"


def test_pinned_netdev_is_used_and_must_exist():
    f = facts([dev("enp1s0f0np0", "192.168.100.1/24"), dev("enp1s0f1np1", "192.168.200.1/24")],
              [hca("rocep1s0f0", "enp1s0f0np0", "192.168.100.1", 3), hca("rocep1s0f1", "enp1s0f1np1",
                                                                           "192.168.200.1", 4)])
    found = discover(f, None, "enp1s0f1np1")
    assert found.pins is not None and found.pins.gid_index == 4
    assert "RANK0_CX7_IF=enp9s0f0np0" in (discover(f, None, "enp9s0f0np0").problem or "")


def test_gid_without_roce_v2_type_is_not_taken_as_zero():
    f = facts([dev("enp1s0f0np0", "192.168.100.1/24")],
              [hca("rocep1s0f0", "enp1s0f0np0", "192.168.100.1", 3, kind="")])
    found = discover(f)
    assert found.pins is None and "no RoCE v2 GID" in (found.problem or "")


def test_missing_hca_and_unreadable_facts():
    assert "no RDMA device" in (discover(facts([dev("enp1s0f0np0", "10.1.0.1/24")], [])).problem or "")
    assert "could not read" in (discover(NodeFacts(problems={"ip-addr": "boom"})).problem or "")
