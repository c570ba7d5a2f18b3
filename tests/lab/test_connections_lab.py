"""One SSH connection per node for each command (README: "how many SSH connections"), counted.

Each host's sshd logs one "Accepted publickey" line per connection. Every lab use holds the machine's
lab lock, so the lines logged while one command runs are that command's. For each command, each node
it works on must show exactly one new line, and no node more than one.
(bench/check_speed.py measures the same for `check` with per-process attribution and timings.)
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
ACCEPTED = re.compile(rb"Accepted publickey for \S+ from \S+ port \d+")
ENV = {"NODES": " ".join(NODES), "CLUSTER_NAME": "conns", "PORT": "18931", "MASTER_PORT": "39531"}


def sizes(lab: Lab) -> dict[str, int]:
    return {n: lab.host(n).sshd_log.stat().st_size if lab.host(n).sshd_log.exists() else 0 for n in NODES}


def connections(lab: Lab, since: dict[str, int]) -> dict[str, int]:
    out = {}
    for n in NODES:
        with open(lab.host(n).sshd_log, "rb") as f:
            f.seek(since[n])
            out[n] = len(ACCEPTED.findall(f.read()))
    return out


def counted(lab: Lab, cwd: Path, *args: str, ok: tuple[int, ...] = (0,)) -> dict[str, int]:
    since = sizes(lab)
    r = subprocess.run([sys.executable, "-m", "sparkctl", *args], env={**lab.env(), **ENV}, cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode in ok, f"{args}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    time.sleep(0.2)  # sshd writes its line at authentication; the command has ended long after
    return connections(lab, since)


def test_each_command_opens_one_connection_per_node(chain: Lab, tmp_path: Path) -> None:
    lab = chain
    every = dict.fromkeys(NODES, 1)
    head_only = {n: int(n == "spark1") for n in NODES}
    try:
        assert counted(lab, tmp_path, "check", ok=(0, 1)) == every
        assert counted(lab, tmp_path, "check", "--fabric", ok=(0, 1)) == every  # the collective: same connections
        assert counted(lab, tmp_path, "verify-model") == every
        # plan reads MODEL here when it is on this machine, else on the head: never more than that.
        assert counted(lab, tmp_path, "plan") in (dict.fromkeys(NODES, 0), head_only)
        assert counted(lab, tmp_path, "build") == every
        assert counted(lab, tmp_path, "up") == every
        assert counted(lab, tmp_path, "wait", "--timeout", "120") == every
        assert counted(lab, tmp_path, "status") == every
        assert counted(lab, tmp_path, "logs", "--tail", "5") == every
        # A command that needs fewer nodes still opens at most one connection to each.
        one_rank = counted(lab, tmp_path, "logs", "--rank", "2", "--tail", "5")
        assert one_rank == {"spark1": 0, "spark2": 0, "spark3": 1, "spark4": 0}, one_rank
        assert counted(lab, tmp_path, "audit") == every
        lock = counted(lab, tmp_path, "lock", "status")
        assert lock["spark1"] == 1 and max(lock.values()) == 1, lock
    finally:
        down = counted(lab, tmp_path, "down")
    assert down == every


def test_nodes_behind_a_proxyjump_host_included_config(chain: Lab, tmp_path: Path) -> None:
    """A user's config that `Include`s the lab's and reaches spark2..4 only through spark1 (ProxyJump):
    resolved as OpenSSH resolves it, every hop's host key verified, one connection per node plus one
    to the jump host (which is also rank 0), and each node is the machine it claims (machine-id)."""
    lab = chain
    cfg = tmp_path / "ssh_config"
    jumped = [f"via-{n}" for n in NODES[1:]]
    cfg.write_text(f"Include {lab.ssh_config}\n" + "".join(
        f"Host {alias}\n  HostName {lab.host(n).mgmt_ip}\n  ProxyJump spark1\n  User root\n"
        f"  IdentityFile {lab.root}/id_ed25519\n  IdentitiesOnly yes\n  UserKnownHostsFile {lab.root}/known_hosts\n"
        for alias, n in zip(jumped, NODES[1:], strict=True)))
    env = {**lab.env(), **ENV, "SPARKCTL_SSH_CONFIG": str(cfg), "NODES": " ".join(["spark1", *jumped])}
    since = sizes(lab)
    r = subprocess.run([sys.executable, "-m", "sparkctl", "--json", "status"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and r.returncode in (0, 1), r.stdout + r.stderr
    time.sleep(0.2)
    # status talks to every node: spark1 twice (rank 0, and the jump for the three others), the rest once
    assert connections(lab, since) == {"spark1": 2, "spark2": 1, "spark3": 1, "spark4": 1}
    # the jumped connections really come from spark1 (its sshd opened them: direct-tcpip)
    tail = lab.host("spark2").sshd_log.read_bytes()[-2000:]
    assert f"from {lab.host('spark1').mgmt_ip}".encode() in tail, tail[-400:]
