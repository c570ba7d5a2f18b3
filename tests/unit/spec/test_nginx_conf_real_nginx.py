"""The real nginx judges the nginx.conf `sparkctl endpoint` renders.

`nginx -t` accepts it, and a running nginx (on loopback, as whoever runs the tests: every path under a
temp dir) spreads requests over two stand-in heads, sends the next request to the head with fewer open
requests while a long completion streams from the other (least_conn), passes Authorization through
unchanged, and hands the client a streamed chunk while the head is still writing (proxy_buffering off).

Skipped only where nginx is not installed and CI is not set: `./one-shot.sh test` as root installs nginx
(one-shot.sh's TEST_PACKAGES), so under CI a missing nginx fails. Every wait is bounded; nginx and the stand-in heads are stopped in `finally`.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sparkctl.spec.nginx_conf import nginx_config

BOUND_S = 10.0  # every wait in this module: a broken proxy fails the test, never hangs it
TOKEN = "Bearer sk-through-the-proxy"


def _nginx() -> str:
    path = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nginx is not installed, and `./one-shot.sh test` as root installs it: the endpoint tests need it")
        pytest.skip("nginx is not installed (apt-get install nginx, or ./one-shot.sh test as root): "
                    "these tests run the real nginx")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nginx_accepts_the_rendered_config(tmp_path: Path) -> None:
    nginx = _nginx()
    state = tmp_path / "state"
    state.mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_config([("127.0.0.1", 8888), ("localhost", 8889), ("::1", 8888)], listen=_free_port(),
                                 api_key_set=True, cluster="lab.a-1", state_dir=str(state)))
    r = subprocess.run([nginx, "-t", "-c", str(conf), "-p", str(state), "-e", str(state / "error.log")],
                       capture_output=True, text=True, timeout=BOUND_S, check=False)
    assert r.returncode == 0, r.stderr
    assert "syntax is ok" in r.stderr


@dataclass
class Head:
    """A stand-in replica head: answers GET /plain with its name, GET /stream with two chunks, the
    second only once `release` is set; records each request's path and Authorization header."""

    name: str
    seen: list[tuple[str, str | None]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    stream_done: threading.Event = field(default_factory=threading.Event)
    server: ThreadingHTTPServer | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.server_address[1])

    def start(self) -> Head:
        head = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked responses and kept-alive connections, like vLLM's

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                head.seen.append((self.path, self.headers.get("Authorization")))
                if self.path == "/stream":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self._chunk(b"data: first\n\n")
                    head.release.wait(BOUND_S)
                    self._chunk(b"data: [DONE]\n\n")
                    self._chunk(b"")
                    head.stream_done.set()
                    return
                body = head.name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[int, list[Head]]]:
    nginx = _nginx()
    heads = [Head("a").start(), Head("b").start()]
    state = tmp_path / "state"
    state.mkdir()
    listen = _free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_config([("127.0.0.1", h.port) for h in heads], listen=listen, listen_host="127.0.0.1",
                                 api_key_set=True, state_dir=str(state)))
    log = (tmp_path / "nginx.out").open("wb")
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(state), "-e", str(state / "error.log"),
                             "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + BOUND_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"nginx exited {proc.returncode}: {(tmp_path / 'nginx.out').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("nginx did not listen within the bound")
                time.sleep(0.05)
        yield listen, heads
    finally:
        proc.terminate()
        try:
            proc.wait(BOUND_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(BOUND_S)
        log.close()
        for h in heads:
            h.stop()


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
    try:
        conn.request("GET", path, headers={"Authorization": TOKEN})
        resp = conn.getresponse()
        assert resp.status == 200, (resp.status, resp.read()[:200])
        return resp.read().decode()
    finally:
        conn.close()


def test_nginx_spreads_requests_over_both_heads_and_passes_the_key(proxy: tuple[int, list[Head]]) -> None:
    port, heads = proxy
    answers = [_get(port, "/plain") for _ in range(6)]
    assert set(answers) == {"a", "b"}, answers
    for h in heads:
        assert h.seen and all(auth == TOKEN for _, auth in h.seen), h.seen


def test_a_stream_comes_through_unbuffered_and_least_conn_avoids_its_head(proxy: tuple[int, list[Head]]) -> None:
    port, heads = proxy
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
    try:
        conn.request("GET", "/stream", headers={"Authorization": TOKEN})
        resp = conn.getresponse()
        assert resp.status == 200
        got = b""
        while b"data: first" not in got:
            more = resp.read1(4096)
            assert more, f"the stream ended before its first chunk: {got!r}"
            got += more
        # the first chunk is here while the head still holds the rest: nginx did not buffer the response
        streaming = [h for h in heads if ("/stream", TOKEN) in h.seen]
        assert len(streaming) == 1 and not streaming[0].stream_done.is_set()
        busy, idle = streaming[0], next(h for h in heads if h is not streaming[0])
        # least_conn: while `busy` streams, every new request goes to the other head
        assert [_get(port, "/plain") for _ in range(4)] == [idle.name] * 4
        busy.release.set()
        rest = resp.read()
        assert b"data: [DONE]" in got + rest
    finally:
        conn.close()


def test_a_missing_nginx_skips_only_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(BaseException) as outside:  # noqa: B017 - which of pytest's outcomes is the claim
        _nginx()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(BaseException) as under_ci:  # noqa: B017
        _nginx()
    assert outside.type is pytest.skip.Exception
    assert under_ci.type is pytest.fail.Exception and "one-shot.sh test` as root installs it" in str(under_ci.value)
