"""remote/lockdir.py without a head: the owner file is untrusted text, and a live holder is asked once, never
broken (mutants of these lines survived tests/unit/test_crash_safety.py; bench/mutation.py lock)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from sparkctl.cluster.channel import RunResult
from sparkctl.errors import CheckFailed
from sparkctl.remote import lockdir as lock

GOOD = {"who": "ann", "pid": 4242, "since": "2026-12-02T10:00:00Z", "command": "up", "token": "t0k"}


def _parse(**over: Any) -> lock.LockOwner | None:
    return lock.LockOwner.parse(json.dumps({**GOOD, **over}))


@pytest.mark.parametrize("field", ["who", "since", "command", "token"])
def test_an_owner_file_with_a_field_that_is_not_text_is_not_ours(field: str) -> None:
    assert _parse() is not None
    assert _parse(**{field: 5}) is None
    assert _parse(pid=True) is None and _parse(pid="4242") is None


def test_a_pid_out_of_range_is_unknown_never_a_real_pid() -> None:
    # pid 1 would be init: always alive, so a lock written with a huge pid would never be judged dead
    assert _parse(pid=2**40).pid == -1 and _parse(pid=-7).pid == -1  # type: ignore[union-attr]
    assert _parse(pid=2**32 - 1).pid == 2**32 - 1  # type: ignore[union-attr]


def test_the_holders_lease_is_kept_within_bounds() -> None:
    assert _parse(lease_s=600).lease_s == 600  # type: ignore[union-attr]
    assert _parse(lease_s=999_999).lease_s == 999_999  # type: ignore[union-attr]
    assert _parse(lease_s=10**6).lease_s == lock.LEASE_S  # type: ignore[union-attr]
    assert _parse(lease_s=0).lease_s == lock.LEASE_S  # type: ignore[union-attr]
    assert _parse(lease_s=10**7).lease_s == lock.LEASE_S  # type: ignore[union-attr]
    assert _parse(start_ticks=2**63 - 1).start_ticks == 2**63 - 1  # type: ignore[union-attr]
    assert _parse(start_ticks=2**63).start_ticks == -1  # type: ignore[union-attr]


def test_the_holder_is_described_with_its_host_only_when_it_named_one() -> None:
    assert " on spark1)" in _parse(host="spark1").describe()  # type: ignore[union-attr]
    assert _parse().describe() == "ann (pid 4242) since 2026-12-02T10:00:00Z, running `up`"  # type: ignore[union-attr]


class _Head:
    """A head whose lock is held by a live holder on another machine: every acquire fails."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def run(self, argv: list[str], *, timeout: float | None = None, stdin: bytes | None = None) -> RunResult:
        self.calls.append(argv[3])
        holder = json.dumps({**GOOD, "host": "elsewhere", "machine_id": "m" * 32, "boot_id": "b", "start_ticks": 9})
        return RunResult(holder + "\n", "", 1, 0.0)


def test_a_live_holder_is_asked_once_and_never_broken() -> None:
    head = _Head()
    with pytest.raises(CheckFailed, match="is locked on spark1 by ann"):
        lock._acquire(head, "spark1", "c", lock.new_owner("down"))
    assert head.calls == ["sparkctl-lock"]  # one acquire: no release, no audit line, no second try


def test_a_live_holder_is_waited_for_and_a_stale_one_may_be_broken() -> None:
    with pytest.raises(CheckFailed) as live:
        lock._acquire(_Head(), "spark1", "c", lock.new_owner("down"))
    assert (live.value.fix or "").startswith("wait for it to finish")

    class StaleHead(_Head):
        def run(self, argv: list[str], *, timeout: float | None = None, stdin: bytes | None = None) -> RunResult:
            r = super().run(argv)
            return RunResult(r.stdout + f"{lock.AGE_MARK} 1000 10\n", "", 1, 0.0)

    with pytest.raises(CheckFailed) as stale:
        lock._acquire(StaleHead(), "spark1", "c", lock.new_owner("down"))
    assert (stale.value.fix or "").startswith("if that run is really gone, break the lock")


def test_lock_status_json_never_shows_the_token() -> None:
    shown = _parse().public()  # type: ignore[union-attr]
    assert "token" not in shown and shown["who"] == "ann" and shown["pid"] == 4242


def test_a_heartbeat_line_is_only_the_marks_own() -> None:
    assert lock.heartbeat_age(f"{lock.AGE_MARK} 100 40\n") == 60
    assert lock.heartbeat_age("zzz 100 40\n") is None  # a word that sorts after the mark is not the mark
    assert lock.heartbeat_age(f"{lock.AGE_MARK}x 100 40\n") is None
    line = f"{lock.AGE_MARK} 100 40\n"
    assert lock.heartbeat_age(line + "x" * (4096 - len(line))) == 60  # the last 4096 characters are read
    assert lock.heartbeat_age(line + "x" * (4097 - len(line))) is None  # the mark cut: not read


def test_an_owner_without_its_start_time_is_not_judged_dead_on_this_machine() -> None:
    import dataclasses

    me = lock.new_owner("check")
    assert me.machine_id and me.boot_id, "this test needs /etc/machine-id and a boot_id"
    # written by this machine, but the pid's start time could not be read (-1): not provably dead
    assert lock.holder_verdict(dataclasses.replace(me, pid=2**31 - 1, start_ticks=-1)) is None
    assert lock.holder_verdict(dataclasses.replace(me, pid=2**31 - 1)) == f"pid {2**31 - 1} on {me.host} is gone"


def test_text_from_the_owner_file_and_ids_in_audit_lines_are_capped() -> None:
    owner = _parse(who="w" * 300)
    assert owner is not None and owner.who == "w" * 256
    assert json.loads(lock.audit_line(action="up", container="c" * 200))["container"] == "c" * 128


