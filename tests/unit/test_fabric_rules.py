"""The fabric test's rules, one claim each (what its mutation run, bench/mutation.py, showed untested).

The fixtures and fakes are test_fabric.py's: the settings, the pins, the captured gloo run, FakeNode and
FakeCluster.
"""

from __future__ import annotations

import _thread
import json
import threading
from typing import Any

import pytest

from sparkctl.cluster import NodeError, RunResult
from sparkctl.orchestrate import fabric_test as fabric
from sparkctl.probes import fabric_allreduce
from sparkctl.rules.check_rules import CLUSTER_ROW, FAIL, OK, WARN
from sparkctl.spec.builders import container_options
from tests.unit.test_fabric import (
    FIX,
    GLOO,
    FakeCluster,
    FakeNode,
    _events,
    _ok_run,
    _pins,
    _run_nodes,
    _settings,
    _side_by_side,
    _split_ranks,
)


def test_the_fabric_container_has_every_service_option_but_the_mounts(clean_env: dict[str, str]) -> None:
    """The ranks meet as the service's would (host network, IPC, ulimits, devices): only the bind mounts go."""
    s = _settings()
    want: list[str] = []
    words = iter(container_options(s))
    for word in words:
        if word == "--mount":
            next(words)
        else:
            want.append(word)
    assert want[:2] == ["--network", "host"]
    argv = fabric.fabric_run_argv(s, 1, _pins(s))
    start = argv.index("--label") + 8  # after the four labels
    assert argv[start:start + len(want)] == want
    assert argv[start + len(want)] == "--env"


def test_a_failed_rank_does_not_hide_a_passing_ranks_cell() -> None:
    """Each rank's table cell stands on its own: rank 0 lost, rank 1 finished -> rank 1 still reads ok."""
    parts = _split_ranks("h200x1-gloo-2rank.log")
    lost = NodeError("n0", "lost", "SSH connection lost: EOF")
    outcomes = [fabric.outcome_from_run(0, "n0", lost), fabric.outcome_from_run(1, "n1", _ok_run(parts[1]))]
    findings = fabric.evaluate(outcomes, GLOO, timeout_s=30)
    cells = {f.node: f for f in findings}
    assert cells["n0"].status == FAIL and "SSH connection lost" in cells["n0"].text
    assert cells["n1"].status == OK and cells["n1"].short.endswith("GB/s")
    assert "rank(s) 0 never joined the all-reduce (1 of 2 did)" in cells[CLUSTER_ROW].text


def test_a_finished_rank_with_a_failure_of_its_own_gets_no_ok() -> None:
    """A rank that finished on sockets where RDMA was expected reads fail, never fail and ok at once."""
    sock = (FIX / "h200x1-nccl-1rank-socket.log").read_text()
    o = fabric.outcome_from_run(0, "n0", _ok_run(sock))
    assert o.event("done") is not None
    mine = [f for f in fabric.evaluate([o], fabric.FabricTest(backend="nccl", expect_rdma=True), timeout_s=60)
            if f.node == "n0"]
    assert mine and all(f.status == FAIL for f in mine), mine
    # the same run without the RDMA expectation is its ok cell
    fine = fabric.evaluate([o], fabric.FabricTest(backend="nccl", expect_rdma=False), timeout_s=60)
    assert [f.status for f in fine if f.node == "n0"] == [OK]


@pytest.mark.parametrize("error", ["RuntimeError: Connection refused", "DistNetworkError: the client socket has timed out",
                                   "RuntimeError: timeout waiting for the store"])
def test_a_rank_that_cannot_reach_the_rendezvous_is_told_to_check_it(error: str) -> None:
    start = '{"event":"start","rank":1,"world":2,"backend":"gloo"}'
    err = json.dumps({"event": "error", "rank": 1, "stage": "init", "error": error})
    (f, _cluster) = fabric.evaluate([fabric.outcome_from_run(1, "n1", _events(start, err))], GLOO, timeout_s=30)
    assert f.status == FAIL and "the head's rendezvous" in f.fix and "MASTER_PORT" in f.fix, f


class _Answers(FakeNode):
    """A node whose sweep answers what it is given."""

    def __init__(self, name: str, log: list[tuple[str, str]], sweep: RunResult) -> None:
        super().__init__(name, log)
        self.answer = sweep

    def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None) -> RunResult:
        if argv[:2] == ["sh", "-c"]:
            return self.answer
        return super().run(argv, stdin=stdin, timeout=timeout)


