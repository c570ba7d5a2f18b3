"""The files setup wants on a node, judged by the real tools (netplan generate on a temp root, visudo -cf),
the addresses (stable, inside FABRIC_SUBNET, never the SSH interface) and the plan (what is right, what changes)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sparkctl.facts.setup_facts import Port, SetupFacts
from sparkctl.rules.cabling import find_cabling
from sparkctl.spec import setup_plan as sp
from tests.unit.rules.test_cabling import N4, scene

NEED = pytest.mark.skipif(os.environ.get("CI") != "true" and not (shutil.which("netplan") and shutil.which("visudo")),
                          reason="needs netplan (netplan.io) and visudo (sudo)")


def ring4() -> tuple[dict, object]:
    ports, neigh = scene(N4, [(0, 1, 1, 0), (1, 1, 2, 0), (2, 1, 3, 0), (3, 1, 0, 0)])
    return ports, find_cabling(N4, ports, neigh, N4)


def test_addresses_are_one_30_per_cable_in_order_and_the_same_on_every_run() -> None:
    _, c = ring4()
    net = ipaddress.IPv4Network("192.168.100.0/24")
    a = sp.allocate(c, net)
    assert a == sp.allocate(c, net)
    assert str(a[("s1", "p0")]) == "192.168.100.1/30" and str(a[("s4", "p1")]) == "192.168.100.2/30"
    assert str(a[("s1", "p1")]) == "192.168.100.5/30" and str(a[("s2", "p0")]) == "192.168.100.6/30"
    assert len({x.network for x in a.values()}) == 4 and all(x.network.subnet_of(net) for x in a.values())


def test_a_node_with_both_ports_on_one_switch_gets_one_address_there() -> None:
    """Two addresses of one subnet on two ports of one host make Linux answer and route through either (on the
    lab a rank could not reach the head): on one segment a node's first port gets the address, its other none."""
    from sparkctl.facts.setup_facts import Port as SPort
    from tests.unit.rules.test_cabling import PORTS, mac

    macs = [mac(i, j) for i in range(4) for j in range(2)]
    ports = {n: [SPort(p, f"hca{j}", mac(i, j)) for j, p in enumerate(PORTS)] for i, n in enumerate(N4)}
    neigh = {n: {p: [m for m in macs if m != mac(i, j)] for j, p in enumerate(PORTS)} for i, n in enumerate(N4)}
    c = find_cabling(N4, ports, neigh, N4)
    a = sp.allocate(c, ipaddress.IPv4Network("192.168.100.0/24"))
    assert sorted(a) == [(n, PORTS[0]) for n in N4]
    assert [str(a[(n, PORTS[0])]) for n in N4] == [f"192.168.100.{i}/24" for i in (1, 2, 3, 4)]


def test_a_subnet_too_small_or_overlapping_the_management_network_is_refused_with_one_line() -> None:
    _, c = ring4()
    with pytest.raises(sp.SetupInputError, match="too small"):
        sp.allocate(c, ipaddress.IPv4Network("192.168.100.0/29"))
    with pytest.raises(sp.SetupInputError, match="overlaps the management network 192.168.0.0/16"):
        sp.check_subnet("192.168.100.0/24", ["192.168.0.0/16"])
    with pytest.raises(sp.SetupInputError, match="not an IPv4 network"):
        sp.check_subnet("300.1.2.0/24", [])
    assert str(sp.check_subnet("10.9.0.0/24", ["192.168.1.0/24"])) == "10.9.0.0/24"


def netplan_generated(root: Path, text: str) -> Path:
    """`text` as setup's netplan file under root, turned into networkd's files by the real `netplan generate`:
    the folder they are in."""
    (root / "etc/netplan").mkdir(parents=True)
    f = root / "etc/netplan/60-sparkctl-fabric.yaml"
    f.write_text(text)
    f.chmod(0o600)
    subprocess.run(["netplan", "generate", "--root-dir", str(root)], check=True, capture_output=True)
    return root / "run/systemd/network"


@NEED
def test_the_netplan_file_is_what_netplan_generate_derives_addresses_and_mtu_from(tmp_path: Path) -> None:
    text = sp.render_netplan("c", {"p1": ipaddress.IPv4Interface("192.168.100.5/30"),
                                   "p0": ipaddress.IPv4Interface("192.168.100.1/30")})
    netplan_generated(tmp_path, text)
    net = (tmp_path / "run/systemd/network/10-netplan-p0.network").read_text()
    assert "Address=192.168.100.1/30" in net
    assert "MTUBytes=9000" in (tmp_path / "run/systemd/network/10-netplan-p0.link").read_text() + net
    assert "Address=192.168.100.5/30" in (tmp_path / "run/systemd/network/10-netplan-p1.network").read_text()


@NEED
def test_the_sudoers_drop_in_passes_visudo_and_holds_exactly_the_drop_caches_line(tmp_path: Path) -> None:
    f = tmp_path / "sparkctl"
    f.write_text(sp.render_sudoers("c", "spark"))
    f.chmod(0o440)
    subprocess.run(["visudo", "-cf", str(f)], check=True, capture_output=True)
    rules = [ln for ln in f.read_text().splitlines() if ln and not ln.startswith("#")]
    assert rules == ["spark ALL=(root) NOPASSWD: /usr/bin/tee /proc/sys/vm/drop_caches"]


