"""Threads the main thread waits for while Ctrl-C (or SIGTERM: signals.Interrupted) may arrive.

Wait for them through an Event each, never Thread.join or is_alive: on Python 3.11 a join that a
signal handler's exception interrupts releases the thread's state lock while the thread still runs
and marks it stopped (the bpo-45274 handling in Thread._wait_for_tstate_lock), after which join()
and is_alive() no longer wait for it. A wait that must outlast a Ctrl-C (the rollback's sweep after
the last `docker run`, a transfer's final report) would then return at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence


def spawn(target: Callable[[], None], name: str) -> threading.Event:
    """Start `target` in a daemon thread; the Event is set when it has ended (returned or raised)."""
    done = threading.Event()

    def run() -> None:
        try:
            target()
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    return done


def wait_all(events: Sequence[threading.Event], poll: float = 0.25) -> None:
    """Until every thread has ended; a signal's exception (KeyboardInterrupt) goes through."""
    for done in events:
        while not done.wait(poll):
            pass


def wait_bounded(events: Sequence[threading.Event], seconds: float) -> bool:
    """At most `seconds` in all for every thread to end (after a first Ctrl-C: a second one stops the
    wait). True when they all ended."""
    deadline = time.monotonic() + seconds
    try:
        for done in events:
            done.wait(max(deadline - time.monotonic(), 0.0))
    except KeyboardInterrupt:
        pass
    return all(done.is_set() for done in events)
