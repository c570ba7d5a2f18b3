"""SIGINT, SIGTERM and SIGHUP: one behaviour for every command, and cleanup that a signal cannot cut short.

`install()` (called by `cli.main`) makes each of the three signals raise `Interrupted` in the main
thread, so `finally` blocks and rollbacks run for SIGTERM (what `timeout`, systemd and CI send) and
SIGHUP (a closed terminal) exactly as for Ctrl-C. Python's default for SIGTERM is to die on the spot,
leaving the cluster lock held and containers half started.

Cleanup (a rollback, the lock's release, a `down` already under way) runs inside `shielded()`: a
signal that arrives there is noted on stderr and the cleanup continues. The third signal in all
raises `CleanupAborted` (not a KeyboardInterrupt: nothing swallows it by mistake), and the code that
was cleaning up says what it leaves where.

Exit status of an interrupted command: 128 + the signal number, the shell's convention: 130 for
SIGINT (Ctrl-C), 143 for SIGTERM, 129 for SIGHUP. A signal that arrives after a command's point of no
return (`committed()`: the service is up and audited, or `down` has started removing) is noted and
changes nothing: the command finishes and exits with its own status.

`watch` runs for days and goes through `up`'s path (and its point of no return) at every restart:
`end_on_first()` makes the first signal that is raised also the point of no return (the stop is
under way: later signals are noted, so the stopped state is always published and the status is the
first signal's), and `reopen()` after a restart makes signals count again, raising one that arrived
meanwhile.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
ABORT_AFTER = 3  # the third signal in all aborts a cleanup


class Interrupted(KeyboardInterrupt):
    """A signal asked the command to stop; it exits 128 + signum once it has cleaned up."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class CleanupAborted(BaseException):
    """A third signal while cleaning up: stop now; the cleaner says what it leaves behind."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class _State:
    def __init__(self) -> None:
        self.received: list[int] = []
        self.shield = 0  # >0: inside a cleanup; signals are noted, not raised
        self.committed = False
        self.pending: int | None = None  # the first signal that arrived while shielded
        self.late: int | None = None  # the first signal noted after the point of no return
        self.end_on_first = False  # `watch`: the first signal raised is also the point of no return
        self.stopping = False  # end_on_first and one was raised: the command is stopping


_state = _State()


def _note(text: str) -> None:
    try:
        sys.stderr.write(f"sparkctl: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr gone (closed terminal): the signal is still handled
        pass


def _handler(signum: int, frame: Any) -> None:
    _state.received.append(signum)
    name = signal.Signals(signum).name
    if _state.shield == 0 and not _state.committed:
        _raise(signum)
    if _state.shield > 0 and len(_state.received) >= ABORT_AFTER:
        raise CleanupAborted(signum)
    if _state.committed:
        if _state.late is None:
            _state.late = signum
        if _state.end_on_first and _state.stopping:
            _note(f"{name} received while stopping: finishing the stop")
        else:
            _note(f"{name} received after the point of no return: finishing, nothing will be undone")
        return
    if _state.pending is None:
        _state.pending = signum
    _note(f"{name} received while cleaning up: the cleanup continues "
          f"(signal {ABORT_AFTER - len(_state.received)} more time(s) to abort it)")


def _raise(signum: int) -> None:
    if _state.end_on_first:
        _state.committed = _state.stopping = True
    raise Interrupted(signum)


def install() -> None:
    """Route SIGINT, SIGTERM and SIGHUP to `_handler` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HANDLED:
        if signal.getsignal(sig) is signal.SIG_IGN and sig == signal.SIGHUP:
            continue  # started under nohup: keep ignoring hangups
        signal.signal(sig, _handler)


def reset() -> None:
    """Forget what was received (tests, and a process that runs several commands)."""
    _state.received.clear()
    _state.shield = 0
    _state.committed = False
    _state.pending = None
    _state.late = None
    _state.end_on_first = False
    _state.stopping = False


def received() -> list[int]:
    return list(_state.received)


@contextmanager
def shielded(*, deliver: bool = True) -> Iterator[None]:
    """Run a cleanup to its end despite signals (the third aborts it: CleanupAborted).

    deliver=True: a signal noted inside is raised as Interrupted when the block ends normally, so a
    command interrupted during, say, taking the lock still stops right after."""
    _state.shield += 1
    try:
        yield
    finally:
        _state.shield -= 1
    if deliver and _state.shield == 0 and _state.pending is not None and not _state.committed:
        signum, _state.pending = _state.pending, None
        _raise(signum)


def commit() -> None:
    """The point of no return: from here on a signal is noted and the command finishes normally."""
    _state.committed = True
    _state.pending = None


def end_on_first() -> None:
    """For a command that runs until stopped (`watch`): the first signal raised (as Interrupted) is
    also its point of no return, so the code that ends it (publishing its stopped state) runs to its
    end and the exit status is that first signal's, however many follow (`timeout` sends two)."""
    _state.end_on_first = True


def reopen() -> None:
    """After a nested point of no return (`watch`'s restart went through `up`'s path): signals stop
    the command again; the first one noted meanwhile is raised now."""
    if _state.stopping:
        return
    late = _state.late
    _state.committed = False
    _state.pending = _state.late = None
    if late is not None:
        _raise(late)


def is_committed() -> bool:
    return _state.committed
