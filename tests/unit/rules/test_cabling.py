"""The cabling from what each port saw: segments, the layout's name, and exactly what to move."""

from __future__ import annotations

from sparkctl.facts.setup_facts import Port
from sparkctl.rules.cabling import find_cabling

PORTS = ("p0", "p1")


def mac(node: int, port: int) -> str:
    return f"02:00:00:00:{node:02x}:{port:02x}"


def scene(nodes: list[str], cables: list[tuple[int, int, int, int]]) -> tuple[dict, dict]:
    """nodes' two ports each; cables (node a, port a, node b, port b) by index: each end sees the other."""
    ports = {n: [Port(p, f"hca{j}", mac(i, j)) for j, p in enumerate(PORTS)] for i, n in enumerate(nodes)}
    neigh: dict[str, dict[str, list[str]]] = {n: {} for n in nodes}
    for a, pa, b, pb in cables:
        neigh[nodes[a]].setdefault(PORTS[pa], []).append(mac(b, pb))
        neigh[nodes[b]].setdefault(PORTS[pb], []).append(mac(a, pa))
    return ports, neigh


N4 = ["s1", "s2", "s3", "s4"]


def test_a_ring_in_nodes_order_carries_tp4_and_each_cable_is_named() -> None:
    ports, neigh = scene(N4, [(0, 1, 1, 0), (1, 1, 2, 0), (2, 1, 3, 0), (3, 1, 0, 0)])
    c = find_cabling(N4, ports, neigh, N4)
    assert c.layout == "ring" and not c.moves and not c.errors
    assert [s.describe() for s in c.segments] == ["s1:p0 <-> s4:p1", "s1:p1 <-> s2:p0", "s2:p1 <-> s3:p0",
                                                  "s3:p1 <-> s4:p0"]
    assert c.peers("s2", "p1") == [("s3", "p0")]


def test_crossed_cables_name_the_nodes_order_that_matches_and_the_cables_to_move() -> None:
    # s1-s3, s3-s2, s2-s4, s4-s1: a ring, but not in NODES' order
    ports, neigh = scene(N4, [(0, 1, 2, 0), (2, 1, 1, 0), (1, 1, 3, 0), (3, 1, 0, 0)])
    c = find_cabling(N4, ports, neigh, N4)
    assert c.layout == "ring"
    assert len(c.moves) == 1
    assert "NODES='s1 s3 s2 s4'" in c.moves[0] and "s1:p1 <-> s3:p0" in c.moves[0]


def test_a_line_says_which_ports_close_the_ring() -> None:
    ports, neigh = scene(N4, [(0, 1, 1, 0), (1, 1, 2, 0), (2, 1, 3, 0)])
    c = find_cabling(N4, ports, neigh, N4)
    assert c.layout == "line"
    assert c.moves == ["cable s4:p1 to s1:p0 (ranks 3 and 0 are neighbours in the ring)"]


def test_a_direct_pair_carries_tp2_but_a_third_node_without_cable_is_named() -> None:
    ports, neigh = scene(["a", "b", "c"], [(0, 0, 1, 0)])
    assert find_cabling(["a", "b"], {k: ports[k] for k in "ab"}, neigh, ["a", "b"]).layout == "direct pair"
    c = find_cabling(["a", "b", "c"], ports, neigh, ["a", "b", "c"])
    assert c.moves and c.moves[0].startswith("c has no cabled CX7 port: cable c:p0 to a:")


def test_a_switch_is_one_segment_and_carries_any_tp() -> None:
    ports = {n: [Port("p0", "h", mac(i, 0))] for i, n in enumerate(N4)}
    neigh = {n: {"p0": [mac(j, 0) for j in range(4) if j != i]} for i, n in enumerate(N4)}
    c = find_cabling(N4, ports, neigh, N4)
    assert c.layout == "switch" and len(c.segments) == 1 and len(c.segments[0].ends) == 4 and not c.moves


def test_both_ports_of_a_node_on_one_switch_are_one_segment_not_a_cable_to_itself() -> None:
    """Every port of every node on one switch: each port also sees its own node's other port, and that is a
    shared segment (as the lab's fabric bridge is), not a loop cable."""
    macs = [mac(i, j) for i in range(4) for j in range(2)]
    ports = {n: [Port(p, f"hca{j}", mac(i, j)) for j, p in enumerate(PORTS)] for i, n in enumerate(N4)}
    neigh = {n: {p: [m for m in macs if m != mac(i, j)] for j, p in enumerate(PORTS)} for i, n in enumerate(N4)}
    c = find_cabling(N4, ports, neigh, N4)
    assert c.errors == [] and c.layout == "switch" and len(c.segments) == 1 and len(c.segments[0].ends) == 8


def test_a_port_cabled_to_its_own_node_is_an_error_naming_both_ports_once() -> None:
    ports, neigh = scene(["a", "b"], [(0, 0, 0, 1)])
    c = find_cabling(["a", "b"], ports, neigh, ["a", "b"])
    assert c.errors == ["a: port p0 is cabled to its own port p1: move one end of that cable to a CX7 port "
                        "of another node"]


def test_a_mac_of_no_cx7_port_is_not_a_peer() -> None:
    ports, neigh = scene(["a", "b"], [])
    neigh["a"]["p0"] = ["aa:bb:cc:dd:ee:ff"]
    c = find_cabling(["a", "b"], ports, neigh, ["a", "b"])
    assert c.layout == "none" and c.segments == []


def test_pcie_twins_of_one_physical_port_are_one_end_of_one_cable() -> None:
    """A GB10's QSFP port is two netdevs (enp1s0f0np0, enP2p1s0f0np0); over one cable all four twins see
    each other: that is one cable between the two nodes' primaries, not a switch."""
    names = ("enp1s0f0np0", "enP2p1s0f0np0", "enp1s0f1np1", "enP2p1s0f1np1")
    ports = {n: [Port(p, f"h{j}", mac(i, j)) for j, p in enumerate(names)] for i, n in enumerate(["a", "b"])}
    neigh = {n: {names[0]: [mac(1 - i, 0), mac(1 - i, 1)], names[1]: [mac(1 - i, 0), mac(1 - i, 1)]}
             for i, n in enumerate(["a", "b"])}
    c = find_cabling(["a", "b"], ports, neigh, ["a", "b"])
    assert c.layout == "direct pair" and [s.describe() for s in c.segments] == ["a:enp1s0f0np0 <-> b:enp1s0f0np0"]


def test_a_slow_cable_is_a_warning_naming_both_ends_and_what_to_try() -> None:
    from sparkctl.rules.cabling import judge_speeds

    w = judge_speeds({"a:p0 <-> b:p0": 12.5, "a:p1 <-> c:p0": 180.0, "b:p1 <-> c:p1": "iperf3 is not installed"}, 40)
    assert w[0].startswith("cable a:p0 <-> b:p0: 12.5 Gbit/s, below the recipe's floor of 40 Gbit/s: reseat")
    assert w[1] == "cable b:p1 <-> c:p1: not measured (iperf3 is not installed)" and len(w) == 2
    assert judge_speeds({"a:p0 <-> b:p0": 1.0}, 0) == []  # no floor: reported, not warned
