"""Two replicas of the TP4 service on eight lab hosts, served as one endpoint by the real nginx.

The lab grows to 8 hosts for this module (`lab up --nodes 8`: TP=4, so its env file holds 2 replicas)
and shrinks back to 4 after, as the other lab tests expect. Real SSH, real Docker engines, the
stand-in engine, the real nginx with the config `sparkctl endpoint` renders.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

EIGHT = [f"spark{i}" for i in range(1, 9)]
HEADS = ("spark1", "spark5")
CLUSTER = {"CLUSTER_NAME": "replicas", "PORT": "18951", "MASTER_PORT": "39551", "STANDIN_LOAD_DELAY_S": "0"}


@pytest.fixture(scope="module")
def eight(lab: Lab) -> Iterator[Lab]:
    from sparkctl.lab import manage

    manage.up(nodes=8)
    try:
        grown = Lab.load()
        r = sk(grown, "build", timeout=900)  # the chain on spark5..8 (spark1..4: up to date, skipped)
        assert r.returncode == 0, r.stderr
        yield grown
    finally:
        sk(Lab.load(), "down")
        manage.up(nodes=4)  # removes spark5..8 and rewrites the env file for 4 hosts


def sk(lab: Lab, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """The real CLI on the lab's env file as `lab up --nodes 8` wrote it (NODES: 8 hosts, TP=4)."""
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env={**lab.env(), **CLUSTER},
                          capture_output=True, text=True, timeout=timeout)


def containers(lab: Lab, name: str) -> list[dict[str, str]]:
    """The labels of the running containers of this module's cluster on host `name`."""
    ids = lab.docker(name, "ps", "-q", "--filter", "label=sparkctl.cluster=replicas").stdout.split()
    if not ids:
        return []
    docs = json.loads(lab.docker(name, "inspect", *ids).stdout)
    return [d["Config"]["Labels"] for d in docs]


def accepted(lab: Lab) -> dict[str, int]:
    return {n: lab.host(n).sshd_log.read_text(errors="replace").count("Accepted publickey") for n in EIGHT}


def api_hits(lab: Lab, head: str) -> int:
    logs = lab.docker(head, "logs", "sparkctl-replicas-rank0").stdout + lab.docker(
        head, "logs", "sparkctl-replicas-rank0").stderr
    return logs.count('"GET /v1/models')


def chat_hits(lab: Lab, head: str) -> int:
    r = lab.docker(head, "logs", "sparkctl-replicas-rank0")
    return (r.stdout + r.stderr).count('"POST /v1/chat/completions')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_replicas_start_wait_serve_through_one_endpoint_and_go(eight: Lab, tmp_path: Path) -> None:
    lab = eight
    before = accepted(lab)
    up = sk(lab, "--json", "up")
    assert up.returncode == 0, up.stderr
    time.sleep(0.3)  # sshd logs asynchronously
    assert {n: c - before[n] for n, c in accepted(lab).items()} == dict.fromkeys(EIGHT, 1), \
        "up opens exactly one SSH connection per host, for both replicas"
    doc = json.loads(up.stdout)
    assert [(r["replica"], r["head"], r["ok"]) for r in doc["replicas"]] == [(0, "spark1", True), (1, "spark5", True)]
    for i, n in enumerate(EIGHT):
        (labels,) = containers(lab, n)
        assert (labels["sparkctl.replica"], labels["sparkctl.rank"]) == (str(i // 4), str(i % 4)), (n, labels)

    wait = sk(lab, "wait", "--timeout", "90")
    assert wait.returncode == 0, wait.stderr
    assert "replica 0 ready" in wait.stdout + wait.stderr and "replica 1 ready" in wait.stdout + wait.stderr
    status = sk(lab, "--json", "status")
    assert status.returncode == 0, status.stderr

    # bench measures both replicas' heads together and adds them up (the chat completions each head logged)
    chats0 = {h: chat_hits(lab, h) for h in HEADS}
    bench = sk(lab, "--json", "bench", "--workload", "prose", "--concurrency", "1,2", "--requests", "2",
               "--warmup", "0", "--max-tokens", "8")
    assert bench.returncode == 0, bench.stderr
    bdoc = json.loads(bench.stdout)
    assert [(r["replica"], r["head"]) for r in bdoc["replicas"]] == [(0, "spark1"), (1, "spark5")]
    assert {h: chat_hits(lab, h) - chats0[h] for h in HEADS} == dict.fromkeys(HEADS, 4), "2 requests per level each"
    for level in bdoc["total"]["workloads"]["prose"]:
        per = [lv for r in bdoc["replicas"] for lv in r["workloads"]["prose"] if lv["concurrency"] == level["concurrency"]]
        assert level["ok"] == 4 and level["agg_tok_s"] == pytest.approx(sum(lv["agg_tok_s"] for lv in per), abs=0.01)

    if shutil.which("nginx") is None:
        assert os.environ.get("CI") != "true", "nginx is missing: ./one-shot.sh test installs it"
        pytest.skip("nginx is not installed (apt-get install nginx)")
    port = free_port()
    conf = tmp_path / "nginx.conf"
    ep = sk(lab, "endpoint", "--out", str(conf), "--listen", str(port), "--bind", "127.0.0.1",
            "--state-dir", str(tmp_path))
    assert ep.returncode == 0, ep.stderr
    hits0 = {h: api_hits(lab, h) for h in HEADS}
    nginx = subprocess.Popen(["nginx", "-c", str(conf), "-e", str(tmp_path / "error.log"), "-g", "daemon off;"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert nginx.poll() is None, nginx.stderr.read() if nginx.stderr else ""
                assert time.monotonic() < deadline, "nginx did not listen within 10 s"
                time.sleep(0.05)
        for _ in range(8):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
                assert resp.status == 200 and "data" in json.loads(resp.read())
        hits = {h: api_hits(lab, h) - hits0[h] for h in HEADS}
        assert all(v > 0 for v in hits.values()) and sum(hits.values()) >= 8, \
            f"the endpoint reached only some replicas' heads: {hits}"
        # One replica's head goes away: the endpoint keeps answering from the other.
        lab.docker("spark5", "stop", "-t", "1", "sparkctl-replicas-rank0")
        for _ in range(4):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
                assert resp.status == 200
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)

    down = sk(lab, "down")
    assert down.returncode == 0, down.stderr
    assert all(containers(lab, n) == [] for n in EIGHT)
