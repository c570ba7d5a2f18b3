"""A running lab as seen by its users (tests, benchmarks, the demo): paths, hosts, and two helpers.

    lab = Lab.load()                       # reads $SPARKCTL_LAB_DIR/lab.json (raises if not up)
    lab.ssh("spark1", "nvidia-smi", "-L")  # ssh -F <lab ssh_config> spark1 -- 'nvidia-smi' '-L'
    lab.docker("spark2", "ps", "-q")       # docker -H <spark2's socket> ps -q (from this machine)
    lab.host("spark3").fabric_if           # the truths a `check` should discover: "enp1s0f1np1"
    lab.env()                              # SPARKCTL_SSH_CONFIG / SPARKCTL_ENV_FILE for subprocesses
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from sparkctl.errors import CheckFailed
from sparkctl.lab.seams import CONTAINER_SYSFS
from sparkctl.lab.state import ENGINE_IMAGE, FABRIC_NET, MODEL_PATH, HostPaths, HostSpec, LabFiles


@dataclass(frozen=True)
class LabHost:
    """One host: its SSH alias and addresses, the expected hardware facts, and its files on this machine."""

    name: str
    mgmt_ip: str  # what the ssh_config's HostName says; the head's API is reached here
    fabric_ip: str
    fabric_if: str  # the CX7 port carrying fabric_ip (enp1s0f1np1 on spark3, spark7, ...)
    idle_if: str
    fabric_hca: str  # RDMA device of fabric_if (rocep1s0f0 / rocep1s0f1)
    gid_index: int  # RoCE v2 GID index of fabric_ip (5 on spark2, 3 elsewhere)
    docker_host: str  # unix://... : that host's own engine, usable from this machine too
    docker_sock: Path
    docker_root: Path  # its DockerRootDir
    model_dir: Path  # this host's folder, seen as /models/lab on the host and in its containers
    sshd_log: Path  # "Accepted publickey ..." lines, one per SSH connection
    sysfs_root: Path  # its SPARKCTL_SYSFS_ROOT
    bin_dir: Path  # first on its PATH (nvidia-smi)


@dataclass(frozen=True)
class Lab:
    root: Path
    ssh_config: Path
    env_file: Path
    known_hosts: Path
    client_key: Path
    hosts: tuple[LabHost, ...]
    model_path: str = MODEL_PATH
    fabric_subnet: str = str(FABRIC_NET)

    @classmethod
    def load(cls, root: Path | None = None) -> Lab:
        files = LabFiles.of(root)
        try:
            state = json.loads(files.state_json.read_text())
        except (OSError, ValueError):
            raise CheckFailed(f"no lab at {files.root} (lab.json missing)", fix="sparkctl lab up") from None
        hosts = []
        for i in range(1, int(state["nodes"]) + 1):
            spec = HostSpec.of(i)
            paths = HostPaths.of(spec.name, files.root)
            hosts.append(LabHost(
                name=spec.name, mgmt_ip=spec.mgmt_ip, fabric_ip=spec.fabric_ip, fabric_if=spec.fabric_if,
                idle_if=spec.idle_if, fabric_hca=spec.fabric_hca, gid_index=spec.gid_index,
                docker_host=paths.docker_host, docker_sock=paths.docker_sock, docker_root=paths.docker_data,
                model_dir=paths.models, sshd_log=paths.sshd_log, sysfs_root=paths.sysfs, bin_dir=paths.bin_dir,
            ))
        return cls(root=files.root, ssh_config=files.ssh_config, env_file=files.env_file,
                   known_hosts=files.known_hosts, client_key=files.client_key, hosts=tuple(hosts))

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def host(self, name: str) -> LabHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no lab host {name!r} (hosts: {', '.join(self.names)})")

    def env(self) -> dict[str, str]:
        """os.environ plus the two variables that point sparkctl at the lab."""
        return {**os.environ, "SPARKCTL_SSH_CONFIG": str(self.ssh_config), "SPARKCTL_ENV_FILE": str(self.env_file)}

    def ssh(self, name: str, *argv: str, timeout: float = 60, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run argv on a host over real SSH (each word quoted: the remote shell sees them verbatim)."""
        remote = " ".join(shlex.quote(a) for a in argv)
        return subprocess.run(["ssh", "-F", str(self.ssh_config), name, "--", remote],
                              capture_output=True, text=True, timeout=timeout, check=check)

    def docker(self, name: str, *args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess[str]:
        """The docker CLI against a host's engine, from this machine (no SSH)."""
        return subprocess.run(["docker", "-H", self.host(name).docker_host, *args],
                              capture_output=True, text=True, timeout=timeout, check=check)

    def pin_knobs(self, names: list[str]) -> dict[str, str]:
        """RANK<n>_* knobs with every rank's true fabric pins (what `check` discovers), in `names` order,
        so that offline commands such as `render` work without a `check` first."""
        out: dict[str, str] = {}
        for r, n in enumerate(names):
            h = self.host(n)
            out |= {f"RANK{r}_FABRIC_IP": h.fabric_ip, f"RANK{r}_CX7_IF": h.fabric_if,
                    f"RANK{r}_CX7_IB": h.fabric_hca, f"RANK{r}_GID_INDEX": str(h.gid_index)}
        return out

    # -- the stand-in service, one container per rank (tests and benchmarks)
    def rank_env(self, name: str, ifname: str | None = None) -> dict[str, str]:
        """The per-rank pins a real launcher sets, from the host's truths (ifname overrides the pin)."""
        h = self.host(name)
        pin = ifname or h.fabric_if
        return {"NCCL_SOCKET_IFNAME": pin, "GLOO_SOCKET_IFNAME": pin,
                "NCCL_IB_HCA": h.fabric_hca, "NCCL_IB_GID_INDEX": str(h.gid_index), "VLLM_HOST_IP": h.fabric_ip}

    def run_rank(self, name: str, container: str, vllm_args: list[str], env: dict[str, str] | None = None,
                 image: str = ENGINE_IMAGE) -> str:
        """`docker run -d --network host ... --entrypoint vllm IMAGE serve /models/lab ARGS`; the container id."""
        argv = ["run", "-d", "--name", container, "--network", "host", "--ipc", "host",
                "--ulimit", "nofile=20000:20000", "--cap-add", "IPC_LOCK",
                "-v", f"{self.model_path}:{self.model_path}:ro", "-v", f"{CONTAINER_SYSFS}:{CONTAINER_SYSFS}:ro",
                "-e", f"SPARKCTL_SYSFS_ROOT={CONTAINER_SYSFS}"]
        for key, value in (env or {}).items():
            argv += ["-e", f"{key}={value}"]
        # --entrypoint: the engine image's ENTRYPOINT is `vllm serve`, as in vLLM's own image
        res = self.docker(name, *argv, "--entrypoint", "vllm", image, "serve", self.model_path, *vllm_args)
        if res.returncode != 0:
            raise CheckFailed(f"{name}: docker run {container} failed: {res.stderr.strip()}")
        return res.stdout.strip()

    def rm(self, pairs: list[tuple[str, str]]) -> None:
        """Remove (host, container) pairs; the ones already gone are fine."""
        for name, container in pairs:
            self.docker(name, "rm", "-f", container, timeout=60)

    def wait_exit(self, name: str, container: str, timeout: float) -> int | None:
        """The container's exit code once it stopped, or None if it still runs after timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.docker(name, "inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", container)
            words = res.stdout.split()
            if res.returncode == 0 and len(words) == 2 and words[0] == "false":
                return int(words[1])
            time.sleep(0.3)
        return None

    def logs(self, name: str, container: str) -> str:
        res = self.docker(name, "logs", container)
        return res.stdout + res.stderr


def running_lab(needs: str = "a running lab (sparkctl lab up --nodes 4)") -> Lab | None:
    """For scripts (bench/, scripts/): the lab, or None after saying on stderr why there is none (not root, or
    no lab up); the script then exits 2."""
    import sys

    if os.geteuid() != 0:
        print(f"needs root and {needs}", file=sys.stderr)
        return None
    try:
        return Lab.load()
    except Exception as exc:  # noqa: BLE001 - no lab: nothing to run against
        print(f"no lab: {exc}", file=sys.stderr)
        return None
