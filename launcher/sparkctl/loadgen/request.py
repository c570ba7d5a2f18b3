"""One request, timed as `vllm bench serve` times it: a streamed chat completion on a raw socket (each
chunk dated to its packet's arrival where the kernel timestamps packets), and the plain calls a run
makes beside it (/v1/models, /metrics, /tokenize: through headapi.HeadApi, the one client of the head's API).
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests

from ..errors import CheckFailed
from ..facts import promtext
from ..facts.parsing import ParseError, parse_json
from ..measure import metrics as benchmetrics
from ..remote.headapi import BadAnswer, Endpoint, HeadApi, reason
from .report import rounded
from .wire import ChunkedDecoder, SpecCounters, SSEParser, spec_counters

RECV_SIZE = 65536
MAX_HEAD = 64 * 1024  # response status line + headers
MAX_ERROR_BODY = 64 * 1024
CONNECT_TIMEOUT_S = 10.0
RCVBUF = 1 << 20  # room for many small per-token segments, so a busy client never throttles the server
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux value; Python does not export it
_ANC_SIZE = socket.CMSG_SPACE(16)


@dataclass
class RequestResult:
    index: int
    ok: bool = False
    start: float = 0.0  # wall clock (time.time()), the clock kernel timestamps use
    end: float = 0.0
    ttft_s: float | None = None  # vLLM's TTFT: first streamed-output chunk (benchmetrics.streamed_output)
    latency_s: float | None = None  # vLLM's E2EL: the last streamed-output chunk (not the usage chunk, not [DONE])
    itl: list[float] = field(default_factory=list)  # gaps between streamed-output chunks
    completion_tokens: int | None = None
    prompt_tokens: int | None = None  # the server's usage.prompt_tokens
    prompt_tokens_built: int | None = None  # --input-len: what /tokenize counted for the prompt sparkctl built
    tokens_from: str = ""  # "usage" | "chunks"
    content_chunks: int = 0
    malformed: int = 0
    status: int | None = None
    error_kind: str | None = None  # connect | http | not-streaming | stream-error | truncated | timeout | protocol | cancelled
    error: str | None = None
    retried_without: str | None = None

    @property
    def wall_s(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def decode_tok_s(self) -> float | None:
        """sparkctl's per-stream decode rate (the model card's): (N − 1) ÷ (E2EL − TTFT) = 1 ÷ vLLM's TPOT
        (llama-benchy's tg rate, (N − 1) ÷ (last token − first token), is the same quantity)."""
        if not self.ok or self.ttft_s is None or self.latency_s is None or not self.completion_tokens:
            return None
        decode = self.latency_s - self.ttft_s
        return (self.completion_tokens - 1) / decode if decode > 0 and self.completion_tokens > 1 else None

    @property
    def tpot_s(self) -> float | None:
        """vLLM's TPOT: (E2EL − TTFT) ÷ (N − 1)."""
        if not self.ok or self.ttft_s is None or self.latency_s is None or not self.completion_tokens:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1) if self.completion_tokens > 1 else None

    def timeline(self) -> benchmetrics.Timeline:
        """This request as vLLM's RequestFuncOutput would hold it."""
        if not self.ok or self.ttft_s is None or self.latency_s is None:
            return benchmetrics.Timeline(False, self.start)
        return benchmetrics.Timeline(True, self.start, self.ttft_s, self.latency_s, list(self.itl),
                                     self.completion_tokens, self.prompt_tokens or 0)

    @property
    def cancelled(self) -> bool:
        return self.error_kind == "cancelled"

    def fail(self, kind: str, message: str) -> RequestResult:
        self.ok = False
        self.error_kind = kind
        self.error = message
        if not self.end:
            self.end = time.time()
        return self

    def to_dict(self) -> dict[str, Any]:
        rate = self.decode_tok_s
        return {"index": self.index, "ok": self.ok, "ttft_s": rounded(self.ttft_s, 4), "e2el_s": rounded(self.latency_s, 4),
                "tpot_s": rounded(self.tpot_s, 5), "wall_s": round(self.wall_s, 4), "decode_tok_s": rounded(rate, 3),
                "completion_tokens": self.completion_tokens, "prompt_tokens": self.prompt_tokens,
                "prompt_tokens_built": self.prompt_tokens_built, "output_chunks": self.content_chunks,
                "tokens_from": self.tokens_from or None, "error_kind": self.error_kind, "error": self.error}


