"""Crash safety, offline: signals, the lock's dead/stale holders, orphans, the rollback report, identity,
strict env-file keys and the disk rule. The lab tests (tests/lab/test_signals_lab.py) run the same
claims against real SSH and Docker."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from sparkctl import signals
from sparkctl.cluster import Cluster, NodeError
from sparkctl.errors import CheckFailed, UsageError
from sparkctl.facts import node_facts as F
from sparkctl.facts.machine_identity import NodeIdentity, duplicates, parse_machine_id
from sparkctl.remote import cleanup
from sparkctl.remote import lockdir as lock
from sparkctl.rules import check_rules as C
from sparkctl.spec.settings import load_settings
from tests.unit.test_cluster import sshlab  # noqa: F401  (the fixture: real OpenSSH servers)

# --------------------------------------------------------------------------------------- signals


@pytest.fixture
def handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    for s in signals.HANDLED:  # as a terminal leaves them (a run under nohup ignores SIGHUP: tested below)
        signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
    signals.reset()
    signals.install()
    try:
        yield
    finally:
        signals.reset()
        for s, h in saved.items():
            signal.signal(s, h)


def _send(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs here (and may raise out of the sleep)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_each_signal_interrupts_with_128_plus_signum(handlers: None, sig: int, code: int) -> None:
    with pytest.raises(signals.Interrupted) as exc:
        _send(sig)
    assert exc.value.exit_code == code


def test_under_nohup_a_hangup_stays_ignored() -> None:
    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signals.reset()
        signals.install()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the others are still handled
    finally:
        signals.reset()
        for s, h in saved.items():
            signal.signal(s, h)


def test_cleanup_notes_the_second_signal_and_the_third_aborts(handlers: None, capsys: Any) -> None:
    with pytest.raises(signals.Interrupted):
        _send(signal.SIGTERM)
    with pytest.raises(signals.CleanupAborted):
        with signals.shielded(deliver=False):
            _send(signal.SIGTERM)  # the second: noted, the cleanup goes on
            assert "cleanup continues" in capsys.readouterr().err
            _send(signal.SIGINT)  # the third: abort


def test_a_signal_while_shielded_is_delivered_after(handlers: None) -> None:
    done = False
    with pytest.raises(signals.Interrupted) as exc:
        with signals.shielded():
            _send(signal.SIGHUP)
            done = True
    assert done and exc.value.signum == signal.SIGHUP


def test_after_the_point_of_no_return_a_signal_changes_nothing(handlers: None, capsys: Any) -> None:
    signals.commit()
    _send(signal.SIGINT)
    assert "nothing will be undone" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ lock


@dataclass
class Ran:
    exit_code: int
    stdout: str
    stderr: str


class LocalHead:
    """The head as a local shell in a scratch HOME (the lock scripts use paths relative to it)."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.calls: list[list[str]] = []

    def run(self, argv: list[str], *, timeout: float | None = None) -> Ran:
        self.calls.append(argv)
        r = subprocess.run(argv, cwd=self.home, capture_output=True, text=True, timeout=timeout or 10)
        return Ran(r.returncode, r.stdout, r.stderr)


def test_sigterm_inside_the_lock_releases_it(handlers: None, tmp_path: Path) -> None:
    head = LocalHead(tmp_path)
    with pytest.raises(signals.Interrupted):
        with lock.cluster_lock(head, "h", "c", "up"):
            assert lock.lock_state(head, "c") is not None
            _send(signal.SIGTERM)
    assert lock.lock_state(head, "c") is None


def test_a_signal_while_taking_the_lock_still_releases_it(handlers: None, tmp_path: Path) -> None:
    """The sweep's finding: SIGTERM landing during the acquire left the lock held."""
    class SignalledHead(LocalHead):
        def run(self, argv: list[str], *, timeout: float | None = None) -> Ran:
            r = super().run(argv, timeout=timeout)
            if argv[3] == "sparkctl-lock":  # the acquire script: signal right after it took the lock
                os.kill(os.getpid(), signal.SIGTERM)
            return r

    head = SignalledHead(tmp_path)
    with pytest.raises(signals.Interrupted):
        with lock.cluster_lock(head, "h", "c", "up"):
            pass
    assert lock.lock_state(head, "c") is None


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_holder_verdicts() -> None:
    me = lock.new_owner("up")
    assert lock.holder_verdict(me) is None  # this very process: alive
    assert "is gone" in str(lock.holder_verdict(replace(me, pid=_dead_pid())))
    assert "another process" in str(lock.holder_verdict(replace(me, start_ticks=me.start_ticks - 1)))
    assert lock.holder_verdict(replace(me, boot_id="0" * 36)) is None  # a clone, or a reboot: no proof either way
    assert lock.holder_verdict(replace(me, machine_id="f" * 32, pid=_dead_pid())) is None  # not ours to judge
    assert lock.holder_verdict(replace(me, pidns="pid:[1]", pid=_dead_pid())) is None
    assert lock.holder_verdict(lock.LockOwner("old", _dead_pid(), "s", "up", "t")) is None  # old owner file


