"""The supervisor against the lab: a killed rank, a spent restart budget, a host's dockerd restarted,
a person's `down`, and rollback. Real SSH, real Docker engines, the stand-in engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkctl.spec.systemd_unit import unquote_exec
from tests.kit.lab import Lab
from tests.lab.faults import docker_stopped

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
CLUSTER = {"CLUSTER_NAME": "watchlab", "PORT": "18891", "MASTER_PORT": "39511", "STANDIN_LOAD_DELAY_S": "0",
           "WATCH_INTERVAL_S": "0.5", "WATCH_CANARY_S": "2", "WATCH_CANARY_TIMEOUT_S": "10",
           "WATCH_BACKOFF_S": "1", "WATCH_MAX_RESTARTS": "3", "WATCH_NODE_WAIT_S": "120",
           "WATCH_READY_TIMEOUT_S": "60"}


def env(lab: Lab, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**lab.env(), "NODES": " ".join(NODES), **CLUSTER, **(extra or {})}


def sk(lab: Lab, *args: str, extra: dict[str, str] | None = None, timeout: float = 120,
       check: bool = False) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env(lab, extra), capture_output=True,
                       text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, f"sparkctl {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def containers(lab: Lab) -> dict[str, list[str]]:
    return {n: lab.docker(n, "ps", "-aq", "--filter", "label=sparkctl.cluster=watchlab").stdout.split()
            for n in NODES}


def completion_ok(port: int = 18891) -> bool:
    body = json.dumps({"model": "GLM-5.3-EXL3", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://{lab_head_ip()}:{port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:  # noqa: S310 - the lab's head
            return r.status == 200
    except OSError:
        return False


_HEAD: dict[str, str] = {}


def lab_head_ip() -> str:
    return _HEAD["ip"]


def audit_actions(lab: Lab) -> list[dict[str, object]]:
    r = sk(lab, "--json", "audit", "--tail", "500", check=True)
    return [e for e in json.loads(r.stdout)["entries"] if e["node"] == "spark1"]


@pytest.fixture
def served(chain: Lab) -> Iterator[Lab]:
    lab = chain
    _HEAD["ip"] = lab.host("spark1").mgmt_ip
    sk(lab, "lock", "--force-unlock", timeout=30)
    sk(lab, "down", timeout=60)
    sk(lab, "up", check=True)
    sk(lab, "wait", "--timeout", "60", check=True)
    try:
        yield lab
    finally:
        sk(lab, "lock", "--force-unlock", timeout=30)
        sk(lab, "down", timeout=60)
        assert containers(lab) == {n: [] for n in NODES}


def unit_command(lab: Lab) -> tuple[list[str], dict[str, str]]:
    """The `export systemd` unit's ExecStart argv and Environment, as systemd would run them on the head --
    which in the lab is this machine: the head's copies the unit names are the local files its comment says
    they are copied from (`/etc/sparkctl/... <- LOCAL`), and the head's ssh config is the lab's."""
    text = sk(lab, "export", "systemd", "--print", "--sparkctl", f"{sys.executable} -m sparkctl", check=True).stdout
    lines = text.splitlines()
    copies = dict(ln.removeprefix("#").strip().split(" <- ", 1) for ln in lines
                  if ln.startswith("#") and " <- " in ln)
    argv = unquote_exec(next(ln for ln in lines if ln.startswith("ExecStart=")).removeprefix("ExecStart="))
    argv = [copies.get(a, a) for a in argv]
    envs = dict(unquote_exec(ln.removeprefix("Environment="))[0].split("=", 1)
                for ln in lines if ln.startswith("Environment="))
    return argv, {**envs, "SPARKCTL_SSH_CONFIG": lab.env()["SPARKCTL_SSH_CONFIG"]}


def start_watch(lab: Lab, extra: dict[str, str] | None = None, *, via_unit: bool = False) -> subprocess.Popen[str]:
    if via_unit:  # the lab has no systemd: run the unit's ExecStart line directly, in a clean environment
        argv, envs = unit_command(lab)
        assert envs["CLUSTER_NAME"] == "watchlab" and "--env-file" in argv, (argv, envs)
        proc = subprocess.Popen(argv, env={"PATH": os.environ["PATH"], **envs}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    else:
        proc = subprocess.Popen([sys.executable, "-m", "sparkctl", "watch"], env=env(lab, extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until its state file says it watches
        st = json.loads(sk(lab, "--json", "status").stdout or "{}").get("supervisor") or {}
        if st.get("alive") and st.get("state") == "watching":
            return proc
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"watch did not start: {proc.communicate()}")


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.kill()
    return proc.communicate(timeout=10)


def test_killed_rank_restarts_the_group_then_a_down_ends_watch_with_zero(served: Lab) -> None:
    lab = served
    before = containers(lab)
    proc = start_watch(lab, via_unit=True)
    try:
        lab.docker("spark3", "kill", "sparkctl-watchlab-rank2", check=True)
        killed = time.monotonic()
        deadline = killed + 60
        while time.monotonic() < deadline:
            now = containers(lab)
            if all(now[n] and now[n] != before[n] for n in NODES) and completion_ok():
                break
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert all(containers(lab)[n] != before[n] for n in NODES), "the whole group was not restarted"
        assert completion_ok(), f"no completion {took:.1f}s after the kill"
        sup: dict[str, object] = {}
        for _ in range(40):  # its own `wait` ends a moment after our completion
            sup = json.loads(sk(lab, "--json", "status").stdout)["supervisor"] or {}
            if sup.get("state") == "watching":
                break
            time.sleep(0.5)
        assert sup.get("state") == "watching" and sup.get("restarts") == 1, sup
        assert proc.poll() is None, "watch ended after a successful restart"
        down = sk(lab, "down", check=True)
        assert "4/4 nodes clean" in down.stdout
        proc.wait(timeout=30)
        out, err = proc.communicate()
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    assert "stopped on purpose" in err
    assert containers(lab) == {n: [] for n in NODES}, "watch restarted the service after a person's down"
    actions = [e["action"] for e in audit_actions(lab)]
    assert "watch-restart" in actions and "watch-restarted" in actions


def head_health() -> int:
    try:
        with urllib.request.urlopen(f"http://{lab_head_ip()}:18891/health", timeout=2) as r:  # noqa: S310 - the lab's head
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def test_a_dead_worker_behind_a_healthy_head_is_a_broken_service(served: Lab) -> None:
    """vLLM's head keeps /health 200 after a worker died (docs/sources.md, "Real vLLM on CPU"; the stand-in
    does the same): `status` must not trust the head's word and exits 1 naming the rank."""
    lab = served
    lab.docker("spark3", "kill", "sparkctl-watchlab-rank2", check=True)
    time.sleep(4)  # past the stand-in's heartbeat timeout
    assert head_health() == 200
    r = sk(lab, "status")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rank 2 (spark3)" in r.stdout + r.stderr


