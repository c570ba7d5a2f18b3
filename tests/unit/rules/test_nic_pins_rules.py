"""The fabric discovery rule's claims, stated exactly
(what its mutation run, bench/mutation.py, showed untested).

Which netdev, RDMA device and RoCE v2 GID index each rank pins (`nic_pins.discover_fabric`, `check`'s `fabric`
row) and what `up` says when a rank cannot be pinned (`nic_pins.pins_from_facts`). The node facts are built
as the probe delivers them: `ip -j addr` JSON (the captured tests/fixtures/host/ip-j-addr.json: lo, ifb0/1,
eth0; the CX7 netdevs added in the same shape) through `facts.parse_ip_addr`, and the probe's walk of
/sys/class/infiniband through `facts.parse_infiniband`; the RANK<n>_* pins come from the settings, as a user
sets them. Names and numbers therefore reach the rule as separate objects, compared by value.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import CheckFailed, NodeError
from sparkctl.facts import node_facts as F
from sparkctl.rules.findings import FAIL, OK, WARN, Finding, Needs
from sparkctl.rules.nic_pins import discover_fabric, pins_from_facts
from sparkctl.spec.settings import RankPins, Settings, load_settings

CAPTURE = Path(__file__).resolve().parent.parent.parent / "fixtures" / "host" / "ip-j-addr.json"
NODES = ["spark1", "spark2", "spark3", "spark4"]
P0, P1 = ("enp1s0f0np0", "rocep1s0f0"), ("enp1s0f1np1", "rocep1s0f1")  # a DGX Spark's two QSFP ports
STALE = "remove stale RANK<n>_* pins from the env file; check writes the discovered ones"
FOUND = "spark1: enp1s0f0np0 192.168.100.1/24 rocep1s0f0 GID 3"  # check's words for spark("192.168.100.1")
PINNED = RankPins("192.168.100.1", "enp1s0f0np0", "rocep1s0f0", 3)  # and its pins


def port(netdev: str, *addrs: str, up: bool = True) -> dict[str, Any]:
    """One `ip -j addr` entry, shaped as the captured ones."""
    flags = ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"] if up else ["BROADCAST", "MULTICAST"]
    return {"ifname": netdev, "flags": flags, "mtu": 9000, "operstate": "UP" if up else "DOWN",
            "link_type": "ether",
            "addr_info": [{"family": "inet", "local": a.split("/")[0], "prefixlen": int(a.split("/")[1]),
                           "scope": "global", "label": netdev} for a in addrs]}  # fmt: skip


def hca(netdev: str, name: str, *gids: tuple[int, str, str]) -> list[str]:
    """The probe's infiniband records for RDMA device `name` (of `netdev`): (index, IPv4, type) per GID,
    after the two link-local ones a CX7 port always lists (0: RoCE v1, 1: RoCE v2)."""
    rows = [f"hca\t{name}", f"netdev\t{name}\t{netdev}", f"port\t{name}\t1\t4: ACTIVE\tEthernet"]
    link_local = "fe80:0000:0000:0000:0000:0000:0000:0001"
    for i, kind in ((0, "IB/RoCE v1"), (1, "RoCE v2")):
        rows.append(f"gid\t{name}\t1\t{i}\t{link_local}\t{kind}\t{netdev}")
    for index, ip, kind in gids:
        mapped = "0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}".format(*map(int, ip.split(".")))
        rows.append(f"gid\t{name}\t1\t{index}\t{mapped}\t{kind}\t{netdev}")
    return rows


def v2(ip: str, index: int = 3) -> tuple[tuple[int, str, str], tuple[int, str, str]]:
    """An address's two GIDs as the kernel adds them: RoCE v1 at index-1, RoCE v2 at index."""
    return (index - 1, ip, "IB/RoCE v1"), (index, ip, "RoCE v2")


def probed(netdevs: list[dict[str, Any]], records: list[list[str]]) -> F.NodeFacts:
    """A node's facts as the probe reports them: the captured `ip -j addr` plus `netdevs`, and the walk."""
    ip_addr = json.loads(CAPTURE.read_text()) + netdevs
    return F.NodeFacts(netdevs=F.parse_ip_addr(json.dumps(ip_addr)),
                       hcas=F.parse_infiniband("\n".join(r for rows in records for r in rows)))  # fmt: skip


def spark(ip: str, on: tuple[str, str] = P0, gid: int = 3, up: bool = True) -> F.NodeFacts:
    """A DGX Spark with its fabric address on one QSFP port, the other port down without an address."""
    other = P1 if on == P0 else P0
    devs = {on[0]: port(on[0], f"{ip}/24", up=up), other[0]: port(other[0], up=False)}
    return probed([devs[P0[0]], devs[P1[0]]], [hca(*P0, *(v2(ip, gid) if on == P0 else ())),
                                               hca(*P1, *(v2(ip, gid) if on == P1 else ()))])  # fmt: skip


