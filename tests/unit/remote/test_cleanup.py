"""cleanup.sweep without SSH or Docker: what it says and reports when a third signal aborts it (a
mutant of that path survived tests/unit/test_crash_safety.py; bench/mutation.py cleanup)."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from sparkctl import signals
from sparkctl.cluster import NodeError
from sparkctl.cluster.fanout import Results
from sparkctl.remote import cleanup
from tests.unit.test_crash_safety import handlers  # noqa: F401  (the fixture: sparkctl's handlers)


class _Node:
    def __init__(self, name: str) -> None:
        self.name = name




def test_a_sweep_aborted_by_a_third_signal_names_each_node_and_what_may_be_left(monkeypatch: Any) -> None:
    monkeypatch.setattr(cleanup, "remove_cluster", lambda node, cluster: ["sparkctl-c-rank0"])
    said: list[str] = []

    class Aborted:  # runs the head's group; the third signal arrives while the workers' group runs
        def run_all(self, job: Any, *, nodes: list[str]) -> Results[Any]:
            if nodes == ["head"]:
                job(_Node("head"))
                return Results({"head": None})
            raise signals.CleanupAborted(signal.SIGINT)

    with pytest.raises(signals.CleanupAborted):
        cleanup.sweep(Aborted(), "c", [["head"], ["w1", "w2"]],  # type: ignore[arg-type]
                      expected={"w1": ["sparkctl-c-rank1"]}, say=said.append)
    assert said == [
        "aborted: the cleanup did not finish; per node:",
        "  head: removed sparkctl-c-rank0",
        "  w1: NOT clean (removal not finished: aborted by a third signal); may still be there: sparkctl-c-rank1",
        "  w2: NOT clean (removal not finished: aborted by a third signal); may still be there: (unknown: not inspected)",
        "run `sparkctl down` to remove what is left",
    ]


def test_an_unreachable_node_is_reported_with_what_was_expected_there(monkeypatch: Any) -> None:
    class Unreachable:
        def run_all(self, job: Any, *, nodes: list[str]) -> Results[Any]:
            return Results({n: NodeError(n, "ssh", "connection refused") for n in nodes})

    report = cleanup.sweep(Unreachable(), "c", [["n1"]], expected={"n1": ["sparkctl-c-rank0"]})  # type: ignore[arg-type]
    assert cleanup.sweep_lines(report) == ["n1: NOT clean (connection refused); may still be there: sparkctl-c-rank0"]


def test_the_newest_2000_audit_lines_are_all_read() -> None:
    from sparkctl.remote import lockdir as lock

    first = lock.audit_line(action="up", rank=0, container="a" * 64)
    text = "\n".join([first, *[lock.audit_line(action="status")] * 1999])
    assert cleanup.parse_up_records(text).ids == {"a" * 64}  # the 2000th newest line still counts
    assert cleanup.parse_up_records("x\n" * 1 + text + "\n" + first.replace("a" * 64, "b" * 64)).ids == {"b" * 64}


def test_a_node_whose_listing_failed_names_what_was_expected_there(monkeypatch: Any) -> None:
    def remove(node: Any, cluster: str) -> list[str]:  # `docker ps` itself failed: nothing listed
        raise cleanup.RemoveFailed(node.name, "cannot remove containers: docker is down", [])

    class One:
        def run_all(self, job: Any, *, nodes: list[str]) -> Results[Any]:
            for n in nodes:
                job(_Node(n))
            return Results({n: None for n in nodes})

    monkeypatch.setattr(cleanup, "remove_cluster", remove)
    report = cleanup.sweep(One(), "c", [["n1"]], expected={"n1": ["sparkctl-c-rank0"]})  # type: ignore[arg-type]
    assert cleanup.sweep_lines(report) == [
        "n1: NOT clean (cannot remove containers: docker is down); may still be there: sparkctl-c-rank0"]


def test_an_audit_line_that_is_not_json_does_not_hide_the_lines_after_it() -> None:
    from sparkctl.remote import lockdir as lock

    text = "\n".join(["not json", lock.audit_line(action="up", rank=0, container="a" * 64)])
    assert cleanup.parse_up_records(text).ids == {"a" * 64}


def test_what_a_node_says_is_capped() -> None:
    import json

    from sparkctl.cluster.channel import RunResult

    listing = "\n".join(f"{i:064x} sparkctl-c-rank{i}" for i in range(150))
    assert len(cleanup._names(listing)) == 100

    class Failing:
        name = "n1"

        def run(self, argv: list[str], *, timeout: float | None = None) -> RunResult:
            return RunResult("", "e" * 500, 1, 0.0)

    with pytest.raises(cleanup.RemoveFailed) as exc:
        cleanup.remove_cluster(Failing(), "c")  # type: ignore[arg-type]
    assert exc.value.reason == "cannot remove containers: " + "e" * 300
    up = json.dumps({"action": "up", "container": "c" * 200})
    assert cleanup.parse_up_records(up).ids == {"c" * 128}


def test_an_older_up_line_counts_only_with_both_its_rank_and_its_config() -> None:
    import json

    lines = [json.dumps({"action": "up", "rank": 1}), json.dumps({"action": "up", "config_hash": "h"}),
             json.dumps({"action": "up", "rank": 2, "config_hash": "h2"})]
    assert cleanup.parse_up_records("\n".join(lines)).legacy == {(2, "h2")}


def test_a_signal_during_a_sweep_is_raised_once_it_is_done(handlers: None) -> None:  # noqa: F811
    import os
    import time

    class Signalled:
        def run_all(self, job: Any, *, nodes: list[str]) -> Results[Any]:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            return Results({n: None for n in nodes})

    with pytest.raises(signals.Interrupted):
        cleanup.sweep(Signalled(), "c", [["n1"]])  # type: ignore[arg-type]