def test_earlyoom_prefers_the_engine_and_never_sshd_or_dockerd() -> None:
    import re

    text = sp.render_earlyoom("c")
    args = text.split('EARLYOOM_ARGS="', 1)[1].rstrip('"\n').split()
    prefer, avoid = re.compile(args[args.index("--prefer") + 1]), re.compile(args[args.index("--avoid") + 1])
    for name in ("vllm", "python3", "pt_main_thread", "VLLM::Worker"):
        assert prefer.search(name) and not avoid.search(name)
    for name in ("sshd", "dockerd", "containerd", "containerd-shim-runc-v2", "systemd", "systemd-journald"):
        assert avoid.search(name) and not prefer.search(name)
    assert "'" not in text  # systemd's EnvironmentFile keeps quotes inside a value: none there


def _facts(name: str, ports: list[Port], **kw: object) -> SetupFacts:
    f = SetupFacts(user="spark", uid=1000, groups=("spark",), sudo=True, machine_id=name * 32, ports=ports,
                   earlyoom=False, ctk=True, docker_group=True, files={})
    for k, v in kw.items():
        setattr(f, k, v)
    return f


def test_the_plan_lists_every_change_then_nothing_once_the_files_and_state_match() -> None:
    ports, c = ring4()
    addrs = sp.allocate(c, ipaddress.IPv4Network("192.168.100.0/24"))
    want = sp.Wanted("c", tuple(N4), 1048576, -1)
    facts = {n: _facts(n[-1], ports[n], ssh_iface="eth0") for n in N4}
    plans = sp.plan_setup(want, facts, c, addrs)
    s1 = plans["s1"]
    assert [ch.path for ch in s1.changes if ch.path] == [sp.NETPLAN_PATH, sp.SUDOERS_PATH, sp.LIMITS_PATH,
                                                          sp.EARLYOOM_PATH, sp.fabric_doc_path("c")]
    assert [ch.command for ch in s1.changes if ch.command] == [
        "netplan apply", "usermod -aG docker spark", sp.COMMANDS["install-earlyoom"], "systemctl restart earlyoom"]
    # the node as setup leaves it: the files' hashes, the addresses live, docker group, earlyoom installed
    for n in N4:
        f = facts[n]
        f.files = {d.path: sp.sha256(d.content) for d in plans[n].files}
        f.ports = [Port(p.name, p.hca, p.mac, 9000, True, True, None, (str(addrs[(n, p.name)]),)) for p in f.ports]
        f.groups, f.earlyoom = ("spark", "docker"), True
    again = sp.plan_setup(want, facts, c, addrs)
    assert [ch for p in again.values() for ch in p.changes] == []
    # an address changed by hand: netplan apply again, and only that
    f = facts["s2"]
    f.ports = [Port(p.name, p.hca, p.mac, 9000, True, True, None, ("10.0.0.1/24",)) for p in f.ports]
    assert [ch.command for ch in sp.plan_setup(want, facts, c, addrs)["s2"].changes] == ["netplan apply"]


def test_the_ssh_interface_never_gets_a_fabric_address() -> None:
    ports, c = ring4()
    addrs = sp.allocate(c, ipaddress.IPv4Network("192.168.100.0/24"))
    want = sp.Wanted("c", tuple(N4), 1048576, -1)
    facts = {n: _facts(n[-1], ports[n], ssh_iface="p0" if n == "s1" else "eth0") for n in N4}
    plan = sp.plan_setup(want, facts, c, addrs)["s1"]
    netplan = next(d for d in plan.files if d.path == sp.NETPLAN_PATH).content
    assert "    p1:" in netplan and "    p0:" not in netplan
    assert any("p0 carries the SSH session" in w for w in plan.warnings)


def test_without_passwordless_sudo_the_plan_gives_the_exact_commands_by_hand() -> None:
    ports, c = ring4()
    addrs = sp.allocate(c, ipaddress.IPv4Network("192.168.100.0/24"))
    want = sp.Wanted("c", tuple(N4), 1048576, -1)
    facts = {n: _facts(n[-1], ports[n], sudo=False) for n in N4}
    plan = sp.plan_setup(want, facts, c, addrs)["s3"]
    assert not plan.privileged
    lines = plan.by_hand()
    assert any(ln.endswith(f"| sudo install -D -m 440 /dev/stdin {sp.SUDOERS_PATH}") for ln in lines)
    assert f"sudo visudo -cf {sp.SUDOERS_PATH} || sudo rm -f {sp.SUDOERS_PATH}" in lines
    assert "sudo usermod -aG docker spark" in lines


def test_a_node_without_cx7_or_two_nodes_with_one_machine_id_are_refused() -> None:
    ports, _ = ring4()
    facts = {n: _facts(n[-1], ports[n]) for n in N4}
    facts["s3"].ports = []
    with pytest.raises(sp.SetupInputError, match="^s3: no ConnectX-7 port"):
        sp.refuse_bad_nodes(N4, facts)
    facts["s3"].ports = ports["s3"]
    facts["s4"].machine_id = facts["s2"].machine_id
    with pytest.raises(sp.SetupInputError, match="^s2 and s4 have one machine-id"):
        sp.refuse_bad_nodes(N4, facts)


@NEED
def test_a_port_without_an_address_still_gets_jumbo_frames_as_netplan_reads_it(tmp_path: Path) -> None:
    """A node's second port on a segment that has its first: in the netplan file with MTU 9000 and no address;
    the real `netplan generate` gives it MTUBytes=9000 and no Address= (a peer's jumbo frame that reaches that
    port, through ARP's any-port answers, is not dropped)."""
    out = netplan_generated(tmp_path, sp.render_netplan("c", {"p0": ipaddress.IPv4Interface("192.168.100.1/24"),
                                                             "p1": None}))
    p1 = (out / "10-netplan-p1.network").read_text()
    assert "MTUBytes=9000" in p1 and "Address=" not in p1
    assert "Address=192.168.100.1/24" in (out / "10-netplan-p0.network").read_text()