def test_a_dead_holder_is_broken_with_an_audit_line(tmp_path: Path) -> None:
    head = LocalHead(tmp_path)
    dead = replace(lock.new_owner("up"), pid=_dead_pid())
    assert head.run(lock.acquire_argv("c", dead)).exit_code == 0
    with lock.cluster_lock(head, "h", "c", "down") as mine:
        st = lock.lock_state(head, "c")
        assert st is not None and st.owner.token == mine.token
    log = (tmp_path / ".sparkctl" / "c" / "audit.log").read_text()
    (entry,) = [json.loads(ln) for ln in log.splitlines()]
    assert entry["action"] == "lock-broken" and "is gone" in entry["detail"] and str(dead.pid) in entry["detail"]


def test_a_live_holder_is_not_broken(tmp_path: Path) -> None:
    head = LocalHead(tmp_path)
    alive = lock.new_owner("up")
    head.run(lock.acquire_argv("c", alive))
    with pytest.raises(CheckFailed) as exc:
        with lock.cluster_lock(head, "h", "c", "down"):
            pass
    assert "locked" in exc.value.message and "stale" not in exc.value.message
    assert lock.lock_state(head, "c").owner.token == alive.token  # type: ignore[union-attr]


def test_a_live_holder_on_a_cloned_jump_host_keeps_its_lock_and_is_named(tmp_path: Path) -> None:
    """A clone of this machine (same machine-id, hostname and pid namespace, another boot) holds the lock:
    it is refused, not broken, naming the holder, its host, pid and heartbeat age and the break command."""
    head = LocalHead(tmp_path)
    clone = replace(lock.new_owner("up"), who="bob@jump", boot_id="0" * 36)
    assert head.run(lock.acquire_argv("c", clone)).exit_code == 0
    with pytest.raises(CheckFailed) as exc:
        with lock.cluster_lock(head, "h", "c", "down"):
            pass
    said = f"{exc.value.message}\n{exc.value.fix}"
    assert f"is locked on h by bob@jump (pid {clone.pid} on {clone.host})" in said, said
    assert re.search(r"last heartbeat \d+s ago", said) and lock.FORCE_UNLOCK in said and "dead" not in said, said
    assert lock.lock_state(head, "c").owner.token == clone.token  # type: ignore[union-attr]
    assert not (tmp_path / ".sparkctl" / "c" / "audit.log").exists()  # nothing was broken


def test_a_remote_holder_without_heartbeat_is_stale_with_age_and_the_command(tmp_path: Path) -> None:
    head = LocalHead(tmp_path)
    remote = replace(lock.new_owner("up"), machine_id="e" * 32, host="elsewhere")
    head.run(lock.acquire_argv("c", remote))
    beat = tmp_path / lock.lock_dir("c") / "heartbeat"  # the shared lock, what `lock status` reads
    old = beat.stat().st_mtime - 600
    os.utime(beat, (old, old))
    st = lock.lock_state(head, "c")
    assert st is not None and st.stale and st.age_s is not None and st.age_s >= 600
    with pytest.raises(CheckFailed) as exc:
        with lock.cluster_lock(head, "h", "c", "down"):
            pass
    assert "stale" in exc.value.message and "last heartbeat" in exc.value.message
    assert lock.FORCE_UNLOCK in (exc.value.fix or "")


def test_the_holder_heartbeats_only_its_own_lock(tmp_path: Path) -> None:
    head = LocalHead(tmp_path)
    me = lock.new_owner("up")
    head.run(lock.acquire_argv("c", me))
    beat = tmp_path / lock.lock_dir("c") / "heartbeat"  # the shared lock, what `lock status` reads
    os.utime(beat, (0, 0))
    assert head.run(lock.heartbeat_argv("c", "not-the-token")).exit_code != 0 and beat.stat().st_mtime == 0
    assert head.run(lock.heartbeat_argv("c", me.token)).exit_code == 0 and beat.stat().st_mtime > 0