@pytest.mark.parametrize("stdout", ["", "\n", "Error: garbled\n"])
def test_a_sweep_that_printed_no_count_removed_none(stdout: str) -> None:
    """docker rm succeeded but no count came back: nothing removed, not a cleanup problem."""
    node = _Answers("n0", [], RunResult(stdout, "", 0, 0.0))
    assert fabric.sweep(node, "c") == 0  # type: ignore[arg-type]
    assert fabric.sweep(_Answers("n0", [], RunResult("0\n3\n", "", 0, 0.0)), "c") == 3  # type: ignore[arg-type]


def test_a_failed_sweep_is_a_warning_with_its_reason_and_the_fix_by_hand(clean_env: dict[str, str]) -> None:
    """A node where the fabric-test containers could not be removed: a `not cleaned` warning naming the
    node, docker's first error line (capped at 300 characters, as every node's error) and the command."""
    s = _settings("lab")
    c = FakeCluster([], _side_by_side)
    c.nodes = {n: FakeNode(n, c.log) for n in s.nodes}
    c.nodes["spark3"] = _Answers("spark3", c.log, RunResult("", "permission denied " + "e" * 500 + "\nsecond", 1, 0))
    report = fabric.run_fabric_test(c, s, _pins(s))  # type: ignore[arg-type]
    reason = "could not remove the fabric-test containers: " + ("permission denied " + "e" * 500)[:300]
    assert report.cleanup == {"spark3": reason}
    (warn,) = [f for f in report.findings if f.status == WARN]
    assert warn.node == "spark3" and warn.short == "not cleaned" and warn.text == f"spark3: {reason}"
    assert (f"by hand on spark3: docker rm -f $(docker ps -aq --filter label=sparkctl.cluster={s.cluster_name} "
            "--filter label=sparkctl.purpose=fabric-test)") in warn.fix
    assert report.swept == {n: 0 for n in s.nodes if n != "spark3"}


def test_what_a_rank_says_is_capped_at_300_characters() -> None:
    """A container's error line and a rank's last output line reach the table capped, as every node's error."""
    res = RunResult("", "docker: " + "x" * 500 + "\n", 125, 0.1)
    assert fabric.outcome_from_run(0, "n0", res).error == "the fabric test container did not run: " + ("docker: " + "x" * 500)[:300]
    start = '{"event":"start","rank":0,"world":1,"backend":"gloo"}'
    ended = _events(start)
    ended = RunResult(ended.stdout + "\n" + "y" * 500, "", 1, 0.1)
    (f, _cluster) = fabric.evaluate([fabric.outcome_from_run(0, "n0", ended)], GLOO, timeout_s=30)
    assert f.short == "no result" and f.text.endswith("(exit 1): " + "y" * 300)


def test_a_rank_that_measured_zero_busbw_makes_the_collectives_zero() -> None:
    """The collective's busbw per size is its slowest rank's: a rank that measured 0 GB/s makes it 0, never below."""
    def rank(r: int, busbw: float) -> fabric.RankOutcome:
        return fabric.RankOutcome(r, f"n{r}", events=[{"event": "result", "bytes": 1024, "busbw_gbps": busbw}])

    report = fabric.FabricReport("gloo", "img", [rank(0, 5.0), rank(1, 0.0)], [], 1.0, 0.5, {}, {})
    assert report.busbw_by_size() == {"1024": 0.0}
    report = fabric.FabricReport("gloo", "img", [rank(0, 5.0), rank(1, 2.5)], [], 1.0, 0.5, {}, {})
    assert report.busbw_by_size() == {"1024": 2.5}


@pytest.mark.parametrize("garbled", ['{"event":"result","rank":0,"bytes":4194304}',
                                     '{"event":"result","rank":0,"busbw_gbps":9.5}',
                                     '{"event":"result","rank":0,"bytes":"4194304","busbw_gbps":"fast"}'])
def test_a_garbled_result_line_is_not_a_figure_and_no_crash(garbled: str) -> None:
    """A rank's output is untrusted: a result line without its figures is left out (as the floor's rule does),
    never a KeyError or ValueError out of `check --fabric`."""
    parts = _split_ranks("h200x1-gloo-2rank.log")
    bad = _ok_run(fabric_allreduce.MARK + garbled + "\n" + parts[0])
    outcomes = [fabric.outcome_from_run(0, "n0", bad), fabric.outcome_from_run(1, "n1", _ok_run(parts[1]))]
    findings = fabric.evaluate(outcomes, GLOO, timeout_s=30)
    assert [f.status for f in findings] == [OK, OK] and "4194304 B" in findings[0].text
    report = fabric.FabricReport("gloo", "img", outcomes, findings, 2.0, 0.9, {}, {})
    assert set(report.busbw_by_size()) == {"65536", "1048576", "4194304"} and report.to_dict()["ok"]