class Canceller:
    """Lets the main thread stop every running stream at once (Ctrl-C): shut their sockets down."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()

    def register(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.add(sock)
        if self.stop.is_set():
            self._shut(sock)

    def unregister(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)

    def cancel(self) -> None:
        self.stop.set()
        with self._lock:
            socks = list(self._socks)
        for sock in socks:
            self._shut(sock)

    @staticmethod
    def _shut(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class _Deadline(Exception):
    pass


class _Cancelled(Exception):
    pass


class _Receiver:
    """recv() with a deadline, a cancel flag and, where the kernel offers them, packet arrival times.

    It returns as soon as anything arrives, so every chunk is dated (ITL needs each chunk's time);
    the kernel timestamp dates the data to its last packet, not to when the thread woke up.
    """

    def __init__(self, sock: socket.socket, deadline: float, stop: threading.Event) -> None:
        self.sock = sock
        self.deadline = deadline
        self.stop = stop
        self.tls = isinstance(sock, ssl.SSLSocket)  # no recvmsg, no flags, buffered records: plain reads
        self.stamped = False
        self.wait_s = 1.0  # at most 1 s per wait, so a cancel is noticed even without a shutdown
        self._poll = select.poll()
        if not self.tls:
            try:
                sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
                self.stamped = True
            except OSError:
                pass
            sock.setblocking(True)  # waits are poll()'s; reads below never block (MSG_DONTWAIT)
            self._poll.register(sock.fileno(), select.POLLIN)

    def recv(self) -> tuple[bytes, float]:
        """(data, arrival time of its last packet); b'' at EOF."""
        while True:
            if self.stop.is_set():
                raise _Cancelled
            left = self.deadline - time.time()
            if left <= 0:
                raise _Deadline
            if self.tls:
                self.sock.settimeout(min(left, 1.0))
                try:
                    return self.sock.recv(RECV_SIZE), time.time()
                except TimeoutError:
                    continue
            self._poll.poll(min(left, self.wait_s) * 1000)
            try:
                if self.stamped:
                    data, anc, _flags, _addr = self.sock.recvmsg(RECV_SIZE, _ANC_SIZE, socket.MSG_DONTWAIT)
                    return data, _stamp(anc) or time.time()
                return self.sock.recv(RECV_SIZE, socket.MSG_DONTWAIT), time.time()
            except BlockingIOError:
                continue


def _stamp(anc: list[tuple[int, int, bytes]]) -> float | None:
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= 16:
            sec, nsec = struct.unpack("qq", data[:16])
            return sec + nsec / 1e9
    return None


@dataclass
class _Head:
    status: int
    reason: str
    headers: dict[str, str]
    rest: bytes
    t: float  # arrival time of the packet that completed the head


def _read_head(rx: _Receiver) -> _Head:
    buf = b""
    t = time.time()
    while b"\r\n\r\n" not in buf:
        data, t = rx.recv()
        if not data:
            raise ConnectionError("the server closed the connection before answering")
        buf += data
        if len(buf) > MAX_HEAD:
            raise ValueError("response headers larger than 64 KiB")
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP response: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return _Head(int(parts[1]), parts[2] if len(parts) > 2 else "", headers, rest, t)


class _Body:
    """The response body's framing: chunked, content-length, or until the server closes."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.decoder = ChunkedDecoder() if self.chunked else None
        length = headers.get("content-length")
        self.left: int | None = int(length) if length and length.isdigit() and not self.chunked else None

    def feed(self, data: bytes) -> bytes:
        if self.decoder is not None:
            return self.decoder.feed(data)
        if self.left is not None:
            data = data[:self.left]
            self.left -= len(data)
        return data

    @property
    def complete(self) -> bool:
        return (self.decoder is not None and self.decoder.done) or self.left == 0


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """socket.create_connection, with a receive buffer set before connecting (it sizes the TCP window)."""
    err: OSError | None = None
    for family, kind, proto, _name, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            sock.settimeout(timeout)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            err = exc
    raise err or OSError(f"no address for {host}")


def _request_bytes(ep: Endpoint, path: str, body: bytes, api_key: str | None) -> bytes:
    host = f"[{ep.host}]" if ":" in ep.host else ep.host
    lines = [f"POST {ep.base}{path} HTTP/1.1", f"Host: {host}:{ep.port}", "User-Agent: sparkctl-bench",
             "Content-Type: application/json", "Accept: text/event-stream", f"Content-Length: {len(body)}",
             "Connection: close"]
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def _error_message(body: bytes) -> str:
    """The message of an OpenAI/vLLM error body ({"error": {"message"}}, {"message"}, {"detail"}), else the text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = parse_json(text)
    except ParseError:
        return text[:300] or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            for key in ("message", "detail", "msg"):
                if err.get(key):
                    return str(err[key])[:300]
        elif isinstance(err, str):
            return err[:300]
    return text[:300]


class _Tracker:
    """Follows one SSE stream as vLLM's benchmark does: every event parsed, the arrival time of each
    chunk that carries streamed output (benchmetrics.streamed_output), usage, errors, [DONE]."""

    __slots__ = ("first_t", "last_t", "itl", "chunks", "usage_tokens", "prompt_tokens", "done", "error", "malformed")

    def __init__(self) -> None:
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.itl: list[float] = []
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.done = False
        self.error: str | None = None
        self.malformed = 0

    def feed(self, events: list[bytes], t: float) -> None:
        for ev in events:
            if ev[:1] != b"{":
                if ev.strip() == b"[DONE]":
                    self.done = True
                else:
                    self.malformed += 1
                continue
            try:
                obj = parse_json(ev)
            except ParseError:
                self.malformed += 1
                continue
            if not isinstance(obj, dict):
                self.malformed += 1
                continue
            if benchmetrics.streamed_output(obj):
                self.chunks += 1
                if self.last_t is None:
                    self.first_t = t
                else:
                    self.itl.append(t - self.last_t)
                self.last_t = t
            if obj.get("error") or obj.get("object") == "error":
                self.error = _error_message(ev)
            usage = obj.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    self.usage_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    self.prompt_tokens = usage["prompt_tokens"]

    def feed_bulk(self, region: bytes, t: float) -> None:
        """Complete events cut by SSEParser.feed_bulk, all arrived by `t`."""
        self.feed(SSEParser.split(region), t)


def stream_request(ep: Endpoint, path: str, body: bytes, *, index: int = 0, api_key: str | None = None,
                   timeout: float = 300.0, canceller: Canceller | None = None) -> RequestResult:
    """Send one streaming request and time it. Never raises for a network or server problem:
    the result says what went wrong (error_kind, error)."""
    canceller = canceller or Canceller()
    r = RequestResult(index=index, start=time.time())
    deadline = r.start + timeout
    try:
        sock = _connect(ep.host, ep.port, min(timeout, CONNECT_TIMEOUT_S))
    except OSError as exc:
        return r.fail("connect", f"cannot connect to {ep.host}:{ep.port}: {reason(exc)}")
    if ep.scheme == "https":
        try:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=ep.host)
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            return r.fail("connect", f"TLS handshake with {ep.host}:{ep.port} failed: {exc}")
    canceller.register(sock)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_request_bytes(ep, path, body, api_key))
        rx = _Receiver(sock, deadline, canceller.stop)
        r = _read_response(r, rx)
        if not r.ok and canceller.stop.is_set():  # the shut socket read as the server's EOF ("truncated")
            return r.fail("cancelled", "stopped (Ctrl-C)")
        return r
    except _Cancelled:
        return r.fail("cancelled", "stopped (Ctrl-C)")
    except _Deadline:
        return r.fail("timeout", f"no complete answer within --timeout {timeout:g} s"
                      + (f" ({r.content_chunks} chunks received)" if r.content_chunks else ""))
    except (OSError, ConnectionError) as exc:
        if canceller.stop.is_set():
            return r.fail("cancelled", "stopped (Ctrl-C)")
        return r.fail("connect", f"connection to {ep.host}:{ep.port} failed: {reason(exc)}")
    except ValueError as exc:
        return r.fail("protocol", f"unexpected answer from {ep.host}:{ep.port}: {exc}")
    finally:
        canceller.unregister(sock)
        sock.close()


def _read_response(r: RequestResult, rx: _Receiver) -> RequestResult:
    head = _read_head(rx)
    r.status = head.status
    body = _Body(head.headers)
    ctype = head.headers.get("content-type", "")
    if head.status != 200 or "text/event-stream" not in ctype:
        data = body.feed(head.rest)
        while not body.complete and len(data) < MAX_ERROR_BODY:
            chunk, _ = rx.recv()
            if not chunk:
                break
            data += body.feed(chunk)
        r.end = time.time()
        if head.status != 200:
            return r.fail("http", f"HTTP {head.status} {head.reason}: {_error_message(data)}".replace("  ", " "))
        return r.fail("not-streaming", f"the server answered 200 with {ctype or 'no content-type'} instead of "
                      "a text/event-stream: it ignored stream=true (a non-streaming server or proxy?); "
                      "bench needs a streaming OpenAI API to time tokens")
    sse = SSEParser()
    tr = _Tracker()
    data, t = head.rest, head.t
    while True:
        if data:
            tr.feed(sse.feed(body.feed(data)), t)
            r.content_chunks = tr.chunks
        if tr.done or tr.error or body.complete:
            break
        data, t = rx.recv()
        if not data:
            break
    r.end = t
    r.malformed = tr.malformed
    r.itl = tr.itl
    r.prompt_tokens = tr.prompt_tokens
    if tr.first_t is not None and tr.last_t is not None:
        r.ttft_s = tr.first_t - r.start
        r.latency_s = tr.last_t - r.start
    if tr.error:
        return r.fail("stream-error", f"the server reported an error mid-stream after {tr.chunks} chunks: {tr.error}")
    if not tr.done:
        return r.fail("truncated", f"the stream ended without [DONE] after {tr.chunks} chunks "
                      "(the server closed the connection mid-stream)")
    if tr.first_t is None:
        return r.fail("no-tokens", "the stream finished without generating any text")
    if tr.usage_tokens is not None:
        r.completion_tokens, r.tokens_from = tr.usage_tokens, "usage"
    else:
        r.completion_tokens, r.tokens_from = tr.chunks, "chunks"
    r.ok = True
    return r


class Tokenizer:
    """The served model's own tokenizer, through the server's /tokenize and /detokenize (vLLM's
    endpoints: nothing is downloaded). Used to build prompts of an exact length in tokens."""

    def __init__(self, ep: Endpoint, model: str, api_key: str | None, timeout: float = 30.0) -> None:
        self.ep, self.model = ep, model
        self.api = HeadApi.of(ep, api_key, timeout)

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            status, obj = self.api.post_json(path, {"model": self.model, **payload})
        except (requests.RequestException, BadAnswer) as exc:
            raise CheckFailed(f"--input-len: cannot reach {self.ep.url}{path}: {reason(exc)}",
                              fix="start the service, or leave --input-len out") from None
        if status != 200 or not isinstance(obj, dict):
            raise CheckFailed(f"--input-len needs the server's {path} (vLLM serves it); {self.ep.url} answered "
                              f"HTTP {status}", fix="leave --input-len out for this server (the built-in prompts "
                              "are used, their length counted from the server's usage)")
        return obj

    def encode(self, text: str) -> list[int]:
        toks = self._post("/tokenize", {"prompt": text, "add_special_tokens": False}).get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise CheckFailed(f"{self.ep.url}/tokenize answered without a token list", fix="leave --input-len out")
        return toks

    def decode(self, tokens: list[int]) -> str:
        text = self._post("/detokenize", {"tokens": tokens}).get("prompt")
        if not isinstance(text, str):
            raise CheckFailed(f"{self.ep.url}/detokenize answered without a prompt", fix="leave --input-len out")
        return text

    def prompt_of(self, tag: str, filler: str, n_tokens: int, tries: int = 6) -> tuple[str, int]:
        """A prompt opening with `tag`, `n_tokens` long as this tokenizer counts it (or as near as a few
        rounds of cut-and-recount get: a cut can merge tokens), and its count."""
        text = tag + " " + filler
        while True:
            toks = self.encode(text)
            if len(toks) >= n_tokens:
                break
            if len(text) > 64 * n_tokens + 4096:
                raise CheckFailed(f"--input-len {n_tokens}: the prompt does not grow in tokens",
                                  fix="use a smaller --input-len")
            text = text + " " + filler
        count = len(toks)
        for _ in range(tries):
            text = self.decode(toks[:n_tokens])
            toks = self.encode(text)
            count = len(toks)
            if count == n_tokens:
                break
        return text, count


def list_models(ep: Endpoint, api_key: str | None, timeout: float = 10.0) -> list[str] | None:
    """The served model ids, or None when /v1/models does not answer with a model list.
    Raises CheckFailed when the server cannot be reached or refuses the API key."""
    try:
        status, body = HeadApi.of(ep, api_key, timeout).get("/v1/models")
    except requests.RequestException as exc:
        raise CheckFailed(f"cannot reach the API at {ep.url}: {reason(exc)}",
                          fix="start the service (sparkctl up, then sparkctl wait) or point --url at it") from None
    except BadAnswer:
        return None
    if status in (401, 403):
        raise CheckFailed(f"the API at {ep.url} refused the API key (HTTP {status})",
                          fix="set VLLM_API_KEY in the env file, or name the variable that holds it with --api-key-env")
    if status != 200:
        return None
    try:
        data = parse_json(body).get("data")
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
    except (ValueError, AttributeError, TypeError):  # ParseError is a ValueError
        return None


def read_spec_counters(ep: Endpoint, model: str | None, api_key: str | None,
                       timeout: float = 10.0) -> SpecCounters | None:
    """The spec-decode counters now, or None (no /metrics, or speculative decoding off)."""
    text = HeadApi.of(ep, api_key, timeout).metrics()
    return None if text is None else spec_counters(promtext.parse(text), model)
