"""What sparkctl reads from the engine, and what the lab's stand-in says, against vLLM 0.33 itself.

- each log pattern of engine_lines matches a format string in the vLLM (or uvicorn) file it names,
  and the stand-in's line for it matches that format string;
- each /metrics name is declared in the vLLM file engine_lines names;
- /v1/models and chat completions: vLLM's own response models accept the stand-in's answers, and
  sparkctl's HeadApi reads documents built by vLLM's models;
- the stand-in's parser takes a production argv to the same values as vLLM's parser.
Needs vLLM (the fidelity venv); skipped without it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")

from sparkctl.facts.engine_lines import FAILURE_MARKERS, METRIC_SOURCES, PHASE_MARKERS  # noqa: E402
from sparkctl.lab import standin_vllm as standin  # noqa: E402
from sparkctl.remote.readiness import HeadApi  # noqa: E402
from tests.fidelity import vllm_serve_flags  # noqa: E402
from tests.unit.test_standin import free_port, wait_status, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.fidelity
STANDIN = Path(standin.__file__)
_SPEC = re.compile(r"%[-#0 +]*\d*(?:\.(\d+))?([sdfr])")


def source_file(rel: str) -> Path:
    top = rel.split("/")[0]
    spec = importlib.util.find_spec(top)
    assert spec is not None and spec.origin, f"{top} is not installed next to vLLM"
    return Path(spec.origin).parent.parent / rel


@cache
def literals(rel: str) -> tuple[str, ...]:
    """Every string constant of a source file (implicitly joined literals come out joined), and every
    f-string as a printf-style format (each `{...}` a `%s`: exceptions' messages are f-strings)."""
    tree = ast.parse(source_file(rel).read_text())
    consts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    fstrings = ["".join(v.value if isinstance(v, ast.Constant) else "%s" for v in n.values)
                for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)]
    return (*consts, *fstrings)


def sample(fmt: str) -> str:
    """A line that printf-style format would print (numbers for numbers, `x` for strings)."""
    def one(m: re.Match[str]) -> str:
        prec, kind = m.group(1), m.group(2)
        if kind == "d":
            return "4"
        if kind == "f":
            return "31" if prec == "0" else "1." + "5" * int(prec or 6)
        return "x"
    return _SPEC.sub(one, fmt)


def as_regex(fmt: str) -> re.Pattern[str]:
    """The format string as a regex of the whole message."""
    parts, last = [], 0
    for m in _SPEC.finditer(fmt):
        parts.append(re.escape(fmt[last:m.start()]))
        parts.append({"d": r"-?\d+", "f": r"-?\d+(?:\.\d+)?"}.get(m.group(2), r".*?"))
        last = m.end()
    parts.append(re.escape(fmt[last:]))
    return re.compile("".join(parts) + r"$")


def formats_for(marker: Any) -> list[str]:
    rx = re.compile(marker.pattern)
    return [s for s in literals(marker.source) if rx.search(sample(s))]


@pytest.mark.parametrize("marker", PHASE_MARKERS + FAILURE_MARKERS, ids=lambda m: m.pattern[:40])
def test_each_log_pattern_matches_a_format_string_in_vllm(marker: Any) -> None:
    assert formats_for(marker), f"{marker.pattern!r} matches no string in {marker.source} (vLLM {vllm.__version__})"


@pytest.mark.parametrize("name", sorted(METRIC_SOURCES))
def test_each_metric_name_is_declared_in_vllm(name: str) -> None:
    declared = name.removesuffix("_total")  # prometheus_client adds _total to a Counter's name
    assert declared in literals(METRIC_SOURCES[name]), f"{declared} not in {METRIC_SOURCES[name]}"


@pytest.fixture(scope="module")
def standin_lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Both ranks' log lines of a two-rank stand-in run on loopback (tp 2, dcp 2)."""
    model = write_checkpoint(tmp_path_factory.mktemp("m"))
    mport, hport = free_port(), free_port()
    common = ["serve", str(model), "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(mport),
              "-tp", "2", "-dcp", "2"]
    env = {"PATH": "/usr/bin:/bin", "GLOO_SOCKET_IFNAME": "lo", "STANDIN_RENDEZVOUS_TIMEOUT_S": "15"}
    procs = [subprocess.Popen([sys.executable, str(STANDIN), *common, "--node-rank", "1", "--headless"], env=env,
                              stderr=subprocess.PIPE, text=True),
             subprocess.Popen([sys.executable, str(STANDIN), *common, "--port", str(hport)], env=env,
                              stderr=subprocess.PIPE, text=True)]
    try:
        assert wait_status(f"http://127.0.0.1:{hport}/health", 200, 20)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
    return [line for p in procs for line in (p.stderr.read() if p.stderr else "").splitlines()]


@pytest.mark.parametrize("marker", [m for m in PHASE_MARKERS if "Capturing CUDA graphs" not in m.pattern],
                         ids=lambda m: m.pattern[:40])
def test_the_standin_prints_each_line_as_vllm_formats_it(marker: Any, standin_lines: list[str]) -> None:
    rx = re.compile(marker.pattern)
    mine = [line.split("] ", 1)[-1].removeprefix("INFO:     ") for line in standin_lines if rx.search(line)]
    assert mine, f"the stand-in never prints {marker.pattern!r}"
    formats = [as_regex(f) for f in formats_for(marker)]
    for msg in mine:
        assert any(f.match(msg) for f in formats), f"{msg!r} is not how vLLM prints it: {formats_for(marker)}"