def test_the_json_report_gives_times_to_the_millisecond() -> None:
    d = fabric.FabricReport("gloo", "img", [], [], 12.34567, 0.98765, {}, {}).to_dict()
    assert (d["seconds"], d["collective_s"]) == (12.346, 0.988)


class _Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def monotonic(self) -> float:
        return self.now


def test_the_reports_seconds_are_the_runs_wall_time(clean_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`seconds`: from the start of the ranks to their end (here the head's run took 7.5 s); `collective_s`:
    the slowest rank's own figure."""
    s = _settings("lab")
    parts = dict(zip(s.nodes, _split_ranks("h200x1-gloo-2rank.log") * 2, strict=True))
    clock = _Clock()
    monkeypatch.setattr(fabric, "time", clock)

    class Node(FakeNode):
        def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None) -> RunResult:
            if argv[:2] == ["sh", "-c"]:
                clock.now += 100.0  # the sweep comes after the measured span
                return super().run(argv, stdin=stdin, timeout=timeout)
            if self.name == "spark1":
                clock.now += 7.5
            return _ok_run(parts[self.name])

    c = FakeCluster([], lambda c, fn, nodes: {n: fn(c.node(n)) for n in nodes})
    c.nodes = {n: Node(n, c.log) for n in s.nodes}
    report = fabric.run_fabric_test(c, s, _pins(s))  # type: ignore[arg-type]
    assert report.ok
    assert report.seconds == 7.5 and report.collective_s == 0.861


def test_a_lost_node_stops_the_others_at_once(clean_env: dict[str, str]) -> None:
    """A node whose SSH connection fails during its `docker run` is a failure like any other: the others are
    released by the sweep at once (not at the bound) and read `stopped`."""
    woken: list[bool] = []

    def act(name: str, swept: threading.Event) -> RunResult:
        if name == "spark2":
            raise NodeError("spark2", "lost", "SSH connection lost: EOF")
        woken.append(swept.wait(10))  # at the rendezvous until the container is removed
        return RunResult("", "", 137, 5)

    report = _run_nodes(_settings("lab"), act)
    assert woken == [True, True, True]
    by_node = {f.node: f for f in report.findings if f.status == FAIL}
    assert "SSH connection lost" in by_node["spark2"].text
    for n in ("spark1", "spark3", "spark4"):
        assert by_node[n].short == "stopped" and "after rank 1 failed" in by_node[n].text


def test_a_ctrl_c_waits_for_the_runs_as_long_as_one_may_last(clean_env: dict[str, str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """After a Ctrl-C, sparkctl waits for the in-flight `docker run`s as long as each was given (the program's
    deadline + the start allowance): not less (a container started late would escape the last sweep), not
    more (a stuck SSH channel must not hold the Ctrl-C)."""
    s = _settings("lab")
    released = threading.Event()
    given: list[float | None] = []
    waited: list[float] = []
    real_wait = fabric.wait_bounded

    def wait_bounded(events: Any, seconds: float) -> bool:
        waited.append(seconds)
        return real_wait(events, seconds)

    class Node(FakeNode):
        def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None) -> RunResult:
            if argv[:2] == ["sh", "-c"]:
                released.set()
                return super().run(argv, stdin=stdin, timeout=timeout)
            given.append(timeout)
            released.wait(30)
            return RunResult("", "", 137, 0)

    def run_all(c: FakeCluster, fn: Any, nodes: list[str]) -> dict[str, Any]:
        _thread.interrupt_main()
        return {n: fn(c.node(n)) for n in nodes[:1]}

    monkeypatch.setattr(fabric, "wait_bounded", wait_bounded)
    c = FakeCluster([], run_all)
    c.nodes = {n: Node(n, c.log) for n in s.nodes}
    with pytest.raises(KeyboardInterrupt):
        fabric.run_fabric_test(c, s, _pins(s), timeout_s=12)  # type: ignore[arg-type]
    assert given == [12 + fabric.START_ALLOWANCE_S] and fabric.START_ALLOWANCE_S > 0
    assert waited == given


class _CountingEvent:
    def __init__(self, inner: threading.Event) -> None:
        self.inner = inner
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return self.inner.wait(timeout)

    def is_set(self) -> bool:
        return self.inner.is_set()


def test_waiting_for_the_ranks_blocks_and_does_not_spin(clean_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """While the ranks run, the main thread sleeps between looks (a few a second, so a Ctrl-C still lands):
    it does not burn a CPU that the ranks' own node may share. The fake run lasts 0.4 s."""
    s = _settings("lab")
    counted: list[_CountingEvent] = []
    real_spawn = fabric.spawn

    def spawn(target: Any, name: str) -> Any:
        done = real_spawn(target, name)
        if name != "fabric-test":
            return done
        counted.append(_CountingEvent(done))
        return counted[-1]

    class Node(FakeNode):
        def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None) -> RunResult:
            if argv[:2] != ["sh", "-c"] and self.name == "spark1":
                threading.Event().wait(0.4)  # a rank's docker run in flight
            return super().run(argv, stdin=stdin, timeout=timeout)

    monkeypatch.setattr(fabric, "spawn", spawn)
    c = FakeCluster([], lambda c, fn, nodes: {n: fn(c.node(n)) for n in nodes})
    c.nodes = {n: Node(n, c.log) for n in s.nodes}
    fabric.run_fabric_test(c, s, _pins(s))  # type: ignore[arg-type]
    assert len(counted) == 1 and 1 <= counted[0].waits <= 50, counted[0].waits  # spinning: thousands


def test_only_the_mount_pairs_leave_the_options_wherever_they_stand() -> None:
    """The fabric container drops each `--mount` and its value and keeps every other option, also one that
    stands after a mount (today container_options puts the mounts last; an option added after them must
    not vanish from the fabric test without a word)."""
    opts = ["--network", "host", "--mount", "type=bind,source=/m,target=/m", "--ipc", "host",
            "--mount", "type=bind,source=/s,target=/s", "--gpus", "all", "--shm-size", "64g"]
    assert fabric._without_mounts(opts) == ["--network", "host", "--ipc", "host", "--gpus", "all", "--shm-size", "64g"]


def test_a_second_lost_node_keeps_its_own_reason(clean_env: dict[str, str]) -> None:
    """Two nodes lost: the second is not `stopped by sparkctl` (its container was never the reason it
    ended); it reads its own SSH error, as the first does."""

    def act(name: str, swept: threading.Event) -> RunResult:
        if name == "spark2":
            raise NodeError("spark2", "lost", "SSH connection lost: EOF")
        if name == "spark3":
            assert swept.wait(10)  # lost after the first failure was noted
            raise NodeError("spark3", "lost", "SSH connection lost: reset by peer")
        swept.wait(10)
        return RunResult("", "", 137, 5)

    report = _run_nodes(_settings("lab"), act)
    by_node = {f.node: f for f in report.findings if f.status == FAIL}
    assert by_node["spark3"].short == "no result" and "SSH connection lost: reset by peer" in by_node["spark3"].text
    assert report.to_dict()["ranks"][2]["error"] == "SSH connection lost: reset by peer"
    for n in ("spark1", "spark4"):
        assert by_node[n].short == "stopped" and "after rank 1 failed" in by_node[n].text


@pytest.mark.parametrize("stdout", ["2\n", "Welcome to spark1\nlast login: today\n2\n"])
def test_a_sweep_reports_how_many_it_removed(stdout: str) -> None:
    """The count is the sweep's last line (`grep -c`), whatever a login banner printed before it."""
    assert fabric.sweep(_Answers("n0", [], RunResult(stdout, "", 0, 0.0)), "c") == 2  # type: ignore[arg-type]


def test_a_rank_killed_by_a_signal_before_any_event_did_not_run() -> None:
    """SSH reports -1 when the remote command died of a signal (no exit status): a rank with no event and that
    status failed to run, and says so with docker's first error line (and in the JSON's `error`)."""
    res = RunResult("", "docker: killed\nsecond line\n", -1, 0.1)
    o = fabric.outcome_from_run(0, "n0", res)
    assert o.error == "the fabric test container did not run: docker: killed"
    (f, _cluster) = fabric.evaluate([o], GLOO, timeout_s=30)
    assert f.status == FAIL and f.text == "rank 0 (n0): the fabric test container did not run: docker: killed"


def test_a_rank_that_exited_0_without_any_event_ran_but_gave_no_result() -> None:
    """Exit 0 and no event: the container ran (not `did not run`); the program ended without a result."""
    o = fabric.outcome_from_run(0, "n0", RunResult("hello from the image\n", "", 0, 0.1))
    assert o.error is None
    (f, _cluster) = fabric.evaluate([o], GLOO, timeout_s=30)
    assert f.status == FAIL and f.short == "no result"
    assert f.text == "rank 0 (n0): the fabric program ended without a result (exit 0): hello from the image"
