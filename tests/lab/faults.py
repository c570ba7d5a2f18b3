"""Real faults on lab hosts, each undone on exit (use in a `with` block)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from sparkctl.lab import hosts
from sparkctl.lab.proc import read_pid, stop_pid
from sparkctl.lab.state import HostPaths, HostSpec
from tests.kit.lab import Lab


def _host(lab: Lab, name: str) -> tuple[HostPaths, HostSpec]:
    return HostPaths.of(name, lab.root), HostSpec.of(int(name.removeprefix("spark")))


@contextmanager
def sshd_stopped(lab: Lab, name: str) -> Iterator[None]:
    paths, spec = _host(lab, name)
    stop_pid(read_pid(paths.sshd_pid))
    try:
        yield
    finally:
        hosts.start_sshd(paths, spec)


@contextmanager
def docker_stopped(lab: Lab, name: str) -> Iterator[None]:
    """Stops the engine (it removes that host's containers first, as the lab's stop does)."""
    paths, spec = _host(lab, name)
    hosts.stop_docker(paths)
    try:
        yield
    finally:
        hosts.start_docker(paths, spec)


@contextmanager
def docker_frozen(lab: Lab, name: str) -> Iterator[None]:
    """The host's dockerd stopped in its tracks (SIGSTOP): a wedged engine, whose socket accepts and never
    answers, so every docker command there hangs. Thawed (SIGCONT) after."""
    import os
    import signal

    paths, _ = _host(lab, name)
    pid = read_pid(paths.docker_pid)
    assert pid, f"{name}: no dockerd pid"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@contextmanager
def link_down(lab: Lab, name: str, iface: str | None = None) -> Iterator[str]:
    iface = iface or lab.host(name).fabric_if
    subprocess.run(["ip", "-n", name, "link", "set", iface, "down"], check=True, timeout=10)
    try:
        yield iface
    finally:
        subprocess.run(["ip", "-n", name, "link", "set", iface, "up"], check=True, timeout=10)


@contextmanager
def tcp_dropped(lab: Lab, name: str, port: int) -> Iterator[None]:
    """A firewall on the host that silently drops incoming TCP to `port` (no RST, no ICMP)."""
    rule = ["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"]
    subprocess.run(["ip", "netns", "exec", name, "iptables", "-I", *rule], check=True, timeout=10)
    try:
        yield
    finally:
        subprocess.run(["ip", "netns", "exec", name, "iptables", "-D", *rule], check=True, timeout=10)


@contextmanager
def path_dropped(lab: Lab, src: str, dst: str) -> Iterator[str]:
    """Every packet from host `src` to host `dst`'s fabric address silently dropped, in src's network
    namespace (no RST, no ICMP): a partition between two ranks' nodes. Yields dst's fabric address."""
    ip = lab.host(dst).fabric_ip
    rule = ["OUTPUT", "-d", ip, "-j", "DROP"]
    subprocess.run(["ip", "netns", "exec", src, "iptables", "-I", *rule], check=True, timeout=10)
    try:
        yield ip
    finally:
        subprocess.run(["ip", "netns", "exec", src, "iptables", "-D", *rule], check=True, timeout=10)


def _ip(name: str, *argv: str) -> None:
    subprocess.run(["ip", "-n", name, *argv], check=True, timeout=10, capture_output=True)


@contextmanager
def fresh_fabric(lab: Lab) -> Iterator[None]:
    """The lab as a new owner's nodes are (sparkctl.lab.fresh.make_fresh: fabric ports cabled, without an
    address, MTU 1500, nothing of setup's), and after: each host's ports as the lab made them, setup's files gone."""
    from sparkctl.lab import fresh, net
    from sparkctl.lab.state import PORT_IFS

    hosts_ = [_host(lab, h.name) for h in lab.hosts]
    was_up = {(spec.name, p): net.iface_up(spec, p) for _, spec in hosts_ for p in PORT_IFS}
    fresh.make_fresh(hosts_)
    try:
        yield
    finally:
        fresh.restore(hosts_, was_up)


@contextmanager
def recabled(lab: Lab, cables: list[tuple[str, int, str, int]], slow: dict[int, str] | None = None) -> Iterator[None]:
    """The fabric re-cabled without the switch: each (node, port index, node, port index) is a cable of its own (a
    two-port bridge, jumbo frames), both its ends up; every other port down. `slow` {cable index: rate}: that
    cable's both ends shaped to `rate` (tc tbf) -- a bad cable. Use inside fresh_fabric (which puts addresses back);
    after: every port on the lab's switch again, up or down as before, no shaping."""
    from sparkctl.lab import fresh, net
    from sparkctl.lab.state import FABRIC_BRIDGE, PORT_IFS

    specs = [_host(lab, h.name)[1] for h in lab.hosts]
    was_up = {(spec.name, p): net.iface_up(spec, p) for spec in specs for p in PORT_IFS}
    outers = {(spec.name, i): spec.veth_port(i) for spec in specs for i in (0, 1)}
    bridges = [f"slcab{k}" for k in range(len(cables))]
    used = {(a, i) for a, i, _, _ in cables} | {(b, j) for _, _, b, j in cables}
    # Docker's FORWARD policy drops bridged traffic (br_netfilter): accept the cables' own bridges, as the lab's
    forward = [["FORWARD", flag, br, "-j", "ACCEPT"] for br in bridges for flag in ("-i", "-o")]
    try:
        for rule in forward:
            subprocess.run(["iptables", "-I", *rule], check=True, timeout=10)
        for outer in outers.values():
            subprocess.run(["ip", "link", "set", "dev", outer, "nomaster"], check=True, timeout=10)
        for name, i in outers:
            if (name, i) not in used:
                _ip(name, "link", "set", "dev", PORT_IFS[i], "down")
        for k, (a, i, b, j) in enumerate(cables):
            br = bridges[k]
            subprocess.run(["ip", "link", "add", "name", br, "type", "bridge"], check=True, timeout=10)
            subprocess.run(["ip", "link", "set", "dev", br, "mtu", "9000", "up"], check=True, timeout=10)
            for name, idx in ((a, i), (b, j)):
                subprocess.run(["ip", "link", "set", "dev", outers[(name, idx)], "master", br, "up"], check=True,
                               timeout=10)
                _ip(name, "link", "set", "dev", PORT_IFS[idx], "up")
                if slow and k in slow:
                    subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", PORT_IFS[idx],
                                    "root", "tbf", "rate", slow[k], "burst", "64kb", "latency", "50ms"],
                                   check=True, timeout=10, capture_output=True)
        for h in lab.hosts:
            for port in PORT_IFS:
                _ip(h.name, "neigh", "flush", "dev", port)
                _ip(h.name, "-6", "neigh", "flush", "dev", port)
        fresh.dad_done([spec.name for spec in specs])
        yield
    finally:
        for h in lab.hosts:
            for port in PORT_IFS:
                subprocess.run(["ip", "netns", "exec", h.name, "tc", "qdisc", "del", "dev", port, "root"],
                               timeout=10, capture_output=True)  # none there: an error, nothing to undo
        for outer in outers.values():
            subprocess.run(["ip", "link", "set", "dev", outer, "master", FABRIC_BRIDGE, "up"], timeout=10,
                           capture_output=True)
        for br in bridges:
            subprocess.run(["ip", "link", "delete", "dev", br], timeout=10, capture_output=True)
        for rule in forward:
            subprocess.run(["iptables", "-D", *rule], timeout=10, capture_output=True)
        for (name, port), up in was_up.items():
            _ip(name, "link", "set", "dev", port, "up" if up else "down")
        fresh.dad_done([spec.name for spec in specs])
