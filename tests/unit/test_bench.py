"""sparkctl bench: wire formats, statistics, the table, and the error paths, against loopback servers
(tiny http.server ones started here, and the lab's stand-in engine as a subprocess)."""

from __future__ import annotations

import _thread
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkctl.errors import CheckFailed, UsageError
from sparkctl.facts import promtext
from sparkctl.loadgen import inputs, level, report, wire
from sparkctl.loadgen import request as rq
from sparkctl.orchestrate import bench as flow
from sparkctl.remote import headapi
from tests.conftest import run_cli
from tests.kit.local import local_standin

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "launcher" / "sparkctl" / "lab" / "standin_vllm.py"


# ============================================================================ helpers


def chunk(content: str | None = None, *, role: bool = False, finish: str | None = None, compact: bool = False) -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    elif content is not None:
        delta = {"content": content}
    obj = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return json.dumps(obj, separators=(",", ":") if compact else None).encode()


def usage(n: int) -> bytes:
    return json.dumps({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n,
                                                                    "total_tokens": n + 5}}).encode()


def sse(*payloads: bytes) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.server.app(self)  # type: ignore[attr-defined]

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers.get("content-length") or 0)
        self.body = json.loads(self.rfile.read(n) or b"{}")
        self.server.app(self)  # type: ignore[attr-defined]


