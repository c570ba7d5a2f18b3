"""`sparkctl wait`'s flow: connect every node, then `readiness.wait_ready` on the head (several replicas:
on every replica's head at once, within the one timeout; each must answer a real completion)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..cluster import Cluster, parallel
from ..remote import readiness, service
from ..spec.settings import Settings
from . import require_all


def wait(s: Settings, ssh_config: Any, *, url: str | None, timeout: float, prompt: str,
         on_phase: Callable[[readiness.RankWatch], None]) -> tuple[str, dict[str, Any]]:
    """One service: (the API's base URL, `wait_ready`'s result)."""
    with Cluster(s.nodes, ssh_config) as cluster:
        require_all(cluster, "wait")
        api = readiness.HeadApi(url or service.head_base_url(cluster, s), s.get("VLLM_API_KEY"))
        result = readiness.wait_ready(cluster, s, api, timeout=timeout, on_phase=on_phase, prompt=prompt)
    return api.base_url, result


def wait_replicas(s: Settings, ssh_config: Any, *, timeout: float, prompt: str,
                  on_phase: Callable[[Settings, readiness.RankWatch], None]) -> list[dict[str, Any]]:
    """Every replica's head, together: per replica its index, head, URL and `wait_ready`'s result. The
    first replica that fails (or is not ready in time) fails the wait."""
    with Cluster(s.nodes, ssh_config) as cluster:
        require_all(cluster, "wait")

        def one(view: Settings) -> dict[str, Any]:
            api = readiness.HeadApi(service.head_base_url(cluster, view), view.get("VLLM_API_KEY"))
            result = readiness.wait_ready(cluster, view, api, timeout=timeout,
                                          on_phase=functools.partial(on_phase, view), prompt=prompt)
            return {"replica": view.replica_index, "head": view.head, "url": api.base_url, **result}

        jobs: list[Callable[[], dict[str, Any]]] = [functools.partial(one, v) for v in s.replicas()]
        return parallel(jobs)