def settings(**knobs: str) -> Settings:
    return load_settings(cli={}, environ={"NODES": " ".join(NODES), "MODEL": "/models/GLM-5.3-EXL3",
                                          "RECIPE": "glm53-exl3-tp4", "FABRIC_SUBNET": "192.168.100.0/24",
                                          **knobs})  # fmt: skip


def row(status: str, reason: str, fix: str = "", short: str = "enp1s0f0np0") -> Finding:
    """spark1's fabric row in check's table."""
    return Finding("spark1", "fabric", status, short, reason, fix)


def check_row(facts: F.NodeFacts, rank: int = 0, **knobs: str) -> tuple[Finding, RankPins | None]:
    """`check`'s fabric row for one rank, under the settings `knobs` give."""
    return discover_fabric(NODES[rank], rank, facts, Needs.from_settings(settings(**knobs)))


# ------------------------------------------------------------------ up: every rank pinned, or nothing started


def four_sparks() -> dict[str, F.NodeFacts | NodeError]:
    return {"spark1": spark("192.168.100.1"), "spark2": spark("192.168.100.2"),
            "spark3": spark("192.168.100.3", on=P1, gid=4), "spark4": spark("192.168.100.4")}  # fmt: skip


def test_up_pins_every_rank_in_rank_order() -> None:
    assert pins_from_facts(settings(), four_sparks()) == [
        RankPins("192.168.100.1", "enp1s0f0np0", "rocep1s0f0", 3),
        RankPins("192.168.100.2", "enp1s0f0np0", "rocep1s0f0", 3),
        RankPins("192.168.100.3", "enp1s0f1np1", "rocep1s0f1", 4),
        RankPins("192.168.100.4", "enp1s0f0np0", "rocep1s0f0", 3),
    ]


def test_up_pins_a_rank_whose_check_row_only_warns() -> None:
    """A stale RANK1_GID_INDEX is a warning, not a stop: `up` pins the GID it finds now."""
    pins = pins_from_facts(settings(RANK1_GID_INDEX="2"), four_sparks())
    assert pins[1] == RankPins("192.168.100.2", "enp1s0f0np0", "rocep1s0f0", 3)


def up_refuses(**changed: F.NodeFacts | NodeError) -> str:
    """What `up` says, before starting anything, when these nodes' facts replace the good ones."""
    with pytest.raises(CheckFailed) as exc:
        pins_from_facts(settings(), {**four_sparks(), **changed})
    return exc.value.message


def test_up_names_every_rank_it_cannot_pin_each_with_its_fix_and_starts_nothing() -> None:
    assert up_refuses(spark2=NodeError("spark2", "lost", "SSH connection lost"),
                      spark4=spark("192.168.100.4", up=False)) == (  # spark4: its cable pulled since `check`
        "fabric pins could not be resolved, nothing was started:\n"
        "  rank 1 (spark2): SSH connection lost\n"
        "  rank 3: spark4: fabric netdev enp1s0f0np0 (192.168.100.4/24) is DOWN\n"
        "    fix: bring it up on spark4 (`ip link set enp1s0f0np0 up`) and check its cable/QSFP link"
    )


def test_up_stops_on_one_rank_without_an_address_in_the_subnet() -> None:
    assert up_refuses(spark1=spark("192.168.200.1")) == (
        "fabric pins could not be resolved, nothing was started:\n"
        "  rank 0: spark1: no RDMA-backed netdev is up with an IPv4 address in "
        "FABRIC_SUBNET=192.168.100.0/24 (CX7 netdevs: enp1s0f0np0 192.168.200.1/24, enp1s0f1np1 no IPv4)\n"
        "    fix: give spark1's CX7 port its fabric address (e.g. `ip addr add ADDR/24 dev IFACE`), or fix "
        "FABRIC_SUBNET"
    )


# ------------------------------------------------------------------------------------ check's fabric row


def test_one_port_up_and_nothing_pinned_is_ok_and_says_what_was_found() -> None:
    assert check_row(spark("192.168.100.1")) == (row(OK, FOUND), PINNED)


def test_two_ports_up_warns_naming_the_other_and_the_one_used() -> None:
    both = probed([port(P0[0], "192.168.100.1/24"), port(P1[0], "192.168.100.11/24")],
                  [hca(*P0, *v2("192.168.100.1")), hca(*P1, *v2("192.168.100.11"))])  # fmt: skip
    finding, pins = check_row(both)
    assert finding == row(WARN, f"{FOUND}; also up with a fabric address: enp1s0f1np1 (using enp1s0f0np0)",
                          STALE)
    assert pins == PINNED