class _QuietServer(ThreadingHTTPServer):
    """A client that closes its connection with unread data (an abandoned stream, the answer to a failed
    request) resets it: a real server (uvicorn) says nothing, socketserver prints a traceback to stderr,
    which these tests read as sparkctl's. Any other error in a handler is still printed."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionResetError | BrokenPipeError):
            return
        super().handle_error(request, client_address)


@contextlib.contextmanager
def tiny_server(app: Callable[[Any], None], host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """A loopback HTTP server calling app(handler) for every request; yields its base URL."""
    srv = _QuietServer((host, port), _Handler)
    srv.daemon_threads = True
    srv.app = app  # type: ignore[attr-defined]
    th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    th.start()
    try:
        yield f"http://{host}:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def send_json(h: Any, code: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    h.send_response(code)
    h.send_header("content-type", "application/json")
    h.send_header("content-length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def models_or(h: Any, post: Callable[[Any], None]) -> None:
    if h.command == "GET" and h.path.startswith("/v1/models"):
        send_json(h, 200, {"object": "list", "data": [{"id": "m"}]})
    elif h.command == "GET":
        send_json(h, 404, {"detail": "Not Found"})
    else:
        post(h)


def stream_app(payloads: list[bytes], *, chunked: bool = False, delay: float = 0.0,
               ctype: str = "text/event-stream") -> Callable[[Any], None]:
    """An SSE answer of the given events, one write each (chunked like uvicorn, or until close)."""

    def post(h: Any) -> None:
        h.send_response(200)
        h.send_header("content-type", ctype)
        if chunked:
            h.send_header("transfer-encoding", "chunked")
        else:
            h.send_header("connection", "close")
        h.end_headers()
        for p in payloads:
            if delay:
                time.sleep(delay)
            data = b"data: " + p + b"\n\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            h.wfile.flush()
        if chunked:
            h.wfile.write(b"0\r\n\r\n")
        h.close_connection = True

    return lambda h: models_or(h, post)


def ok_stream(n: int = 8, *, with_usage: bool = True) -> list[bytes]:
    out = [chunk(role=True)] + [chunk(f" t{i}") for i in range(n)] + [chunk(finish="length")]
    return out + ([usage(n)] if with_usage else []) + [b"[DONE]"]


def request(url: str, **kw: Any) -> rq.RequestResult:
    body = json.dumps({"model": "m", "messages": [], "stream": True}).encode()
    return rq.stream_request(headapi.Endpoint.parse(url), "/v1/chat/completions", body, **kw)


# ============================================================================ wire formats


def test_sse_events_split_across_reads_crlf_comments_and_multiline_data():
    p = wire.SSEParser()
    assert p.feed(b"data: {\"a\":1}\n") == []
    assert p.feed(b"\ndata: [DONE]\n\n") == [b'{"a":1}', b"[DONE]"]
    # CRLF line ends, a CR left dangling at the end of a read, comments and other fields ignored
    assert p.feed(b": keep-alive\r\n\r\nevent: x\r\ndata: one\r") == []
    assert p.feed(b"\n\r\ndata:two\r\ndata: three\r\n\r\n") == [b"one", b"two\nthree"]
    assert p.feed(b"id: 7\nretry: 10\n\n") == []  # an event without data


def test_sse_feed_bulk_cuts_at_the_last_complete_event():
    p = wire.SSEParser()
    region = p.feed_bulk(b"data: 1\n\ndata: 2\n\ndata: 3")
    assert region == b"data: 1\n\ndata: 2\n\n"
    assert wire.SSEParser.split(region) == [b"1", b"2"]
    assert p.feed(b"\n\n") == [b"3"]


@given(st.lists(st.binary(min_size=0, max_size=40), max_size=12), st.data())
@settings(max_examples=60, deadline=None)
def test_chunked_decoder_any_split(pieces: list[bytes], data: st.DataObject) -> None:
    raw = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    dec = wire.ChunkedDecoder()
    out = b""
    prev = 0
    for c in [*cuts, len(raw)]:
        out += dec.feed(raw[prev:c])
        prev = c
    assert out == b"".join(pieces)
    assert dec.done


def test_chunked_decoder_rejects_garbage():
    with pytest.raises(ValueError, match="chunk size"):
        wire.ChunkedDecoder().feed(b"zz\r\n")


def test_tracker_role_chunk_is_not_the_first_token_and_usage_wins():
    tr = rq._Tracker()
    tr.feed([chunk(role=True)], 1.0)
    assert tr.first_t is None
    tr.feed([chunk("Hi", compact=True), chunk(" there")], 2.0)
    tr.feed([chunk(finish="length"), usage(42), b"[DONE]"], 3.0)
    assert (tr.first_t, tr.chunks, tr.usage_tokens, tr.done, tr.malformed) == (2.0, 2, 42, True, 0)


def test_tracker_malformed_and_error_events():
    tr = rq._Tracker()
    # Every event is parsed (vLLM's benchmark does): each broken one counts.
    tr.feed([b"not json", b"{broken", b'{"usage": {broken', b'{"error": {"message": "boom", "code": 500}}'], 1.0)
    assert tr.malformed == 3 and tr.error == "boom" and tr.usage_tokens is None
    tr2 = rq._Tracker()
    tr2.feed([b'{"object": "error", "message": "old style"}'], 1.0)
    assert tr2.error == "old style"


def test_tracker_bulk_path_agrees_with_the_event_path():
    body = sse(*[chunk(f" w{i}") for i in range(50)])
    end = sse(chunk(" last"), chunk(finish="length"), usage(51), b"[DONE]")
    slow, fast = rq._Tracker(), rq._Tracker()
    slow.feed(wire.SSEParser.split(body + end), 1.0)
    fast.first_t = slow.first_t
    fast.feed_bulk(body, 1.0)
    fast.feed_bulk(end, 2.0)
    assert (fast.chunks, fast.usage_tokens, fast.done) == (slow.chunks, slow.usage_tokens, slow.done) == (51, 51, True)


def test_prometheus_counters_with_labels_summed_and_filtered_by_model():
    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="m",engine="0"} 100.0
vllm:spec_decode_num_drafts_total{model_name="m",engine="1"} 50
vllm:spec_decode_num_drafts_total{model_name="other",engine="0"} 999
vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="0"} 120
vllm:spec_decode_num_accepted_tokens_total{model_name="m",engine="1"} 60 1700000000000
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 450
weird{label="a \\"quoted\\" value"} 1
vllm:gpu_cache_usage_perc NaN
garbage line here
"""
    samples = promtext.parse(text)
    assert promtext.total(samples, wire.SPEC_DRAFTS, "m") == 150
    assert promtext.total(samples, wire.SPEC_DRAFTS) == 1149
    assert promtext.total(samples, wire.SPEC_DRAFTS, "absent") == 1149  # unknown model: all series
    assert promtext.total(samples, "nope") is None
    assert [s.labels for s in samples if s.name == "weird"] == [{"label": 'a "quoted" value'}]
    before = wire.spec_counters(samples, "m")
    assert before == wire.SpecCounters(150, 450, 180)
    after = wire.SpecCounters(250, 750, 330)
    delta = wire.spec_delta(before, after)
    assert delta is not None
    # 100 drafts (request-steps), 150 accepted: 1.5 accepted per step + the sampled token = 2.5 per step
    assert (delta.accepted_per_step, delta.tokens_per_step, delta.acceptance_rate) == (1.5, 2.5, 0.5)
    assert wire.spec_counters(promtext.parse("vllm:num_requests_running 1\n")) is None
    assert wire.spec_delta(None, after) is None
    assert wire.SpecDelta(0, 0, 0).tokens_per_step is None


