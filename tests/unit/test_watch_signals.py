"""`watch` stopped by SIGTERM, SIGHUP or SIGINT: it ends with 128 + that signal's number,
names that signal, and publishes "stopped" (the state file `status` reads) before it exits, every time.

Each run is a real `sparkctl watch` process on local nodes (tests/unit/localnodes.py: every remote
command really runs, `docker` is the stateful stand-in). No API answers on the head's port, so the
supervisor restarts the group every few rounds (through `up`'s path: lock, start, point of no return,
wait): the signal lands at moments chosen by what watch has just said, from a watching round to the
middle of a restart and its wait. `timeout` sends its SIGTERM twice (to the process and to its process
group): one case sends two at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODES = ["spark1", "spark2", "spark3", "spark4"]

# The subprocess: the local nodes (the same patch the in-process tests use), then sparkctl's own entry point.
DRIVER = r'''
import sys
root = sys.argv[1]
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/launcher"]
from pathlib import Path
import pytest
from tests.unit.localnodes import local_nodes
mp = pytest.MonkeyPatch()
with local_nodes(mp, Path(root) / "lab", sys.argv[3].split()) as ln:
    for n in sys.argv[3].split():
        ln.docker(n, "pull", "sparkctl-lab/chain:keys3")
    sys.argv = ["sparkctl", "watch"]
    from sparkctl import entry
    entry.main()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def scene(tmp_path: Path) -> dict[str, str]:
    from tests.conftest import write_model, write_serving

    model = write_model(tmp_path / "model", 1_000_000, 2)
    write_serving(model)
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARKCTL_ENV_FILE", "TP", "DCP", "VLLM_API_KEY") and not k.startswith("WATCH_")}
    env |= {"NODES": " ".join(NODES), "MODEL": str(model), "RECIPE": "lab", "CLUSTER_NAME": "t",
            "FABRIC_SUBNET": "10.232.0.0/24", "SERVED_MODEL_NAME": "lab-model", "VLLM_API_KEY": "k-local",
            "PORT": str(_free_port()),  # nothing answers there: the head never gets healthy
            "WATCH_INTERVAL_S": "0.2", "WATCH_CANARY_S": "3600", "WATCH_MAX_RESTARTS": "50",
            "WATCH_BACKOFF_S": "0.05", "WATCH_READY_TIMEOUT_S": "1.5", "WATCH_NODE_WAIT_S": "60",
            "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "COLUMNS": "200"}
    return env


class Watch:
    """One `sparkctl watch` process; its stderr read as it comes, to time the signal by what it says."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.tmp = tmp
        # SIGHUP as a terminal leaves it: a suite started under `nohup` hands an ignored SIGHUP down, which
        # watch keeps ignoring by design (signals.install), so the hangup cases would wait forever.
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp), str(REPO), " ".join(NODES)],
                                     cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, marker: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not any(marker in ln for ln in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"watch never said {marker!r}:\n" + "".join(self.lines))
                self.cond.wait(min(left, 0.5))

    def end(self, timeout: float = 90) -> tuple[int, str]:  # a bound on a loaded machine, not a speed claim
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # say where it stood: its words, and every thread's stack
            # (SIGABRT: PYTHONFAULTHANDLER makes the child print them on stderr)
            self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.reader.join(timeout=10)
            raise AssertionError(f"watch did not end within {timeout:g}s of the signal:\n" + "".join(self.lines)) from None
        self.reader.join(timeout=10)
        return code, "".join(self.lines)

    def state(self) -> dict[str, object]:
        doc: dict[str, object] = json.loads(
            (self.tmp / "lab" / "nodes" / "spark1" / ".sparkctl" / "t" / "watch.json").read_text())
        return doc


# (what watch has just said, then seconds): a watching round, the start of a restart (lock, preflight,
# start), later in it (`up`'s point of no return, the wait for readiness), and a restart that failed.
MOMENTS = [("watching cluster", 0.0), ("watching cluster", 0.25), ("restarting: attempt 1", 0.0),
           ("restarting: attempt 1", 0.6), ("started rank 0", 0.0), ("restart attempt 1 failed", 0.0)]


def _check(w: Watch, sig: signal.Signals, how: str) -> None:
    code, err = w.end()
    assert code == 128 + sig, f"{how}: exit {code}, not {128 + sig}:\n{err}"
    assert f"watch ends ({128 + sig}): stopped by {sig.name}" in err, f"{how}:\n{err}"
    named = set(re.findall(r"interrupted \((SIG[A-Z]+)\)", err))  # a rollback's report names the signal
    assert named <= {sig.name} and "Traceback" not in err, f"{how}:\n{err}"
    st = w.state()
    assert st["state"] == "stopped" and st["detail"] == f"stopped by {sig.name}", f"{how}: published {st}\n{err}"
    assert st["pid"] == w.proc.pid, f"{how}: the state is not this run's: {st}"
    from sparkctl.remote.watchstate import describe, parse_state

    seen = parse_state(json.dumps(st))
    assert seen is not None and not seen["alive"]
    assert f"stopped: stopped by {sig.name}" in describe(seen)
    lock = w.tmp / "lab" / "nodes" / "spark1" / ".sparkctl" / "t" / "lock"
    assert not (lock / "owner").exists(), f"{how}: the cluster lock was left held"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=lambda s: s.name)
def test_watch_ends_with_the_signals_status_and_publishes_stopped_at_every_moment(
        scene: dict[str, str], tmp_path: Path, sig: signal.Signals) -> None:
    for i, (marker, after) in enumerate(MOMENTS):
        run_dir = tmp_path / f"m{i}"
        run_dir.mkdir()
        w = Watch(run_dir, scene)
        try:
            w.wait_for(marker)
            time.sleep(after)
            w.proc.send_signal(sig)
            _check(w, sig, f"{sig.name} {after}s after {marker!r}")
        finally:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()


@pytest.mark.parametrize("marker, after, second", [
    ("watching cluster", 0.1, None), ("restarting: attempt 1", 0.3, None), ("started rank 0", 0.0, None),
    ("watching cluster", 0.1, "SIGTERM: stopping"), ("restarting: attempt 1", 0.3, "SIGTERM: stopping")])
def test_two_sigterms_as_timeout_sends_them(scene: dict[str, str], tmp_path: Path, marker: str, after: float,
                                            second: str | None) -> None:
    """Two at once (`timeout`: to the process and to its group), or the second while it stops."""
    w = Watch(tmp_path, scene)
    try:
        w.wait_for(marker)
        time.sleep(after)
        w.proc.send_signal(signal.SIGTERM)
        if second:
            w.wait_for(second)
        else:
            time.sleep(0.002)
        w.proc.send_signal(signal.SIGTERM)
        _check(w, signal.SIGTERM, f"two SIGTERMs {after}s after {marker!r}, the second after {second!r}")
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()
