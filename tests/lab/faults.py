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
