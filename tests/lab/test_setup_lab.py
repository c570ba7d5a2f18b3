"""`sparkctl setup` on a fresh lab (as a new owner has the nodes: fabric links cabled but without addresses, nothing
of setup's on them): the plan lists every change and changes nothing; `--yes` applies it; `check` then passes; a
second `setup` has nothing to change; a port taken down after fails `check` naming it and setup.

The lab gives each host its own root for setup's files (SPARKCTL_SETUP_ROOT in its sshd environment: setup on
the lab never writes this machine's /etc) and a stand-in for `netplan apply` that applies what the real
`netplan generate` made of setup's file (the hosts have no networkd). `faults.fresh_fabric` makes the lab fresh
and puts it back after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
ENV = {"NODES": " ".join(NODES), "CLUSTER_NAME": "setuptest"}


@pytest.fixture
def fresh(lab: Lab) -> Iterator[Lab]:
    from tests.lab.faults import fresh_fabric

    with fresh_fabric(lab):
        yield lab


def _sparkctl(lab: Lab, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env={**lab.env(), **ENV, **(env or {})},
                          capture_output=True, text=True, timeout=900)


def _plan(lab: Lab) -> dict[str, Any]:
    r = _sparkctl(lab, "setup", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_a_fresh_lab_reaches_a_passing_check_through_setup_alone(fresh: Lab) -> None:
    plan = _plan(fresh)
    kinds = {(c["node"], c.get("path") or c["command"]) for c in plan["changes"]}
    for n in NODES:
        for what in ("/etc/netplan/60-sparkctl-fabric.yaml", "/etc/security/limits.d/60-sparkctl.conf",
                     "/etc/default/earlyoom", "/etc/sparkctl/setuptest/fabric.json", "netplan apply"):
            assert (n, what) in kinds, (n, what, plan["changes"])
        assert (n, "/etc/sudoers.d/sparkctl") not in kinds  # the lab logs in as root: no sudo line needed
    assert plan["cabling"]["layout"] in ("switch", "ring", "direct pair")
    assert _plan(fresh)["changes"] == plan["changes"]  # planning changed nothing

    r = _sparkctl(fresh, "setup", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _sparkctl(fresh, "check", "--json", env={"FABRIC_SUBNET": plan["fabric_subnet"]})
    assert r.returncode == 0, r.stdout + r.stderr
    assert _plan(fresh)["changes"] == []
    audit = _sparkctl(fresh, "audit", "--json")
    assert "/etc/netplan/60-sparkctl-fabric.yaml" in audit.stdout


def test_a_port_taken_down_after_setup_fails_check_naming_it_and_setup(fresh: Lab) -> None:
    from tests.lab.faults import link_down

    assert _sparkctl(fresh, "setup", "--yes").returncode == 0
    host = fresh.host("spark2")
    with link_down(fresh, "spark2"):
        r = _sparkctl(fresh, "check", "--json")
    assert r.returncode == 1
    fabric = [f for f in json.loads(r.stdout)["findings"] if f["node"] == "spark2" and f["check"] == "fabric"]
    assert fabric and host.fabric_if in fabric[0]["reason"] and "sparkctl setup" in fabric[0]["fix"]


def test_the_plan_on_the_lab_finds_its_fabric_switch_and_changes_nothing(lab: Lab) -> None:
    """On the lab as it is (one fabric bridge, its hosts sharing this machine's files): discovery over real SSH and
    real IPv6 neighbour discovery names the switch segment with every host's cabled port, and plans the netplan
    file for each host; the plan writes nothing (no file appears, a second plan is the same)."""
    before = {p: os.path.exists(p) for p in ("/etc/netplan/60-sparkctl-fabric.yaml", "/etc/sudoers.d/sparkctl",
                                             "/etc/sparkctl/setuptest/fabric.json")}
    plan = _plan(lab)
    cab = plan["cabling"]
    assert cab["layout"] == "switch" and cab["errors"] == [], cab
    ends = {e.split(":")[0] for seg in cab["segments"] for e in seg}
    assert ends == set(NODES), cab
    for n in NODES:
        assert lab.host(n).fabric_if in {e.split(":")[1] for seg in cab["segments"] for e in seg if e.startswith(n + ":")}
        assert (n, "/etc/netplan/60-sparkctl-fabric.yaml") in {(c["node"], c.get("path")) for c in plan["changes"]}
    assert _plan(lab)["changes"] == plan["changes"]
    assert {p: os.path.exists(p) for p in before} == before


def test_a_neighbour_entry_whose_host_does_not_answer_is_not_a_cable(lab: Lab) -> None:
    """A cable moved a minute ago leaves its neighbour entry in the table (STALE) though nothing answers at that
    address any more: spark1's cabled port is given one naming spark2's second port (down, on no segment); the
    real ping and `ip neigh` of setup's discovery leave it out of every segment."""
    ns = "spark1"
    port = lab.host(ns).fabric_if
    link = json.loads(subprocess.run(["ip", "-n", "spark2", "-j", "link", "show", "dev", "enp1s0f1np1"],
                                     capture_output=True, text=True, check=True, timeout=10).stdout)[0]
    subprocess.run(["ip", "-n", ns, "-6", "neigh", "replace", "fe80::dead:1", "lladdr", link["address"], "dev", port,
                    "nud", "stale"], check=True, timeout=10)
    try:
        cab = _plan(lab)["cabling"]
    finally:
        subprocess.run(["ip", "-n", ns, "-6", "neigh", "del", "fe80::dead:1", "dev", port], check=False, timeout=10)
    ends = {e for seg in cab["segments"] for e in seg}
    assert "spark2:enp1s0f1np1" not in ends, cab
    assert cab["layout"] == "switch" and cab["errors"] == [], cab


RING_CROSSED = [("spark1", 1, "spark3", 0), ("spark3", 1, "spark2", 0), ("spark2", 1, "spark4", 0), ("spark4", 1, "spark1", 0)]
RING = [("spark1", 1, "spark2", 0), ("spark2", 1, "spark3", 0), ("spark3", 1, "spark4", 0), ("spark4", 1, "spark1", 0)]


def test_a_ring_cabled_across_nodes_order_is_named_with_the_move(fresh: Lab) -> None:
    """Four cables, no switch, in the ring spark1 -> spark3 -> spark2 -> spark4: found by real neighbour discovery
    over each cable, named a ring, and for NODES' order (TP 4) the move is said exactly: the NODES order of the
    cables, and the two cables between ranks that are not neighbours."""
    from sparkctl.lab.state import PORT_IFS
    from tests.lab.faults import recabled

    with recabled(fresh, RING_CROSSED):
        cab = _plan(fresh)["cabling"]
    assert cab["layout"] == "ring" and cab["errors"] == [], cab
    got = {frozenset(seg) for seg in cab["segments"]}
    assert got == {frozenset({f"{a}:{PORT_IFS[i]}", f"{b}:{PORT_IFS[j]}"}) for a, i, b, j in RING_CROSSED}, cab
    assert len(cab["moves"]) == 1, cab
    move = cab["moves"][0]
    assert "crossed" in move and "NODES='spark1 spark3 spark2 spark4'" in move, move
    assert f"spark1:{PORT_IFS[1]} <-> spark3:{PORT_IFS[0]}" in move and f"spark2:{PORT_IFS[1]} <-> spark4:{PORT_IFS[0]}" in move


def test_a_ring_in_order_is_set_up_and_its_slow_cable_warned(fresh: Lab, tmp_path: Path) -> None:
    """The ring in NODES' order, one cable shaped to 100 Mbit/s (tc): nothing to move; `setup --yes --speed`
    addresses every cable's two ends (a /30 each) and measures each cable with the real iperf3 over them; the
    slow one, and only it, is a warning naming both its ends (the recipe's floor here: 0.5 Gbit/s, five times the
    slow cable's rate and far below what a veth carries even on a busy machine), not a failure."""
    from sparkctl.lab.state import PORT_IFS
    from tests.lab.faults import recabled

    recipe = tmp_path / "lab-floor.toml"
    text = (Path(__file__).resolve().parents[2] / "launcher/sparkctl/recipes/lab.toml").read_text()
    recipe.write_text(text.replace("[fabric]", "[fabric]\nbusbw_floor_gbps = 0.0625", 1))
    with recabled(fresh, RING, slow={2: "100mbit"}):
        plan = _plan(fresh)
        assert plan["cabling"]["layout"] == "ring" and plan["cabling"]["moves"] == [], plan["cabling"]
        r = _sparkctl(fresh, "--json", "setup", "--yes", "--speed", env={"RECIPE": str(recipe)})
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    speeds = {c["cable"]: c["gbit_per_s"] for c in doc["cables"]}
    slow = f"spark3:{PORT_IFS[1]} <-> spark4:{PORT_IFS[0]}"
    assert len(speeds) == 4 and all(v for v in speeds.values()), doc["cables"]
    assert speeds[slow] < 0.15 and all(v > 0.5 for c, v in speeds.items() if c != slow), speeds
    assert [w.split(":")[0] for w in doc["speed_warnings"]] == [f"cable {slow.split(':')[0]}"], doc["speed_warnings"]
    assert slow in doc["speed_warnings"][0] and "below the recipe's floor" in doc["speed_warnings"][0]
