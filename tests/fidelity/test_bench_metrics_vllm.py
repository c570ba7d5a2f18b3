"""sparkctl bench's metrics against vLLM 0.33's own benchmark code (the fidelity venv).

- benchmetrics.serving_metrics and vLLM's `calculate_metrics` (vllm/benchmarks/serve.py) on the same
  synthetic timelines: every count, throughput, mean, median, std and percentile under the same key.
- benchmetrics.streamed_output and vLLM's `_choice_has_streamed_output` (what starts TTFT and ends E2EL)
  on the chunks servers send.
- one streamed request read by vLLM's own client (`async_request_openai_chat_completions`, aiohttp) and
  by sparkctl's (request.stream_request) from the same scripted server: the same number of ITLs, the
  same output and prompt token counts, and both TTFTs after the server's scripted prefill.
Skipped without vLLM (tests/fidelity/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")

from vllm.benchmarks.lib import endpoint_request_func as erf  # noqa: E402
from vllm.benchmarks.serve import calculate_metrics  # noqa: E402

from sparkctl.loadgen import request  # noqa: E402
from sparkctl.measure import metrics as benchmetrics  # noqa: E402
from sparkctl.remote import headapi  # noqa: E402

pytestmark = pytest.mark.fidelity


def timelines(seed: int, n: int) -> list[benchmetrics.Timeline]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < 0.05:
            out.append(benchmetrics.Timeline(False, float(i)))
            continue
        start = i * 0.37
        t = start + rng.uniform(0.05, 2.0)
        times = [t]
        for _ in range(rng.randint(0, 40)):
            t += rng.expovariate(30.0)
            times.append(t)
        tokens = len(times) + rng.randint(0, 10)  # a chunk can carry several tokens (speculative decoding)
        out.append(benchmetrics.Timeline.from_chunk_times(start, times, output_tokens=tokens,
                                                          prompt_len=rng.randint(10, 500)))
    return out


def vllm_output(t: benchmetrics.Timeline) -> Any:
    return erf.RequestFuncOutput(success=t.success, latency=t.latency, output_tokens=t.output_tokens or 0,
                                 ttft=t.ttft, itl=list(t.itl), prompt_len=t.prompt_len, start_time=t.start)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_serving_metrics_equal_vllms_calculate_metrics(seed: int) -> None:
    tl = timelines(seed, 150)  # > 100 completed: every percentile reported
    dur = 60.0
    theirs, _ = calculate_metrics(input_requests=[], outputs=[vllm_output(t) for t in tl], dur_s=dur,
                                  tokenizer=None, selected_percentiles=list(benchmetrics.PERCENTILES),
                                  goodput_config_dict={})
    mine = benchmetrics.serving_metrics(tl, dur)
    assert mine["completed"] == theirs.completed and mine["failed"] == theirs.failed
    assert mine["total_input_tokens"] == theirs.total_input
    assert mine["total_output_tokens"] == theirs.total_output
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert mine[key] == pytest.approx(getattr(theirs, key), rel=1e-12), key
    for name in benchmetrics.METRICS:
        for stat in ("mean", "median", "std"):
            assert mine[f"{stat}_{name}_ms"] == pytest.approx(getattr(theirs, f"{stat}_{name}_ms"), rel=1e-9), \
                (stat, name)
        for p, value in getattr(theirs, f"percentiles_{name}_ms"):
            word = str(int(p)) if int(p) == p else str(p)
            assert mine[f"p{word}_{name}_ms"] == pytest.approx(value, rel=1e-9), (p, name)


CHUNKS: list[Any] = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "a"}}]},
    {"choices": [{"index": 0, "delta": {"content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "", "role": "assistant"}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
    {"choices": [{"index": 0, "delta": {"reasoning": "r"}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "r"}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]},
    {"choices": [{"index": 0, "delta": {"function_call": {"name": "f"}}}]},
    {"choices": [{"index": 0, "delta": {"content": None}}]},
    {"choices": [{"index": 0, "delta": "text"}]},
    {"choices": [], "usage": {"completion_tokens": 3}},
    {"usage": {"completion_tokens": 3}},
]


@pytest.mark.parametrize("chunk", CHUNKS, ids=[json.dumps(c)[:60] for c in CHUNKS])
def test_streamed_output_is_vllms_choice_rule(chunk: Any) -> None:
    theirs = bool((choices := chunk.get("choices")) and erf._choice_has_streamed_output(choices[0]))
    assert benchmetrics.streamed_output(chunk) is theirs


# One scripted stream: the role chunk, 6 content chunks (the 2nd and 3rd in one write), the closing
# chunk, usage, [DONE]; prefill PREFILL_S, a gap of GAP_S between writes.
PREFILL_S, GAP_S = 0.3, 0.05


def script() -> list[list[dict[str, Any]]]:
    writes: list[list[dict[str, Any]]] = [[{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                                           {"choices": [{"index": 0, "delta": {"content": "w0"}}]}]]
    writes.append([{"choices": [{"index": 0, "delta": {"content": " w1"}}]},
                   {"choices": [{"index": 0, "delta": {"content": " w2"}}]}])
    writes += [[{"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]}] for i in range(3, 6)]
    writes.append([{"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "length"}]},
                   {"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": 9, "total_tokens": 26}}])
    return writes


class _Scripted(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        time.sleep(PREFILL_S)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for k, write in enumerate(script()):
            if k:
                time.sleep(GAP_S)
            data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in write)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        done = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        self.wfile.flush()


@pytest.fixture
def scripted() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    th = Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_one_request_read_by_vllms_client_and_sparkctls(scripted: str) -> None:
    import aiohttp

    async def theirs() -> Any:
        async with aiohttp.ClientSession() as session:
            inp = erf.RequestFuncInput(prompt="hello", api_url=f"{scripted}/v1/chat/completions", prompt_len=1,
                                       output_len=9, model="m")
            return await erf.async_request_openai_chat_completions(inp, session)

    v = asyncio.run(theirs())
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}).encode()
    s = request.stream_request(headapi.Endpoint.parse(scripted), "/v1/chat/completions", body, timeout=30)
    assert v.success and s.ok, (v.error, s.error)
    assert len(s.itl) == len(v.itl) == 6  # 7 output chunks (w0..w5 and the closing "" token): 6 gaps
    assert s.completion_tokens == v.output_tokens == 9 and s.prompt_tokens == v.prompt_len == 17
    assert s.ttft_s is not None and s.latency_s is not None
    # both clocks start before the send and stop at the first output chunk (after the prefill), and at the
    # last output chunk (after the five gaps): lower bounds only, so the machine's load cannot flip them
    assert s.ttft_s >= PREFILL_S and v.ttft >= PREFILL_S
    assert s.latency_s - s.ttft_s >= 5 * GAP_S * 0.9 and v.latency - v.ttft >= 5 * GAP_S * 0.9
