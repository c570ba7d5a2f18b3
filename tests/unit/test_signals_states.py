"""signals.py's states the crash-safety tests did not reach: the count it says, a fourth signal under
nested cleanups, a signal noted after the point of no return raised by reopen() (mutants of these
lines survived tests/unit/test_crash_safety.py and test_threads.py; bench/mutation.py signals)."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from sparkctl import signals
from tests.unit.test_crash_safety import _send, handlers  # noqa: F401  (the fixture: sparkctl's handlers)


def test_the_second_signal_says_how_many_more_abort_the_cleanup(handlers: None, capsys: Any) -> None:  # noqa: F811
    with signals.shielded(deliver=False):
        _send(signal.SIGTERM)
        assert "(signal 2 more time(s) to abort it)" in capsys.readouterr().err
        _send(signal.SIGTERM)
        assert "(signal 1 more time(s) to abort it)" in capsys.readouterr().err


def test_every_signal_after_the_third_aborts_a_cleanup_still_running(handlers: None) -> None:  # noqa: F811
    with signals.shielded(deliver=False):  # an outer cleanup (the lock's release around a rollback)
        with pytest.raises(signals.CleanupAborted), signals.shielded(deliver=False):
            for _ in range(3):
                _send(signal.SIGTERM)
        with pytest.raises(signals.CleanupAborted):
            _send(signal.SIGINT)  # the fourth, in the outer cleanup: aborts it too


def test_reopen_raises_the_first_signal_noted_after_the_point_of_no_return(handlers: None) -> None:  # noqa: F811
    signals.commit()
    _send(signal.SIGTERM)
    _send(signal.SIGHUP)
    with pytest.raises(signals.Interrupted) as exc:
        signals.reopen()
    assert exc.value.signum == signal.SIGTERM
    signals.commit()
    signals.reopen()  # nothing noted since: nothing raised


def test_after_the_point_of_no_return_no_signal_aborts_anything(handlers: None, capsys: Any) -> None:  # noqa: F811
    signals.commit()
    for _ in range(4):  # the third and fourth too: nothing is being cleaned up, nothing to abort
        _send(signal.SIGTERM)
    assert capsys.readouterr().err.count("nothing will be undone") == 4


def test_watch_committed_by_a_restart_says_the_point_of_no_return_not_stopping(handlers: None,  # noqa: F811
                                                                              capsys: Any) -> None:
    signals.end_on_first()
    signals.commit()  # `up`'s path inside watch's restart: nothing was raised, so watch is not stopping
    _send(signal.SIGTERM)
    err = capsys.readouterr().err
    assert "after the point of no return" in err and "while stopping" not in err


def test_a_closed_stderr_does_not_stop_a_signal_from_being_handled(monkeypatch: Any) -> None:
    import io
    import sys

    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    signals._note("SIGTERM received")  # ValueError: I/O operation on closed file, swallowed


def test_a_fresh_state_lets_the_first_signal_interrupt() -> None:
    s = signals._State()  # the state a command starts in, before any reset()
    assert (s.shield, s.committed, s.stopping, s.end_on_first, s.pending, s.late) == (0, False, False, False,
                                                                                      None, None)
    assert signals.signal_name(999) == "signal 999" and signals.signal_name(signal.SIGTERM) == "SIGTERM"


def test_watch_stops_on_the_first_signal_and_notes_the_rest_as_stopping(handlers: None,  # noqa: F811
                                                                         capsys: Any) -> None:
    signals.end_on_first()
    with pytest.raises(signals.Interrupted):
        _send(signal.SIGTERM)
    assert signals.is_committed()  # the stop is its own point of no return
    _send(signal.SIGTERM)  # `timeout` sends a second one
    err = capsys.readouterr().err
    assert "received while stopping: finishing the stop" in err and "after the point of no return" not in err


def test_after_reopen_a_signal_interrupts_again(handlers: None) -> None:  # noqa: F811
    signals.commit()
    signals.reopen()
    with pytest.raises(signals.Interrupted):
        _send(signal.SIGINT)


def test_a_stderr_that_cannot_be_written_does_not_stop_a_signal_from_being_handled(monkeypatch: Any) -> None:
    import sys

    class Broken:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Broken())
    signals._note("SIGHUP received")
