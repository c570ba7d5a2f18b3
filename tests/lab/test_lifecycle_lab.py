"""The service lifecycle against the lab: real SSH, real Docker engines, the stand-in engine.

After every test no sparkctl container remains on any host (the `clean` fixture proves it), unless
the test says the service should still be up. The model folders' checksums never change.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.kit.lab import Lab
from tests.lab.faults import link_down, sshd_stopped

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
# Its own cluster name and ports, so these tests never touch another test's service or containers.
CLUSTER = {"CLUSTER_NAME": "lifecycle", "PORT": "18888", "MASTER_PORT": "39501"}


def sk(lab: Lab, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
       check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the real CLI against the lab's first four hosts."""
    full = {**lab.env(), "NODES": " ".join(NODES), **CLUSTER, **(env or {})}
    r = subprocess.run([sys.executable, "-m", "sparkctl", *args], env=full, capture_output=True, text=True,
                       timeout=timeout)
    if check:
        assert r.returncode == 0, f"sparkctl {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def sparkctl_containers(lab: Lab) -> dict[str, list[str]]:
    out = {}
    for n in NODES:
        r = lab.docker(n, "ps", "-a", "--filter", "label=sparkctl.cluster=lifecycle", "--format", "{{.Names}}")
        out[n] = r.stdout.split()
    return out


def model_digest(lab: Lab) -> str:
    h = hashlib.sha256()
    for n in NODES:
        root = lab.host(n).model_dir
        for p in sorted(root.rglob("*")):
            if p.is_file():
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def clean(chain: Lab) -> Iterator[Lab]:
    lab = chain
    before = model_digest(lab)
    sk(lab, "down", timeout=60)
    try:
        yield lab
    finally:
        sk(lab, "lock", "--force-unlock", timeout=30)
        sk(lab, "down", timeout=60)
        assert sparkctl_containers(lab) == {n: [] for n in NODES}
        assert model_digest(lab) == before, "the model folders changed"


def test_happy_path_up_wait_status_logs_down(clean: Lab) -> None:
    lab = clean
    up = sk(lab, "up", check=True)
    assert "4 ranks started" in up.stdout
    assert sparkctl_containers(lab) == {n: [f"sparkctl-lifecycle-rank{i}"] for i, n in enumerate(NODES)}

    wait = sk(lab, "wait", "--timeout", "60", check=True)
    assert "ready after" in wait.stdout and "completion (" in wait.stdout

    status = sk(lab, "--json", "status")
    doc = json.loads(status.stdout)
    assert [r["state"] for r in doc["ranks"]] == ["running"] * 4
    assert doc["head"]["health"] == 200 and "GLM-5.3-EXL3" in doc["head"]["models"]
    assert all(r["config_current"] for r in doc["ranks"])

    logs = sk(lab, "logs", "--tail", "5", check=True)
    for i, n in enumerate(NODES):
        assert f"[{i} {n}" in logs.stdout

    again = sk(lab, "up", check=True)
    assert "nothing changed" in again.stdout

    audit = sk(lab, "--json", "audit", check=True)
    actions = [(e["node"], e["action"]) for e in json.loads(audit.stdout)["entries"]]
    assert all((n, "up") in actions for n in NODES)

    down = sk(lab, "down", check=True)
    assert "4/4 nodes clean" in down.stdout
    assert sparkctl_containers(lab) == {n: [] for n in NODES}
    assert sk(lab, "down").returncode == 0  # idempotent


def test_changed_knob_replaces_the_service(clean: Lab) -> None:
    lab = clean
    first = json.loads(sk(lab, "--json", "up", check=True).stdout)
    second = sk(lab, "--json", "up", env={"MAX_MODEL_LEN": "16384"}, check=True)
    doc = json.loads(second.stdout)
    assert doc["changed"] and doc["config_hash"] != first["config_hash"]
    assert any("config changed" in r for r in doc["reasons"])
    labels = lab.docker("spark2", "inspect", "-f", '{{index .Config.Labels "sparkctl.config-hash"}}',
                        "sparkctl-lifecycle-rank1").stdout.strip()
    assert labels == doc["config_hash"]


