"""signals.py's states the crash-safety tests did not reach: the count it says, a fourth signal under
nested cleanups, a signal noted after the point of no return raised by reopen() (mutants of these
lines survived tests/unit/test_crash_safety.py and test_threads.py; bench/mutation.py signals, issue 32)."""

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