@pytest.mark.parametrize("case", ["one shard missing", "no shard at all"])
def test_the_standins_load_failures_are_vllms(case: str, tmp_path: Path) -> None:
    """A folder that lacks shards: the stand-in fails the load with the lines vLLM 0.33 prints
    (WorkerProc's "failed to start", then the exception raised by _prepare_weights /
    filter_duplicate_safetensors_files), each matching its format string in vLLM's source."""
    model = write_checkpoint(tmp_path / "m", shards=3)
    for shard in sorted(model.glob("*.safetensors"))[1 if case == "no shard at all" else 2:]:
        shard.unlink()
    if case == "no shard at all":
        next(model.glob("*.safetensors")).unlink()
    res = subprocess.run([sys.executable, str(STANDIN), "serve", str(model), "--port", "0"], capture_output=True,
                         text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 1
    wanted = [FAILURE_MARKERS[2], FAILURE_MARKERS[1 if case == "no shard at all" else 0]]
    for marker in wanted:
        rx = re.compile(marker.pattern)
        mine = [re.sub(r"^\w+(?:\.\w+)*Error: ", "", line.split("] ", 1)[-1])
                for line in res.stderr.splitlines() if rx.search(line)]
        assert mine, f"the stand-in never prints {marker.pattern!r}"
        formats = [as_regex(f) for f in formats_for(marker)]
        for msg in mine:
            assert any(f.match(msg) for f in formats), f"{msg!r} is not how vLLM says it: {formats_for(marker)}"


# --------------------------------------------------------------------------------------------- HTTP shapes
def test_vllm_accepts_the_standins_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
    from vllm.entrypoints.serve.engine.protocol import ModelList

    monkeypatch.setenv("STANDIN_DECODE_TOK_S", "1000")
    monkeypatch.setenv("STANDIN_TTFT_S", "0")
    args = standin.parse_args(["serve", str(write_checkpoint(tmp_path / "m")), "--served-model-name", "lab",
                               "--host", "127.0.0.1", "--port", "0"])
    httpd = standin.make_server(args, standin.Cluster(args), standin.Engine(args))
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        import urllib.request
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:  # noqa: S310 - loopback
            ModelList.model_validate_json(r.read())
        body = json.dumps({"model": "lab", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        req = urllib.request.Request(base + "/v1/chat/completions", data=body.encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback
            ChatCompletionResponse.model_validate_json(r.read())
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_headapi_reads_documents_built_by_vllms_models() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionResponseChoice,
        ChatMessage,
    )
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList, UsageInfo

    docs = {"/v1/models": ModelList(data=[ModelCard(id="GLM-5.3-EXL3")]).model_dump_json(),
            "/v1/chat/completions": ChatCompletionResponse(
                model="GLM-5.3-EXL3", usage=UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3),
                choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(role="assistant", content="Hi there"))],
            ).model_dump_json()}

    class Fixed(BaseHTTPRequestHandler):
        def _send(self) -> None:
            data = docs[self.path].encode()
            if self.command == "POST":
                self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _send  # noqa: N815 - stdlib names

        def log_message(self, *a: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Fixed)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        api = HeadApi(f"http://127.0.0.1:{httpd.server_address[1]}")
        assert api.models() == ["GLM-5.3-EXL3"]
        assert api.chat("GLM-5.3-EXL3", "hi")[0] == "Hi there"
    finally:
        httpd.shutdown()
        httpd.server_close()


# --------------------------------------------------------------------------------------------- flags
PRODUCTION_ARGV = ["/models/glm", "--served-model-name", "GLM-5.3-EXL3", "--port", "8888",
                   "--tensor-parallel-size", "4", "--decode-context-parallel-size", "4", "--dcp-comm-backend", "ag_rs",
                   "--nnodes", "4", "--node-rank", "2", "--master-addr", "10.0.0.1", "--master-port", "29501",
                   "--max-model-len", "1000000", "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "15569972224",
                   "--gpu-memory-utilization", "0.8", "--speculative-config",
                   '{"method":"mtp","num_speculative_tokens":3}', "--trust-remote-code", "--headless",
                   "--no-enable-prefix-caching", "-cc", '{"mode": 3}', "--max-num-seq", "8"]


def test_the_standin_parses_argv_as_vllm_does() -> None:
    real = vars(vllm_serve_flags.serve_parser().parse_args(PRODUCTION_ARGV))
    mine = vars(standin.parse_args(["serve", *PRODUCTION_ARGV]))
    for dest, conv in (("tensor_parallel_size", int), ("decode_context_parallel_size", int), ("nnodes", int),
                       ("node_rank", int), ("master_addr", str), ("master_port", int), ("port", int),
                       ("headless", bool), ("gpu_memory_utilization", float), ("kv_cache_dtype", str),
                       ("kv_cache_memory_bytes", int), ("max_model_len", int), ("enable_prefix_caching", bool),
                       ("max_num_seqs", int), ("dcp_comm_backend", str), ("trust_remote_code", bool)):
        assert conv(mine[dest]) == conv(real[dest]), dest
    assert mine["served_model_name"] == list(real["served_model_name"])
    assert mine["speculative_config"] == dict(real["speculative_config"])
    assert mine["model"] == real["model_tag"]
