"""The console script's first code (`sparkctl`, `python -m sparkctl`).

From here until `cli.main` installs sparkctl's own handlers (signals.install), nothing has been
started or taken, so SIGINT, SIGTERM or SIGHUP ends the process at once and quietly, with the shell's
status for it (130, 143, 129) — not Python's KeyboardInterrupt traceback out of an import, nor a bare
death by the signal. This module imports nothing heavy on purpose: the window it closes is the
interpreter's import of click, rich, paramiko and the rest (tens of milliseconds).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

_EARLY = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _before_start(signum: int, frame: Any) -> None:
    try:
        os.write(2, f"interrupted ({signal.Signals(signum).name}) before anything started\n".encode())
    finally:
        os._exit(128 + signum)


def install_early() -> None:
    for sig in _EARLY:
        if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
            continue  # under nohup: keep ignoring hangups
        signal.signal(sig, _before_start)


def _exit_now(code: int) -> None:
    """End the process with the command's status, skipping the interpreter's teardown: once the
    command is over nothing is left to do, and a signal that lands while Python finalizes (after it
    has put the default handlers back) would otherwise turn a finished command into a death by that
    signal (the sweep saw `down` exit -2 after it had removed everything)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`sparkctl status | head`): nothing more to say
            pass
    os._exit(code)


def skip_invoke() -> None:
    """paramiko.config imports invoke at import time, for `Match exec` in paramiko's own ssh_config
    parser -- which sparkctl never uses (OpenSSH's `ssh -G` resolves every alias): about 0.1 s of every
    command's start. Marked absent, paramiko takes it as not installed. The CLI process only; a
    program that imports sparkctl as a library keeps its invoke."""
    sys.modules.setdefault("invoke", None)  # type: ignore[arg-type]


def main() -> None:
    install_early()
    skip_invoke()
    from .cli import main as cli_main

    try:
        cli_main()
        code = 0
    except SystemExit as exc:  # how cli.main always ends
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    _exit_now(code)