def test_worker_killed_during_wait_fails_within_5s_naming_the_rank(clean: Lab) -> None:
    lab = clean
    sk(lab, "up", env={"STANDIN_LOAD_DELAY_S": "30"}, check=True)
    proc = subprocess.Popen([sys.executable, "-m", "sparkctl", "wait", "--timeout", "60"],
                            env={**lab.env(), "NODES": " ".join(NODES), **CLUSTER, "STANDIN_LOAD_DELAY_S": "30"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)
        killed_at = time.monotonic()
        lab.docker("spark3", "kill", "sparkctl-lifecycle-rank2")
        out, err = proc.communicate(timeout=20)
        noticed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out + err
    assert "rank 2 on spark3 died" in err
    assert noticed < 5.0, f"wait took {noticed:.1f}s to notice"


def test_fabric_interface_down_refuses_before_starting(clean: Lab) -> None:
    lab = clean
    with link_down(lab, "spark4") as iface:
        r = sk(lab, "up")
    assert r.returncode == 1
    assert "spark4" in r.stderr and iface in r.stderr
    assert sparkctl_containers(lab) == {n: [] for n in NODES}


def test_sshd_stopped_is_a_clean_refusal(clean: Lab) -> None:
    lab = clean
    with sshd_stopped(lab, "spark3"):
        r = sk(lab, "up", timeout=60)
    assert r.returncode == 1 and "spark3" in r.stderr and "nothing was changed" in r.stderr
    assert sparkctl_containers(lab) == {n: [] for n in NODES}


def test_two_ups_at_once_never_make_two_services(clean: Lab) -> None:
    lab = clean
    env = {**lab.env(), "NODES": " ".join(NODES), **CLUSTER}
    procs = [subprocess.Popen([sys.executable, "-m", "sparkctl", "up"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    # Either one held the lock and the other was refused naming the holder, or they ran one after the
    # other (the second then found the identical service): never two services.
    outs = sorted(o for o, _ in results)
    if codes == [0, 1]:
        err = next(e for p, (_, e) in zip(procs, results, strict=True) if p.returncode == 1)
        assert "locked" in err and "running `up`" in err
    else:  # one after the other: exactly one started the ranks, the other found them and changed nothing
        assert codes == [0, 0]
        assert sum("4 ranks started" in o for o in outs) == 1, outs
        assert sum("already running" in o and "nothing changed" in o for o in outs) == 1, outs
    assert sparkctl_containers(lab) == {n: [f"sparkctl-lifecycle-rank{i}"] for i, n in enumerate(NODES)}


def test_sigint_during_up_rolls_back(clean: Lab) -> None:
    lab = clean
    env = {**lab.env(), "NODES": " ".join(NODES), **CLUSTER}
    # Interrupt as soon as the first worker has started (watch the engines from this machine).
    proc = subprocess.Popen([sys.executable, "-m", "sparkctl", "up"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if any(sparkctl_containers(lab).values()):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("up finished before the interrupt arrived (machine too fast to interrupt mid-way)")
    assert proc.returncode == 130 and "interrupted (SIGINT)" in err, (proc.returncode, out + err)  # signals.py
    assert sparkctl_containers(lab) == {n: [] for n in NODES}
    assert json.loads(sk(lab, "--json", "lock", "status").stdout)["locked"] is False


def test_down_with_one_host_unreachable_downs_the_rest(clean: Lab) -> None:
    lab = clean
    sk(lab, "up", check=True)
    with sshd_stopped(lab, "spark2"):
        r = sk(lab, "down", timeout=60)
        left = sparkctl_containers(lab)
    assert r.returncode == 1 and "spark2" in r.stdout
    assert left["spark2"] == ["sparkctl-lifecycle-rank1"]
    assert all(left[n] == [] for n in NODES if n != "spark2")


def test_down_leaves_foreign_containers_alone(clean: Lab) -> None:
    lab = clean
    lab.docker("spark1", "run", "-d", "--name", "foreign", "--label", "app=other", "sparkctl-lab/base:bookworm",
               "sleep", "300", timeout=60)
    try:
        sk(lab, "up", check=True)
        sk(lab, "down", check=True)
        names = lab.docker("spark1", "ps", "--format", "{{.Names}}").stdout.split()
        assert "foreign" in names
    finally:
        lab.docker("spark1", "rm", "-f", "foreign")


def test_model_is_read_only_in_every_container(clean: Lab) -> None:
    lab = clean
    sk(lab, "up", check=True)
    for rank, node in enumerate(NODES):
        name = f"sparkctl-lifecycle-rank{rank}"
        # Writing a new file, an existing file and the folder's metadata all fail, even as root.
        r = lab.docker(node, "exec", name, "sh", "-c",
                       "for f in /models/lab/x /models/lab/config.json; do (echo x >> $f) 2>&1; echo rc=$?; done; "
                       "touch /models/lab 2>&1; echo rc=$?")
        assert r.stdout.count("Read-only file system") == 3 and "rc=0" not in r.stdout, f"{node}: {r.stdout}"
        mounts = json.loads(lab.docker(node, "inspect", "-f", "{{json .Mounts}}", name).stdout)
        assert [m["RW"] for m in mounts if m["Destination"] == "/models/lab"] == [False], f"{node}: {mounts}"

