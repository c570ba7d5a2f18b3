"""The load generator and measurement core of `sparkctl bench`: vLLM's serving metrics, and the model card's table.

Every request is timed as `vllm bench serve` times it (benchmetrics: TTFT, TPOT, ITL, E2EL, request and
output throughput, under vLLM's names); the level's figures are benchmetrics.serving_metrics over its
requests. Two quantities are sparkctl's own, for the model card's table (README, "bench"):

- per-stream decode tok/s = (N − 1) ÷ (E2EL − TTFT) = 1 ÷ TPOT per request, N the usage chunk's
  completion_tokens (a server that sends no usage gets its chunks counted, flagged: with speculative
  decoding a chunk can carry several tokens). C1's table cell is its mean; "Cn agg" is C × the level's
  mean per-stream rate (the card's "summed across streams"). vLLM's output_throughput (all output
  tokens ÷ duration, TTFT and queueing included) sits beside it.
- accepted tok/step = 1 + Δaccepted ÷ Δdrafts over the level, from the server's /metrics counters
  vllm:spec_decode_num_accepted_tokens_total and vllm:spec_decode_num_drafts_total (vLLM's "mean
  acceptance length", spec_decode_acceptance_length in its result). The counters are server-wide:
  other traffic during a level pollutes this figure (the per-request figures are unaffected).

Sampling is the card's benchmark sampling: temperature 0.6, top_p 0.95, thinking off
(chat_template_kwargs.enable_thinking=false), 256-token outputs forced with ignore_eos. A server that
rejects ignore_eos / chat_template_kwargs / stream_options with HTTP 400 gets them dropped (noted).

Load shapes: a closed loop of C streams (each sends its next request when the last one ends), or with
a request rate, requests arriving as vLLM's benchmark schedules them (Poisson) with at most C in
flight (vLLM's --max-concurrency); a level ends after its number of requests or its --duration.

The client must not become the bottleneck it measures: each stream is one thread on a raw socket,
woken per packet (ITL needs every chunk's time); where the kernel timestamps packets (SO_TIMESTAMPNS,
Linux) a chunk is dated to its packet's arrival, not to when the thread woke up. bench/loadgen_cpu.py
measures the client's CPU per stream.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import itertools
import json
import math
import os
import random
import re
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from . import benchmetrics
from .engine_lines import SPEC_ACCEPTED, SPEC_DRAFT_TOKENS, SPEC_DRAFTS  # vLLM's metric names, in one place
from .errors import CheckFailed, UsageError
from .threads import spawn, wait_all, wait_bounded

SCHEMA = "sparkctl-bench/2"  # /2: vLLM's metric definitions and names (issue 27)
OLD_SCHEMAS = ("sparkctl-bench/1", "sparkctl-bench-replicas/1")  # read for --compare (their TTFT and tok/s were defined otherwise: noted)
MULTI_SCHEMA = "sparkctl-bench-replicas/2"  # several replicas: {replicas: [{replica, head, url, ...SCHEMA doc}], total}
DEFAULT_CONCURRENCY = (1, 2, 4, 8)
DEFAULT_WORKLOADS = ("prose", "code", "list")
TEMPERATURE = 0.6
TOP_P = 0.95
RECV_SIZE = 65536
MAX_HEAD = 64 * 1024  # response status line + headers
MAX_ERROR_BODY = 64 * 1024
CONNECT_TIMEOUT_S = 10.0
RCVBUF = 1 << 20  # room for many small per-token segments, so a busy client never throttles the server
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux value; Python does not export it
_ANC_SIZE = socket.CMSG_SPACE(16)


DEFINITIONS = {
    "vllm": benchmetrics.DEFINITIONS,  # the level's flat keys named as vLLM names them (mean_ttft_ms, ...)
    "sparkctl": {  # sparkctl's own quantities, for the model card's table
        "decode_tok_s": "per stream: (N − 1) ÷ (E2EL − TTFT) = 1 ÷ TPOT, N = usage.completion_tokens",
        "per_stream_tok_s": "mean / p50 / p90 of the level's per-stream decode_tok_s",
        "agg_tok_s": "C × the level's mean per-stream decode_tok_s (the card's 'summed across streams')",
        "throughput_tok_s": "= output_throughput (vLLM's): all output tokens ÷ duration",
        "ttft_s": "vLLM's TTFT in seconds: p50 / p90 / min / max",
        "tokens_per_step": "1 + Δaccepted ÷ Δdrafts over the level (vLLM spec-decode counters in /metrics)",
        "client_cpu_pct": "bench's own CPU time ÷ level wall time, in % of one core",
        "prompt_tokens_built": "--input-len: the prompt's tokens as the server's /tokenize counted them "
                               "(the server's own count, chat template included, is total_input_tokens)",
    },
}

# Several prompts per workload, each opening with different words, and every request is prefixed
# with a tag unique to it: no two requests share a prefix-cache block, which would flatter TTFT.
PROMPTS: dict[str, tuple[str, ...]] = {
    "prose": (
        "Write an essay about the history of lighthouses and the keepers who lived in them.",
        "Describe a long walk through a rainy city at night, in flowing literary prose.",
        "Tell the story of a baker who finds a forgotten family recipe in an old tin box.",
        "Explain to a curious teenager why the sky turns orange and red at sunset.",
        "Compose a letter from a sailor to his sister about a winter spent at sea.",
        "Reflect, in a personal essay, on what makes a small town feel like home.",
        "Narrate the first warm day of spring in a mountain village, from dawn to dusk.",
        "Argue in a persuasive essay for keeping public libraries open late at night.",
    ),
    "code": (
        "Write a Python module implementing an LRU cache class with get, put and resize, with tests.",
        "Implement in Rust a tokenizer for arithmetic expressions and a recursive-descent parser.",
        "Create a TypeScript React component for a sortable, paginated data table with filtering.",
        "Give a C function that parses an IPv4 CIDR string and checks whether an address is inside it.",
        "Produce a Go HTTP server with a rate limiter middleware (token bucket) and graceful shutdown.",
        "Build a SQL schema for a library lending system and the queries for overdue books.",
        "Port this idea to Java: a thread-safe bounded blocking queue using locks and conditions.",
        "Design a bash script that rotates log files by size, compresses old ones and keeps ten.",
    ),
    "list": (
        "List forty common kitchen herbs and spices, each with one typical dish that uses it.",
        "Enumerate thirty famous bridges of the world with their city and year of completion.",
        "Give a numbered list of fifty English words that describe weather, one per line.",
        "Name thirty board games with the number of players and a one-line description each.",
        "Make a checklist of forty things to pack for a two-week hiking trip in the mountains.",
        "Provide a list of thirty-five programming languages with the year each first appeared.",
        "Catalogue thirty rivers of Europe with the countries each one flows through.",
        "Outline forty tasks for spring cleaning a house, grouped by room, as a bulleted list.",
    ),
}
WARMUP_PROMPT = "Warm-up request: say a few words about the weather today."

# Parameters a non-vLLM server may refuse; dropped (and noted) when a 400 names them.
OPTIONAL_PARAMS = ("ignore_eos", "chat_template_kwargs", "stream_options")


# ================================================================================= inputs


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: tuple[str, ...]


def builtin_workload(name: str) -> Workload:
    if name not in PROMPTS:
        raise UsageError(f"unknown workload {name!r}", fix=f"use one of: {', '.join(PROMPTS)} (or --prompt-file)")
    return Workload(name, PROMPTS[name])


def load_prompt_file(path: str | os.PathLike[str]) -> Workload:
    """Prompts from a file: one per non-empty line, or for *.jsonl one JSON string / {"prompt": ...} per line."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"prompt file {p}: cannot be read ({exc})") from None
    prompts: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"prompt file {p}, line {n}: not JSON ({exc.msg})",
                                 fix='write one JSON string or {"prompt": "..."} per line') from None
            item = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(item, str) or not item.strip():
                raise UsageError(f"prompt file {p}, line {n}: expected a string or an object with a 'prompt' string")
            prompts.append(item)
        else:
            prompts.append(line.strip())
    if not prompts:
        raise UsageError(f"prompt file {p} holds no prompts", fix="write one prompt per line")
    return Workload(p.stem or "file", tuple(prompts))


