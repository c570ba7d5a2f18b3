"""The lab as a new owner's nodes are (`sparkctl lab up --fresh`), and back to the lab's own fabric.

Fresh: each host's fabric ports cabled (on the lab's switch) without an address, at MTU 1500, the port the lab
addresses up and the other down (two ports of one host on one switch need ARP settings setup does not write
yet), their neighbour tables empty, and nothing of `sparkctl setup`'s in the host's setup root (its files,
its fabric document, the commands it recorded). `sparkctl setup` then finds the cabling, plans the addresses
and applies them, as on real nodes. The lab's state records `fabric: setup`: its hosts' fabric addresses are
setup's, not the lab's, and `lab status` does not hold them to the lab's.

Back (`lab up` without --fresh, on a lab whose fabric is not the lab's): each host's network is rebuilt with
the lab's addresses, and what setup wrote for the old network is removed with it (reset_setup_root).
"""

from __future__ import annotations

import shutil
import subprocess
import time

from . import net, seams
from .proc import run
from .state import FABRIC_NET, PORT_IFS, HostPaths, HostSpec

DAD_BOUND_S = 15.0


def reset_setup_root(paths: HostPaths) -> None:
    """Everything `sparkctl setup` wrote or installed on the host removed: its root holds only the host's
    machine-id and the lab's stand-ins (sbin/)."""
    root = paths.setup_root
    if not root.exists():
        return
    for child in root.iterdir():
        if child.name not in ("etc", "sbin"):
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    etc = root / "etc"
    if etc.is_dir():
        for child in etc.iterdir():
            if child.name != "machine-id":
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def _ip(name: str, *argv: str) -> None:
    run(["ip", "-n", name, *argv], timeout=10)


def gids_follow_addresses(paths: HostPaths, name: str) -> None:
    """The host's RoCE GID table (its sysfs seam) as the kernel would have it after its ports' addresses changed."""
    subprocess.run(["ip", "netns", "exec", name, "python3", str(paths.bin_dir / "roce_gids.py"), *PORT_IFS],
                   check=True, timeout=30, capture_output=True, env={"SPARKCTL_SYSFS_ROOT": str(paths.sysfs),
                                                                     "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


def make_fresh(root_paths: list[tuple[HostPaths, HostSpec]]) -> None:
    """Every host as a new owner's node is (see the module): no fabric address, MTU 1500, setup's files gone."""
    for paths, spec in root_paths:
        reset_setup_root(paths)
        for port in PORT_IFS:
            _ip(spec.name, "addr", "flush", "dev", port, "scope", "global")
            _ip(spec.name, "link", "set", "dev", port, "mtu", "1500")
            _ip(spec.name, "link", "set", "dev", port, "up" if port == spec.fabric_if else "down")
            _ip(spec.name, "neigh", "flush", "dev", port)  # a new node has seen no neighbour on it yet
            _ip(spec.name, "-6", "neigh", "flush", "dev", port)
        gids_follow_addresses(paths, spec.name)
    dad_done([spec.name for _, spec in root_paths])


def restore(root_paths: list[tuple[HostPaths, HostSpec]], was_up: dict[tuple[str, str], bool]) -> None:
    """Each host's ports as the lab made them (its address on its own port, the other up or down as `was_up`
    says, MTU 1500), setup's files removed. For tests that made the lab fresh in place."""
    for paths, spec in root_paths:
        reset_setup_root(paths)
        for port in PORT_IFS:
            _ip(spec.name, "addr", "flush", "dev", port, "scope", "global")
            _ip(spec.name, "link", "set", "dev", port, "mtu", "1500")
            _ip(spec.name, "link", "set", "dev", port, "up" if was_up[(spec.name, port)] else "down")
        _ip(spec.name, "addr", "add", f"{spec.fabric_ip}/{FABRIC_NET.prefixlen}", "dev", spec.fabric_if)
        seams.write_sysfs(paths.sysfs, spec, {p: net.iface_mac(spec, p) for p in PORT_IFS},
                          {p: net.iface_up(spec, p) for p in PORT_IFS})
    dad_done([spec.name for _, spec in root_paths])


def dad_done(names: list[str], bound_s: float = DAD_BOUND_S) -> None:
    """Until no fabric port's IPv6 link-local address is still tentative (duplicate address detection runs
    for about a second after a link comes up; a port that is still in it answers no neighbour discovery, so
    the next `setup` would see a segment without it). Bounded; a real node's ports are long past it."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        tentative = [n for n in names for p in PORT_IFS
                     if subprocess.run(["ip", "-n", n, "-6", "addr", "show", "dev", p, "tentative"],
                                       capture_output=True, text=True, timeout=10).stdout.strip()]
        if not tentative:
            return
        time.sleep(0.2)