def test_percentiles_linear_between_ranks():
    assert wire.percentile([], 50) is None
    assert wire.percentile([7.0], 90) == 7.0
    assert wire.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert wire.percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert wire.percentile([float(i) for i in range(1, 11)], 90) == pytest.approx(9.1)


def test_inputs_are_checked():
    assert inputs.parse_int_list("1, 2,4,8", "--concurrency") == [1, 2, 4, 8]
    for bad in ("0", "1,x", "", "2,2", "-1"):
        with pytest.raises(UsageError):
            inputs.parse_int_list(bad, "--concurrency")
    with pytest.raises(UsageError, match="unknown workload"):
        inputs.builtin_workload("poetry")
    ep = headapi.Endpoint.parse("10.0.0.1:8888/v1/")
    assert (ep.scheme, ep.host, ep.port, ep.base, ep.url) == ("http", "10.0.0.1", 8888, "", "http://10.0.0.1:8888")
    assert headapi.Endpoint.parse("https://h/api").url == "https://h:443/api"
    for bad in ("ftp://x", "http://", "http://h:99999"):
        with pytest.raises(UsageError):
            headapi.Endpoint.parse(bad)


def test_builtin_prompts_share_no_prefix():
    for name, prompts in inputs.PROMPTS.items():
        assert len(prompts) >= 6, name
        assert len({p.split()[0] for p in prompts}) == len(prompts), f"{name}: two prompts open alike"
    cfg = level.BenchConfig(endpoint=headapi.Endpoint.parse("http://h:1"), model="m")
    s = level.Sampling(cfg, "n0nce")
    one, two = (json.loads(s.body("same prompt")) for _ in range(2))
    assert one["messages"][0]["content"] != two["messages"][0]["content"]
    assert one["messages"][0]["content"].startswith("[n0nce-0] ")
    assert (one["temperature"], one["top_p"], one["max_tokens"], one["stream"]) == (0.6, 0.95, 256, True)
    assert one["chat_template_kwargs"] == {"enable_thinking": False} and one["ignore_eos"] is True
    assert one["stream_options"] == {"include_usage": True}


def test_prompt_file_text_and_jsonl(tmp_path):
    (tmp_path / "mine.txt").write_text("first prompt\n\n  second prompt  \n")
    assert inputs.load_prompt_file(tmp_path / "mine.txt") == inputs.Workload("mine", ("first prompt", "second prompt"))
    (tmp_path / "j.jsonl").write_text('"a"\n{"prompt": "b"}\n')
    assert inputs.load_prompt_file(tmp_path / "j.jsonl").prompts == ("a", "b")
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    with pytest.raises(UsageError, match="line 1"):
        inputs.load_prompt_file(tmp_path / "bad.jsonl")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(UsageError, match="no prompts"):
        inputs.load_prompt_file(tmp_path / "empty.txt")
    with pytest.raises(UsageError, match="cannot be read"):
        inputs.load_prompt_file(tmp_path / "missing.txt")


# ============================================================================ one request, loopback


@pytest.mark.parametrize("chunked", [False, True])
def test_stream_ok_times_ttft_and_decode(chunked):
    with tiny_server(stream_app(ok_stream(8), chunked=chunked, delay=0.02)) as url:
        r = request(url)
    assert r.ok and r.error is None
    assert (r.completion_tokens, r.tokens_from) == (8, "usage")
    # Lower bounds only (load can only make it slower): the role chunk at 0.02 s does not count as
    # the first token, and 8 tokens 0.02 s apart cannot decode faster than 8 / 0.1 s.
    assert r.ttft_s is not None and 0.03 <= r.ttft_s
    assert r.decode_tok_s is not None and 0 < r.decode_tok_s < 8 / 0.1