def test_killed_head_restarts_the_group_and_removes_the_orphaned_workers(served: Lab) -> None:
    """The head killed: vLLM's headless workers stay up, silent (orphans holding their memory). `watch`
    must replace every rank, not start a head beside the old workers."""
    lab = served
    before = containers(lab)
    lab.docker("spark1", "kill", "sparkctl-watchlab-rank0", check=True)
    # the orphan stays up on its own (looked at before watch starts: watch may replace it within the second)
    assert lab.wait_exit("spark2", "sparkctl-watchlab-rank1", 1) is None
    proc = start_watch(lab)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = containers(lab)
            if all(now[n] and now[n] != before[n] for n in NODES) and completion_ok():
                break
            time.sleep(0.2)
        now = containers(lab)
        assert all(len(now[n]) == 1 and not set(now[n]) & set(before[n]) for n in NODES), (before, now)
        assert completion_ok()
    finally:
        out, err = stop(proc)
    assert "rank 0 (spark1)" in err, err


def test_spent_budget_leaves_the_cluster_down_and_exits_non_zero(served: Lab) -> None:
    lab = served
    # The engine crashes at start on spark2: one of its shards is away (restored below).
    model = lab.host("spark2").model_dir
    shard = sorted(model.glob("*.safetensors"))[0]
    aside = Path(str(shard) + ".aside")
    counted = ("watch-restart", "watch-restart-failed", "watch-gave-up")
    before = {a: [e["action"] for e in audit_actions(lab)].count(a) for a in counted}
    proc = start_watch(lab, {"WATCH_MAX_RESTARTS": "2"})
    try:
        shutil.move(shard, aside)
        lab.docker("spark2", "kill", "sparkctl-watchlab-rank1", check=True)
        proc.wait(timeout=90)
        out, err = proc.communicate()
    finally:
        if aside.exists():
            shutil.move(aside, shard)
        stop(proc)
    assert proc.returncode == 1, err
    assert "gave up" in err and "2 restarts within" in err
    assert containers(lab) == {n: [] for n in NODES}, "the cluster was not left down and clean"
    actions = [e["action"] for e in audit_actions(lab)]
    new = {a: actions.count(a) - before[a] for a in counted}  # this cluster's log holds earlier tests' lines
    assert new == {"watch-restart": 2, "watch-restart-failed": 2, "watch-gave-up": 1}, new
    st = json.loads(sk(lab, "--json", "status").stdout)["supervisor"]
    assert st["state"] == "gave-up" and not st["alive"]


