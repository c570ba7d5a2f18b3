"""On the lab: one lock per cluster whoever's env file, swapped node names, errors said once.

- Two env files that name the same nodes in another order (so another head): while one's `up` holds
  the lock (stopped with SIGSTOP while it holds it: no timing involved), the other's `down` and `up`
  are refused naming the node and the holder, and the service is whole after. When the
  lock lived on each env file's head: the other `down` could remove the ranks `up` had just started.
- A cluster that shares only one node with another: refused on that node, holding nothing after.
- Two node names whose HostNames were swapped in a copy of the ssh config (known_hosts is keyed by
  address, so each connection still verifies against the real host's key): `status` names it and
  exits 1, `down` refuses without --force, `down --force` removes the service.
- Two aliases of one machine: every command says so once.
- The lock is one per machine outside any home (each host's /var/tmp): another user reads it, cannot
  remove it or write into it.

Its own cluster name and ports, so it never touches another test's service.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
CLUSTER = {"CLUSTER_NAME": "lockscope", "PORT": "18893", "MASTER_PORT": "39513"}
LABEL = "label=sparkctl.cluster=lockscope"


def _env(lab: Lab, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**lab.env(), "NODES": " ".join(NODES), **CLUSTER, **(extra or {})}


def sk(lab: Lab, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=_env(lab, env), capture_output=True,
                          text=True, timeout=timeout)


def containers(lab: Lab) -> dict[str, list[str]]:
    return {n: sorted(lab.docker(n, "ps", "-a", "--filter", LABEL, "--format", "{{.Names}}").stdout.split())
            for n in NODES}


NONE: dict[str, list[str]] = {n: [] for n in NODES}


@pytest.fixture
def clean(chain: Lab) -> Iterator[Lab]:
    lab = chain
    sk(lab, "lock", "--force-unlock", timeout=30)
    sk(lab, "down", "--force", timeout=60)
    try:
        yield lab
    finally:
        sk(lab, "lock", "--force-unlock", timeout=30)
        sk(lab, "down", "--force", timeout=60)
        assert containers(lab) == NONE


def _holders(lab: Lab, env: dict[str, str] | None = None) -> dict[str, int]:
    r = sk(lab, "--json", "lock", "status", env=env, timeout=30)
    return {n: h["pid"] for n, h in json.loads(r.stdout)["nodes"].items()}


def _up_stopped_holding_the_lock(lab: Lab, env: dict[str, str] | None = None,
                                 nodes: list[str] | None = None) -> subprocess.Popen[str]:
    """An `up` stopped (SIGSTOP) while it holds the lock on every one of its nodes. Bounded: 3 tries
    (an `up` that finished before the stop landed is let go and `down` starts the next try)."""
    nodes = nodes or NODES
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-m", "sparkctl", "up"], env=_env(lab, env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            c = containers(lab)
            if any(c[n] for n in nodes if n in c):
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGSTOP)
        if proc.poll() is None and _holders(lab, env) == dict.fromkeys(nodes, proc.pid):
            return proc
        proc.send_signal(signal.SIGCONT)
        proc.communicate(timeout=90)
        sk(lab, "down", env=env, timeout=60)
    raise AssertionError("could not stop `up` while it held the lock in 3 tries")


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out + err


# 1. `down` with the other env file (head spark2) takes the same locks as `up` (every node's, in
# one order), so the two exclude each other and `down` cannot remove the ranks a running `up` started.
def test_two_env_files_naming_the_nodes_in_another_order_exclude_each_other(clean: Lab, tmp_path: Path) -> None:
    lab = clean
    other = tmp_path / "d.env"
    # The other operator's copy of the env file, its NODES in another order (a second NODES= line is
    # refused, so the line is rewritten, as an operator would).
    other.write_text(re.sub(r'^NODES=.*$', 'NODES="spark2 spark1 spark4 spark3"', Path(lab.env_file).read_text(),
                            flags=re.M))
    theirs = {"SPARKCTL_ENV_FILE": str(other), "NODES": "spark2 spark1 spark4 spark3"}
    proc = _up_stopped_holding_the_lock(lab)
    try:
        for cmd in (["down"], ["up", "--recreate"]):
            r = sk(lab, "--env-file", str(other), *cmd, env=theirs, timeout=60)
            assert r.returncode == 1, (cmd, r.stdout + r.stderr)
            assert re.search(r"locked on spark\d by .*running `up`", r.stderr), r.stderr
            assert r.stderr.count("error:") == 1, r.stderr
    finally:
        code, said = _finish(proc)
    assert code == 0 and "4 ranks started" in said, said
    assert containers(lab) == {n: [f"sparkctl-lockscope-rank{i}"] for i, n in enumerate(NODES)}
    assert _holders(lab) == {}
    r = sk(lab, "--env-file", str(other), "down", env=theirs, timeout=60)  # free now: it runs
    assert r.returncode == 0, r.stdout + r.stderr
    assert containers(lab) == NONE


# 2. the second cluster's `up` takes the lock on every node, so it is refused on the one node
# the two clusters share instead of replacing the first cluster's rank there.
def test_a_cluster_sharing_one_node_is_refused_there(clean: Lab) -> None:
    lab = clean
    first = {"NODES": "spark3 spark4", "TP": "2", "DCP": "2"}
    second = {"NODES": "spark2 spark3", "TP": "2", "DCP": "2"}
    proc = _up_stopped_holding_the_lock(lab, first, ["spark3", "spark4"])
    try:
        r = sk(lab, "up", env=second, timeout=60)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "locked on spark3 by" in r.stderr and "running `up`" in r.stderr, r.stderr
        assert _holders(lab, {"NODES": "spark1 spark2", "TP": "2", "DCP": "2"}) == {}  # it gave spark2 back
    finally:
        code, said = _finish(proc)
    assert code == 0, said
    c = containers(lab)
    assert c["spark3"] == ["sparkctl-lockscope-rank0"] and c["spark4"] == ["sparkctl-lockscope-rank1"], c
    assert c["spark1"] == c["spark2"] == []
    assert sk(lab, "down", env=first, timeout=60).returncode == 0


LOCK = "/var/tmp/sparkctl-lockscope.lock"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


# The lock is one per cluster per machine, whoever logs in: outside the SSH user's home, in each host's own
# /var/tmp, root's (the SSH user), 0755 with a 0644 owner file. Another user of the host reads who holds
# it but can neither remove it nor write into it; `lock status` names the SSH user.
def test_the_lock_is_one_per_machine_and_another_user_reads_it_but_cannot_tamper(clean: Lab) -> None:
    lab = clean
    proc = _up_stopped_holding_the_lock(lab)
    try:
        seen = set()
        for n in NODES:
            r = lab.ssh(n, "stat", "-c", "%a %U %d:%i", LOCK, f"{LOCK}/owner")
            modes = [ln.split()[:2] for ln in r.stdout.splitlines()]
            assert modes == [["755", "root"], ["644", "root"]], (n, r.stdout + r.stderr)
            seen.add(r.stdout.splitlines()[0].split()[2])
            r = lab.ssh(n, *NOBODY, "sh", "-c", 'cat "$1/owner"; rm -rf "$1" 2>/dev/null; '
                        'touch "$1/heartbeat" 2>/dev/null && echo touched; test -d "$1" && echo kept', "sh", LOCK)
            assert f'"pid": {proc.pid}' in r.stdout and "kept" in r.stdout and "touched" not in r.stdout, r.stdout
        assert len(seen) == len(NODES)  # each host its own /var/tmp: four machines, four locks
        r = sk(lab, "--json", "lock", "status", timeout=30)
        holders = json.loads(r.stdout)["nodes"]
        assert sorted(holders) == NODES and all(h["ssh_user"] == "root" and h["where"] == "shared"
                                                for h in holders.values()), r.stdout
    finally:
        code, said = _finish(proc)
    assert code == 0, said
    assert all(lab.ssh(n, "test", "-e", LOCK).returncode == 1 for n in NODES)  # released on every host


def _swapped_config(lab: Lab, tmp_path: Path, a: str, b: str) -> Path:
    """A copy of the lab's ssh config with a's and b's HostNames swapped. known_hosts is keyed by
    address, so each connection still verifies against the key of the host at that address."""
    text = Path(lab.ssh_config).read_text()
    ha = re.search(rf"Host {a}\n\s+HostName (\S+)\n", text)
    hb = re.search(rf"Host {b}\n\s+HostName (\S+)\n", text)
    assert ha and hb
    swapped = (text.replace(f"Host {a}\n  HostName {ha.group(1)}\n", f"Host {a}\n  HostName @B@\n")
                   .replace(f"Host {b}\n  HostName {hb.group(1)}\n", f"Host {b}\n  HostName {ha.group(1)}\n")
                   .replace("@B@", hb.group(1)))
    assert swapped != text and "StrictHostKeyChecking yes" in swapped
    cfg = tmp_path / "ssh_config"
    cfg.write_text(swapped)
    return cfg


# 3. status names the swap (not only ranks "absent"/config "stale"), and down refuses to act
# on whatever the names reach.
def test_swapped_node_names_are_named_by_status_and_refused_by_down(clean: Lab, tmp_path: Path) -> None:
    lab = clean
    assert sk(lab, "up").returncode == 0
    assert sk(lab, "wait", "--timeout", "60", timeout=90).returncode == 0
    r = sk(lab, "--json", "status")
    assert r.returncode == 0 and json.loads(r.stdout)["swapped"] == [], r.stdout + r.stderr  # the control
    swapped = {"SPARKCTL_SSH_CONFIG": str(_swapped_config(lab, tmp_path, "spark2", "spark3"))}
    r = sk(lab, "--json", "status", env=swapped)
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert [(s["node"], s["was"]) for s in doc["swapped"]] == [("spark2", "spark3"), ("spark3", "spark2")]
    r = sk(lab, "status", env=swapped)
    assert r.returncode == 1 and "spark2 now reaches the machine that was spark3" in r.stdout + r.stderr
    before = containers(lab)
    r = sk(lab, "down", env=swapped)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "spark3 now reaches the machine that was spark2" in r.stderr and "down --force" in r.stderr
    assert r.stderr.count("error:") == 1, r.stderr
    assert containers(lab) == before and _holders(lab) == {}
    r = sk(lab, "down", "--force", env=swapped)
    assert r.returncode == 0, r.stdout + r.stderr
    assert containers(lab) == NONE


# 4. every command says "two node names reach the same machine" once.
def test_two_aliases_of_one_machine_are_said_once_by_every_command(clean: Lab, tmp_path: Path) -> None:
    lab = clean
    text = Path(lab.ssh_config).read_text()
    ip2 = re.search(r"Host spark2\n\s+HostName (\S+)", text)
    ip3 = re.search(r"Host spark3\n\s+HostName (\S+)", text)
    assert ip2 and ip3
    cfg = tmp_path / "ssh_config"
    cfg.write_text(text.replace(f"HostName {ip3.group(1)}\n", f"HostName {ip2.group(1)}\n", 1))
    env = {"SPARKCTL_SSH_CONFIG": str(cfg)}
    for cmd in (["down"], ["status"], ["up"], ["check"], ["lock", "status"], ["--json", "down"]):
        r = sk(lab, *cmd, env=env)
        assert r.returncode == 1, (cmd, r.stdout + r.stderr)
        said = r.stdout + r.stderr if cmd[0] != "--json" else r.stderr
        assert said.count("reach the same machine") == 1, (cmd, said)
    assert containers(lab) == NONE


# 5. with the path from spark3 to the head's master cut after the rendezvous, `status` names
# it and exits 1, though every container runs and the head answers.
def test_status_names_the_path_to_the_master_that_is_cut(clean: Lab) -> None:
    from tests.lab.faults import path_dropped

    lab = clean
    assert sk(lab, "up").returncode == 0
    assert sk(lab, "wait", "--timeout", "60", timeout=90).returncode == 0
    r = sk(lab, "--json", "status")
    assert r.returncode == 0, r.stdout + r.stderr  # the control
    assert [(p["node"], p["ok"]) for p in json.loads(r.stdout)["master_paths"]] == \
        [("spark2", True), ("spark3", True), ("spark4", True)]
    with path_dropped(lab, "spark3", "spark1") as ip:
        r = sk(lab, "--json", "status")
        assert r.returncode == 1, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        assert [(p["node"], p["ok"]) for p in doc["master_paths"]] == \
            [("spark2", True), ("spark3", False), ("spark4", True)]
        want = f"rank 2 (spark3) cannot reach the head's master {ip}:{CLUSTER['MASTER_PORT']} on spark1"
        assert any(p.startswith(want) and "the path spark3 → spark1 is cut" in p for p in doc["problems"]), \
            doc["problems"]
        r = sk(lab, "status")
        assert r.returncode == 1 and "spark3 → spark1 is cut" in r.stdout + r.stderr