def test_stream_without_usage_counts_chunks():
    with tiny_server(stream_app(ok_stream(5, with_usage=False))) as url:
        r = request(url)
    assert r.ok and (r.completion_tokens, r.tokens_from) == (5, "chunks")


def test_server_down_is_a_connect_error():
    r = request(f"http://127.0.0.1:{free_port()}")
    assert not r.ok and r.error_kind == "connect" and "connection refused" in (r.error or "")


def test_http_500_before_the_stream_carries_the_server_message():
    def post(h: Any) -> None:
        send_json(h, 500, {"error": {"message": "EngineCore encountered an issue", "code": 500}})

    with tiny_server(lambda h: models_or(h, post)) as url:
        r = request(url)
    assert (r.ok, r.error_kind, r.status) == (False, "http", 500)
    assert "HTTP 500" in (r.error or "") and "EngineCore encountered an issue" in (r.error or "")


def test_500_mid_stream_error_event():
    events = [chunk(role=True), chunk(" a"), chunk(" b"),
              b'{"error": {"message": "engine died mid-request", "type": "InternalServerError", "code": 500}}',
              b"[DONE]"]
    with tiny_server(stream_app(events)) as url:
        r = request(url)
    assert r.error_kind == "stream-error" and "engine died mid-request" in (r.error or "")
    assert "after 2 chunks" in (r.error or "")


def test_connection_dropped_mid_stream_is_truncated():
    with tiny_server(stream_app([chunk(role=True), chunk(" a"), chunk(" b")])) as url:
        r = request(url)
    assert r.error_kind == "truncated" and "without [DONE]" in (r.error or "")


def test_non_streaming_json_answer():
    def post(h: Any) -> None:
        send_json(h, 200, {"id": "x", "object": "chat.completion", "choices": [{"message": {"content": "hi"}}],
                           "usage": {"completion_tokens": 1}})

    with tiny_server(lambda h: models_or(h, post)) as url:
        r = request(url)
    assert r.error_kind == "not-streaming" and "application/json" in (r.error or "")


def stalled_stream(release: threading.Event, then: Any = None) -> Any:
    """A POST handler that streams one chunk, then holds the stream (after calling `then`) until released."""

    def post(h: Any) -> None:
        h.send_response(200)
        h.send_header("content-type", "text/event-stream")
        h.end_headers()
        h.wfile.write(sse(chunk(role=True), chunk(" a")))
        h.wfile.flush()
        if then is not None:
            then()
        release.wait(10)

    return post


def test_timeout_bounds_a_stalled_stream():
    release = threading.Event()
    post = stalled_stream(release)

    with tiny_server(lambda h: models_or(h, post)) as url:
        r = request(url, timeout=0.5)  # the server holds the stream 10 s: only the timeout ends it sooner
        done = release.is_set()
        release.set()
    assert r.error_kind == "timeout" and "--timeout 0.5" in (r.error or "") and not done


def test_a_cancelled_stream_is_cancelled_not_truncated():
    """Ctrl-C shuts the socket down; the read then sees an EOF, which must not pass for the server's."""
    canceller = rq.Canceller()
    release = threading.Event()

    def cancel_while_the_client_waits() -> None:
        release.wait(0.3)  # the client is now waiting for more: cancel it there
        canceller.cancel()

    post = stalled_stream(release, cancel_while_the_client_waits)

    with tiny_server(lambda h: models_or(h, post)) as url:
        r = request(url, timeout=20, canceller=canceller)
        release.set()
    assert (r.ok, r.error_kind, r.cancelled) == (False, "cancelled", True)


# ============================================================================ runs, tables, compare


def synthetic_level(task: str, c: int, rate: float, ttft: float, drafts: float, accepted: float,
                    n: int | None = None) -> level.LevelResult:
    reqs = []
    for i in range(n or c):
        decode = 255 / rate  # (N − 1) ÷ (E2EL − TTFT) = rate
        reqs.append(rq.RequestResult(index=i, ok=True, start=100.0, end=100.0 + ttft + decode, ttft_s=ttft,
                                    latency_s=ttft + decode, completion_tokens=256, tokens_from="usage"))
    return level.LevelResult(task, c, reqs, wall_s=ttft + 256 / rate, cpu_s=0.01,
                         spec=wire.SpecDelta(drafts, drafts * 3, accepted))


