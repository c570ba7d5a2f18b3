"""One lock per cluster, whoever's env file, and node names that reach another machine.

The lock is taken on every node a command changes, in one order set by what the machines are (their
machine-id), so two env files that list the same nodes in another order, or share only one node, meet
on a shared node: one command runs, the other is refused naming the node and the holder, and holds
nothing after. `up` leaves every node's identity on every node; `status` names a node name that now
reaches another machine ("spark2 now reaches the machine that was spark3") and `down` refuses it
without --force.

Local nodes (tests/unit/localnodes.py): every remote command really runs, `docker` is the stand-in.
Each node gets its own machine-id (a file in its home, read in place of /etc/machine-id: the one seam).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster import Cluster
from sparkctl.errors import CheckFailed
from sparkctl.facts import machine_identity as identity
from sparkctl.orchestrate.locking import lock_cluster, lock_states
from sparkctl.remote import lockdir as lock
from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

A = ["spark1", "spark2", "spark3", "spark4"]
ALL = [*A, "spark5", "spark6", "spark7"]
# spark4's machine sorts last: a command on spark5..7 + spark4 takes spark5..7 before it meets spark4.
MACHINE = {"spark1": "1" * 32, "spark2": "2" * 32, "spark3": "3" * 32, "spark4": "f" * 32,
           "spark5": "5" * 32, "spark6": "6" * 32, "spark7": "7" * 32}


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    monkeypatch.setattr(identity, "WHOAMI", identity.WHOAMI.replace("/etc/machine-id", "machine-id"))
    with served_scene(monkeypatch, tmp_path, ALL, {"NODES": " ".join(A), "SERVED_MODEL_NAME": "lab-model"}) as ln:
        for n, mid in MACHINE.items():
            (ln.home(n) / "machine-id").write_text(mid + "\n")
        yield ln


def _running(ln: LocalNodes, node: str) -> list[str]:
    r = ln.docker(node, "ps", "-aq", "--filter", "label=sparkctl.cluster=t")
    return sorted(r.stdout.split())


def _locked(names: list[str]) -> dict[str, str]:
    with Cluster(names) as c:
        return {n: st.owner.command for n, st in lock_states(c, names, "t").items()}


def test_two_env_files_with_the_same_nodes_in_another_order_exclude_each_other(nodes: LocalNodes,
                                                                                capsys: Any) -> None:
    assert run(["up"], capsys)[0] == 0
    before = {n: _running(nodes, n) for n in A}
    assert all(before.values())
    # Another operator's env file: another head (spark2), another order.
    other = ["--nodes", "spark2 spark1 spark4 spark3"]
    with Cluster(A) as c, lock_cluster(c, A, "t", "up"):  # this operator's `up`, in flight
        assert _locked(A) == dict.fromkeys(A, "up")
        for argv in (["down"], ["up", "--recreate"]):
            code, out, err = run([*other, *argv], capsys)
            assert code == 1, (argv, out + err)
            assert "is locked on spark1 by" in err and "running `up`" in err, err  # the first node in the order
        assert {n: _running(nodes, n) for n in A} == before  # nothing removed, nothing replaced
        assert _locked(A) == dict.fromkeys(A, "up")  # the refused commands left the holder's lock alone
    assert _locked(A) == {}
    assert run([*other, "down"], capsys)[0] == 0  # once it is free, the other env file works
    assert not any(_running(nodes, n) for n in A)


def test_a_cluster_sharing_one_node_is_refused_there_and_holds_nothing_after(nodes: LocalNodes,
                                                                              capsys: Any) -> None:
    assert run(["up"], capsys)[0] == 0
    on4 = _running(nodes, "spark4")
    assert len(on4) == 1  # rank 3 of the first cluster
    b = ["--nodes", "spark5 spark6 spark7 spark4"]  # shares spark4 only; takes spark5..7 first (MACHINE)
    with Cluster(A) as c, lock_cluster(c, A, "t", "down"):
        code, out, err = run([*b, "up"], capsys)
        assert code == 1, out + err
        assert "is locked on spark4 by" in err and "running `down`" in err, err
        assert _locked(["spark5", "spark6", "spark7"]) == {}  # what it took first was given back
        assert not any(_running(nodes, n) for n in ("spark5", "spark6", "spark7"))
        assert _running(nodes, "spark4") == on4  # the other env file's rank, untouched
    assert run([*b, "up"], capsys)[0] == 0  # free again: it runs


def test_the_order_is_the_machines_not_the_env_files() -> None:
    ids = {n: (MACHINE[n], None) for n in ALL}
    first = lock.lock_order(["spark4", "spark1", "spark7"], ids)
    assert first == lock.lock_order(["spark7", "spark1", "spark4"], ids) == ["spark1", "spark7", "spark4"]
    by_key = {"a": (None, "SHA256:b"), "b": (None, "SHA256:a")}  # no machine-id: the host key decides
    assert lock.lock_order(["a", "b"], by_key) == ["b", "a"]


def test_a_dead_holder_on_a_worker_is_broken_and_the_lock_is_released_on_every_exit(
        nodes: LocalNodes, capsys: Any, tmp_path: Path) -> None:
    from tests.unit.test_crash_safety import _dead_pid

    dead = replace(lock.new_owner("up"), pid=_dead_pid())
    with Cluster(["spark3"]) as c:
        assert c.node("spark3").run(lock.acquire_argv("t", dead)).exit_code == 0
    code, out, err = run(["down"], capsys)  # its head (spark1) was never locked: the old lock saw nothing
    assert code == 0, out + err
    audit = (nodes.home("spark3") / ".sparkctl" / "t" / "audit.log").read_text().splitlines()
    assert any(json.loads(x)["action"] == "lock-broken" and "is gone" in json.loads(x)["detail"] for x in audit)
    assert _locked(A) == {}
    # A failure inside the lock (here: a refused body) releases it on every node it took.
    with Cluster(A) as c:
        with pytest.raises(CheckFailed), lock_cluster(c, A, "t", "up"):
            assert _locked(A) == dict.fromkeys(A, "up")
            raise CheckFailed("refused")
    assert _locked(A) == {}


def test_lock_status_and_force_unlock_see_every_node(nodes: LocalNodes, capsys: Any) -> None:
    alive = lock.new_owner("up")  # this process: alive, so not broken automatically
    with Cluster(["spark3"]) as c:
        c.node("spark3").run(lock.acquire_argv("t", alive))
    code, out, err = run(["lock", "status"], capsys)
    assert code == 0 and "locked on spark3 by" in out + err, out + err
    code, out, err = run(["--json", "lock", "status"], capsys)
    assert json.loads(out)["locked"] is True and list(json.loads(out)["nodes"]) == ["spark3"]
    code, out, err = run(["lock", "--force-unlock"], capsys)
    assert code == 0 and "lock broken on spark3" in err, err
    assert _locked(A) == {}


# ------------------------------------------------------------------------------- swapped identities


def _swap_machines(ln: LocalNodes, a: str, b: str) -> None:
    """As if the ssh config's HostNames of a and b were swapped: each name reaches the other's machine
    (its machine-id, and the identity record the last `up` left there)."""
    ha, hb = ln.home(a), ln.home(b)
    for rel in ("machine-id", ".sparkctl/t/identity.json"):
        ta, tb = (ha / rel).read_text(), (hb / rel).read_text()
        (ha / rel).write_text(tb)
        (hb / rel).write_text(ta)


def test_status_names_a_swapped_node_and_down_refuses_it_without_force(nodes: LocalNodes, capsys: Any) -> None:
    from tests.kit.local import local_standin
    from tests.unit.test_standin import write_checkpoint

    assert run(["up"], capsys)[0] == 0
    with local_standin(write_checkpoint(nodes.root / "served"), env={}, served_name="lab-model") as url:
        code, out, err = run(["--json", "status", "--url", url], capsys)
        assert code == 0 and json.loads(out)["swapped"] == [], out + err  # the control
        _swap_machines(nodes, "spark2", "spark3")
        code, out, err = run(["--json", "status", "--url", url], capsys)
        assert code == 1, out + err
        doc = json.loads(out)
        assert [(s["node"], s["was"]) for s in doc["swapped"]] == [("spark2", "spark3"), ("spark3", "spark2")]
        assert any(p.startswith("spark2 now reaches the machine that was spark3") for p in doc["problems"])
        code, out, err = run(["status", "--url", url], capsys)
        assert code == 1 and "spark3 now reaches the machine that was spark2" in out + err
    before = {n: _running(nodes, n) for n in A}
    code, out, err = run(["down"], capsys)
    assert code == 1, out + err
    assert "spark2 now reaches the machine that was spark3" in err and "--force" in err, err
    assert err.count("error:") == 1, err  # said once
    assert {n: _running(nodes, n) for n in A} == before and _locked(A) == {}
    code, out, err = run(["down", "--force"], capsys)
    assert code == 0, out + err
    assert not any(_running(nodes, n) for n in A)


def test_a_machine_new_to_the_cluster_is_named_too() -> None:
    me = identity.NodeIdentity("spark2", "10.0.0.9", 22, "SHA256:new", "9" * 32)
    rec = {"spark1": {"machine_id": "1" * 32, "host_key": "SHA256:one"},
           "spark2": {"machine_id": "2" * 32, "host_key": "SHA256:two"}}
    seen = {"spark2": identity.Seen(me, rec, "2026-12-02T10:00:00Z")}
    (sw,) = identity.swaps(seen)
    assert sw.was is None and sw.describe().startswith("spark2 now reaches another machine than at the last `up`")
    assert "HostName 10.0.0.9" in sw.detail
    same = identity.NodeIdentity("spark2", "10.0.0.2", 22, "SHA256:two", "2" * 32)
    assert identity.swaps({"spark2": identity.Seen(same, rec, "x")}) == []
    # Untrusted records: garbage is no record, never an exception.
    for text in ("", "@@sparkctl-identity-record\n{", "x\n@@sparkctl-identity-record\n[1]",
                 "@@sparkctl-identity-record\n" + json.dumps({"nodes": {"a": 3, "b": {"machine_id": 5}}})):
        identity.parse_whoami(me, text)


# ------------------------------------------------------------- every command that changes nodes, every user


def _changes(ln: LocalNodes, since: int) -> list[str]:
    """What reached the nodes after `since` that changes them: a docker call that makes or removes an
    image or a container, rsync, a pull (the head's python running hf_pull.py), a systemd unit."""
    made = [" ".join(c["argv"][:2]) for c in ln.docker_calls()
            if c["argv"][:1] and c["argv"][0] in ("build", "load", "tag", "rmi", "pull", "run", "rm", "create")]
    with ln.lock:
        sent = [s.command for s in ln.sent[since:]]
    return made + [c[:80] for c in sent if "rsync" in c or "hf_pull.py" in c or "sparkctl-export" in c
                   or "authorized_keys" in c]


def _systemd_seam(ln: LocalNodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """`export systemd` installs into a folder of the head's, with a systemctl that does nothing and a
    `sparkctl` where the unit's program is looked for."""
    from sparkctl.spec import systemd_unit

    monkeypatch.setattr(systemd_unit, "UNIT_DIR", "units")
    bin_dir = ln.root / "hw" / "spark1" / "bin"
    monkeypatch.setattr(systemd_unit, "SEARCH_PATH", str(bin_dir))
    for name in ("systemctl", "sparkctl"):
        stub = bin_dir / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)


CHANGERS = {
    "build": ["build"],
    "build --ship": ["build", "--ship"],
    "model sync": ["model", "sync"],
    "model pull": ["model", "pull"],
    "export systemd": ["export", "systemd"],
}


@pytest.mark.parametrize("name", list(CHANGERS))
def test_every_command_that_changes_nodes_is_refused_while_another_holds_the_lock(
        name: str, nodes: LocalNodes, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_REPO", "org/model")
    monkeypatch.setenv("MODEL_REVISION", "0" * 40)
    _systemd_seam(nodes, monkeypatch)
    docker_log = nodes.root / "docker-calls.jsonl"
    with Cluster(A) as c, lock_cluster(c, A, "t", "up"):  # another operator's `up`, in flight
        docker_log.unlink(missing_ok=True)
        since = len(nodes.sent)
        code, out, err = run(CHANGERS[name], capsys)
        assert code == 1, (name, out + err)
        assert "is locked on spark1 by" in err and "running `up`" in err, (name, err)
        assert err.count("error:") == 1, err
        assert _changes(nodes, since) == [], name  # refused before it changed anything
        assert _locked(A) == dict.fromkeys(A, "up")  # the holder's lock is whole
    assert not (nodes.home("spark1") / "units").exists()


def test_the_newly_locked_commands_release_the_lock_and_still_run(nodes: LocalNodes, capsys: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _systemd_seam(nodes, monkeypatch)
    for argv in (["build"], ["export", "systemd"]):
        code, out, err = run(argv, capsys)
        assert code == 0, (argv, out + err)
        assert _locked(A) == {}, argv
    assert (nodes.home("spark1") / "units" / "sparkctl-watch-t.service").is_file()
    audit = (nodes.home("spark1") / ".sparkctl" / "t" / "audit.log")
    assert not audit.exists() or "lock-broken" not in audit.read_text()


def test_two_ssh_users_of_one_node_meet_on_one_lock(nodes: LocalNodes, capsys: Any) -> None:
    """The lock is one per cluster per node, whoever logs in: another SSH user (another home on the
    same machines) is refused while the first holds it, and `lock status` names the SSH user."""
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name  # the local nodes run as this uid, whatever the home
    with Cluster(A) as c, lock_cluster(c, A, "t", "up"):
        nodes.login_as("bob")
        try:
            for argv in (["down"], ["up"], ["build"]):
                code, out, err = run(argv, capsys)
                assert code == 1, (argv, out + err)
                assert "is locked on spark1 by" in err and f"as SSH user {me}" in err, (argv, err)
            code, out, err = run(["lock", "status"], capsys)
            assert code == 0 and f"running `up`, as SSH user {me}" in out, out + err
            code, out, err = run(["--json", "lock", "status"], capsys)
            assert json.loads(out)["holder"]["ssh_user"] == me and json.loads(out)["holder"]["where"] == "shared"
            assert not (nodes.login_home("spark1") / ".sparkctl" / "t" / "lock").exists()  # nothing in bob's home
        finally:
            nodes.login_as(None)
    nodes.login_as("bob")
    assert run(["up"], capsys)[0] == 0  # free again: bob's `up` runs
    assert run(["down"], capsys)[0] == 0
    assert _locked(A) == {}


def test_a_lock_an_older_sparkctl_took_in_the_home_is_still_seen(nodes: LocalNodes, capsys: Any) -> None:
    """Before the shared lock, sparkctl took it in the SSH user's home: such a lock still refuses every
    command, and `lock status` shows it (and says where it is)."""
    old = lock.new_owner("up")  # alive: this process
    where = nodes.home("spark2") / ".sparkctl" / "t" / "lock"
    where.mkdir(parents=True)
    (where / "owner").write_text(old.to_json() + "\n")
    (where / "heartbeat").write_text("")
    for argv in (["down"], ["build"]):
        code, out, err = run(argv, capsys)
        assert code == 1, (argv, out + err)
        assert "is locked on spark2 by" in err and "taken by an older sparkctl" in err, err
    assert not any((nodes.home(n) / lock.lock_dir("t")).exists() for n in A)  # what it took, given back
    code, out, err = run(["lock", "status"], capsys)
    assert "locked on spark2 by" in out and "in that user's home" in out, out + err
    assert run(["lock", "--force-unlock"], capsys)[0] == 0
    assert not where.exists() and _locked(A) == {}


# ------------------------------------------------------------------ two real users (root and nobody)


class _User:
    """A node's shell as one user (setpriv to that uid when not root), logged in to its home: the lock
    scripts really run with that user's permissions."""

    def __init__(self, home: Path, uid: int | None) -> None:
        self.home, self.uid = home, uid
        self.scripts: list[str] = []  # each script's $0 (sparkctl-lock, sparkctl-unlock, sparkctl-audit, ...)

    def run(self, argv: list[str], *, timeout: float | None = None) -> Any:
        import subprocess

        self.scripts.append(argv[3])
        from sparkctl.cluster.channel import RunResult

        pre = [] if self.uid is None else ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"]
        r = subprocess.run([*pre, *argv], cwd=self.home, capture_output=True, text=True, timeout=timeout or 20,
                           env={"PATH": "/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8"}, check=False)
        return RunResult(r.stdout, r.stderr, r.returncode, 0.0)


@pytest.fixture
def two_users() -> Iterator[tuple[_User, _User, Path]]:
    """One machine, two SSH users: root (its home is the machine's folder) and nobody (another home),
    both seeing the machine's sticky LOCK_ROOT."""
    import shutil
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to run the scripts as a second user")
    base = Path(tempfile.mkdtemp(prefix="sparkctl-lock-users-", dir="/tmp"))  # pytest's tmp is 0700
    try:
        base.chmod(0o755)
        machine, bob = base / "machine", base / "bob"
        (machine / "var-tmp").mkdir(parents=True)
        (machine / "var-tmp").chmod(0o1777)
        bob.mkdir()
        (bob / "var-tmp").symlink_to(machine / "var-tmp")
        os.chown(bob, 65534, 65534)
        yield _User(machine, None), _User(bob, 65534), machine / lock.lock_dir("t")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_another_ssh_user_sees_the_lock_and_cannot_remove_or_touch_it(two_users: tuple[_User, _User, Path]) -> None:
    root, nobody, shared = two_users
    theirs = lock.new_owner("up")
    assert root.run(lock.acquire_argv("t", theirs)).exit_code == 0
    assert oct(shared.stat().st_mode & 0o7777) == "0o755" and oct((shared / "owner").stat().st_mode & 0o777) == "0o644"
    st = lock.lock_state(nobody, "t")
    assert st is not None and st.owner.token == theirs.token and (st.ssh_user, st.viewer) == ("root", "nobody")
    with pytest.raises(CheckFailed) as exc:
        lock._acquire(nobody, "spark1", "t", lock.new_owner("down"))
    assert "as SSH user root" in exc.value.message and "only SSH user root (or root) can remove it" in str(exc.value.fix)
    held, kept = lock.force_unlock(nobody, "t")  # --force-unlock as the other user: refused by the kernel
    assert held is not None and kept == "root"
    assert nobody.run(lock.heartbeat_argv("t", theirs.token)).exit_code != 0  # cannot even touch it
    assert lock.lock_state(root, "t").owner.token == theirs.token  # type: ignore[union-attr]
    # The holder's own user (root here) breaks it.
    assert lock.force_unlock(root, "t")[1] is None and lock.lock_state(root, "t") is None


def test_a_dead_holders_lock_of_another_ssh_user_is_named_not_half_broken(
        two_users: tuple[_User, _User, Path]) -> None:
    from dataclasses import replace as _replace

    from tests.unit.test_crash_safety import _dead_pid

    root, nobody, shared = two_users
    dead = _replace(lock.new_owner("up"), pid=_dead_pid())
    assert nobody.run(lock.acquire_argv("t", dead)).exit_code == 0  # nobody's, and its holder is gone
    # As a third user, neither root nor nobody, the break is refused and says whose it is.
    other = _User(nobody.home, 65533)
    with pytest.raises(CheckFailed) as exc:
        lock._acquire(other, "spark1", "t", lock.new_owner("down"))
    assert "its holder is dead" in exc.value.message and "only SSH user nobody" in str(exc.value.fix)
    assert other.scripts == ["sparkctl-lock", "sparkctl-unlock"]  # one try, no audit line saying it was broken
    assert lock.lock_state(root, "t").owner.token == dead.token  # type: ignore[union-attr]
    with lock.cluster_lock(root, "spark1", "t", "down") as mine:  # root breaks it: the dead holder's lock goes
        assert lock.lock_state(root, "t").owner.token == mine.token  # type: ignore[union-attr]