def test_heartbeat_age_and_owner_parsing_of_untrusted_text() -> None:
    me = lock.new_owner("up")
    text = me.to_json() + "\n@@sparkctl-lock-age 1000 940\n"
    assert lock.heartbeat_age(text) == 60 and lock.LockOwner.parse(text) == me
    assert lock.heartbeat_age("@@sparkctl-lock-age x 1") is None
    odd = json.loads(me.to_json()) | {"start_ticks": "9", "lease_s": -5, "boot_id": 7}
    parsed = lock.LockOwner.parse(json.dumps(odd))
    assert parsed is not None and parsed.start_ticks == -1 and parsed.lease_s == lock.LEASE_S and parsed.boot_id == ""


# --------------------------------------------------------------------------- orphans and rollback


def _state(cid: str, rank: int, cfg: str = "h1") -> Any:
    from sparkctl.remote.service import ContainerState

    return ContainerState(cid, f"sparkctl-c-rank{rank}", rank, cfg, "sha256:i", "running", True, 0, "", 0, "")


def test_orphans_are_containers_no_successful_up_recorded() -> None:
    log = "\n".join([
        lock.audit_line(action="up", rank=0, config_hash="h1", container="a" * 64),
        lock.audit_line(action="up-rolled-back", rank=1, config_hash="h1", container="b" * 64),
        lock.audit_line(action="up", rank=2, config_hash="old"),  # an older sparkctl: no container ID
        "not json", "[1]",
    ])
    rec = cleanup.parse_up_records(log)
    states = [_state("a" * 64, 0), _state("b" * 64, 1), _state("c" * 64, 2, "old"), _state("d" * 64, 3)]
    assert [c.rank for c in cleanup.orphans(states, rec)] == [1, 3]


class FakeDockerNode:
    """A node whose `docker` is a script in PATH: `ps` prints the listing, `rm` fails when asked."""

    def __init__(self, tmp: Path, listing: str, rm_fails: bool) -> None:
        self.name = "n1"
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        (tmp / "listing").write_text(listing)
        (bin_dir / "docker").write_text(
            "#!/bin/sh\n"
            f"case $1 in ps) cat {tmp / 'listing'} ;; "
            f"rm) {'echo cannot connect >&2; exit 1' if rm_fails else 'exit 0'} ;; esac\n")
        (bin_dir / "docker").chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        self.tmp = tmp

    def run(self, argv: list[str], *, timeout: float | None = None, stdin: bytes | None = None) -> Any:
        from sparkctl.cluster import RunResult

        r = subprocess.run(argv, cwd=self.tmp, env=self.env, capture_output=True, text=True, timeout=10)
        return RunResult(r.stdout, r.stderr, r.returncode, 0.0)


def test_remove_reports_what_it_removed_and_what_it_left(tmp_path: Path) -> None:
    listing = f"{'a' * 64} sparkctl-c-rank0\n{'b' * 64} sparkctl-c-rank1\n"
    (tmp_path / "ok").mkdir()
    ok = FakeDockerNode(tmp_path / "ok", listing, rm_fails=False)
    assert cleanup.remove_cluster(ok, "c") == ["sparkctl-c-rank0", "sparkctl-c-rank1"]  # type: ignore[arg-type]
    (tmp_path / "bad").mkdir()
    bad = FakeDockerNode(tmp_path / "bad", listing, rm_fails=True)
    with pytest.raises(cleanup.RemoveFailed) as exc:
        cleanup.remove_cluster(bad, "c")  # type: ignore[arg-type]
    assert exc.value.left == ["sparkctl-c-rank0", "sparkctl-c-rank1"] and "cannot connect" in exc.value.reason


def test_sweep_lines_name_per_node_removed_and_left() -> None:
    report = {"n1": cleanup.NodeSweep(removed=["sparkctl-c-rank0"]), "n2": cleanup.NodeSweep(),
              "n3": cleanup.NodeSweep(error="docker is down", left=["sparkctl-c-rank2 (rank 2, being started)"])}
    assert cleanup.sweep_lines(report) == [
        "n1: removed sparkctl-c-rank0", "n2: nothing to remove",
        "n3: NOT clean (docker is down); may still be there: sparkctl-c-rank2 (rank 2, being started)"]


# -------------------------------------------------------------------------------------- identity


def test_same_machine_id_or_host_key_is_one_machine() -> None:
    a = NodeIdentity("spark2", "10.0.0.2", 22, "SHA256:k2", "2" * 32)
    b = NodeIdentity("spark3", "10.0.0.3", 22, "SHA256:k3", "3" * 32)
    assert duplicates([a, b]) == []
    (line,) = duplicates([a, replace(b, machine_id=a.machine_id)])
    assert "spark2 (HostName 10.0.0.2" in line and "spark3 (HostName 10.0.0.3" in line and "machine-id" in line
    assert "host key" in duplicates([a, replace(b, host_key=a.host_key)])[0]
    assert duplicates([replace(a, machine_id=None, host_key=None), replace(b, machine_id=None, host_key=None)]) == []
    assert parse_machine_id("3d1219c7c4c5404aaa1f6d2a48adfda4\n") == "3d1219c7c4c5404aaa1f6d2a48adfda4"
    assert parse_machine_id("uninitialized\n") is None


