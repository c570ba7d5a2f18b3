"""What every real-engine lab test shares (tests/lab/test_realengine*_lab.py): the `real` fixture (`lab up
--engine vllm` on the running lab, the image loaded only on the hosts the tests use), the cluster's settings,
and small helpers around the CLI and the lab hosts. tests/lab/conftest.py imports the fixture, so every lab
test can ask for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.lab import Lab

START_S = 600  # one start of two real ranks, on a loaded 2-CPU machine: 37-95 s seen, 600 allowed
PORT = 18931
CLUSTER = {"CLUSTER_NAME": "vllmlab", "PORT": str(PORT), "MASTER_PORT": "39531", "TP": "2",
           "WATCH_INTERVAL_S": "1", "WATCH_CANARY_S": "30", "WATCH_CANARY_TIMEOUT_S": "60",
           "WATCH_BACKOFF_S": "1", "WATCH_MAX_RESTARTS": "3", "WATCH_NODE_WAIT_S": "120",
           "WATCH_READY_TIMEOUT_S": str(START_S)}
# spark1 and spark3: spark3 carries its fabric address on its second port, so the discovered Gloo pin is the
# interesting one; the real image is loaded on these two hosts only (a load is about 75 s per host here).
PAIR = ["spark1", "spark3"]


@pytest.fixture(scope="module")
def real(lab: Lab) -> Iterator[dict[str, str]]:
    """`lab up --engine vllm` on the running lab: the real checkpoint on every host, the real base on PAIR, the
    checkpoint's chain built FROM it there (`build`); the env."""
    from sparkctl.errors import SparkctlError
    from sparkctl.lab import manage

    try:
        files = manage.up(nodes=len(lab.hosts), engine="vllm", engine_hosts=PAIR)
    except SparkctlError as exc:
        if os.environ.get("SPARKCTL_REALENGINE") == "1":
            raise
        pytest.skip(f"the lab's real-engine image cannot be made here: {exc}")
    env = {**lab.env(), "SPARKCTL_ENV_FILE": str(files.vllm_env_file), **CLUSTER, "NODES": " ".join(PAIR)}
    # the checkpoint's chain FROM the real base on both ranks (skipped where its content hash matches)
    r = sk(env, "--json", "build", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in json.loads(r.stdout)["ranks"]:
        for layer in rank["layers"]:
            assert layer["action"] == "skip" or layer["versions"]["vllm"] == "0.32.0+cpu", (rank["node"], layer)
    yield env
    sk(env, "down", timeout=120)


def sk(env: dict[str, str], *args: str, extra: dict[str, str] | None = None, timeout: float = 180
       ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env={**env, **(extra or {})},
                          capture_output=True, text=True, timeout=timeout)


def must(r: subprocess.CompletedProcess[str], what: str) -> str:
    assert r.returncode == 0, f"sparkctl {what} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout + r.stderr


def head_url(lab: Lab, path: str) -> str:
    return f"http://{lab.host(PAIR[0]).mgmt_ip}:{PORT}{path}"


def health(lab: Lab) -> int:
    """The head's /health status code (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(head_url(lab, "/health"), timeout=10) as r:  # noqa: S310 - the lab's head
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def chat(lab: Lab, timeout: float = 60, model: str = "lab-llama") -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": 4}).encode()
    req = urllib.request.Request(head_url(lab, "/v1/chat/completions"), data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the lab's head
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return 0, {}


def rank_containers(lab: Lab, nodes: list[str] = PAIR) -> dict[str, str]:
    out = {}
    for n in nodes:
        # the ranks' only: the argv judge's short-lived container on the head carries the cluster label too
        ids = lab.docker(n, "ps", "-aq", "--filter", "label=sparkctl.cluster=vllmlab",
                         "--filter", "label=sparkctl.rank").stdout.split()
        out[n] = ids[0] if ids else ""
    return out


def up_then_wait_fails(env: dict[str, str]) -> str:
    """`up` (exit 1 when it sees the rank die), else `wait` must fail: what the failing one said."""
    up = sk(env, "up", timeout=300)
    if up.returncode != 0:
        assert up.returncode == 1, up.stdout + up.stderr
        return up.stdout + up.stderr
    w = sk(env, "wait", "--timeout", str(START_S), timeout=START_S + 60)
    assert w.returncode == 1, w.stdout + w.stderr
    return w.stdout + w.stderr


def fresh(env: dict[str, str]) -> None:
    sk(env, "lock", "--force-unlock", timeout=30)
    must(sk(env, "down", timeout=120), "down")


def serve(env: dict[str, str]) -> None:
    fresh(env)
    must(sk(env, "up", timeout=300), "up")
    must(sk(env, "wait", "--timeout", str(START_S), timeout=START_S + 60), "wait")


def watch(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen([sys.executable, "-m", "sparkctl", "watch"], env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def serving_again(lab: Lab, before: dict[str, str], must_change: list[str], deadline_s: float) -> dict[str, str]:
    deadline = time.monotonic() + deadline_s
    now = before
    while time.monotonic() < deadline:
        now = rank_containers(lab)
        if all(now[n] and now[n] != before[n] for n in must_change) and chat(lab, timeout=30)[0] == 200:
            return now
        time.sleep(3)
    raise AssertionError(f"not serving again with new containers on {must_change} within {deadline_s:.0f}s: {now}")