def test_a_pinned_netdev_is_the_only_candidate_even_when_another_port_comes_first() -> None:
    """RANK0_CX7_IF=enp1s0f0np0 while `ip addr` lists enp1s0f1np1 first, also up in the subnet."""
    f = probed([port(P1[0], "192.168.100.11/24"), port(P0[0], "192.168.100.1/24")],
               [hca(*P0, *v2("192.168.100.1")), hca(*P1, *v2("192.168.100.11", 5))])  # fmt: skip
    assert check_row(f, RANK0_CX7_IF="enp1s0f0np0") == (row(OK, FOUND), PINNED)


def test_an_address_outside_the_subnet_does_not_hide_the_next_one_on_the_same_port() -> None:
    """A port carrying a management address first and its fabric address second."""
    f = probed([port(P0[0], "10.20.0.7/24", "192.168.100.1/24"), port(P1[0], up=False)],
               [hca(*P0, *v2("10.20.0.7"), *v2("192.168.100.1", 5)), hca(*P1)])  # fmt: skip
    finding, pins = check_row(f)
    assert finding.status == OK and pins == RankPins("192.168.100.1", "enp1s0f0np0", "rocep1s0f0", 5)


def test_a_pinned_fabric_ip_picks_that_address_among_the_ports_addresses() -> None:
    """RANK0_FABRIC_IP names the port's second address; the first is in the subnet too."""
    f = probed([port(P0[0], "192.168.100.13/24", "192.168.100.12/24"), port(P1[0], up=False)],
               [hca(*P0, *v2("192.168.100.13"), *v2("192.168.100.12", 5)), hca(*P1)])  # fmt: skip
    assert check_row(f, RANK0_FABRIC_IP="192.168.100.12") == (
        row(OK, "spark1: enp1s0f0np0 192.168.100.12/24 rocep1s0f0 GID 5"),
        RankPins("192.168.100.12", "enp1s0f0np0", "rocep1s0f0", 5),
    )


def test_with_every_candidate_down_the_first_in_ip_order_is_named() -> None:
    """Both ports carry a fabric address and both are down: the message names the one `ip addr` lists first,
    the one discovery would have taken."""
    f = probed([port(P0[0], "192.168.100.1/24", up=False), port(P1[0], "192.168.100.11/24", up=False)],
               [hca(*P0, *v2("192.168.100.1")), hca(*P1, *v2("192.168.100.11"))])  # fmt: skip
    assert check_row(f) == (
        row(FAIL, "spark1: fabric netdev enp1s0f0np0 (192.168.100.1/24) is DOWN",
            "bring it up on spark1 (`ip link set enp1s0f0np0 up`) and check its cable/QSFP link",
            short="enp1s0f0np0 down"),
        None,
    )


def test_of_two_roce_v2_gids_for_the_address_the_lowest_index_is_pinned() -> None:
    f = probed([port(P0[0], "192.168.100.1/24"), port(P1[0], up=False)],
               [hca(*P0, *v2("192.168.100.1"), *v2("192.168.100.1", 7)), hca(*P1)])  # fmt: skip
    assert check_row(f) == (row(OK, FOUND), PINNED)


@pytest.mark.parametrize("given, found", [("3", 3), ("300", 300)])
def test_a_gid_index_pin_equal_to_the_discovered_one_is_not_stale(given: str, found: int) -> None:
    """Compared by value (300: an index past the small integers CPython shares, as a parsed one is)."""
    finding, pins = check_row(spark("192.168.100.1", gid=found), RANK0_GID_INDEX=given)
    assert finding.status == OK and pins is not None and pins.gid_index == found


@pytest.mark.parametrize("given", ["2", "4"])
def test_a_stale_gid_index_pin_warns_whichever_way_the_index_drifted(given: str) -> None:
    finding, pins = check_row(spark("192.168.100.1"), RANK0_GID_INDEX=given)
    assert finding == row(WARN, f"{FOUND}; RANK0_GID_INDEX={given} is set but the GID is now 3 (it drifts); "
                                "env.tp4 gets 3", STALE)
    assert pins is not None and pins.gid_index == 3


def test_a_cx7_ib_pin_naming_the_right_device_is_ok_and_the_other_port_s_warns() -> None:
    finding, _ = check_row(spark("192.168.100.1"), RANK0_CX7_IB="rocep1s0f0")
    assert finding.status == OK
    finding, pins = check_row(spark("192.168.100.1"), RANK0_CX7_IB="rocep1s0f1")
    assert finding == row(WARN, f"{FOUND}; RANK0_CX7_IB=rocep1s0f1 is set but enp1s0f0np0 belongs to "
                                "rocep1s0f0", STALE)
    assert pins is not None and pins.rdma_dev == "rocep1s0f0"


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_needs_without_given_pins_leave_every_rank_unpinned(rank: int) -> None:
    """`Needs.given_pins` defaults to (): a rank past the given pins is discovered as if none were pinned."""
    needs = replace(Needs.from_settings(settings()), given_pins=())
    finding, pins = discover_fabric("spark1", rank, spark("192.168.100.1"), needs)
    assert (finding, pins) == (row(OK, FOUND), PINNED)