SEED = {  # the model card's table (docs/sources.md), rebuilt from per-stream rates
    "prose": [(1, 11.1, 0.6), (2, 7.7, 0.9), (4, 5.25, 1.4), (8, 3.8125, 2.0)],
    "code": [(1, 15.0, 0.7), (2, 12.2, 0.8), (4, 7.1, 1.1), (8, 5.2125, 1.5)],
}


def seed_doc(scale: float = 1.0) -> dict[str, Any]:
    cfg = level.BenchConfig(endpoint=headapi.Endpoint.parse("http://spark1:8888"), model="GLM-5.3-EXL3")
    run = level.BenchRun(cfg, started=1_700_000_000.0, finished=1_700_000_100.0)
    for task, levels in SEED.items():
        acc = 800.0 if task == "prose" else 1500.0
        for c, rate, ttft in levels:
            run.levels.append(synthetic_level(task, c, rate * scale, ttft, 1000.0, acc))
    return run.to_dict()


GOLDEN_TABLE = """\
| Task | C1 per-stream | C2 agg | C4 agg | C8 agg | accepted tok/step | TTFT p50 (s) |
|---|---:|---:|---:|---:|---:|---|
| prose | 11.1 | 15.4 | 21.0 | 30.5 | 1.80 | 0.60–2.00 |
| code | 15.0 | 24.4 | 28.4 | 41.7 | 2.50 | 0.70–1.50 |

sparkctl's own figures, the model card's: tok/s per stream = (N − 1) ÷ (E2EL − TTFT) = 1 ÷ TPOT; Cn agg = \
n × the mean per-stream rate (vLLM's output_throughput is below); accepted tok/step = 1 + accepted ÷ drafts \
(vLLM's spec_decode_acceptance_length).
TTFT 0.60–2.00 s (p50 per level) across C1–C8."""


def test_table_golden_in_the_seed_layout():
    assert report.render_table(seed_doc()) == GOLDEN_TABLE


def test_table_marks_partial_levels_and_missing_cells():
    cfg = level.BenchConfig(endpoint=headapi.Endpoint.parse("http://h:1"), model="m")
    run = level.BenchRun(cfg, started=0.0)
    lv = synthetic_level("prose", 1, 10.0, 0.5, 10, 5)
    lv.requests.append(rq.RequestResult(index=9).fail("http", "HTTP 500"))
    run.levels.append(lv)
    lv2 = level.LevelResult("prose", 2, [rq.RequestResult(index=0).fail("connect", "refused")], spec=None)
    run.levels.append(lv2)
    table = report.render_table(run.to_dict())
    assert "| prose | 10.0* | — | 1.50 | 0.50–0.50 |" in table
    assert "* some requests of that level failed" in table


def test_json_document_has_p50_p90_and_definitions():
    doc = seed_doc()
    lv = doc["workloads"]["prose"][1]
    # two samples: a p50, no p90 (that needs 10: benchmetrics.min_samples)
    assert lv["per_stream_tok_s"] == {"n": 2, "mean": 7.7, "p50": 7.7, "p90": None}
    assert lv["agg_tok_s"] == 15.4 and lv["ttft_s"]["p50"] == 0.9 and lv["ttft_s"]["p90"] is None
    ten = synthetic_level("prose", 2, 7.7, 0.9, 10, 8, n=10).to_dict()
    assert ten["per_stream_tok_s"]["p90"] == 7.7 and ten["ttft_s"]["p90"] == 0.9
    assert lv["spec_decode"]["tokens_per_step"] == 1.8 and lv["spec_decode"]["acceptance_rate"] == pytest.approx(0.2667, abs=1e-4)
    assert lv["results"][0]["decode_tok_s"] == 7.7
    assert doc["schema"] == report.SCHEMA and "agg_tok_s" in doc["definitions"]["sparkctl"]
    assert "tpot" in doc["definitions"]["vllm"]
    json.dumps(doc)


