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

from sparkctl.lab.client import Lab

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
        assert one_rank["spark3"] == 1 and max(one_rank.values()) == 1, one_rank
        assert counted(lab, tmp_path, "audit") == every
        lock = counted(lab, tmp_path, "lock", "status")
        assert lock["spark1"] == 1 and max(lock.values()) == 1, lock
    finally:
        down = counted(lab, tmp_path, "down")
    assert down == every