def parse_int_list(text: str, what: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]: positive, distinct, kept in the given order."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise UsageError(f"{what} {text!r}: {part!r} is not a positive whole number", fix="e.g. 1,2,4,8")
        if int(part) in out:
            raise UsageError(f"{what} {text!r}: {part} is listed twice")
        out.append(int(part))
    if not out:
        raise UsageError(f"{what} is empty", fix="e.g. 1,2,4,8")
    return out


@dataclass(frozen=True)
class Endpoint:
    """Where the OpenAI API is: scheme, host, port and a base path ('' or '/prefix')."""

    scheme: str
    host: str
    port: int
    base: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        try:
            u = urlsplit(url.strip() if "://" in url else "http://" + url.strip())
            port = u.port
        except ValueError as exc:
            raise UsageError(f"--url {url!r} is not a URL ({exc})", fix="e.g. http://10.0.0.1:8888") from None
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UsageError(f"--url {url!r} must be an http:// or https:// URL with a host",
                             fix="e.g. http://10.0.0.1:8888")
        base = u.path.rstrip("/")
        if base.endswith("/v1"):  # people paste the OpenAI base URL; the paths below add /v1 themselves
            base = base[:-3]
        return cls(u.scheme, u.hostname, port or (443 if u.scheme == "https" else 80), base)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.base}"


# ================================================================================= wire formats


class ChunkedDecoder:
    """Incremental HTTP/1.1 chunked transfer decoding (uvicorn, i.e. vLLM, streams this way)."""

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # bytes still due in the current chunk
        self._crlf = False  # the CRLF after a chunk's data is still due
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        out: list[bytes] = []
        i = 0
        while not self.done:
            if self._left:
                piece = buf[i:i + self._left]
                out.append(piece)
                self._left -= len(piece)
                i += len(piece)
                if self._left:
                    break
                self._crlf = True
            if self._crlf:
                if len(buf) - i < 2:
                    break
                i += 2
                self._crlf = False
            j = buf.find(b"\r\n", i)
            if j < 0:
                if len(buf) - i > 1024:
                    raise ValueError("chunk size line longer than 1 KiB")
                break
            try:
                size = int(buf[i:j].split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ValueError(f"bad chunk size line {buf[i:j][:40]!r}") from None
            i = j + 2
            if size == 0:
                self.done = True  # trailers, if any, are ignored
            self._left = size
        self._buf = buf[i:]
        return b"".join(out)


class SSEParser:
    """Server-sent events -> the data payload of each event (bytes). Other fields and comments are ignored.

    feed() splits events one by one; feed_bulk() only cuts the input at the last complete event and
    hands back that region whole, for callers that scan it with C-speed searches instead of a loop.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        return self.split(self.feed_bulk(data))

    def feed_bulk(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:  # CRLF line ends: normalise, keeping a trailing CR until its LF arrives
            tail = b"\r" if buf.endswith(b"\r") else b""
            buf = buf[:len(buf) - len(tail)].replace(b"\r\n", b"\n")
        else:
            tail = b""
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._buf = buf + tail
            return b""
        self._buf = buf[cut + 2:] + tail
        return buf[:cut + 2]

    @staticmethod
    def split(region: bytes) -> list[bytes]:
        """The data payloads of the complete events in `region`."""
        events: list[bytes] = []
        for block in region.split(b"\n\n"):
            if block.startswith(b"data: ") and b"\n" not in block:  # the usual one-line event
                events.append(block[6:])
                continue
            lines = [ln[5:] for ln in block.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                events.append(b"\n".join(ln[1:] if ln.startswith(b" ") else ln for ln in lines))
        return events


@dataclass
class Sample:
    name: str
    labels: dict[str, str]
    value: float


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[Sample]:
    """Prometheus text exposition -> samples. Comments, blank and unparsable lines are skipped."""
    out: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL_RE.findall(m.group(2) or "")}
        out.append(Sample(m.group(1), labels, value))
    return out


def counter_total(samples: Iterable[Sample], name: str, model: str | None = None) -> float | None:
    """Sum of a counter over its label sets (engines, ranks); only `model`'s series when it has any."""
    series = [s for s in samples if s.name == name]
    if model is not None and any(s.labels.get("model_name") == model for s in series):
        series = [s for s in series if s.labels.get("model_name") == model]
    return sum(s.value for s in series) if series else None


@dataclass(frozen=True)
class SpecCounters:
    drafts: float
    draft_tokens: float | None
    accepted: float


@dataclass(frozen=True)
class SpecDelta:
    drafts: float
    draft_tokens: float | None
    accepted: float

    @property
    def accepted_per_step(self) -> float | None:
        return self.accepted / self.drafts if self.drafts > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        """1 + accepted ÷ drafts: each step adds its accepted draft tokens to the one it samples."""
        a = self.accepted_per_step
        return None if a is None else 1.0 + a

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None


def spec_counters(samples: Sequence[Sample], model: str | None = None) -> SpecCounters | None:
    drafts = counter_total(samples, SPEC_DRAFTS, model)
    accepted = counter_total(samples, SPEC_ACCEPTED, model)
    if drafts is None or accepted is None:
        return None
    return SpecCounters(drafts, counter_total(samples, SPEC_DRAFT_TOKENS, model), accepted)


def spec_delta(before: SpecCounters | None, after: SpecCounters | None) -> SpecDelta | None:
    if before is None or after is None:
        return None
    dt = None if before.draft_tokens is None or after.draft_tokens is None else after.draft_tokens - before.draft_tokens
    return SpecDelta(after.drafts - before.drafts, dt, after.accepted - before.accepted)


percentile = benchmetrics.percentile  # q-th percentile (0..100), numpy's linear default; None when empty


# ================================================================================= one request


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
        return {"index": self.index, "ok": self.ok, "ttft_s": _r(self.ttft_s, 4), "e2el_s": _r(self.latency_s, 4),
                "tpot_s": _r(self.tpot_s, 5), "wall_s": round(self.wall_s, 4), "decode_tok_s": _r(rate, 3),
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
        obj = json.loads(text)
    except json.JSONDecodeError:
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


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port: is the service up?)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror})"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out"
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


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
                obj = json.loads(ev)
            except ValueError:
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
        return r.fail("connect", f"cannot connect to {ep.host}:{ep.port}: {_reason(exc)}")
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
        return r.fail("connect", f"connection to {ep.host}:{ep.port} failed: {_reason(exc)}")
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


