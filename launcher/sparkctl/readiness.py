"""Readiness of a started service: the head's HTTP API and `wait`.

`wait` is done only when /health is 200, /v1/models lists the served name and one real chat
completion comes back ("/health lies" in practice). Every poll also inspects every rank's container,
so a rank that dies fails the wait at once, with its last log lines. Kept apart from service.py so
that `up` and `down` do not import an HTTP client.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
from tenacity import Retrying, retry_if_result, stop_after_delay, wait_exponential

from .builders import container_name
from .cluster import Cluster, Node, NodeError
from .errors import CheckFailed
from .service import ContainerState, _failures, _log_tail, _raise_nodes, inspect_cluster
from .settings import Settings

PHASES: list[tuple[str, re.Pattern[str]]] = [
    ("rendezvous", re.compile(r"rendezvous|init_process_group|world_size=|Initializing a V1 LLM engine", re.I)),
    ("loading weights", re.compile(r"Loading (model )?weights|Starting to load model|Loading safetensors", re.I)),
    ("graph capture", re.compile(r"Capturing CUDA graph|Graph capturing|capturing cudagraph", re.I)),
    ("ready", re.compile(r"Application startup complete", re.I)),
]


def phase_of(lines: Sequence[str]) -> str:
    """The furthest phase these log lines have reached ("starting" before any)."""
    best = -1
    for line in lines:
        for i, (_, rx) in enumerate(PHASES):
            if i > best and rx.search(line):
                best = i
    return PHASES[best][0] if best >= 0 else "starting"


@dataclass
class HeadApi:
    base_url: str
    api_key: str | None = None
    timeout: float = 5.0

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def health(self) -> int | None:
        try:
            return requests.get(f"{self.base_url}/health", timeout=self.timeout, headers=self._headers()).status_code
        except requests.RequestException:
            return None

    def models(self) -> list[str]:
        r = requests.get(f"{self.base_url}/v1/models", timeout=self.timeout, headers=self._headers())
        r.raise_for_status()
        data = r.json().get("data") or []
        return [str(m.get("id")) for m in data if isinstance(m, dict)]

    def chat(self, model: str, prompt: str, max_tokens: int = 32, timeout: float = 120.0) -> tuple[str, float]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0, "chat_template_kwargs": {"enable_thinking": False}}
        start = time.monotonic()
        r = requests.post(f"{self.base_url}/v1/chat/completions", json=body, timeout=timeout, headers=self._headers())
        latency = time.monotonic() - start
        r.raise_for_status()
        choice = (r.json().get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        return str(text), latency

    def metrics(self) -> str | None:
        try:
            r = requests.get(f"{self.base_url}/metrics", timeout=self.timeout, headers=self._headers())
        except requests.RequestException:
            return None
        return r.text if r.ok else None


@dataclass
class RankWatch:
    rank: int
    node: str
    phase: str = "starting"
    phase_since: float = field(default_factory=time.monotonic)
    history: list[tuple[str, float]] = field(default_factory=list)


class RankDied(CheckFailed):
    pass


def wait_ready(
    cluster: Cluster,
    settings: Settings,
    api: HeadApi,
    *,
    timeout: float,
    on_phase: Callable[[RankWatch], None] = lambda w: None,
    poll_s: float = 0.5,
    prompt: str = "Say hello in five words.",
) -> dict[str, Any]:
    """Until /health is 200, /v1/models lists the served name and a real chat completion answers.

    Every poll also inspects every rank's container: a rank that died fails the wait at once, with
    its last log lines. Polls back off from 0.2 s to `poll_s`; nothing busy-waits.
    """
    name = settings.cluster_name
    served = str(settings.get("SERVED_MODEL_NAME"))
    watches = {r: RankWatch(r, n) for r, n in enumerate(settings.nodes)}
    start = time.monotonic()
    seen: dict[str, float] = {}  # when /health first answered 200 (wall clock, for benchmarks)

    def poll_rank(node: Node) -> tuple[list[ContainerState], list[str]]:
        rank = settings.nodes.index(node.name)
        states = inspect_cluster(node, name)
        lines = _log_tail(node, container_name(name, rank), 200)
        return states, lines

    def once() -> dict[str, Any] | None:
        results = cluster.run_all(poll_rank, nodes=settings.nodes)
        failed = _failures(results)
        if failed:
            _raise_nodes("lost contact while waiting", failed)
        for rank, w in watches.items():
            res = results[w.node]
            assert not isinstance(res, NodeError)
            states, lines = res
            mine = [c for c in states if c.rank == rank]
            if not mine or not mine[0].running:
                status = f"{mine[0].status}, exit code {mine[0].exit_code}" if mine else "no container"
                tail = "\n    ".join(lines[-15:]) or "(no log output)"
                raise RankDied(f"rank {rank} on {w.node} died ({status}) after {time.monotonic() - start:.1f}s; "
                               f"its last log lines:\n    {tail}",
                               fix=f"read `sparkctl logs --rank {rank}`; then `sparkctl down` and fix the cause")
            phase = phase_of(lines)
            if phase != w.phase:
                now = time.monotonic()
                w.history.append((w.phase, now - w.phase_since))
                w.phase, w.phase_since = phase, now
                on_phase(w)
        if api.health() != 200:
            return None
        seen.setdefault("health_ok_at", time.time())
        models = api.models()
        if served not in models:
            return None
        text, latency = api.chat(served, prompt)
        return {"models": models, "completion": text, "latency_s": latency, "health_ok_at": seen["health_ok_at"],
                "elapsed_s": time.monotonic() - start,
                "phases": {w.rank: [*w.history, (w.phase, time.monotonic() - w.phase_since)]
                           for w in watches.values()}}

    retry = Retrying(
        stop=stop_after_delay(timeout),
        wait=wait_exponential(multiplier=0.1, min=0.2, max=poll_s),
        retry=retry_if_result(lambda r: r is None),
        retry_error_callback=lambda state: None,
        reraise=True,
    )
    result = retry(_guard_http(once))
    if result is None:
        phases = ", ".join(f"rank {w.rank}: {w.phase}" for w in watches.values())
        raise CheckFailed(f"the service was not ready within {timeout:g}s ({phases})",
                          fix="`sparkctl logs` shows what each rank is doing; raise --timeout for a slow load")
    return result


def _guard_http(fn: Callable[[], dict[str, Any] | None]) -> Callable[[], dict[str, Any] | None]:
    """A refused/timed-out HTTP call while the head loads is 'not ready yet', not a failure."""
    def wrapped() -> dict[str, Any] | None:
        try:
            return fn()
        except (requests.ConnectionError, requests.Timeout):
            return None
        except requests.HTTPError as exc:
            status = exc.response.status_code if exc.response is not None else 0
            if status in (502, 503, 504):
                return None
            raise CheckFailed(f"the head answered HTTP {status}: {str(exc)[:200]}") from None
    return wrapped