def test_compare_per_cell_percent_change(tmp_path):
    base = seed_doc()
    new = seed_doc(scale=1.1)
    cmp = report.compare(new, base)
    cell = cmp["tasks"]["prose"]["C1 per-stream"]
    assert cell["old"] == 11.1 and cell["new"] == pytest.approx(12.21) and cell["change_pct"] == pytest.approx(10.0)
    assert cmp["tasks"]["code"]["accepted tok/step"]["change_pct"] == 0.0
    text = report.render_compare(new, base)
    assert "| prose | 11.1 → 12.2 (+10.0%) | 15.4 → 16.9 (+10.0%) |" in text
    assert "1.80 → 1.80 (+0.0%)" in text and "0.60–2.00 → 0.60–2.00 (+0.0%)" in text
    # a saved file round-trips; a wrong file is bad input (exit 2)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(base))
    assert report.load_saved(path) == base
    path.write_text('{"schema": "something-else"}')
    with pytest.raises(UsageError, match="not a sparkctl bench run"):
        report.load_saved(path)
    path.write_text("{")
    with pytest.raises(UsageError, match="not JSON"):
        report.load_saved(path)


def quick_cfg(url: str, **kw: Any) -> level.BenchConfig:
    kw.setdefault("workloads", [inputs.builtin_workload("prose")])
    kw.setdefault("concurrency", [1, 2])
    kw.setdefault("requests", 2)
    kw.setdefault("warmup", 0)
    kw.setdefault("max_tokens", 8)
    kw.setdefault("timeout", 5.0)
    return level.BenchConfig(endpoint=headapi.Endpoint.parse(url), model="m", **kw)


def test_run_against_a_server_that_refuses_ignore_eos_drops_it_and_retries():
    seen: list[dict[str, Any]] = []
    ok = stream_app(ok_stream(4))

    def app(h: Any) -> None:
        if h.command == "POST":
            seen.append(h.body)
            if "ignore_eos" in h.body:
                send_json(h, 400, {"error": {"message": "Unrecognized request argument supplied: ignore_eos"}})
                return
        ok(h)

    with tiny_server(app) as url:
        run = flow.run_bench(quick_cfg(url, concurrency=[1], requests=3))
    assert [len(lv.ok) for lv in run.levels] == [3]
    assert run.levels[0].requests[0].retried_without == "ignore_eos"
    assert sum("ignore_eos" in body for body in seen) == 1
    assert any("ignore_eos" in n for n in run.notes) and not run.failures()


def test_run_stops_when_no_request_of_a_level_succeeds():
    def post(h: Any) -> None:
        send_json(h, 503, {"error": {"message": "overloaded"}})

    with tiny_server(lambda h: models_or(h, post)) as url:
        run = flow.run_bench(quick_cfg(url, warmup=1))
    assert run.levels == [] and run.stopped and "overloaded" in run.stopped
    doc = run.to_dict()
    assert doc["failures"]["total"] == 1 and "HTTP 503" in doc["failures"]["by_kind"]["http"]["first"]


def test_ctrl_c_stops_cleanly_with_what_was_measured():
    """Ctrl-C while C2 streams: C1's results are kept, C2's cancelled requests are not failures.

    The interrupt is sent by the server once C2's first stream is held open, not by a timer: a timer
    raced the run itself (C1 and C2 together took about as long as the 1.0 s timer, so on a loaded
    machine the run could end first or the interrupt land in C1)."""
    full = stream_app(ok_stream(6))
    release = threading.Event()
    posts = {"n": 0}
    lock = threading.Lock()
    held = stalled_stream(release)
    ctrl_c = stalled_stream(release, _thread.interrupt_main)  # C2's first stream: Ctrl-C while it is held

    def app(h: Any) -> None:
        if h.command != "POST":
            full(h)
            return
        with lock:  # which request this is, decided once (C2's two requests arrive together)
            posts["n"] += 1
            n = posts["n"]
        # C1's two requests, one after the other, stream in full; then C2's
        full(h) if n <= 2 else ctrl_c(h) if n == 3 else held(h)

    try:
        with tiny_server(app) as url:
            run = flow.run_bench(quick_cfg(url, concurrency=[1, 2], requests=2))
    finally:
        release.set()
    assert posts["n"] >= 3  # C2 started: the interrupt came from its held stream
    assert run.interrupted
    assert run.levels and run.levels[0].ok and run.levels[0].concurrency == 1  # C1 finished and is kept
    assert not run.failures()  # cancelled requests are not failures
    table = report.render_table(run.to_dict())
    assert table.startswith("| Task | C1 per-stream")


