"""sparkctl.threads: waits that a Ctrl-C interrupts, and the bounded wait after it, see the thread end."""

from __future__ import annotations

import _thread
import threading
from pathlib import Path

import pytest

from sparkctl.threads import spawn, wait_all, wait_bounded


def test_after_a_ctrl_c_the_bounded_wait_still_waits_for_the_running_thread() -> None:
    release, finished = threading.Event(), []

    def work() -> None:
        release.wait(60)
        finished.append(True)

    events = [spawn(work, "worker")]
    threading.Timer(0.2, _thread.interrupt_main).start()  # Ctrl-C while the main thread waits
    with pytest.raises(KeyboardInterrupt):
        wait_all(events, poll=0.05)
    assert finished == [] and not events[0].is_set()  # the thread runs on
    threading.Timer(0.2, release.set).start()
    assert wait_bounded(events, 60) is True
    assert finished == [True]


def test_the_bounded_wait_gives_up_and_says_so() -> None:
    release = threading.Event()
    events = [spawn(lambda: release.wait(60) and None, "stuck")]
    try:
        assert wait_bounded(events, 0.05) is False
    finally:
        release.set()
    assert wait_bounded(events, 60) is True


def test_a_thread_that_raises_is_ended_too(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[type[BaseException] | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_type))  # on purpose

    def boom() -> None:
        raise RuntimeError("x")

    events = [spawn(boom, "boom")]
    wait_all(events)
    assert events[0].is_set() and seen == [RuntimeError]


# Where a module may start its own threads: threads.py (spawn), cluster/fanout.py (the fan-out's pool and
# cluster.parallel), the probes (they run on a node, without sparkctl), and fabric.py until the flows
# change moves its fan-out onto these.
_MAY_START_THREADS = {"threads.py", "cluster/fanout.py"}


def _starts_threads(path: Path) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("Thread", "ThreadPoolExecutor"):
                found.append(f"{name} at line {node.lineno}")
    return found


def test_work_runs_in_parallel_through_spawn_or_cluster_parallel_only() -> None:
    """One parallel primitive: no module builds its own Thread (whose join a Ctrl-C breaks, see
    threads.py) or ThreadPoolExecutor; it uses threads.spawn/wait_all or cluster.parallel."""
    import sparkctl

    root = Path(sparkctl.__file__).parent
    offenders = {
        rel: hits
        for path in sorted(root.rglob("*.py"))
        if not (rel := path.relative_to(root).as_posix()).startswith(("probes/", "lab/"))
        and rel not in _MAY_START_THREADS
        and (hits := _starts_threads(path))
    }
    assert offenders == {}
