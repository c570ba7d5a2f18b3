"""Two replicas of a TP4 service on eight local nodes (tests/unit/localnodes.py): `up` starts both on one
Cluster, and a replica whose start fails is rolled back alone while the other keeps running (exit 1)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

NODES = [f"spark{i}" for i in range(1, 9)]


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    with served_scene(monkeypatch, tmp_path, NODES, {"SERVED_MODEL_NAME": "lab-model", "VLLM_API_KEY": "k-local"},
                      unset=("SPARKCTL_ENV_FILE", "TP", "DCP", "VLLM_API_KEY", "REPLICAS")) as ln:
        (ln.root / "docker-calls.jsonl").unlink()
        yield ln


def labels(ln: LocalNodes, name: str) -> list[dict[str, str]]:
    r = ln.docker(name, "ps", "-aq", "--filter", "label=sparkctl.cluster=t")
    out = []
    for cid in r.stdout.split():
        doc = json.loads(ln.docker(name, "inspect", cid).stdout)[0]
        out.append(doc["Config"]["Labels"])
    return out


def test_up_starts_two_replicas_each_on_its_own_nodes(nodes: LocalNodes, capsys: Any) -> None:
    code, out, err = run(["--json", "up"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert [(r["replica"], r["head"], r["ok"], r["changed"]) for r in doc["replicas"]] == [
        (0, "spark1", True, True), (1, "spark5", True, True)]
    for i, n in enumerate(NODES):
        (lab,) = labels(nodes, n)
        assert (lab["sparkctl.replica"], lab["sparkctl.rank"]) == (str(i // 4), str(i % 4))
    assert Path("env/env.tp4").exists() and Path("env/env.tp4.replica1").exists()
    code, out, err = run(["--json", "up"], capsys)  # the same again: nothing changes on either
    assert code == 0, err
    assert [r["changed"] for r in json.loads(out)["replicas"]] == [False, False]


def test_a_failed_replica_is_rolled_back_alone_and_up_exits_1(nodes: LocalNodes, capsys: Any) -> None:
    (nodes.root / "docker-fail-spark7").touch()  # replica 1's rank 2 cannot start
    code, out, err = run(["up"], capsys)
    assert code == 1
    assert "replica 1 failed and was rolled back; replica 0 runs" in err
    assert "stub refuses to run here" in err
    assert all(len(labels(nodes, n)) == 1 for n in NODES[:4]), "replica 0 does not run"
    assert all(labels(nodes, n) == [] for n in NODES[4:]), "a container of replica 1 survived its rollback"
    assert "up: replica 0 (head spark1): 4 ranks started" in out


def test_up_json_reports_the_failed_replica(nodes: LocalNodes, capsys: Any) -> None:
    (nodes.root / "docker-fail-spark2").touch()  # replica 0 fails this time
    code, out, err = run(["--json", "up"], capsys)
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    assert [(r["replica"], r["ok"]) for r in doc["replicas"]] == [(0, False), (1, True)]
    assert doc["replicas"][0]["rolled_back"] and "spark2" in doc["replicas"][0]["error"]
    assert "replica 0 failed and was rolled back; replica 1 runs" in err
    assert all(labels(nodes, n) == [] for n in NODES[:4]) and all(len(labels(nodes, n)) == 1 for n in NODES[4:])


def calls(ln: LocalNodes, verb: str) -> list[tuple[str, int]]:
    return [(c["node"], c["seq"]) for c in ln.docker_calls() if c["argv"][:1] == [verb]]


def test_down_removes_every_replica_heads_first(nodes: LocalNodes, capsys: Any) -> None:
    assert run(["up"], capsys)[0] == 0
    code, out, err = run(["down"], capsys)
    assert code == 0, err
    removed = calls(nodes, "rm")
    last_head = max(seq for n, seq in removed if n in ("spark1", "spark5"))
    assert all(last_head < seq for n, seq in removed if n not in ("spark1", "spark5")), removed
    assert all(labels(nodes, n) == [] for n in NODES)


def test_logs_and_status_per_replica(nodes: LocalNodes, capsys: Any) -> None:
    assert run(["up"], capsys)[0] == 0
    code, out, err = run(["logs", "--replica", "1", "--rank", "2", "--tail", "3"], capsys)
    assert code == 0, err
    assert out and all(ln.startswith("[2 spark7] ") for ln in out.splitlines()), out
    logs = [c for c in nodes.docker_calls() if c["argv"][:1] == ["logs"]]
    assert [c["node"] for c in logs] == ["spark7"]
    code, _, err = run(["logs", "--replica", "2"], capsys)
    assert code == 2 and "replica 2 does not exist: there are 2" in err
    code, out, err = run(["--json", "status"], capsys)  # no API answers here: not serving, exit 1
    assert code == 1
    doc = json.loads(out)
    assert (doc["total"], doc["serving"], doc["ok"]) == (2, 0, False)
    for rep in doc["replicas"]:
        assert [(r["rank"], r["node"], r["state"]) for r in rep["ranks"]] == [
            (k, NODES[rep["replica"] * 4 + k], "running") for k in range(4)]
        assert all(r["config_current"] for r in rep["ranks"]), rep["problems"]
    assert any(p.startswith("replica 1: head /health") for p in doc["problems"])


def test_check_reads_the_listening_ports_of_every_replicas_head(nodes: LocalNodes, capsys: Any) -> None:
    """The demo on 8 lab hosts failed `check` with "spark5 ports: could not read listening": the probe
    asked only replica 0's head for its listening ports, the rule judged every head's."""
    code, out, err = run(["--json", "check"], capsys)
    doc = json.loads(out)
    ports = {f["node"]: f for f in doc["findings"] if f["check"] == "ports"}
    assert ports["spark1"]["status"] == "ok" and ports["spark5"]["status"] == "ok", (ports, err)


def test_check_writes_each_replicas_env_file_from_its_own_nodes_pins(nodes: LocalNodes, capsys: Any) -> None:
    """check (its --render: the local stand-ins fail other rules) writes env.tp4 for replica 0 and
    env.tp4.replica1 for replica 1, each naming its own head and the pins found on its own nodes."""
    run(["check", "--render"], capsys)
    first, second = Path("env/env.tp4").read_text(), Path("env/env.tp4.replica1").read_text()
    ip = {f: next(ln for ln in text.splitlines() if ln.startswith("RANK0_FABRIC_IP=")) for f, text in
          (("0", first), ("1", second))}
    assert ip["0"] != ip["1"], ip
    assert "spark5" in second and "spark5" not in first


def test_a_signal_while_replicas_start_leaves_each_replica_whole_or_gone(nodes: LocalNodes, capsys: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT reaches the main thread while the replicas start on pool threads. `up` lets every start
    settle before it leaves the lock and closes the connections: each replica ends fully running (a
    replica reached its point of no return: the signal is a note, exit 0) or rolled back -- never a
    part of one, and the lock is released."""
    import os
    import signal
    import time

    from sparkctl.orchestrate import up as orchestrate_up

    real = orchestrate_up.start_service

    def start(cluster: Any, view: Any, **kw: Any) -> Any:
        if view.replica_index == 1:
            os.kill(os.getpid(), signal.SIGINT)  # handled on the main thread, now waiting for us
            time.sleep(0.5)
        return real(cluster, view, **kw)

    monkeypatch.setattr(orchestrate_up, "start_service", start)
    code, out, err = run(["up"], capsys)
    per_replica = [[len(labels(nodes, n)) for n in NODES[i * 4:(i + 1) * 4]] for i in (0, 1)]
    assert all(c in ([1] * 4, [0] * 4) for c in per_replica), (per_replica, code, err)
    assert code in (0, 130), err
    if code == 0:
        assert per_replica == [[1] * 4, [1] * 4], err
    assert not any((nodes.home(n) / ".sparkctl" / "t" / "lock").exists() for n in NODES), "the lock is held"