# ============================================================================ the command


def test_cli_bad_input_exits_2(capsys, tmp_path):
    code, _, err = run_cli(["bench", "--url", "http://127.0.0.1:1", "--concurrency", "1,x"], capsys)
    assert code == 2 and "not a positive whole number" in err
    code, _, err = run_cli(["bench", "--url", "http://127.0.0.1:1", "--concurrency", "8", "--requests", "2"], capsys)
    assert code == 2 and "fewer than the concurrency" in err
    (tmp_path / "x.json").write_text("[]")
    code, _, err = run_cli(["bench", "--url", "http://127.0.0.1:1", "--compare", str(tmp_path / "x.json")], capsys)
    assert code == 2 and "not a sparkctl bench run" in err
    code, _, err = run_cli(["bench", "--url", "http://127.0.0.1:1", "--api-key-env", "SPARKCTL_NO_SUCH_VAR"], capsys)
    assert code == 2 and "SPARKCTL_NO_SUCH_VAR" in err


def test_cli_server_down_exits_1_without_traceback(capsys):
    code, out, err = run_cli(["bench", "--url", f"http://127.0.0.1:{free_port()}"], capsys)
    assert code == 1 and out == ""
    assert "cannot reach the API" in err and "connection refused" in err and "Traceback" not in err


def test_cli_failures_mid_run_reported_per_request_and_summary(capsys):
    calls = {"n": 0}
    good = stream_app(ok_stream(4))
    lock = threading.Lock()

    def app(h: Any) -> None:
        if h.command == "POST":
            with lock:
                calls["n"] += 1
                n = calls["n"]
            if n % 2 == 0:
                send_json(h, 500, {"error": {"message": f"boom {n}"}})
                return
        good(h)

    with tiny_server(app) as url:
        code, out, err = run_cli(["--json", "bench", "--url", url, "--workload", "prose", "--concurrency", "1,2",
                                  "--requests", "2", "--warmup", "0", "--max-tokens", "4"], capsys)
    doc = json.loads(out)
    assert code == 1
    # a failure's `failures` is the list every command's failure has; bench's request counts are beside it
    counts = doc["request_failures"]
    assert counts["total"] >= 1 and "boom" in counts["by_kind"]["http"]["first"]
    assert doc["exit_code"] == 1 and doc["failures"] and "\n" not in doc["error"]
    assert "request(s) failed" in err and "HTTP 500" in err and "Traceback" not in err


def test_cli_sigterm_mid_run_exits_143_with_what_was_measured(capsys):
    """SIGTERM (a supervisor, `kill`) while a request streams: the run stops as on Ctrl-C, says which
    signal, and exits 128 + 15 like every other command (it exited 130 whatever the signal)."""
    release = threading.Event()

    def sigterm_while_the_client_waits() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # sparkctl's handler raises it in the main thread

    post = stalled_stream(release, sigterm_while_the_client_waits)
    try:
        with tiny_server(lambda h: models_or(h, post)) as url:
            code, out, err = run_cli(["bench", "--url", url, "--workload", "prose", "--concurrency", "1",
                                      "--requests", "1", "--warmup", "0", "--max-tokens", "4"], capsys)
    finally:
        release.set()
    assert code == 143, err
    assert "note: interrupted (SIGTERM)" in out and "Traceback" not in err


def test_cli_non_streaming_server_exits_1(capsys):
    def post(h: Any) -> None:
        send_json(h, 200, {"object": "chat.completion", "choices": []})

    with tiny_server(lambda h: models_or(h, post)) as url:
        code, out, err = run_cli(["bench", "--url", url, "--warmup", "1", "--max-tokens", "4"], capsys)
    assert code == 1 and "not-streaming" in err and "ignored stream=true" in err


