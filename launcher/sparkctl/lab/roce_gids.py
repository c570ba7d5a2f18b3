#!/usr/bin/env python3
"""A lab host's RoCE GID table follows its port's IPv4 addresses, as the kernel's does when an address is added
or removed: `roce_gids.py IFNAME...` rewrites, in the sysfs seam ($SPARKCTL_SYSFS_ROOT), the IPv4-mapped
entries of the RDMA device whose netdev is IFNAME (a RoCE v1 and a RoCE v2 GID per address, after the entries
that are not IPv4: the link-local pair, an IPv6 pair) from `ip -j addr show dev IFNAME`.

Installed beside netplan-apply in each lab host's bin/ (self-contained: the host runs it with its python3);
`sparkctl.lab.seams.write_sysfs` writes the table the lab starts with, in the same layout.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

MAPPED = "0000:0000:0000:0000:0000:ffff:"
ZERO_GID = ":".join(["0000"] * 8)


def gid_text(addr: ipaddress.IPv6Address) -> str:
    """sysfs spells a GID as eight 4-digit hex groups."""
    return ":".join(addr.exploded.split(":"))


def port_dir(root: Path, ifname: str) -> Path | None:
    for dev in sorted(root.iterdir()) if root.is_dir() else []:
        if (dev / "device" / "net" / ifname).exists():
            return dev / "ports" / "1"
    return None


def rewrite(port: Path, ifname: str, addrs: list[str]) -> None:
    slots = sorted(int(p.name) for p in (port / "gids").iterdir())
    keep = []
    for n in slots:
        gid = (port / "gids" / str(n)).read_text().strip()
        kind = (port / "gid_attrs" / "types" / str(n)).read_text().strip()
        if kind and not gid.startswith(MAPPED):
            keep.append((gid, kind))
    entries = keep + [(gid_text(ipaddress.IPv6Address(f"::ffff:{a}")), k)
                      for a in addrs for k in ("IB/RoCE v1", "RoCE v2")]
    for n in slots:
        gid, kind = entries[n] if n < len(entries) else (ZERO_GID, "")
        (port / "gids" / str(n)).write_text(gid + "\n")
        (port / "gid_attrs" / "types" / str(n)).write_text(kind + "\n" if kind else "")
        (port / "gid_attrs" / "ndevs" / str(n)).write_text(ifname + "\n" if kind else "")


def main(argv: list[str]) -> int:
    root = Path(os.environ.get("SPARKCTL_SYSFS_ROOT", "/sys/class/infiniband"))
    for ifname in argv:
        port = port_dir(root, ifname)
        if port is None:
            continue  # not an RDMA device's netdev
        shown = subprocess.run(["ip", "-j", "addr", "show", "dev", ifname], capture_output=True, text=True,
                               check=True, timeout=10).stdout
        addrs = [a["local"] for link in json.loads(shown or "[]") for a in link.get("addr_info", [])
                 if a.get("family") == "inet" and a.get("scope") == "global"]
        rewrite(port, ifname, addrs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
