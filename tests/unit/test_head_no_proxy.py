"""The API key goes to the head and nowhere else: a proxy named by the environment (http_proxy, HTTPS_PROXY,
ALL_PROXY, in either case, with or without a NO_PROXY that leaves the head out) is never used to reach the
head. On loopback: a tiny head that records each request's Authorization header, and a "proxy" listener
that records every byte anyone sends it. `wait`, `status` and `watch` ask through headapi.HeadApi (every
call is made here), `bench` through it and its raw sockets, and `bench --tool llama-benchy` runs the real
llama-benchy (aiohttp, which honours the environment's proxies) when it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sparkctl.loadgen import inputs, level
from sparkctl.loadgen.request import Tokenizer, list_models
from sparkctl.measure import llama_benchy as llamabenchy
from sparkctl.orchestrate import bench as flow
from sparkctl.remote import headapi
from tests.unit.test_bench_load import standin as _standin

standin = _standin  # test_bench_load's stand-in engine on loopback, a module fixture

KEY = "sk-never-to-a-proxy"
PROXY_VARS = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY")


class Listener:
    """A TCP listener on loopback that accepts every connection and records what it is sent (a proxy that
    never answers: a client that used it would fail, or hang until its timeout)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(1.0)
            try:
                self.received.append(conn.recv(65536))
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Listener]:
    """Every proxy variable names the listener; a NO_PROXY in lower case that does not cover loopback."""
    listener = Listener()
    for var in PROXY_VARS:
        monkeypatch.setenv(var, f"http://127.0.0.1:{listener.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.setenv("no_proxy", "corp.example")
    yield listener
    listener.close()


class _Head(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str | None]] = []

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _answer(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization")))
        path = self.path
        if path == "/metrics":
            body, kind = b"vllm:num_requests_running 0\n", "text/plain"
        else:
            doc: dict[str, Any] = {"ok": True}
            if path == "/v1/models":
                doc = {"data": [{"id": "m"}]}
            elif path == "/v1/chat/completions":
                doc = {"choices": [{"message": {"content": "pong"}}]}
            body, kind = json.dumps(doc).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self._answer()


@pytest.fixture
def head() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    seen: list[tuple[str, str | None]] = []
    handler = type("Head", (_Head,), {"seen": seen})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


def test_every_head_api_call_goes_to_the_head_never_to_the_environments_proxy(
        proxy: Listener, head: tuple[str, list[tuple[str, str | None]]]) -> None:
    url, seen = head
    api = headapi.HeadApi(url, KEY, timeout=3)
    assert api.health() == 200
    assert api.models() == ["m"]
    assert api.chat("m", "ping", timeout=3)[0] == "pong"
    assert api.metrics() == "vllm:num_requests_running 0\n"
    assert api.get("/v1/models")[0] == 200
    assert api.post_json("/tokenize", {"prompt": "x"})[0] == 200
    ep = headapi.Endpoint.parse(url)
    assert list_models(ep, KEY, timeout=3) == ["m"]
    assert Tokenizer(ep, "m", KEY, timeout=3)._post("/detokenize", {"tokens": [1]}) == {"ok": True}
    assert proxy.connections == 0 and proxy.received == []
    assert [p for p, _ in seen] == ["/health", "/v1/models", "/v1/chat/completions", "/metrics", "/v1/models",
                                    "/tokenize", "/v1/models", "/detokenize"]
    assert all(auth == f"Bearer {KEY}" for _, auth in seen)


def test_a_netrc_entry_for_the_head_does_not_replace_the_api_key(
        head: tuple[str, list[tuple[str, str | None]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """requests would read ~/.netrc and send its login in place of the Bearer key: not for the head."""
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login someone password hunter2\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    url, seen = head
    assert headapi.HeadApi(url, KEY, timeout=3).models() == ["m"]
    assert seen == [("/v1/models", f"Bearer {KEY}")]


REAL_LLAMA_BENCHY = importlib.util.find_spec("llama_benchy") is not None


def test_bench_reaches_the_head_directly_whatever_the_proxy_environment(standin: str, proxy: Listener) -> None:
    """sparkctl's own load (raw sockets) and --input-len's /tokenize (HeadApi)."""
    cfg = level.BenchConfig(endpoint=headapi.Endpoint.parse(standin), model="m", concurrency=[2], requests=2,
                            warmup=0, max_tokens=8, input_len=16, workloads=[inputs.builtin_workload("prose")],
                            api_key=KEY)
    doc = flow.run_bench(cfg).to_dict()
    assert doc["workloads"]["prose"][0]["completed"] == 2
    assert proxy.connections == 0


@pytest.mark.skipif(not REAL_LLAMA_BENCHY and os.environ.get("CI") != "true",
                    reason="llama-benchy is not installed (the optional extra sparkctl-launcher[llama-benchy])")
def test_llama_benchy_reaches_the_head_directly_whatever_the_proxy_environment(
        standin: str, proxy: Listener, tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers

    words = sorted({w for p in inputs.PROMPTS["prose"] for w in p.split()} | {"[UNK]"})
    tok = HfTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = level.BenchConfig(endpoint=headapi.Endpoint.parse(standin), model="m", concurrency=[2], requests=2,
                            warmup=0, max_tokens=8, input_len=16, workloads=[inputs.builtin_workload("prose")],
                            api_key=KEY)
    doc = {"workloads": {"prose": [{"concurrency": 2, "requests": 2}]}}
    work = tmp_path / "work"
    work.mkdir()
    out, _ = flow.run_llama_benchy(cfg, doc, tmp_path / "tokenizer.json", lambda _s: None, python=sys.executable,
                                   work=work)
    run = llamabenchy.level_of(out["levels"][0]["result"], 2)
    assert run is not None and run["e2e_ttft"]["mean"] > 0
    assert proxy.connections == 0 and not any(KEY.encode() in b for b in proxy.received)


# ---------------------------------------- what runs beside the engine, inside its container, with the key


def _proxy_env(listener: Listener) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "no_proxy": "corp.example",
            **{var: f"http://127.0.0.1:{listener.port}" for var in PROXY_VARS}}


def test_the_lws_readiness_probe_asks_the_engine_directly_whatever_the_pods_proxy_variables(
        proxy: Listener, head: tuple[str, list[tuple[str, str | None]]]) -> None:
    """The probe runs in the leader's container, whose environment may name a proxy (for the hub)."""
    from sparkctl.spec import lws

    url, seen = head
    done = subprocess.run([sys.executable, "-c", lws.READINESS_SCRIPT, "m", url], capture_output=True, timeout=60,
                          env={**_proxy_env(proxy), "VLLM_API_KEY": KEY}, check=False)
    assert done.returncode == 0, done.stderr
    assert seen == [("/v1/models", f"Bearer {KEY}"), ("/v1/chat/completions", f"Bearer {KEY}")]
    assert proxy.connections == 0


def test_vllm_bench_serve_runs_with_no_proxy_variable(proxy: Listener, tmp_path: Path) -> None:
    """`bench --tool vllm` runs `vllm bench serve` in the head's container (the real sh runs the script here,
    the tool stands in as a command that writes its environment): vLLM's client honours the environment's
    proxies, so none reaches it."""
    from sparkctl.measure import vllm_bench as vllmbench

    out = tmp_path / "env.txt"
    argv = vllmbench.exec_argv("c", ["sh", "-c", 'env > "$0"', str(out)])[4:]  # the container's part dropped
    subprocess.run(argv, input=f"{KEY}\n".encode(), env=_proxy_env(proxy), capture_output=True, timeout=60,
                   check=False)
    names = [line.split("=", 1)[0] for line in out.read_text().splitlines()]
    assert "OPENAI_API_KEY" in names
    assert not [n for n in names if n.lower().endswith("_proxy")], names
