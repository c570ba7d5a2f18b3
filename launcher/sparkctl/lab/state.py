"""Where the lab lives and what each host looks like: names, addresses, paths. Pure data, no I/O.

Everything about a host is derived from its index, so `lab up`, `lab status`, `lab down` and the
tests agree without reading anything but the lab folder's location.

Layout:
    $SPARKCTL_LAB_DIR (default /var/lib/sparkctl-lab)   persistent: keys, configs, engines' data
        ssh_config  known_hosts  id_ed25519  lab.env  lab.json  checkpoint/
        hosts/sparkN/  ssh/ (host key, sshd_config, authorized_keys)  sshd.log  bin/nvidia-smi
                       sysfs/ (SPARKCTL_SYSFS_ROOT)  models/ (bound at /models/lab)  home/
                       docker/ (data-root)  containerd/ (root)  *.log
    /run/sparkctl-lab                                    volatile: pid files, sockets, exec roots
        ns/sparkN (the host's mount namespace)  sparkN/{docker.sock, containerd/...}
    /var/cache/sparkctl-lab                               cache: the base image tarball
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_LAB_DIR = Path("/var/lib/sparkctl-lab")
CACHE_DIR = Path("/var/cache/sparkctl-lab")
RUN_DIR = Path("/run/sparkctl-lab")
NS_DIR = RUN_DIR / "ns"
NETNS_DIR = Path("/run/netns")
MODEL_PATH = "/models/lab"
VLLM_MODEL_PATH = "/models/lab-vllm"  # `lab up --engine vllm`: the real checkpoint, bound in each host
MARKER = ".sparkctl-lab"  # a lab folder carries this file; `down` deletes nothing that lacks it

# Two /24s in 10.0.0.0/8 that nothing on a usual machine uses; `up` refuses if they collide.
MGMT_NET = ipaddress.ip_network("10.231.0.0/24")
FABRIC_NET = ipaddress.ip_network("10.232.0.0/24")
MGMT_BRIDGE = "sparklab0"
FABRIC_BRIDGE = "sparklab1"
MGMT_IF = "enP7s7"  # the DGX Spark's onboard 10GbE name
PORT_IFS = ("enp1s0f0np0", "enp1s0f1np1")  # the CX7's two ports, as the kernel names them
PORT_HCAS = ("rocep1s0f0", "rocep1s0f1")
IPTABLES_COMMENT = "sparkctl-lab"

BASE_IMAGE = "sparkctl-lab/base:bookworm"
# `check --fabric`'s image on the lab (lab/torch_image.py builds it; named here, where fabric.py can
# read it without importing the lab's Docker code)
TORCH_IMAGE = "sparkctl-lab/torch:latest"
ENGINE_IMAGE = "sparkctl-lab/engine:latest"
# `lab up --engine vllm`: the real vLLM for CPU (lab/vllm_image.py builds it; recipe lab-vllm runs it)
VLLM_IMAGE = "sparkctl-lab/vllm:0.32.0-cpu"
MAX_NODES = 64


def lab_dir() -> Path:
    return Path(os.environ.get("SPARKCTL_LAB_DIR") or DEFAULT_LAB_DIR)


@dataclass(frozen=True)
class HostSpec:
    """One lab host: its names, addresses and the quirks a real cluster has (per host, by index)."""

    name: str
    index: int
    mgmt_ip: str
    fabric_ip: str
    fabric_if: str  # the port that carries the fabric IPv4
    idle_if: str  # the other port: up without an address (second-port hosts) or down
    fabric_hca: str  # RDMA device of fabric_if
    gid_index: int  # RoCE v2 GID index of fabric_ip on fabric_hca

    @classmethod
    def of(cls, index: int) -> HostSpec:
        if not 1 <= index <= MAX_NODES:
            raise ValueError(f"host index {index} out of range 1..{MAX_NODES}")
        # spark3, spark7, ... carry their fabric address on the *second* port, as some real nodes do.
        second = index % 4 == 3
        port = 1 if second else 0
        return cls(
            name=f"spark{index}",
            index=index,
            mgmt_ip=str(MGMT_NET.network_address + 10 + index),
            fabric_ip=str(FABRIC_NET.network_address + 10 + index),
            fabric_if=PORT_IFS[port],
            idle_if=PORT_IFS[1 - port],
            fabric_hca=PORT_HCAS[port],
            # spark2's GID table has an extra IPv6 pair first, so RoCE v2 for its IPv4 sits at 5, not 3.
            gid_index=5 if index == 2 else 3,
        )

    # host-side veth names: short, unique, and obviously the lab's
    @property
    def veth_mgmt(self) -> str:
        return f"slm{self.index}"

    def veth_port(self, port: int) -> str:
        return f"slf{self.index}p{port}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HostPaths:
    """Files and sockets of one host (persistent under the lab folder, volatile under /run)."""

    root: Path
    run: Path
    netns: Path
    mntns: Path
    utsns: Path
    ipcns: Path

    @classmethod
    def of(cls, name: str, base: Path | None = None) -> HostPaths:
        base = base or lab_dir()
        return cls(root=base / "hosts" / name, run=RUN_DIR / name, netns=NETNS_DIR / name,
                   mntns=NS_DIR / name, utsns=NS_DIR / f"{name}.uts", ipcns=NS_DIR / f"{name}.ipc")

    # persistent
    @property
    def ssh_dir(self) -> Path:
        return self.root / "ssh"

    @property
    def host_key(self) -> Path:
        return self.ssh_dir / "ssh_host_ed25519_key"

    @property
    def sshd_config(self) -> Path:
        return self.ssh_dir / "sshd_config"

    @property
    def authorized_keys(self) -> Path:
        return self.ssh_dir / "authorized_keys"

    @property
    def sshd_log(self) -> Path:
        return self.root / "sshd.log"

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def sysfs(self) -> Path:
        return self.root / "sysfs"

    @property
    def setup_root(self) -> Path:
        """$SPARKCTL_SETUP_ROOT: the host's own / for every file `sparkctl setup` reads or writes (netplan,
        sudoers, limits, earlyoom, the fabric document), so that setup on the lab never writes this machine's
        /etc; the commands it would run as root are recorded in its commands.log."""
        return self.root / "setup-root"

    @property
    def kernel_seam(self) -> Path:
        """$SPARKCTL_KERNEL_SEAM: files that stand in for the kernel's (release, cmdline, kmsg); empty: the real ones."""
        return self.root / "kernel"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def vllm_models(self) -> Path:
        """Bound at VLLM_MODEL_PATH in the host's mount namespace (`lab up --engine vllm`)."""
        return self.root / "models-vllm"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def var_tmp(self) -> Path:
        """Bound at /var/tmp in the host's mount namespace: each host its own, as each machine has (sparkctl's
        cluster lock lives there, one per cluster per machine)."""
        return self.root / "var-tmp"

    @property
    def docker_data(self) -> Path:
        return self.root / "docker"

    @property
    def containerd_data(self) -> Path:
        return self.root / "containerd"

    @property
    def dockerd_log(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def containerd_log(self) -> Path:
        return self.root / "containerd.log"

    @property
    def daemon_json(self) -> Path:
        return self.root / "daemon.json"

    @property
    def containerd_toml(self) -> Path:
        return self.root / "containerd.toml"

    # volatile
    @property
    def sshd_pid(self) -> Path:
        return self.run / "sshd.pid"

    @property
    def docker_sock(self) -> Path:
        return self.run / "docker.sock"

    @property
    def docker_pid(self) -> Path:
        return self.run / "dockerd.pid"

    @property
    def docker_exec(self) -> Path:
        return self.run / "exec"

    @property
    def containerd_state(self) -> Path:
        return self.run / "containerd"

    @property
    def containerd_sock(self) -> Path:
        return self.run / "containerd" / "containerd.sock"

    @property
    def containerd_pid(self) -> Path:
        return self.run / "containerd.pid"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.docker_sock}"


@dataclass(frozen=True)
class LabFiles:
    """The files `lab up` writes for clients (sparkctl, tests, the demo)."""

    root: Path

    @classmethod
    def of(cls, base: Path | None = None) -> LabFiles:
        return cls(root=base or lab_dir())

    @property
    def ssh_config(self) -> Path:
        return self.root / "ssh_config"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def client_key(self) -> Path:
        return self.root / "id_ed25519"

    @property
    def env_file(self) -> Path:
        return self.root / "lab.env"

    @property
    def state_json(self) -> Path:
        return self.root / "lab.json"

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoint"

    @property
    def vllm_env_file(self) -> Path:
        """`lab up --engine vllm`'s cluster input: recipe lab-vllm, the real checkpoint."""
        return self.root / "lab-vllm.env"

    @property
    def vllm_checkpoint(self) -> Path:
        """The real engine's checkpoint (tests/realengine/make_model.py's tiny Llama), copied to every host."""
        return self.root / "checkpoint-vllm"

    @property
    def marker(self) -> Path:
        return self.root / MARKER


def hosts_for(nodes: int) -> list[HostSpec]:
    return [HostSpec.of(i) for i in range(1, nodes + 1)]