def http_get(ep: Endpoint, path: str, *, api_key: str | None = None, timeout: float = 10.0,
             limit: int = 16 * 2**20) -> tuple[int, bytes]:
    """A plain GET (for /metrics and /v1/models); raises OSError when the server cannot be reached."""
    cls = http.client.HTTPSConnection if ep.scheme == "https" else http.client.HTTPConnection
    conn = cls(ep.host, ep.port, timeout=timeout)
    try:
        headers = {"User-Agent": "sparkctl-bench"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request("GET", ep.base + path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(limit)
    except http.client.HTTPException as exc:
        raise OSError(f"bad HTTP answer: {exc!r}") from None
    finally:
        conn.close()


def http_post_json(ep: Endpoint, path: str, payload: dict[str, Any], *, api_key: str | None = None,
                   timeout: float = 30.0, limit: int = 16 * 2**20) -> tuple[int, Any]:
    """POST a JSON body, parse the JSON answer (None when it is not JSON); raises OSError when the
    server cannot be reached."""
    cls = http.client.HTTPSConnection if ep.scheme == "https" else http.client.HTTPConnection
    conn = cls(ep.host, ep.port, timeout=timeout)
    try:
        headers = {"User-Agent": "sparkctl-bench", "Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        conn.request("POST", ep.base + path, body=json.dumps(payload).encode(), headers=headers)
        resp = conn.getresponse()
        raw = resp.read(limit)
    except http.client.HTTPException as exc:
        raise OSError(f"bad HTTP answer: {exc!r}") from None
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, None


class Tokenizer:
    """The served model's own tokenizer, through the server's /tokenize and /detokenize (vLLM's
    endpoints: nothing is downloaded). Used to build prompts of an exact length in tokens."""

    def __init__(self, ep: Endpoint, model: str, api_key: str | None, timeout: float = 30.0) -> None:
        self.ep, self.model, self.api_key, self.timeout = ep, model, api_key, timeout

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            status, obj = http_post_json(self.ep, path, {"model": self.model, **payload}, api_key=self.api_key,
                                         timeout=self.timeout)
        except OSError as exc:
            raise CheckFailed(f"--input-len: cannot reach {self.ep.url}{path}: {_reason(exc)}",
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
        status, body = http_get(ep, "/v1/models", api_key=api_key, timeout=timeout)
    except OSError as exc:
        raise CheckFailed(f"cannot reach the API at {ep.url}: {_reason(exc)}",
                          fix="start the service (sparkctl up, then sparkctl wait) or point --url at it") from None
    if status in (401, 403):
        raise CheckFailed(f"the API at {ep.url} refused the API key (HTTP {status})",
                          fix="set VLLM_API_KEY in the env file, or name the variable that holds it with --api-key-env")
    if status != 200:
        return None
    try:
        data = json.loads(body).get("data")
        return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
    except (ValueError, AttributeError, TypeError):
        return None


def read_spec_counters(ep: Endpoint, model: str | None, api_key: str | None,
                       timeout: float = 10.0) -> SpecCounters | None:
    """The spec-decode counters now, or None (no /metrics, or speculative decoding off)."""
    try:
        status, body = http_get(ep, "/metrics", api_key=api_key, timeout=timeout)
    except OSError:
        return None
    if status != 200:
        return None
    return spec_counters(parse_prometheus(body.decode("utf-8", "replace")), model)


# ================================================================================= a run


@dataclass
class BenchConfig:
    endpoint: Endpoint
    model: str
    api_key: str | None = None
    workloads: list[Workload] = field(default_factory=lambda: [builtin_workload(w) for w in DEFAULT_WORKLOADS])
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    requests: int | None = None  # per level (--num-prompts); None: default_requests(C), or no limit with a duration
    warmup: int = 1
    max_tokens: int = 256
    timeout: float = 300.0
    temperature: float = TEMPERATURE
    top_p: float = TOP_P
    duration: float | None = None  # per level: no request is sent after this many seconds
    request_rate: float | None = None  # requests/s, Poisson arrivals (vLLM's); None: a closed loop of C streams
    seed: int = 0  # of the arrival times (vLLM's --seed default)
    input_len: int | None = None  # prompts of this many tokens, built and counted with the server's /tokenize

    def requests_for(self, concurrency: int) -> int | None:
        """Requests per level: --num-prompts, else none (a --duration ends the level), else the default."""
        if self.requests is not None:
            return self.requests
        return None if self.duration is not None else default_requests(concurrency)


MIN_REQUESTS = 10  # the default's floor: a p90 over fewer than 10 samples is not printed (benchmetrics.min_samples)


def describe_load(cfg: BenchConfig) -> str:
    """One line: requests per level, arrivals, lengths."""
    if cfg.requests is not None:
        n = f"{cfg.requests} requests per level"
    elif cfg.duration is None:
        n = ", ".join(f"C{c}: {default_requests(c)}" for c in cfg.concurrency) + " requests"
    else:
        n = "as many requests as fit"
    if cfg.duration is not None:
        n += f", sent for {cfg.duration:g} s per level"
    shape = (f"Poisson arrivals at {cfg.request_rate:g} req/s (C = the most in flight)" if cfg.request_rate
             else "a closed loop of C streams")
    length = f"{cfg.input_len}-token prompts (/tokenize), " if cfg.input_len else ""
    return f"{n}, {shape}, {length}{cfg.max_tokens}-token outputs"


def default_requests(concurrency: int) -> int:
    """Requests per level when neither --num-prompts nor --duration says: at least MIN_REQUESTS (so the
    p90 means something) and at least two waves of C."""
    return max(MIN_REQUESTS, 2 * concurrency)


class Sampling:
    """The request body, and which optional parameters the server refused (shared by all streams)."""

    def __init__(self, cfg: BenchConfig, nonce: str) -> None:
        self.cfg = cfg
        self.nonce = nonce
        self.dropped: list[str] = []
        self._lock = threading.Lock()
        self._seq = itertools.count()

    def tag(self) -> str:
        """Opens every prompt, so no two requests start with the same tokens (no prefix-cache hits)."""
        return f"[{self.nonce}-{next(self._seq)}]"

    def body(self, prompt: str, *, tagged: bool = False) -> bytes:
        d: dict[str, Any] = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": prompt if tagged else f"{self.tag()} {prompt}"}],
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
            "top_p": self.cfg.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        for name in self.dropped:
            d.pop(name, None)
        return json.dumps(d).encode()

    def drop_for(self, result: RequestResult) -> str | None:
        """When a 400 names an optional parameter, stop sending it; returns its name."""
        if result.status != 400 or not result.error:
            return None
        for name in OPTIONAL_PARAMS:
            if name in result.error:
                with self._lock:
                    if name not in self.dropped:
                        self.dropped.append(name)
                return name
        return None


class ProgressSink:
    """What the run reports while it goes; the command shows it, tests can record it. Called from
    worker threads (request_done) as well as the main thread."""

    def level_started(self, workload: str, concurrency: int, total: int | None) -> None:
        pass

    def request_done(self, workload: str, concurrency: int, result: RequestResult) -> None:
        pass

    def level_done(self, level: LevelResult) -> None:
        pass


@dataclass
class LevelResult:
    workload: str
    concurrency: int
    requests: list[RequestResult]
    wall_s: float = 0.0
    cpu_s: float = 0.0
    spec: SpecDelta | None = None
    interrupted: bool = False
    request_rate: float | None = None  # requests/s (Poisson arrivals), None: a closed loop of `concurrency` streams
    started: float = 0.0  # wall clock when the level's schedule began (arrival times count from it)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.ok]

    @property
    def failed(self) -> list[RequestResult]:
        return [r for r in self.requests if not r.ok and not r.cancelled]

    def to_dict(self) -> dict[str, Any]:
        ok = self.ok
        rates = [x for x in (r.decode_tok_s for r in ok) if x is not None]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        tokens = sum(r.completion_tokens or 0 for r in ok)
        mean = sum(rates) / len(rates) if rates else None
        spec = self.spec
        from_chunks = sum(1 for r in ok if r.tokens_from == "chunks")
        measured = [r for r in self.requests if not r.cancelled]
        vllm = benchmetrics.serving_metrics([r.timeline() for r in measured], self.wall_s)
        built = [r.prompt_tokens_built for r in ok if r.prompt_tokens_built is not None]
        p90 = percentile(rates, 90) if len(rates) >= benchmetrics.min_samples(90) else None
        ttft_p90 = percentile(ttfts, 90) if len(ttfts) >= benchmetrics.min_samples(90) else None
        return {
            **{k: (_r(v, 4) if isinstance(v, float) else v) for k, v in vllm.items()},
            "request_rate": self.request_rate,
            "max_concurrency": self.concurrency,
            "prompt_tokens_built": sum(built) if built else None,
            "output_chunks": sum(r.content_chunks for r in ok),
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "ok": len(ok),
            "failed": len(self.failed),
            "cancelled": sum(1 for r in self.requests if r.cancelled),
            "interrupted": self.interrupted,
            "per_stream_tok_s": {"n": len(rates), "mean": _r(mean, 3), "p50": _r(percentile(rates, 50), 3),
                                 "p90": _r(p90, 3)},
            "agg_tok_s": _r(None if mean is None else mean * self.concurrency, 3),
            "throughput_tok_s": _r(tokens / self.wall_s if self.wall_s > 0 and tokens else None, 3),
            "ttft_s": {"n": len(ttfts), "p50": _r(percentile(ttfts, 50), 4), "p90": _r(ttft_p90, 4),
                       "min": _r(min(ttfts, default=None), 4), "max": _r(max(ttfts, default=None), 4)},
            "completion_tokens": tokens,
            "tokens_counted_from_chunks": from_chunks,
            "spec_decode": None if spec is None else {
                "drafts": spec.drafts, "draft_tokens": spec.draft_tokens, "accepted": spec.accepted,
                "accepted_per_step": _r(spec.accepted_per_step, 4), "tokens_per_step": _r(spec.tokens_per_step, 4),
                "acceptance_rate": _r(spec.acceptance_rate, 4)},
            # vLLM's names for the same counters' deltas (its acceptance_rate is in %)
            "spec_decode_acceptance_length": None if spec is None else _r(spec.tokens_per_step, 4),
            "spec_decode_acceptance_rate": None if spec is None or spec.acceptance_rate is None
            else _r(100 * spec.acceptance_rate, 3),
            "spec_decode_num_drafts": None if spec is None else int(spec.drafts),
            "spec_decode_accepted_tokens": None if spec is None else int(spec.accepted),
            "wall_s": round(self.wall_s, 3),
            "client_cpu_s": round(self.cpu_s, 4),
            "client_cpu_pct": round(100.0 * self.cpu_s / self.wall_s, 3) if self.wall_s > 0 else None,
            "malformed_events": sum(r.malformed for r in self.requests),
            "results": [r.to_dict() for r in self.requests],
        }


@dataclass
class BenchRun:
    cfg: BenchConfig
    started: float
    levels: list[LevelResult] = field(default_factory=list)
    warmup: list[RequestResult] = field(default_factory=list)
    interrupted: bool = False
    stopped: str | None = None  # why the run ended early (other than Ctrl-C)
    notes: list[str] = field(default_factory=list)
    finished: float = 0.0

    def failures(self) -> list[tuple[str, RequestResult]]:
        out = [("warmup", r) for r in self.warmup if not r.ok and not r.cancelled]
        for lv in self.levels:
            out += [(f"{lv.workload} C{lv.concurrency}", r) for r in lv.failed]
        return out

    def to_dict(self) -> dict[str, Any]:
        cfg = self.cfg
        workloads: dict[str, list[dict[str, Any]]] = {}
        for lv in self.levels:
            workloads.setdefault(lv.workload, []).append(lv.to_dict())
        kinds: dict[str, dict[str, Any]] = {}
        for where, r in self.failures():
            k = kinds.setdefault(r.error_kind or "error", {"count": 0, "first": f"{where} #{r.index}: {r.error}"})
            k["count"] += 1
        return {
            "schema": SCHEMA,
            "url": cfg.endpoint.url,
            "model": cfg.model,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "duration_s": round((self.finished or time.time()) - self.started, 2),
            "config": {"workloads": [w.name for w in cfg.workloads], "concurrency": cfg.concurrency,
                       "requests": cfg.requests, "num_prompts": {f"C{c}": cfg.requests_for(c) for c in cfg.concurrency},
                       "duration_s": cfg.duration, "request_rate": cfg.request_rate, "seed": cfg.seed,
                       "input_len": cfg.input_len, "output_len": cfg.max_tokens,
                       "warmup": cfg.warmup, "max_tokens": cfg.max_tokens,
                       "timeout_s": cfg.timeout, "temperature": cfg.temperature, "top_p": cfg.top_p,
                       "thinking": False},
            "definitions": DEFINITIONS,
            "interrupted": self.interrupted,
            "stopped": self.stopped,
            "notes": self.notes,
            "warmup": {"requests": len(self.warmup), "ok": sum(1 for r in self.warmup if r.ok)},
            "workloads": workloads,
            "failures": {"total": sum(k["count"] for k in kinds.values()), "by_kind": kinds},
        }


class _Stop(Exception):
    pass


def run_level(cfg: BenchConfig, sampling: Sampling, workload: Workload, concurrency: int, n_requests: int | None,
              canceller: Canceller, progress: ProgressSink, *, name: str | None = None,
              measure_spec: bool = True, shaped: bool = True) -> LevelResult:
    """n_requests requests (None: until cfg.duration is up), at most `concurrency` in flight: a closed
    loop (each stream sends its next request when its last one ends), or with cfg.request_rate the
    requests arrive as vLLM's benchmark schedules them (benchmetrics.arrival_times) and wait for a free
    stream. No request is sent once cfg.duration has passed. `shaped` False (the warm-up): a plain
    closed loop of the built-in prompts. Ctrl-C cancels the streams and returns what finished."""
    label = name or workload.name
    rate = cfg.request_rate if shaped else None
    level = LevelResult(label, concurrency, [], request_rate=rate)
    progress.level_started(label, concurrency, n_requests)
    built: list[tuple[str, int]] = []
    if shaped and cfg.input_len:  # before the clock starts: the prompts, each opening with its own tag
        tok = Tokenizer(cfg.endpoint, cfg.model, cfg.api_key, timeout=min(cfg.timeout, 30.0))
        pool = n_requests if n_requests is not None else max(4 * concurrency, 32)
        built = [tok.prompt_of(sampling.tag(), workload.prompts[i % len(workload.prompts)], cfg.input_len)
                 for i in range(pool)]
    before = read_spec_counters(cfg.endpoint, cfg.model, cfg.api_key) if measure_spec else None
    duration = cfg.duration if shaped else None
    rng = random.Random(cfg.seed)
    arrivals: Iterator[float] | None = None
    if rate is not None:
        arrivals = iter(benchmetrics.arrival_times(n_requests, rate, rng) if n_requests is not None
                        else benchmetrics.open_arrivals(rate, rng))
    indices = itertools.count() if n_requests is None else iter(range(n_requests))
    lock = threading.Lock()
    results: list[RequestResult] = []

    def worker() -> None:
        while not canceller.stop.is_set():
            with lock:
                i = next(indices, None)
                at = None if i is None or arrivals is None else t0 + next(arrivals)
            if i is None:
                return
            if at is not None and canceller.stop.wait(max(at - time.time(), 0.0)):
                return
            if duration is not None and time.time() >= t0 + duration:
                return
            if built:
                prompt, counted = built[i % len(built)]
                body = sampling.body(prompt, tagged=True)
            else:
                prompt, counted = workload.prompts[i % len(workload.prompts)], None
                body = sampling.body(prompt)
            r = stream_request(cfg.endpoint, "/v1/chat/completions", body, index=i,
                               api_key=cfg.api_key, timeout=cfg.timeout, canceller=canceller)
            dropped = sampling.drop_for(r)
            if dropped:  # the server refuses an optional parameter: once more without it
                body = sampling.body(prompt, tagged=True) if built else sampling.body(prompt)
                r = stream_request(cfg.endpoint, "/v1/chat/completions", body, index=i,
                                   api_key=cfg.api_key, timeout=cfg.timeout, canceller=canceller)
                r.retried_without = dropped
            r.prompt_tokens_built = counted
            with lock:
                results.append(r)
            progress.request_done(label, concurrency, r)

    cpu0, t0 = time.process_time(), time.time()
    level.started = t0
    streams = concurrency if n_requests is None else min(concurrency, n_requests)
    threads = [spawn(worker, f"bench-{label}-{k}") for k in range(streams)]
    try:
        wait_all(threads)
    except KeyboardInterrupt:
        level.interrupted = True
        canceller.cancel()
        wait_bounded(threads, 5.0)
    if canceller.stop.is_set():  # cancelled from elsewhere (the main thread, when this run is one of several)
        level.interrupted = True
    level.cpu_s, level.wall_s = time.process_time() - cpu0, time.time() - t0
    with lock:
        level.requests = sorted(results, key=lambda r: r.index)
    if level.requests:  # vLLM's duration: the schedule's start (the first send, in a closed loop) to the last end
        level.wall_s = max(r.end for r in level.requests) - min(t0, *(r.start for r in level.requests))
    if measure_spec and not level.interrupted:
        level.spec = spec_delta(before, read_spec_counters(cfg.endpoint, cfg.model, cfg.api_key))
    progress.level_done(level)
    return level


def run_bench(cfg: BenchConfig, progress: ProgressSink | None = None, *,
              canceller: Canceller | None = None, run: BenchRun | None = None) -> BenchRun:
    """Warm-up, then every workload at every concurrency level. Ctrl-C ends it early with what was
    measured (run.interrupted); a level where no request succeeded ends it too (run.stopped).
    Ctrl-C reaches the main thread only: a run in another thread is stopped through `canceller`
    (its cancel(), from the main thread: run_replicas), and fills the `run` it is given, so what it
    measured can be read even while it is still winding down."""
    progress = progress or ProgressSink()
    run = run or BenchRun(cfg, started=time.time())
    canceller = canceller or Canceller()
    sampling = Sampling(cfg, os.urandom(4).hex())
    try:
        if canceller.stop.is_set():
            raise _Stop
        if cfg.warmup > 0:
            lv = run_level(cfg, sampling, Workload("warmup", (WARMUP_PROMPT,)), min(cfg.warmup, max(cfg.concurrency)),
                           cfg.warmup, canceller, progress, measure_spec=False, shaped=False)
            run.warmup = lv.requests
            if lv.interrupted:
                raise _Stop
            if not any(r.ok for r in lv.requests):
                run.stopped = f"no warm-up request succeeded: {_first_error(lv.requests)}"
                raise _Stop
        for wl in cfg.workloads:
            for c in cfg.concurrency:
                if canceller.stop.is_set():
                    raise _Stop
                lv = run_level(cfg, sampling, wl, c, cfg.requests_for(c), canceller, progress)
                run.levels.append(lv)
                if lv.interrupted:
                    raise _Stop
                if not lv.ok:
                    run.stopped = f"no request succeeded at {wl.name} C{c}: {_first_error(lv.requests)}"
                    raise _Stop
    except _Stop:
        pass
    except KeyboardInterrupt:  # between levels (e.g. while reading /metrics)
        canceller.cancel()
    run.interrupted = canceller.stop.is_set()
    for name in sampling.dropped:
        run.notes.append(f"the server refused `{name}` (HTTP 400); it was left out of the requests"
                         + (": outputs may end before max_tokens" if name == "ignore_eos" else ""))
    run.finished = time.time()
    return run


# ================================================================================= several replicas
# Each replica is its own service with its own head: each gets its own run_bench in its own thread,
# with the same config, and a LevelSync holds their levels in step, so the replicas load the cluster
# together (the total of a level is what the cluster serves at that load).


class LevelSync:
    """Keeps several runs' levels in step: a run's level k starts once every run still going has
    reached its level k. A run that ends (finished, stopped early, failed) leaves, so it never holds
    the others; a wait is bounded by `timeout` (the longest a level can take), after which -- or after
    abort() -- the sync is broken and every run goes on alone (`broken` says why)."""

    def __init__(self, parties: int, timeout: float | None = None) -> None:
        self._cond = threading.Condition()
        self._started = [0] * parties  # levels each party has started
        self._active = set(range(parties))
        self.timeout = timeout
        self.broken: str | None = None

    def arrive(self, party: int, label: str) -> bool:
        """Party `party` is about to start its next level; True when every other party got there too."""
        with self._cond:
            self._started[party] += 1
            k = self._started[party]
            self._cond.notify_all()
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            while self.broken is None and any(self._started[p] < k for p in self._active if p != party):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    late = sorted(p for p in self._active if self._started[p] < k)
                    self.broken = (f"at {label}, replica(s) {', '.join(map(str, late))} had not finished the "
                                   f"level before within {self.timeout:g} s")
                    self._cond.notify_all()
                    break
                self._cond.wait(0.5 if left is None else min(left, 0.5))
            return self.broken is None

    def leave(self, party: int) -> None:
        with self._cond:
            self._active.discard(party)
            self._cond.notify_all()

    def abort(self, why: str) -> None:
        with self._cond:
            if self.broken is None:
                self.broken = why
            self._cond.notify_all()


class _SyncedSink(ProgressSink):
    """A replica's progress sink, whose level_started first waits for the other replicas (LevelSync)."""

    def __init__(self, inner: ProgressSink, sync: LevelSync, party: int) -> None:
        self.inner, self.sync, self.party = inner, sync, party

    def level_started(self, workload: str, concurrency: int, total: int | None) -> None:
        self.sync.arrive(self.party, f"{workload} C{concurrency}")
        self.inner.level_started(workload, concurrency, total)

    def request_done(self, workload: str, concurrency: int, result: RequestResult) -> None:
        self.inner.request_done(workload, concurrency, result)

    def level_done(self, level: LevelResult) -> None:
        self.inner.level_done(level)


def level_bound_s(cfg: BenchConfig) -> float:
    """The longest one level of `cfg` can take: its waves of requests (each within --timeout, twice
    when a refused optional parameter is retried) and its two /metrics reads (10 s each)."""
    if cfg.duration is not None and cfg.requests is None:
        waves = math.ceil(cfg.duration / cfg.timeout) + 1  # sends stop at the duration; the last ones may run a timeout
    else:
        waves = max(math.ceil(n / min(c, n)) for c in cfg.concurrency if (n := cfg.requests_for(c) or 1))
    if cfg.request_rate is not None and cfg.requests is not None:
        waves += math.ceil(cfg.requests / cfg.request_rate / cfg.timeout)  # arrivals spread over n / rate seconds
    if cfg.warmup:
        waves = max(waves, math.ceil(cfg.warmup / min(cfg.warmup, max(cfg.concurrency))))
    return 2.0 * waves * cfg.timeout + 2 * 10.0 + 5.0


def run_replicas(cfgs: Sequence[BenchConfig], sinks: Sequence[ProgressSink], *, canceller: Canceller | None = None,
                 sync_timeout: float | None = None, join_s: float = 12.0) -> list[BenchRun]:
    """One run_bench per config (one per replica's head), side by side in threads, levels in step.
    Call it from the main thread: Ctrl-C there cancels every run (one shared Canceller) and returns what
    each measured (run.interrupted), waiting at most `join_s` for the runs to wind down. A run that ends
    early (run.stopped) leaves the others to go on. A bug in one run cancels the others and raises."""
    canceller = canceller or Canceller()
    n = len(cfgs)
    sync = LevelSync(n, sync_timeout if sync_timeout is not None else max(level_bound_s(c) for c in cfgs))
    now = time.time()
    runs = [BenchRun(cfg, started=now) for cfg in cfgs]
    errors: list[BaseException | None] = [None] * n

    def one(i: int) -> None:
        try:
            run_bench(cfgs[i], _SyncedSink(sinks[i], sync, i), canceller=canceller, run=runs[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors[i] = exc
            canceller.cancel()
        finally:
            sync.leave(i)

    threads = [spawn(functools.partial(one, i), f"bench-replica{i}") for i in range(n)]
    try:
        wait_all(threads)
    except KeyboardInterrupt:
        canceller.cancel()
        sync.abort("interrupted")
        wait_bounded(threads, join_s)
    interrupted = canceller.stop.is_set()
    for run, done in zip(runs, threads, strict=True):
        if interrupted:
            run.interrupted = True
        if not done.is_set() or not run.finished:
            run.finished = time.time()
            if not done.is_set():
                run.notes.append(f"still winding down after {join_s:g} s: its last level may be missing")
        if sync.broken and sync.broken != "interrupted":
            run.notes.append(f"the replicas' levels went out of step ({sync.broken}); from there on each "
                             "replica went on alone, and the total adds levels that did not run together")
    for exc in errors:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            raise exc
    return runs


TOTAL_DEFINITIONS = {
    "agg_tok_s": "sum over the replicas of their agg_tok_s at that level (each replica at concurrency C, together)",
    "throughput_tok_s": "sum over the replicas of their throughput_tok_s at that level",
    "requests": "requests, ok, failed, cancelled and completion_tokens: summed over the replicas",
    "ttft_p50_worst_s": "TTFT is not summed: the highest (worst) of the replicas' TTFT p50 at that level",
    "replicas": "how many replicas measured a rate at that level (of `of`)",
}


def total_doc(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several replicas' run documents -> the cluster's figures per workload and level (TOTAL_DEFINITIONS)."""
    n = len(docs)
    workloads: dict[str, list[dict[str, Any]]] = {}
    for task in dict.fromkeys(t for d in docs for t in d.get("workloads", {})):
        by_c: dict[int, list[dict[str, Any]]] = {}
        for d in docs:
            for lv in d.get("workloads", {}).get(task, []):
                by_c.setdefault(int(lv["concurrency"]), []).append(lv)
        rows = []
        for c, lvs in by_c.items():
            aggs = [lv["agg_tok_s"] for lv in lvs if lv["agg_tok_s"] is not None]
            thr = [lv["throughput_tok_s"] for lv in lvs if lv.get("throughput_tok_s") is not None]
            p50s = [lv["ttft_s"]["p50"] for lv in lvs if lv["ttft_s"]["p50"] is not None]
            rows.append({
                "concurrency": c, "replicas": len(aggs), "of": n, "streams": c * len(lvs),
                "requests": sum(int(lv["requests"]) for lv in lvs), "ok": sum(int(lv["ok"]) for lv in lvs),
                "failed": sum(int(lv["failed"]) for lv in lvs), "cancelled": sum(int(lv["cancelled"]) for lv in lvs),
                "agg_tok_s": _r(sum(aggs), 3) if aggs else None,
                "throughput_tok_s": _r(sum(thr), 3) if thr else None,
                "completion_tokens": sum(int(lv["completion_tokens"]) for lv in lvs),
                "ttft_p50_worst_s": max(p50s) if p50s else None,
                "partial": len(aggs) < n or any(bool(lv.get("interrupted") or lv.get("failed")) for lv in lvs),
            })
        workloads[task] = rows
    return {"replicas": n, "definitions": TOTAL_DEFINITIONS, "workloads": workloads,
            "failures": {"total": sum(int(d["failures"]["total"]) for d in docs)}}


def render_total(total: dict[str, Any]) -> str:
    """The cluster's table: a row per workload and level, the replicas' figures summed."""
    head = ["Task", "C per replica", "streams", "replicas", "ok/sent", "failed", "agg tok/s", "throughput tok/s",
            "TTFT p50 worst (s)"]
    lines = [f"Total over {total['replicas']} replicas, measured together level by level:", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    partial = False
    for task, rows in total.get("workloads", {}).items():
        for t in rows:
            mark = "*" if t["partial"] and t["agg_tok_s"] is not None else ""
            partial = partial or bool(mark)
            lines.append("| " + " | ".join([
                task, str(t["concurrency"]), str(t["streams"]), f"{t['replicas']}/{t['of']}", f"{t['ok']}/{t['requests']}",
                str(t["failed"]), _f(t["agg_tok_s"]) + mark, _f(t["throughput_tok_s"]), _f(t["ttft_p50_worst_s"], 3)]) + " |")
    lines.append("")
    lines.append("agg tok/s and throughput are the replicas' figures summed; TTFT is not summed: the worst "
                 "replica's p50.")
    if partial:
        lines.append("* a replica did not measure that level, or some of its requests failed or were interrupted.")
    return "\n".join(lines)


def compare_total(total: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Per task and level: the saved summed agg tok/s, the new one and the % change."""
    old = {(task, int(t["concurrency"])): t["agg_tok_s"] for task, rows in base.get("workloads", {}).items() for t in rows}
    out: dict[str, Any] = {}
    for task, rows in total.get("workloads", {}).items():
        cells: dict[str, Any] = {}
        for t in rows:
            a, b = old.get((task, int(t["concurrency"]))), t["agg_tok_s"]
            cells[f"C{t['concurrency']}"] = {"old": a, "new": b,
                                             "change_pct": _r((b - a) / a * 100, 2) if a and b is not None else None}
        out[task] = cells
    return out


def render_total_compare(total: dict[str, Any], base: dict[str, Any]) -> str:
    cmp = compare_total(total, base)
    if not cmp:
        return "(nothing to compare: this run measured no task)"
    columns = list(dict.fromkeys(c for cells in cmp.values() for c in cells))
    lines = ["Change of the total (agg tok/s summed over the replicas):", "",
             "| " + " | ".join(["Task", *columns]) + " |", "|" + "|".join(["---"] * (len(columns) + 1)) + "|"]
    for task, cells in cmp.items():
        lines.append("| " + " | ".join([task, *(_pct(cells[c]["old"], cells[c]["new"]) if c in cells else "—"
                                                for c in columns)]) + " |")
    return "\n".join(lines)


def is_replicas_doc(doc: dict[str, Any]) -> bool:
    """A run of several replicas (MULTI_SCHEMA: replicas + total), not one endpoint's run (SCHEMA)."""
    return doc.get("schema") in (MULTI_SCHEMA, "sparkctl-bench-replicas/1")


def _first_error(results: list[RequestResult]) -> str:
    for r in results:
        if r.error:
            return r.error
    return "no request finished"


def _r(value: float | None, nd: int) -> float | None:
    return None if value is None else round(value, nd)


# ================================================================================= reports
# Everything below works on the JSON document, so a saved run renders and compares like a fresh one.


def load_saved(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"saved run {p}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"saved run {p}: not JSON ({exc})", fix="pass a file written by sparkctl bench --save") from None
    multi = isinstance(doc, dict) and is_replicas_doc(doc)
    if not isinstance(doc, dict) or not multi and (doc.get("schema") not in (SCHEMA, *OLD_SCHEMAS) or not isinstance(doc.get("workloads"), dict)):
        raise UsageError(f"saved run {p} is not a sparkctl bench run ({SCHEMA} or {MULTI_SCHEMA})",
                         fix="pass a file written by sparkctl bench --save")
    try:  # the table and --compare read these fields; a damaged file is bad input, not a crash
        for one in (doc["replicas"] if multi else [doc]):
            if multi and (not isinstance(one.get("replica"), int) or not isinstance(one.get("workloads"), dict)):
                raise TypeError("a replica's run has no replica number or no workloads")
            _, rows = table_rows(one)
            numbers = [v for r in rows for v in (*r.cells.values(), r.tokens_per_step, *(r.ttft or ()))]
            if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in numbers):
                raise TypeError("a measured value is not a number")
            render_compare(one, one)
        if multi:
            if not doc["replicas"]:
                raise ValueError("no replica")
            render_total(doc["total"])
            render_total_compare(doc["total"], doc["total"])
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, IndexError) as exc:
        raise UsageError(f"saved run {p} is damaged ({type(exc).__name__}: {str(exc)[:80]})",
                         fix="pass a file written by sparkctl bench --save") from None
    return doc


@dataclass
class Row:
    task: str
    cells: dict[int, float | None]  # concurrency -> C1 per-stream / Cn aggregate tok/s
    partial: dict[int, bool]
    tokens_per_step: float | None
    ttft: tuple[float, float] | None  # range of the levels' TTFT p50


def table_rows(doc: dict[str, Any]) -> tuple[list[int], list[Row]]:
    """The seed's table from a run document: concurrency columns and one row per task."""
    columns: list[int] = []
    rows: list[Row] = []
    for task, levels in doc.get("workloads", {}).items():
        cells: dict[int, float | None] = {}
        partial: dict[int, bool] = {}
        acc = drafts = 0.0
        p50s: list[float] = []
        for lv in levels:
            c = int(lv["concurrency"])
            if c not in columns:
                columns.append(c)
            cells[c] = lv["per_stream_tok_s"]["mean"] if c == 1 else lv["agg_tok_s"]
            partial[c] = bool(lv.get("interrupted") or lv.get("failed"))
            sd = lv.get("spec_decode")
            if sd and sd.get("drafts"):
                acc += sd["accepted"]
                drafts += sd["drafts"]
            if lv["ttft_s"]["p50"] is not None:
                p50s.append(lv["ttft_s"]["p50"])
        rows.append(Row(task, cells, partial, 1.0 + acc / drafts if drafts else None,
                        (min(p50s), max(p50s)) if p50s else None))
    return sorted(columns), rows


def _col_name(c: int) -> str:
    return "C1 per-stream" if c == 1 else f"C{c} agg"


def _f(value: float | None, nd: int = 1) -> str:
    return "—" if value is None else f"{value:.{nd}f}"


def _ttft(rng: tuple[float, float] | None) -> str:
    return "—" if rng is None else f"{rng[0]:.2f}–{rng[1]:.2f}"


def render_table(doc: dict[str, Any]) -> str:
    """The model card's table: task × C1 per-stream · Cn agg · accepted tok/step, plus TTFT."""
    columns, rows = table_rows(doc)
    head = ["Task", *(_col_name(c) for c in columns), "accepted tok/step", "TTFT p50 (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + "|"]
    for row in rows:
        cells = [_f(row.cells.get(c)) + ("*" if row.partial.get(c) and row.cells.get(c) is not None else "")
                 for c in columns]
        lines.append("| " + " | ".join([row.task, *cells, _f(row.tokens_per_step, 2), _ttft(row.ttft)]) + " |")
    lines.append("")
    lines.append("sparkctl's own figures, the model card's: tok/s per stream = (N − 1) ÷ (E2EL − TTFT) = 1 ÷ TPOT; "
                 "Cn agg = n × the mean per-stream rate (vLLM's output_throughput is below); accepted tok/step = "
                 "1 + accepted ÷ drafts (vLLM's spec_decode_acceptance_length).")
    ranges = [r.ttft for r in rows if r.ttft]
    if ranges and columns:
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        lines.append(f"TTFT {lo:.2f}–{hi:.2f} s (p50 per level) across C{columns[0]}–C{columns[-1]}.")
    if any(any(r.partial.values()) for r in rows):
        lines.append("* some requests of that level failed or were interrupted: measured on those that finished.")
    return "\n".join(lines)


def _ms(lv: dict[str, Any], key: str) -> str:
    v = lv.get(key)
    if v is None and key.startswith("p") and lv.get(f"n_{key.split('_')[1]}"):
        return "n<" + str(benchmetrics.min_samples(float(key[1:key.index("_")])))  # too few samples for it
    return _f(v, 1)


def render_details(doc: dict[str, Any]) -> str:
    """Per level, vLLM's serving metrics as `vllm bench serve` defines them (ms), then sparkctl's own."""
    head = ["Task", "C", "ok/sent", "req/s", "output tok/s", "TTFT mean", "median", "p99", "TPOT mean", "median",
            "p99", "ITL median", "p99", "E2EL median", "p99", "tok/s/stream p50", "tok/step", "client CPU %"]
    lines = ["vLLM's metrics (`vllm bench serve`'s definitions; times in ms; n<K: fewer samples than that "
             "percentile needs):", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for task, levels in doc.get("workloads", {}).items():
        for lv in levels:
            sd = lv.get("spec_decode") or {}
            c = str(lv["concurrency"]) + (f" @{lv['request_rate']:g}/s" if lv.get("request_rate") else "")
            lines.append("| " + " | ".join([
                task, c, f"{lv['ok']}/{lv['requests']}", _f(lv.get("request_throughput"), 2),
                _f(lv.get("output_throughput", lv.get("throughput_tok_s"))),
                _ms(lv, "mean_ttft_ms"), _ms(lv, "median_ttft_ms"), _ms(lv, "p99_ttft_ms"),
                _ms(lv, "mean_tpot_ms"), _ms(lv, "median_tpot_ms"), _ms(lv, "p99_tpot_ms"),
                _ms(lv, "median_itl_ms"), _ms(lv, "p99_itl_ms"), _ms(lv, "median_e2el_ms"), _ms(lv, "p99_e2el_ms"),
                _f(lv["per_stream_tok_s"]["p50"]), _f(sd.get("tokens_per_step"), 2),
                _f(lv.get("client_cpu_pct"), 2)]) + " |")
    return "\n".join(lines)


def _pct(old: float | None, new: float | None) -> str:
    if old is None or new is None:
        return f"{_f(old)} → {_f(new)}"
    if old == 0:
        return f"{old:.1f} → {new:.1f}"
    return f"{old:.1f} → {new:.1f} ({(new - old) / old * 100:+.1f}%)"


def compare(doc: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Per task and column: the saved value, the new one and the % change."""
    cols_new, rows_new = table_rows(doc)
    cols_old, rows_old = table_rows(base)
    old = {r.task: r for r in rows_old}
    columns = sorted(set(cols_new) | set(cols_old))
    out: dict[str, Any] = {"base": {"url": base.get("url"), "started": base.get("started")}, "tasks": {}}
    for row in rows_new:
        o = old.get(row.task)
        cells: dict[str, Any] = {}
        for c in columns:
            a = o.cells.get(c) if o else None
            b = row.cells.get(c)
            cells[_col_name(c)] = {"old": a, "new": b, "change_pct": _r((b - a) / a * 100, 2) if a and b is not None else None}
        a2 = o.tokens_per_step if o else None
        cells["accepted tok/step"] = {"old": _r(a2, 4), "new": _r(row.tokens_per_step, 4),
                                      "change_pct": _r((row.tokens_per_step - a2) / a2 * 100, 2)
                                      if a2 and row.tokens_per_step is not None else None}
        ot = o.ttft if o else None
        cells["TTFT p50 (s)"] = {"old": list(ot) if ot else None, "new": list(row.ttft) if row.ttft else None,
                                 "change_pct": _r((row.ttft[1] - ot[1]) / ot[1] * 100, 2)
                                 if ot and row.ttft and ot[1] else None}
        out["tasks"][row.task] = cells
    return out


def render_compare(doc: dict[str, Any], base: dict[str, Any]) -> str:
    """The table again, each cell as `saved → now (±x%)`; TTFT's % is that of the range's upper end."""
    cmp = compare(doc, base)
    tasks: dict[str, dict[str, Any]] = cmp["tasks"]
    if not tasks:
        return "(nothing to compare: this run measured no task)"
    names = list(next(iter(tasks.values())))
    lines = [f"Change against {base.get('url', '?')} ({base.get('started', '?')}):", "",
             "| " + " | ".join(["Task", *names]) + " |", "|" + "|".join(["---"] * (len(names) + 1)) + "|"]
    for task, cells in tasks.items():
        out: list[str] = []
        for name, cell in cells.items():
            o, n = cell["old"], cell["new"]
            if name.startswith("TTFT"):
                txt = f"{_ttft(tuple(o) if o else None)} → {_ttft(tuple(n) if n else None)}"
            elif name.startswith("accepted"):
                txt = f"{_f(o, 2)} → {_f(n, 2)}"
            else:
                out.append(_pct(o, n))
                continue
            if cell["change_pct"] is not None:
                txt += f" ({cell['change_pct']:+.1f}%)"
            out.append(txt)
        lines.append("| " + " | ".join([task, *out]) + " |")
    missing = [t for t in (r.task for r in table_rows(base)[1]) if t not in tasks]
    if missing:
        lines.append(f"(in the saved run only: {', '.join(missing)})")
    return "\n".join(lines)


def summarize_failures(doc: dict[str, Any]) -> list[str]:
    """One line per kind of failure: how many, and the first one in full."""
    f = doc.get("failures") or {}
    return [f"{k['count']} × {kind}: {k['first']}" for kind, k in (f.get("by_kind") or {}).items()]