def test_two_aliases_of_one_real_sshd_are_refused(sshlab: Any, tmp_path: Path) -> None:  # noqa: F811
    """Against a real OpenSSH server: a typo'd HostName/Port makes n2b reach n1's sshd."""
    text = Path(sshlab.ssh_config).read_text()
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host n2b\n  HostName 127.0.0.1\n  Port {sshlab.nodes['n1'].port}\n" + text)
    with pytest.raises(CheckFailed) as exc:
        with Cluster(["n1", "n2b"], cfg):
            pass
    assert "n1 (HostName 127.0.0.1" in exc.value.message and "n2b" in exc.value.message
    with Cluster(["n1", "n2"], cfg) as cluster:  # two real machines (two sshds, two host keys): fine
        assert cluster.connected == ["n1", "n2"]

# ------------------------------------------------------------------------------ env keys, disk rule


def test_unknown_key_is_an_error_only_when_strict(tmp_path: Path) -> None:
    env = tmp_path / "env"
    env.write_text("NODES=a b c d\nMODEL=/m\nMAX_MODEL_LENGTH=4096\nSKIP_OLD_THING=1\n")
    s = load_settings(env_file=str(env), environ={})
    assert any("MAX_MODEL_LENGTH" in w and "did you mean MAX_MODEL_LEN" in w for w in s.warnings)
    with pytest.raises(UsageError) as exc:
        load_settings(env_file=str(env), environ={}, strict_keys=True)
    assert "did you mean MAX_MODEL_LEN" in exc.value.message and "SKIP_OLD_THING" not in exc.value.message


@pytest.mark.parametrize("command, code", [("up", 2), ("down", 2), ("build", 2), ("check", 2), ("config", 0)])
def test_cli_refuses_unknown_keys_for_commands_that_change_the_cluster(tmp_path: Path, command: str,
                                                                        code: int) -> None:
    env = tmp_path / "env"
    env.write_text("NODES=a b c d\nMODEL=/m\nMAX_MODEL_LENGTH=4096\n")
    r = subprocess.run([sys.executable, "-m", "sparkctl", "--env-file", str(env), command],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SPARKCTL_SSH_CONFIG": str(tmp_path / "none")})
    assert r.returncode == code, r.stderr
    assert "MAX_MODEL_LENGTH" in r.stderr and "did you mean MAX_MODEL_LEN" in r.stderr and "Traceback" not in r.stderr
    said = "error: unknown key MAX_MODEL_LENGTH" if code == 2 else "warning: unknown key MAX_MODEL_LENGTH"
    assert said in r.stderr, r.stderr  # check says what up says: the same refusal, not a warning


def test_a_key_set_twice_is_an_error_only_when_strict(tmp_path: Path) -> None:
    """A second NODES= line (the last one won, silently) made two operators take two locks."""
    env = tmp_path / "env"
    env.write_text('NODES="a b c d"\nMODEL=/m\n# reordered\nNODES="b a c d"\nHF_TOKEN=hf_one\nHF_TOKEN=hf_two\n')
    s = load_settings(env_file=str(env), environ={})
    assert s.get("NODES") == ["b", "a", "c", "d"]  # what python-dotenv reads: the last line
    assert f"NODES is set 2 times in env file {env} (lines 1, 4): the last one is used" in s.warnings
    assert any(w.startswith("HF_TOKEN is set 2 times") for w in s.warnings)
    assert not any("hf_one" in w or "hf_two" in w for w in s.warnings)  # values never said: one may be a secret
    with pytest.raises(UsageError) as exc:
        load_settings(env_file=str(env), environ={}, strict_keys=True)
    assert f"NODES is set 2 times in env file {env} (lines 1, 4)" in exc.value.message
    assert "keep one line per key" in (exc.value.fix or "")
    env.write_text('NODES="a b c d"\nMODEL=/m\n')
    assert load_settings(env_file=str(env), environ={}, strict_keys=True).warnings == []


@pytest.mark.parametrize("command, code", [("up", 2), ("down", 2), ("config", 0)])
def test_cli_refuses_a_key_set_twice_for_commands_that_change_the_cluster(tmp_path: Path, command: str,
                                                                           code: int) -> None:
    env = tmp_path / "env"
    env.write_text("NODES=a b c d\nMODEL=/m\nNODES=d c b a\n")
    r = subprocess.run([sys.executable, "-m", "sparkctl", "--env-file", str(env), command],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "SPARKCTL_SSH_CONFIG": str(tmp_path / "none")})
    assert r.returncode == code, r.stderr
    assert "NODES is set 2 times" in r.stderr and "Traceback" not in r.stderr
    assert ("keep one line per key" in r.stderr) == (code == 2)  # refused for that reason, not another


