"""The fan-out helpers of sparkctl.cluster without any node: Results and parallel."""

from __future__ import annotations

import threading

import pytest

from sparkctl.cluster import NodeError, Results, parallel, raise_failed
from sparkctl.errors import CheckFailed


def test_results_is_the_dict_it_was_plus_ok_failed_and_raise() -> None:
    e2 = NodeError("n2", "lost", "SSH connection lost: EOF", "check n2")
    e4 = NodeError("n4", "timeout", "no answer")
    r: Results[int] = Results([("n1", 1), ("n2", e2), ("n3", 3), ("n4", e4)])
    assert r == {"n1": 1, "n2": e2, "n3": 3, "n4": e4} and list(r) == ["n1", "n2", "n3", "n4"]
    assert r.ok == {"n1": 1, "n3": 3} and list(r.failed) == ["n2", "n4"]
    with pytest.raises(CheckFailed) as exc:
        r.raise_if_failed("start failed")
    assert exc.value.message == ("start failed on 2 node(s):\n  n2: SSH connection lost: EOF (fix: check n2)\n"
                                 "  n4: no answer")
    Results([("n1", 1)]).raise_if_failed("x")
    raise_failed("x", {})


def test_parallel_runs_jobs_side_by_side_and_answers_in_order() -> None:
    barrier = threading.Barrier(3, timeout=30)  # each job waits for the other two: only side by side ends

    def job(i: int) -> int:
        barrier.wait()
        return i * 10

    assert parallel([lambda i=i: job(i) for i in range(3)]) == [0, 10, 20]
    assert parallel([]) == []


def test_parallel_waits_for_every_job_then_raises_the_first_failure_in_order() -> None:
    done: list[str] = []

    def slow_ok() -> str:
        threading.Event().wait(0.2)
        done.append("slow")
        return "slow"

    def bad(msg: str) -> str:
        raise ValueError(msg)

    with pytest.raises(ValueError, match="first"):
        parallel([lambda: bad("first"), slow_ok, lambda: bad("second")])
    assert done == ["slow"]  # the slow job had ended before parallel raised
