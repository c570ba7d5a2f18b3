"""Several replicas measured together: LevelSync holds their levels in step, and the total adds their
figures level by level (TOTAL_DEFINITIONS). The flow that runs them is orchestrate.bench.run_replicas.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from .level import LevelResult, ProgressSink
from .report import rounded
from .request import RequestResult

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


class SyncedSink(ProgressSink):
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
                "agg_tok_s": rounded(sum(aggs), 3) if aggs else None,
                "throughput_tok_s": rounded(sum(thr), 3) if thr else None,
                "completion_tokens": sum(int(lv["completion_tokens"]) for lv in lvs),
                "ttft_p50_worst_s": max(p50s) if p50s else None,
                "partial": len(aggs) < n or any(bool(lv.get("interrupted") or lv.get("failed")) for lv in lvs),
            })
        workloads[task] = rows
    return {"replicas": n, "definitions": TOTAL_DEFINITIONS, "workloads": workloads,
            "failures": {"total": sum(int(d["failures"]["total"]) for d in docs)}}