def test_dockerd_stopped_and_started_the_group_comes_back_alone(served: Lab) -> None:
    lab = served
    proc = start_watch(lab)
    try:
        with docker_stopped(lab, "spark4"):  # the lab's "reboot": its containers die with the engine
            time.sleep(3)
            assert not completion_ok() or True  # the head may still answer for a moment
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (all(containers(lab).values()) and completion_ok()):
            time.sleep(0.5)
        assert all(containers(lab).values()) and completion_ok(), "the group did not come back"
        assert proc.poll() is None
    finally:
        out, err = stop(proc)
    assert "waiting-for-node" in err or "restart" in err, err


def test_rollback_runs_the_previous_images_content_hash_on_every_rank(served: Lab) -> None:
    lab = served
    hist = json.loads(sk(lab, "--json", "history", check=True).stdout)["history"]
    first = hist[0]
    assert first["image_content_hash"], "the history has no content hash for the running image"
    pinned = f"sparkctl-lab/chain:keys3-{first['image_content_hash'][:12]}"
    for n in NODES:  # `build` tagged the chain by content hash on every rank
        assert lab.docker(n, "image", "inspect", pinned).returncode == 0, (n, pinned)
    # A changed image, as a rebuild makes it: the mutable tag keys3 moves to an image with another hash.
    for n in NODES:
        r = lab.ssh(n, "sh", "-c", 'printf "FROM %s\\nLABEL sparkctl.content-hash=%s\\n" "$1" "$2" '
                    '| docker build -q -t sparkctl-lab/chain:keys3 -', "_", pinned, "sha256:" + "f" * 64,
                    timeout=120)
        assert r.returncode == 0, r.stderr
    try:
        sk(lab, "up", check=True)
        hist = json.loads(sk(lab, "--json", "history", check=True).stdout)["history"]
        assert hist[0]["image_content_hash"] == "f" * 64
        rb = sk(lab, "--json", "rollback", check=True)
        assert json.loads(rb.stdout)["image"] == pinned  # keys3 moved on: the hash tag names the old image
        for i, n in enumerate(NODES):
            label = lab.docker(n, "inspect", "-f", '{{index .Config.Labels "sparkctl.content-hash"}}',
                               f"sparkctl-watchlab-rank{i}").stdout.strip()
            assert label == "sha256:" + first["image_content_hash"], n
        sk(lab, "wait", "--timeout", "60", check=True)
        # exec: an argv, never a shell string; the exit code is the command's
        hostile = "a b;$(touch /tmp/pwned)`id`"
        r = sk(lab, "exec", "--rank", "2", "--", "printf", "%s|", hostile, "--rank")
        assert r.returncode == 0 and r.stdout == f"{hostile}|--rank|", r
        assert sk(lab, "exec", "--rank", "1", "--", "sh", "-c", "exit 7").returncode == 7
        assert lab.docker("spark3", "exec", "sparkctl-watchlab-rank2", "ls", "/tmp/pwned").returncode != 0
    finally:
        sk(lab, "down", timeout=60)
        for n in NODES:  # keys3 back where `build` left it; the test image goes
            lab.docker(n, "tag", pinned, "sparkctl-lab/chain:keys3")
            lab.docker(n, "image", "prune", "-f", "--filter", "label=sparkctl.content-hash=sha256:" + "f" * 64)