# ============================================================================ against the stand-in engine


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The lab's stand-in engine on loopback: fast (2,000 tok/s per stream), MTP k=3, acceptance 0.5."""
    from sparkctl.lab.ckptgen import make_checkpoint

    model = tmp_path_factory.mktemp("standin") / "tiny"
    make_checkpoint(model, "tiny")
    env = {"STANDIN_DECODE_TOK_S": "2000", "STANDIN_TTFT_S": "0.05", "STANDIN_ACCEPT_RATE": "0.5"}
    spec = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']
    with local_standin(model, env=env, extra_args=spec) as url:
        yield url


def test_standin_measures_known_speed_ttft_and_tokens_per_step(standin):
    run = flow.run_bench(quick_cfg(standin, concurrency=[1, 2], requests=2, max_tokens=96, warmup=1))
    doc = run.to_dict()
    assert not run.failures() and not run.interrupted
    # Speeds are timing: their ±5% accuracy is bench/bench_accuracy.py's job, not a unit test's.
    # Here: the pipeline measures something sane, and the counter-based figures are exact.
    for lv in doc["workloads"]["prose"]:
        assert 0 < lv["per_stream_tok_s"]["p50"] <= 2000 * 1.2
        # the card's aggregate: summed across streams
        assert lv["agg_tok_s"] == pytest.approx(lv["per_stream_tok_s"]["mean"] * lv["concurrency"], rel=1e-3)
        assert 0.05 <= lv["ttft_s"]["p50"]  # never before the configured TTFT (its accuracy: bench_accuracy.py)
        assert lv["spec_decode"]["tokens_per_step"] == pytest.approx(1 + 0.5 * 3, rel=0.03)
        assert lv["completion_tokens"] == 96 * lv["requests"]


def test_cli_against_standin_save_compare_and_json(standin, capsys, tmp_path):
    saved = tmp_path / "run.json"
    args = ["bench", "--url", standin + "/v1", "--workload", "code", "--concurrency", "1,2", "--requests", "2",
            "--max-tokens", "32", "--warmup", "0"]
    code, out, err = run_cli([*args, "--save", str(saved)], capsys)
    assert code == 0, err
    assert out.startswith("| Task | C1 per-stream | C2 agg | accepted tok/step | TTFT p50 (s) |")
    assert "| code |" in out and f"saved to {saved}" in out
    assert "bench http://127.0.0.1" in err  # the header line goes to stderr
    code, out, err = run_cli(["--json", *args, "--compare", str(saved)], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["model"] == "m" and doc["compare"]["tasks"]["code"]["C1 per-stream"]["change_pct"] is not None


def test_cli_uses_the_heads_address_from_the_settings(standin, capsys, tmp_path, monkeypatch):
    port = standin.rsplit(":", 1)[1]
    ssh = tmp_path / "ssh_config"
    ssh.write_text("Host spark1\n  HostName 127.0.0.1\n  User root\n")
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k in ("SPARKCTL_ENV_FILE", "RECIPE", "TP", "DCP", "VLLM_API_KEY"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NODES", "spark1 spark2 spark3 spark4")
    monkeypatch.setenv("MODEL", "/models/x")
    monkeypatch.setenv("PORT", port)
    monkeypatch.setenv("SERVED_MODEL_NAME", "m")
    code, out, err = run_cli(["--ssh-config", str(ssh), "--json", "bench", "--workload", "list",
                              "--concurrency", "1", "--requests", "1", "--max-tokens", "8", "--warmup", "0"], capsys)
    assert code == 0, err
    assert json.loads(out)["url"] == f"http://127.0.0.1:{port}"


def test_cli_wrong_model_name_is_bad_input(standin, capsys):
    code, _, err = run_cli(["bench", "--url", standin, "--model", "nope", "--max-tokens", "4"], capsys)
    assert code == 2 and "serves m, not 'nope'" in err and "--model m" in err


def test_list_models_errors(standin):
    assert rq.list_models(headapi.Endpoint.parse(standin), None) == ["m"]

    def deny(h: Any) -> None:
        send_json(h, 401, {"error": "Unauthorized"})

    with tiny_server(deny) as url, pytest.raises(CheckFailed, match="refused the API key"):
        rq.list_models(headapi.Endpoint.parse(url), "k")