def _disk(avail_gb: int, mount: str) -> F.DiskUsage:
    return F.DiskUsage("/dev/x", 10**12, 0, avail_gb * 10**9, mount)


def test_disk_rule_measures_the_engines_data_root_not_the_fullest_filesystem() -> None:
    facts = F.NodeFacts(
        disks=[_disk(500, "/srv"), _disk(5, "/models")],
        disk_paths=[F.DiskPath("@docker-root", "/srv/docker", "/srv/docker"),
                    F.DiskPath("/models/m", "/models/m", "/models/m")])
    f = C.rule_disk("n1", facts)
    assert f.status == C.OK and "the Docker data root /srv/docker" in f.reason and "MODEL /models/m" in f.reason
    facts.disks = [_disk(5, "/srv"), _disk(500, "/models")]
    assert C.rule_disk("n1", facts).status == C.FAIL


def test_probe_asks_the_engine_for_its_data_root(tmp_path: Path) -> None:
    """node_facts.sh's disk_paths with a docker CLI that answers DockerRootDir (no socket: the CLI path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    root = tmp_path / "engine-root"
    root.mkdir()
    (bin_dir / "docker").write_text(f"#!/bin/sh\n[ \"$1\" = info ] && echo {root}\n")
    (bin_dir / "docker").chmod(0o755)
    script = (Path(F.__file__).parent.parent / "probes" / "node_facts.sh").read_text()
    body = script.split("\nfacts() {")[0]  # the definitions, not the run
    r = subprocess.run(["sh", "-c", body + "\ndisk_paths; df_paths", "probe", "nonce", "df=@docker-root",
                        f"df={tmp_path}/no/such/model"],
                       capture_output=True, text=True, timeout=30,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DOCKER_HOST": "tcp://x:1"})
    lines = r.stdout.splitlines()
    assert lines[0] == f"@docker-root\t{root}\t{root}", r.stdout + r.stderr
    assert lines[1] == f"{tmp_path}/no/such/model\t{tmp_path}/no/such/model\t{tmp_path}", r.stdout
    assert lines[2].startswith("Filesystem") and len(lines) == 5


def test_node_error_is_what_unreachable_sweeps_report() -> None:
    e = NodeError("n1", "lost", "SSH connection lost")
    assert cleanup.NodeSweep(error=e.reason, left=["x"]).line("n1") == "n1: NOT clean (SSH connection lost); may still be there: x"


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_before_sparkctls_handlers_ends_quietly_with_the_shells_status(sig: int, code: int) -> None:
    """The import window (click, rich, paramiko...) before cli.main installs the real handlers: nothing
    has started, so the process ends at once, with 128 + signum and one line, not a traceback."""
    script = ("import os, signal, time; from sparkctl.entry import install_early; install_early(); "
              f"os.kill(os.getpid(), {int(sig)}); time.sleep(5); print('not reached')")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr == f"interrupted ({signal.Signals(sig).name}) before anything started\n"
    assert "not reached" not in r.stdout


def test_a_signal_after_the_command_finished_changes_nothing(capsys: Any) -> None:
    """While the interpreter exits (thread joins, atexit) a late Ctrl-C must not turn a finished command
    into a death by SIGINT (the sweep saw `down` exit -2 after it had removed everything)."""
    from sparkctl.cli import main

    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    try:
        with pytest.raises(SystemExit) as exc:
            main(["--version"])
        assert exc.value.code in (0, None)
        assert signals.is_committed()
        _send(signal.SIGINT)  # noted, not raised
        assert "nothing will be undone" in capsys.readouterr().err
    finally:
        signals.reset()
        for s, h in saved.items():
            signal.signal(s, h)


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["no-such-command"], 2)])
def test_the_console_script_exits_with_the_commands_status(argv: list[str], code: int) -> None:
    """entry.main ends the process itself (os._exit after flushing) with cli.main's status."""
    script = f"import sys; sys.argv = ['sparkctl', *{argv!r}]; from sparkctl.entry import main; main()"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert (r.stdout if code == 0 else r.stderr).strip(), "the output was flushed before the exit"
