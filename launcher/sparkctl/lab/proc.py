"""Running things for the lab: argv lists only, always a timeout, errors that say what failed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import CheckFailed


def say(msg: str) -> None:
    """Human progress text goes to stderr (stdout carries only the KEY=PATH lines and --json)."""
    print(msg, file=sys.stderr, flush=True)


def run(
    argv: Sequence[str],
    *,
    timeout: float = 60,
    check: bool = True,
    input: bytes | None = None,  # noqa: A002 - mirrors subprocess.run
    env: dict[str, str] | None = None,
    where: str = "lab",
) -> subprocess.CompletedProcess[bytes]:
    """Run argv, capture output; raise CheckFailed naming the command and its stderr on failure."""
    try:
        res = subprocess.run(list(argv), capture_output=True, timeout=timeout, input=input, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{where}: `{' '.join(argv)}` did not finish within {timeout:.0f}s") from None
    except FileNotFoundError:
        raise CheckFailed(
            f"{where}: `{argv[0]}` is not installed",
            fix="apt-get install -y docker.io openssh-server iproute2 iptables debootstrap",
        ) from None
    if check and res.returncode != 0:
        err = (res.stderr or res.stdout).decode(errors="replace").strip()
        raise CheckFailed(f"{where}: `{' '.join(argv)}` failed (exit {res.returncode}): {err[-800:]}")
    return res


def out(argv: Sequence[str], **kwargs: object) -> str:
    return run(argv, **kwargs).stdout.decode(errors="replace")  # type: ignore[arg-type]


def ok(argv: Sequence[str], timeout: float = 30) -> bool:
    """True when argv exits 0 (for probes: missing tools and timeouts count as False)."""
    try:
        return subprocess.run(list(argv), capture_output=True, timeout=timeout, check=False).returncode == 0
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return False


def wait_for(what: str, probe: Callable[[], bool], timeout: float, interval: float = 0.2) -> None:
    """Poll probe until it is true; CheckFailed after timeout (every wait in the lab is bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        if probe():
            return
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(interval)


def read_pid(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_pid(pid: int | None, *, timeout: float = 10) -> None:
    """SIGTERM, wait (bounded), then SIGKILL. Only ever called with pids the lab recorded itself."""
    if not alive(pid):
        return
    assert pid is not None
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not alive(pid):
                return
            time.sleep(0.1)
