"""On the lab: signals, crashes, one machine under two names, what a rollback leaves,
misspelt keys, the disk the engine really uses. Each test reproduces a failure the code once had
(noted on each test) and passes now.

Its own cluster name and ports, so it never touches another test's service.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkctl.lab import hosts
from sparkctl.lab.proc import read_pid
from sparkctl.lab.state import HostPaths, HostSpec
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
CLUSTER = {"CLUSTER_NAME": "signals", "PORT": "18891", "MASTER_PORT": "39511"}
LABEL = "label=sparkctl.cluster=signals"


def _env(lab: Lab, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**lab.env(), "NODES": " ".join(NODES), **CLUSTER, **(extra or {})}


def sk(lab: Lab, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=_env(lab, env), capture_output=True,
                          text=True, timeout=timeout)


def start(lab: Lab, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "sparkctl", *args], env=_env(lab, env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def containers(lab: Lab) -> dict[str, list[str]]:
    return {n: lab.docker(n, "ps", "-a", "--filter", LABEL, "--format", "{{.Names}}").stdout.split() for n in NODES}


def running(lab: Lab) -> dict[str, list[str]]:
    return {n: lab.docker(n, "ps", "--filter", LABEL, "--format", "{{.Names}}").stdout.split() for n in NODES}


def rank_containers(lab: Lab) -> dict[str, list[str]]:
    """Only the ranks' containers (the argv judge's short-lived one on the head carries the cluster label too)."""
    return {n: lab.docker(n, "ps", "-a", "--filter", LABEL, "--filter", "label=sparkctl.rank", "--format",
                          "{{.Names}}").stdout.split() for n in NODES}


def wait_for_first_container(lab: Lab, proc: subprocess.Popen[str], node: str | None = None) -> bool:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        c = rank_containers(lab)
        if (c[node] if node else any(c.values())):
            return True
        time.sleep(0.02)
    return False


def lock_free(lab: Lab) -> bool:
    r = sk(lab, "--json", "lock", "status", timeout=30)
    return json.loads(r.stdout)["locked"] is False


NONE = {n: [] for n in NODES}
SERVICE = {n: [f"sparkctl-signals-rank{i}"] for i, n in enumerate(NODES)}


@pytest.fixture
def clean(chain: Lab) -> Iterator[Lab]:
    lab = chain
    sk(lab, "lock", "--force-unlock", timeout=30)
    sk(lab, "down", timeout=60)
    try:
        yield lab
    finally:
        sk(lab, "lock", "--force-unlock", timeout=30)
        sk(lab, "down", timeout=60)
        assert containers(lab) == NONE


# 1. before the fix: exit 143 with the lock held; `down` left all four containers running.
def test_sigterm_during_up_rolls_back_and_frees_the_lock(clean: Lab) -> None:
    lab = clean
    proc = start(lab, "up")
    assert wait_for_first_container(lab, proc), "up never started a container"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, out + err
    assert containers(lab) == NONE
    assert lock_free(lab)
    assert "rolling back" in out + err


def test_sigterm_during_down_finishes_it_and_frees_the_lock(clean: Lab) -> None:
    lab = clean
    assert sk(lab, "up").returncode == 0
    proc = start(lab, "down")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None and running(lab) == SERVICE:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=90)
    # Interrupted before removing anything (143: the service stays), or after it started (finishes: 0).
    assert (proc.returncode, containers(lab)) in ((0, NONE), (143, SERVICE)), (proc.returncode, out + err)
    assert lock_free(lab)


# 2. before the fix: the lock stayed held by the dead pid (`lock status` did not say it was dead), and
# after a forced unlock `up` adopted the crashed run's containers with no audit line.
def test_kill9_mid_up_dead_holder_broken_and_orphans_replaced(clean: Lab) -> None:
    lab = clean
    proc = start(lab, "up")
    assert wait_for_first_container(lab, proc)
    time.sleep(0.5)
    proc.kill()
    proc.communicate(timeout=30)
    status = sk(lab, "lock", "status", timeout=30)
    assert "dead" in status.stdout and "gone" in status.stdout, status.stdout + status.stderr
    up = sk(lab, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    assert running(lab) == SERVICE
    audit = sk(lab, "--json", "audit", "--tail", "200")
    actions = [e["action"] for e in json.loads(audit.stdout)["entries"]]
    assert "lock-broken" in actions
    # The crash left at least one container without an `up` record: it was replaced, audited as such.
    assert "orphan" in up.stdout + up.stderr and "orphan-removed" in actions, up.stdout + up.stderr


# 3. before the fix: `check` was all ✓ and `up` ran ranks 1 and 2 both on spark2.
def test_two_aliases_of_one_machine_are_refused(clean: Lab, tmp_path: Path) -> None:
    lab = clean
    text = Path(lab.ssh_config).read_text()
    ip2 = re.search(r"Host spark2\n\s+HostName (\S+)", text)
    ip3 = re.search(r"Host spark3\n\s+HostName (\S+)", text)
    assert ip2 and ip3
    cfg = tmp_path / "ssh_config"
    cfg.write_text(text.replace(f"HostName {ip3.group(1)}\n", f"HostName {ip2.group(1)}\n", 1))
    env = {"SPARKCTL_SSH_CONFIG": str(cfg)}
    for cmd in (["check"], ["up"], ["status"]):
        r = sk(lab, *cmd, env=env)
        assert r.returncode == 1, (cmd, r.stdout + r.stderr)
        assert "spark2" in r.stderr and "spark3" in r.stderr and "same machine" in r.stderr, r.stderr
        assert f"HostName {ip2.group(1)}" in r.stderr
    assert containers(lab) == NONE


# 4. before the fix: Ctrl-C during the start phase exited 1, and a second one could abort the rollback.
def test_second_sigint_during_rollback_is_noted_and_the_rollback_finishes(clean: Lab) -> None:
    lab = clean
    proc = start(lab, "up")
    assert wait_for_first_container(lab, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.15)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, out + err
    assert containers(lab) == NONE
    assert lock_free(lab)


# 5. before the fix: dockerd killed on spark3 mid-`up`: spark3 named, but not its rank-2 container.
def test_rollback_names_what_it_could_not_remove(clean: Lab) -> None:
    lab = clean
    paths, spec = HostPaths.of("spark3", lab.root), HostSpec.of(3)
    proc = start(lab, "up")
    try:
        assert wait_for_first_container(lab, proc, "spark3")
        pid = read_pid(paths.docker_pid)
        assert pid
        os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, out + err
        text = out + err
        line = next((ln for ln in text.splitlines() if ln.strip().startswith("spark3:") and "NOT clean" in ln), "")
        assert "sparkctl-signals-rank2" in line, text
        # The others are clean: each says what it removed (or that the head had not started yet).
        assert all(f"{n}: removed sparkctl-signals-rank{i}" in text for i, n in ((1, "spark2"), (3, "spark4"))), text
        assert "spark1: nothing to remove" in text or "spark1: removed sparkctl-signals-rank0" in text, text
    finally:
        if proc.poll() is None:
            proc.kill()
        hosts.start_docker(paths, spec)


# 6. before the fix: MAX_MODEL_LENGTH=4096 was a warning and `up` deployed --max-model-len 32768.
def test_misspelt_key_refused_by_up_and_down_warned_by_status(clean: Lab, tmp_path: Path) -> None:
    lab = clean
    env_file = tmp_path / "env"
    env_file.write_text(Path(lab.env_file).read_text() + "\nMAX_MODEL_LENGTH=4096\n")
    env = {"SPARKCTL_ENV_FILE": str(env_file)}
    for cmd in ("up", "down"):
        r = sk(lab, cmd, env=env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "MAX_MODEL_LENGTH" in r.stderr and "did you mean MAX_MODEL_LEN" in r.stderr
        assert "Traceback" not in r.stderr
    assert containers(lab) == NONE
    r = sk(lab, "config", env=env)
    assert r.returncode == 0 and "MAX_MODEL_LENGTH" in r.stderr


# 7. before the fix: the disk check measured /var/lib/docker (walking up to /), not the engine's data root.
def test_disk_check_measures_the_engines_data_root(clean: Lab) -> None:
    lab = clean
    r = sk(lab, "--json", "check", timeout=300)
    doc = json.loads(r.stdout)
    disk = [f for f in doc["findings"] if f["check"] == "disk"]
    assert len(disk) == len(NODES), disk
    for f in disk:
        root = str(lab.host(f["node"]).docker_root)
        assert f"the Docker data root {root}" in f["reason"], f
        assert "MODEL /models/lab" in f["reason"], f
