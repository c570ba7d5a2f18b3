"""One level of a run: the config, the request body (Sampling), the progress callbacks, and run_level,
which puts one load shape (a closed loop of C streams, or Poisson arrivals capped at C) on the server
and keeps every request's result. The run's document (BenchRun.to_dict) is built here; the whole
run's flow is orchestrate.bench.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..measure import metrics as benchmetrics
from ..remote.headapi import Endpoint
from ..threads import spawn, wait_all, wait_bounded
from .inputs import (
    DEFAULT_CONCURRENCY,
    DEFAULT_WORKLOADS,
    TEMPERATURE,
    TOP_P,
    Workload,
    builtin_workload,
)
from .report import DEFINITIONS, SCHEMA, rounded
from .request import Canceller, RequestResult, Tokenizer, read_spec_counters, stream_request
from .wire import SpecDelta, percentile, spec_delta

# Parameters a non-vLLM server may refuse; dropped (and noted) when a 400 names them.
OPTIONAL_PARAMS = ("ignore_eos", "chat_template_kwargs", "stream_options")


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
            **{k: (rounded(v, 4) if isinstance(v, float) else v) for k, v in vllm.items()},
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
            "per_stream_tok_s": {"n": len(rates), "mean": rounded(mean, 3), "p50": rounded(percentile(rates, 50), 3),
                                 "p90": rounded(p90, 3)},
            "agg_tok_s": rounded(None if mean is None else mean * self.concurrency, 3),
            "throughput_tok_s": rounded(tokens / self.wall_s if self.wall_s > 0 and tokens else None, 3),
            "ttft_s": {"n": len(ttfts), "p50": rounded(percentile(ttfts, 50), 4), "p90": rounded(ttft_p90, 4),
                       "min": rounded(min(ttfts, default=None), 4), "max": rounded(max(ttfts, default=None), 4)},
            "completion_tokens": tokens,
            "tokens_counted_from_chunks": from_chunks,
            "spec_decode": None if spec is None else {
                "drafts": spec.drafts, "draft_tokens": spec.draft_tokens, "accepted": spec.accepted,
                "accepted_per_step": rounded(spec.accepted_per_step, 4), "tokens_per_step": rounded(spec.tokens_per_step, 4),
                "acceptance_rate": rounded(spec.acceptance_rate, 4)},
            # vLLM's names for the same counters' deltas (its acceptance_rate is in %)
            "spec_decode_acceptance_length": None if spec is None else rounded(spec.tokens_per_step, 4),
            "spec_decode_acceptance_rate": None if spec is None or spec.acceptance_rate is None
            else rounded(100 * spec.acceptance_rate, 3),
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
