"""The hardware seams of a lab host: `nvidia-smi` first on PATH, a /sys/class/infiniband tree, and the kernel's
files.

Nothing else about the hardware is simulated: sparkctl reads GPUs only through nvidia-smi, RDMA devices
(their firmware too) only through $SPARKCTL_SYSFS_ROOT (default /sys/class/infiniband), and the kernel's
release, command line and ring buffer through $SPARKCTL_KERNEL_SEAM's files where a lab host has them
(set_kernel_seam; without them, the machine's own). A fabric port's MTU is the lab netdev's own
(hosts.set_port_mtu).
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from .roce_gids import (  # one spelling of a GID: the table lab up writes and the one that follows addresses
    ZERO_GID,
    gid_text,
)
from .state import FABRIC_NET, PORT_HCAS, PORT_IFS, HostPaths, HostSpec

HERE = Path(__file__).resolve().parent
GID_SLOTS = 16  # real tables have up to 256 entries; the lab's unused ones read all-zero like real ones


# The query `check` makes on every node, answered from a file the Python seam wrote at `lab up`:
# 16 lab hosts share this machine's CPUs, and a Python start per probe would be most of a check's cost.
FAST_QUERY = ("--query-gpu=name,driver_version,memory.total,compute_cap,count", "--format=csv,noheader,nounits")
_WRAPPER = """#!/bin/sh
# The lab's GB10 nvidia-smi seam: the common `check` query from a precomputed answer, the rest from
# nvidia_smi.py (which also wrote that answer, so both say the same).
# (Builtins only on the fast path: no dirname, no cat -- one process, as a real nvidia-smi is.)
case $0 in */*) here=${{0%/*}} ;; *) here=. ;; esac
if [ "$#" -eq 2 ] && [ "$1" = '{q}' ] && [ "$2" = '{f}' ]; then
    while IFS= read -r line; do printf '%s\\n' "$line"; done <"$here/nvidia-smi.fast-query"
    exit 0
fi
exec python3 "$here/nvidia_smi.py" "$@"
"""


# Where each lab host's sysfs tree appears in its mount namespace and, bound read-only, in its
# containers (the lab recipe's [container] mounts and SPARKCTL_SYSFS_ROOT): the stand-in engine checks
# NCCL_IB_HCA and NCCL_IB_GID_INDEX against it, as NCCL checks them against /sys/class/infiniband.
CONTAINER_SYSFS = "/run/sparkctl-lab/sysfs"


def write_setup_seams(paths: HostPaths) -> None:
    """What `sparkctl setup` needs on a lab host: its own / for setup's files (with the host's machine-id in
    it), the stand-in for `netplan apply` (netplan_apply.sh: the real `netplan generate`, applied with
    `ip`) and for `apt-get install earlyoom` (setup_apt_get.sh: this machine's real earlyoom, linked in). Files setup wrote there earlier are kept: the lab keeps what a real node would."""
    etc = paths.setup_root / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    machine_id = etc / "machine-id"
    if not machine_id.is_symlink():
        machine_id.unlink(missing_ok=True)
        machine_id.symlink_to(paths.root / "machine-id")  # made with the host's mount namespace
    paths.bin_dir.mkdir(parents=True, exist_ok=True)
    for name, target in (("netplan_apply.sh", "netplan-apply"), ("roce_gids.py", "roce_gids.py")):
        shutil.copyfile(HERE / name, paths.bin_dir / target)
        (paths.bin_dir / target).chmod(0o755)
    (paths.setup_root / "sbin").mkdir(exist_ok=True)  # the commands setup runs that the lab carries out itself
    shutil.copyfile(HERE / "setup_apt_get.sh", paths.setup_root / "sbin" / "apt-get")
    (paths.setup_root / "sbin" / "apt-get").chmod(0o755)


def write_nvidia_smi(bin_dir: Path, spec: HostSpec) -> None:
    """Install the GB10 nvidia-smi seam (a copy, so a host's tree is self-contained) with its uuid."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    seam = bin_dir / "nvidia_smi.py"
    shutil.copyfile(HERE / "nvidia_smi.py", seam)
    seam.chmod(0o755)
    shutil.copyfile(HERE / "nvidia_smi_help_query.txt", bin_dir / "nvidia_smi_help_query.txt")
    gpu_uuid = uuid.uuid5(uuid.NAMESPACE_DNS, f"{spec.name}.gpu.sparkctl-lab")
    (bin_dir / "nvidia-smi.json").write_text(json.dumps({"uuid": f"GPU-{gpu_uuid}", "host": spec.name}) + "\n")
    answer = subprocess.run([sys.executable, str(seam), *FAST_QUERY], capture_output=True, check=True, timeout=30)
    (bin_dir / "nvidia-smi.fast-query").write_bytes(answer.stdout)
    target = bin_dir / "nvidia-smi"
    target.write_text(_WRAPPER.format(q=FAST_QUERY[0], f=FAST_QUERY[1]))
    target.chmod(0o755)


def set_gpu_seam(bin_dir: Path, *, compute_apps: list[dict[str, Any]] | None = None,
                 release: dict[str, Any] | None = None) -> None:
    """What a lab host's nvidia-smi reports beyond an idle GB10 (tests set it, then set it back with no
    arguments): compute_apps, processes holding GPU memory ({"pid", "process_name", "used_memory"
    MiB}); release, a killed engine's memory given back only `delay_s` after its container stopped
    (nvidia_smi.released). Keeps the host's uuid; forgets any earlier release state."""
    path = bin_dir / "nvidia-smi.json"
    cfg = json.loads(path.read_text())
    cfg.pop("compute_apps", None)
    cfg.pop("release", None)
    if compute_apps:
        cfg["compute_apps"] = compute_apps
    if release:
        cfg["release"] = release
    (bin_dir / "nvidia-smi.release-state.json").unlink(missing_ok=True)
    path.write_text(json.dumps(cfg) + "\n")


def link_local(mac: str) -> ipaddress.IPv6Address:
    """EUI-64 link-local address of a MAC (the GID 0/1 entries of a RoCE port)."""
    b = [int(x, 16) for x in mac.split(":")]
    b[0] ^= 0x02
    eui = b[:3] + [0xFF, 0xFE] + b[3:]
    return ipaddress.IPv6Address(bytes([0xFE, 0x80] + [0] * 6 + eui))


def gid_table(spec: HostSpec, ifname: str, mac: str) -> list[tuple[str, str]]:
    """(gid, type) entries of one port, in kernel order: link-local v1/v2, [global IPv6], IPv4 v1/v2."""
    entries = [(gid_text(link_local(mac)), "IB/RoCE v1"), (gid_text(link_local(mac)), "RoCE v2")]
    if ifname == spec.fabric_if:
        if spec.gid_index == 5:  # an extra IPv6 pair ahead of the IPv4 entries moves RoCE v2 to 5
            extra = ipaddress.IPv6Address(f"fd00:232::{spec.index:x}")
            entries += [(gid_text(extra), "IB/RoCE v1"), (gid_text(extra), "RoCE v2")]
        mapped = ipaddress.IPv6Address(f"::ffff:{spec.fabric_ip}")
        entries += [(gid_text(mapped), "IB/RoCE v1"), (gid_text(mapped), "RoCE v2")]
        assert len(entries) - 1 == spec.gid_index, (spec, entries)
    return entries


def write_sysfs(root: Path, spec: HostSpec, macs: dict[str, str], up: dict[str, bool]) -> None:
    """Write <root>/<hca>/{ports/1/{state,phys_state,link_layer,gids,gid_attrs/{types,ndevs}},device/net/<if>}."""
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():  # empty it, but keep the folder: hosts.py binds it at CONTAINER_SYSFS
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    for ifname, hca in zip(PORT_IFS, PORT_HCAS, strict=True):
        dev = root / hca
        (dev / "device" / "net" / ifname).mkdir(parents=True)
        port = dev / "ports" / "1"
        for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
            (port / sub).mkdir(parents=True)
        active = up.get(ifname, False)
        (port / "state").write_text("4: ACTIVE\n" if active else "1: DOWN\n")
        (port / "phys_state").write_text("5: LinkUp\n" if active else "3: Disabled\n")
        (port / "link_layer").write_text("Ethernet\n")
        (port / "rate").write_text("200 Gb/sec (2X NDR)\n")
        entries = gid_table(spec, ifname, macs[ifname])
        for n in range(GID_SLOTS):
            gid, gtype = entries[n] if n < len(entries) else (ZERO_GID, "")
            (port / "gids" / str(n)).write_text(gid + "\n")
            # Unused slots: the kernel refuses the read (EINVAL); an empty file is the closest a tree gets.
            (port / "gid_attrs" / "types" / str(n)).write_text(gtype + "\n" if gtype else "")
            (port / "gid_attrs" / "ndevs" / str(n)).write_text(ifname + "\n" if gtype else "")
        (dev / "node_type").write_text("1: CA\n")
        (dev / "fw_ver").write_text(LAB_FW + "\n")


LAB_FW = "28.45.1020"
"""The firmware every lab CX7 reports (sysfs fw_ver) until set_firmware changes a host's."""


def set_firmware(root: Path, fw: str = LAB_FW) -> None:
    """Every RDMA device of a host's sysfs tree reports firmware `fw` (back to LAB_FW with no argument)."""
    for dev in root.iterdir():
        if (dev / "ports").is_dir():
            (dev / "fw_ver").write_text(fw + "\n")


def set_kernel_seam(where: Path, *, release: str | None = None, cmdline: str | None = None,
                    kmsg: list[str] | None = None) -> None:
    """What a lab host's kernel says (its $SPARKCTL_KERNEL_SEAM folder): another release string, another
    command line (e.g. with cma=0), lines in its ring buffer (an OOM kill). None: the machine's own (the
    file is removed); with no arguments the host is back to the machine's kernel."""
    where.mkdir(parents=True, exist_ok=True)
    for name, value in (("release", release), ("cmdline", cmdline),
                        ("kmsg", None if kmsg is None else "".join(ln + "\n" for ln in kmsg))):
        path = where / name
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(value if name == "kmsg" else value + "\n")


def fabric_cidr() -> str:
    return str(FABRIC_NET)