def test_an_audit_line_is_the_same_text_for_the_same_event() -> None:
    line = lock.audit_line(action="up", rank=1, detail="d", who="ann", when="2026-12-02T10:00:00Z", container="c1",
                           config_hash="h")
    assert list(json.loads(line)) == sorted(json.loads(line))


def test_the_heartbeat_beats_every_quarter_lease_and_never_keeps_a_dead_command_alive() -> None:
    head = _Head()
    beat = lock._Heartbeat([head], "c", lock.LockOwner("ann", 1, "now", "up", "t0k", lease_s=60))
    try:
        assert beat._every == 15.0
        short = lock._Heartbeat([head], "c", lock.LockOwner("ann", 1, "now", "up", "t0k", lease_s=4))
        short.stop()
        assert short._every == 1.0  # a quarter of a 4 s lease
        beats = [t for t in threading.enumerate() if t.name == "lock-heartbeat"]
        assert beats and all(t.daemon for t in beats)  # a command that dies without stop() does not stay alive heartbeating
    finally:
        beat.stop()


def test_the_heartbeat_touches_the_lock_while_held() -> None:
    import time

    head = _Head()
    beat = lock._Heartbeat([head], "c", lock.LockOwner("ann", 1, "now", "up", "t0k", lease_s=4))  # every 1 s
    try:
        for _ in range(200):  # at most 20 s for a beat due after 1 s
            if head.calls:
                break
            time.sleep(0.1)
        assert head.calls[:1] == ["sparkctl-lock-heartbeat"]
    finally:
        beat.stop()


def test_an_unreadable_start_time_is_unknown_and_an_unreadable_owner_is_pid_0(monkeypatch: Any) -> None:
    monkeypatch.setattr(lock, "_start_ticks", lambda pid: None)
    assert lock.new_owner("up").start_ticks == -1  # never 0: a real start time to compare with later
    assert lock._state_from("not an owner file").owner.pid == 0


# ------------------------------------------------------------------ breaking only on positive evidence


def _live_pid() -> Any:
    import subprocess

    return subprocess.Popen(["sleep", "60"])


def _owner_of(pid: int) -> lock.LockOwner:
    """An owner file for `pid` as this machine, this boot and this pid namespace would write it."""
    import dataclasses

    me = lock.new_owner("up")
    assert me.machine_id and me.boot_id and me.pidns, "this test needs /etc/machine-id, a boot_id and /proc"
    ticks = lock._start_ticks(pid)
    assert ticks is not None
    return dataclasses.replace(me, pid=pid, start_ticks=ticks)


def test_a_holder_from_another_boot_of_a_cloned_host_is_never_broken() -> None:
    """A cloned VM shares /etc/machine-id, the hostname and the initial pid namespace's inode with its
    original; only its boot_id differs, exactly as after a reboot: that is no evidence the holder died."""
    import dataclasses

    proc = _live_pid()
    try:
        live = _owner_of(proc.pid)
        assert lock.holder_verdict(live) is None  # the control: same boot, alive
        clone = dataclasses.replace(live, boot_id="0" * 8 + live.boot_id[8:])
        assert lock.holder_verdict(clone) is None
        # Whatever the pid is on this boot: a pid of another boot says nothing about this one.
        assert lock.holder_verdict(dataclasses.replace(clone, pid=2**31 - 1)) is None
        assert lock.holder_verdict(dataclasses.replace(clone, start_ticks=clone.start_ticks + 1)) is None
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_this_user_cannot_see_or_signal_is_alive(monkeypatch: Any) -> None:
    """Under hidepid=2 another user's /proc/PID is invisible; kill(PID, 0) then fails with EPERM, which
    means the process exists: never a reason to break its lock."""
    import errno

    proc = _live_pid()
    try:
        owner = _owner_of(proc.pid)
        monkeypatch.setattr(lock, "_start_ticks", lambda pid: None)  # /proc/PID invisible (hidepid=2)

        def eperm(pid: int, sig: int) -> None:
            raise PermissionError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(lock.os, "kill", eperm)
        assert lock.holder_verdict(owner) is None

        def other(pid: int, sig: int) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")

        monkeypatch.setattr(lock.os, "kill", other)  # any answer but "no such process": not evidence
        assert lock.holder_verdict(owner) is None
    finally:
        monkeypatch.undo()
        proc.kill()
        proc.wait()


def test_a_dead_or_replaced_pid_on_this_very_boot_is_broken() -> None:
    import dataclasses
    import subprocess

    proc = _live_pid()
    owner = _owner_of(proc.pid)
    try:
        assert lock.holder_verdict(owner) is None
        replaced = dataclasses.replace(owner, start_ticks=owner.start_ticks - 1)
        assert lock.holder_verdict(replaced) == f"pid {proc.pid} on {owner.host} is now another process (started later)"
    finally:
        proc.kill()
        proc.wait()
    assert lock.holder_verdict(owner) == f"pid {proc.pid} on {owner.host} is gone"
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert lock.holder_verdict(dataclasses.replace(owner, pid=gone.pid)) == f"pid {gone.pid} on {owner.host} is gone"


def test_pid_0_and_a_missing_identity_are_never_judged() -> None:
    import dataclasses

    me = _owner_of(__import__("os").getpid())
    assert lock.holder_verdict(dataclasses.replace(me, pid=0, start_ticks=1)) is None  # kill(0) is a process group
    assert lock.holder_verdict(dataclasses.replace(me, pid=-1, start_ticks=1)) is None
    for field in ("machine_id", "boot_id", "host", "pidns"):
        assert lock.holder_verdict(dataclasses.replace(me, **{field: ""}, pid=2**31 - 1)) is None, field
