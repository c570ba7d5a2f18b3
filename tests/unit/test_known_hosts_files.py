"""Which known_hosts files sparkctl reads and `trust` writes: the ones OpenSSH reads, with the real ssh
as the referee. `ssh -G` names them (UserKnownHostsFile with its ~, %-tokens and ${VARS} already
expanded; `none` when there is no file); a relative path is opened in the current directory, as ssh
opens it; a file named `none` is never read or written. Then a real `ssh` and sparkctl connect to the
same private sshd (test_cluster.py's sshlab) from the same directory and must agree on the host key.

`trust` of a changed key refuses, naming the old and the new fingerprints as `ssh-keygen -l` prints
them, unless told `--replace`; then only that host's old lines of that key type leave the file.
"""

from __future__ import annotations

import io
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from sparkctl import cluster as cl
from sparkctl.cli import main
from sparkctl.cluster import Cluster, NodeError, RunResult
from tests.unit import test_cluster
from tests.unit.test_cluster import SshLab, _config, _keygen

sshlab = test_cluster.sshlab  # the fixture: real OpenSSH servers

needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's ssh client")
needs_sshd = pytest.mark.skipif(
    not (shutil.which("ssh-keygen") and os.geteuid() == 0), reason="needs OpenSSH's sshd and ssh-keygen, run as root"
)

HOME = pwd.getpwuid(os.getuid()).pw_dir  # ssh's ~ and %d: the passwd entry's home, not $HOME


def _ssh_g_words(cfg: Path, alias: str, key: str) -> list[str]:
    out = subprocess.run(["ssh", "-G", "-F", str(cfg), alias], capture_output=True, text=True, check=True,
                         timeout=20, stdin=subprocess.DEVNULL).stdout
    return next(line.split()[1:] for line in out.splitlines() if line.split()[0] == key)


def _as_ssh_opens(words: list[str], cwd: Path) -> tuple[str, ...]:
    """The files ssh opens for the words `ssh -G` printed: none for `none`; ~ is the passwd home; a relative
    path is relative to ssh's current directory (ssh never chdirs)."""
    if [w.lower() for w in words] == ["none"]:
        return ()
    out = []
    for w in words:
        if w == "~" or w.startswith("~/"):
            w = HOME + w[1:]
        out.append(w if os.path.isabs(w) else str(cwd / w))
    return tuple(out)


@needs_ssh
@pytest.mark.parametrize(("lines", "user", "global_"), [
    ("UserKnownHostsFile none\n  GlobalKnownHostsFile none", (), ()),
    ("UserKnownHostsFile NONE", (), None),
    ("UserKnownHostsFile ./none", ("CWD/none",), None),
    ("UserKnownHostsFile rel/kh ~/x %d/y /abs/z", ("CWD/rel/kh", "HOME/x", "HOME/y", "/abs/z"), None),
    ("UserKnownHostsFile kh-%%h %%d/lit\n  HostName 10.9.8.7", ("CWD/kh-%h", "CWD/%d/lit"), None),
    ("UserKnownHostsFile kh-%h-%p %k\n  HostName 10.9.8.7\n  Port 2222\n  HostKeyAlias hka",
     ("CWD/kh-10.9.8.7-2222", "CWD/hka"), None),
    ("UserKnownHostsFile ${SPARKCTL_TEST_KH}/k", ("/srv/kh_dir/k",), None),
    ("GlobalKnownHostsFile relg ~/g", None, ("CWD/relg", "HOME/g")),
])
def test_known_hosts_files_are_the_files_ssh_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lines: str,
                                                   user: tuple[str, ...] | None,
                                                   global_: tuple[str, ...] | None) -> None:
    """sparkctl's files are exactly those ssh opens for what `ssh -G` prints; the expected lists are written out
    too, so the referee's own reading is checked."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPARKCTL_TEST_KH", "/srv/kh_dir")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host h\n  {lines}\n")
    t = cl.resolve_target("h", *cl.load_ssh_config(cfg))

    def subst(paths: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(p.replace("CWD", str(tmp_path)).replace("HOME", HOME) for p in paths)

    assert t.known_hosts_files == _as_ssh_opens(_ssh_g_words(cfg, "h", "userknownhostsfile"), tmp_path)
    assert t.global_known_hosts_files == _as_ssh_opens(_ssh_g_words(cfg, "h", "globalknownhostsfile"), tmp_path)
    if user is not None:
        assert t.known_hosts_files == subst(user)
    if global_ is not None:
        assert t.global_known_hosts_files == subst(global_)


# ---------------------------------------------------------- a real ssh and sparkctl, same sshd, same directory


def _real_ssh_ok(cfg: Path, alias: str, cwd: Path) -> bool:
    r = subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", alias,
                        "true"], cwd=cwd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                       check=False)
    assert r.returncode == 0 or "Host key verification failed" in r.stderr, r.stderr
    return r.returncode == 0


def _sparkctl_ok(cfg: Path, alias: str) -> bool:
    with Cluster([alias], cfg, connect_timeout=5) as cluster:
        res = cluster.run_all(["true"])[alias]
    assert isinstance(res, RunResult) or (isinstance(res, NodeError) and res.kind.startswith("hostkey")), res
    return isinstance(res, RunResult)


def _line(sshlab: SshLab, node: str, pub: str | None = None) -> str:
    return f"[127.0.0.1]:{sshlab.nodes[node].port} {pub or sshlab.nodes[node].host_pub}\n"


@needs_sshd
def test_a_file_named_none_is_never_read(sshlab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`UserKnownHostsFile none` / `GlobalKnownHostsFile none`: no file. A file named `none` in the current
    directory holding the host's true key trusts nothing: ssh refuses the host, and so does sparkctl."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "none").write_text(_line(sshlab, "n1"))
    monkeypatch.chdir(cwd)
    cfg = _config(sshlab, tmp_path, "Host n1\n  UserKnownHostsFile none\n  GlobalKnownHostsFile none\n")
    assert _real_ssh_ok(cfg, "n1", cwd) is False
    assert _sparkctl_ok(cfg, "n1") is False
    with Cluster(["n1"], cfg, connect_timeout=5) as cluster:
        err = cluster.run_all(["true"])["n1"]
    assert isinstance(err, NodeError) and err.fix and "UserKnownHostsFile none" in err.fix


@needs_sshd
@pytest.mark.parametrize(("setting", "file"), [("rel/kh", "rel/kh"), ("kh-%%h", "kh-%h"), ("./none", "none")])
def test_a_relative_known_hosts_file_is_read_from_the_current_directory_as_ssh_reads_it(
        sshlab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, file: str) -> None:
    """The host's key only in `file` under one directory: from there ssh and sparkctl both trust it; from
    another directory (where the file the name would be after a second %-expansion holds another key)
    both refuse it."""
    other = _keygen(tmp_path / "other")
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    for d in (here, elsewhere):
        d.mkdir()
        (d / "kh-127.0.0.1").write_text(_line(sshlab, "n1", " ".join(other.split()[:2])))
    (here / file).parent.mkdir(parents=True, exist_ok=True)
    (here / file).write_text(_line(sshlab, "n1"))
    cfg = _config(sshlab, tmp_path, f"Host n1\n  UserKnownHostsFile {setting}\n  GlobalKnownHostsFile /dev/null\n")
    for cwd, trusted in ((here, True), (elsewhere, False)):
        monkeypatch.chdir(cwd)
        assert _real_ssh_ok(cfg, "n1", cwd) is trusted, cwd
        assert _sparkctl_ok(cfg, "n1") is trusted, cwd


@needs_sshd
def test_trust_never_writes_a_file_named_none(sshlab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """With `UserKnownHostsFile none` there is no file to record a key in: `trust` says so and how to fix it
    (exit 2, one error line), writing nothing, before it connects."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "none").write_text("# not a known_hosts file\n")
    cfg = _config(sshlab, tmp_path, "Host n1\n  UserKnownHostsFile none\n")
    before = sorted(os.listdir(tmp_path))
    code, out = _trust(monkeypatch, capsys, cfg, "n1", "--yes")
    assert code == 2, out
    assert "UserKnownHostsFile none" in out and "fix:" in out
    assert "Traceback" not in out and "SHA256:" not in out  # refused before connecting
    assert (tmp_path / "none").read_text() == "# not a known_hosts file\n"
    assert sorted(os.listdir(tmp_path)) == before


def _trust(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cfg: Path, *args: str,
           answer: str = "") -> tuple[int, str]:
    """`sparkctl --ssh-config CFG trust ARGS` as a user runs it (cli.main: its exit status, stdout and stderr
    together), `answer` on stdin."""
    monkeypatch.setattr("sys.stdin", io.StringIO(answer))
    with pytest.raises(SystemExit) as exc:
        main(["--ssh-config", str(cfg), "trust", *args])
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out + err


# ------------------------------------------------------------------------------------- a changed host key


def _keygen_l(path: Path) -> list[str]:
    """`ssh-keygen -l -f FILE`: one `SHA256:...` per key (a known_hosts file or a .pub)."""
    out = subprocess.run(["ssh-keygen", "-l", "-f", str(path)], capture_output=True, text=True, check=True,
                         timeout=20).stdout
    return [line.split()[1] for line in out.splitlines()]


@needs_sshd
def test_trust_refuses_a_changed_key_naming_both_fingerprints_unless_told_to_replace(
        sshlab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    n2 = sshlab.nodes["n2"]
    old = _keygen(tmp_path / "old")
    stranger = _keygen(tmp_path / "stranger")
    known = tmp_path / "known_hosts"
    keep = ["# my hosts", f"[127.0.0.1]:{n2.port + 1} {' '.join(old.split()[:2])}",  # another host's line
            f"@cert-authority [127.0.0.1]:{n2.port} {' '.join(stranger.split()[:2])}"]
    text = "\n".join([keep[0], f"[127.0.0.1]:{n2.port} {' '.join(old.split()[:2])} old-comment", *keep[1:]]) + "\n"
    known.write_text(text)
    cfg = tmp_path / "ssh_config"
    cfg.write_text(sshlab.ssh_config.read_text().replace(str(sshlab.known_hosts), str(known)))
    old_fp = _keygen_l(tmp_path / "old.pub")[0]
    new_fp = _keygen_l(n2.dir / "host_ed25519.pub")[0]

    for args, answer in ((["--yes"], ""), ([], "y\n")):
        code, out = _trust(monkeypatch, capsys, cfg, "n2", *args, answer=answer)
        assert code == 1, out
        assert old_fp in out and new_fp in out and "--replace" in out and "Traceback" not in out, out
        assert known.read_text() == text  # nothing written
    assert _real_ssh_ok(cfg, "n2", tmp_path) is False and _sparkctl_ok(cfg, "n2") is False

    code, out = _trust(monkeypatch, capsys, cfg, "n2", "--replace", answer="n\n")
    assert code == 1 and known.read_text() == text, out  # asked, declined: nothing written

    code, out = _trust(monkeypatch, capsys, cfg, "n2", "--replace", "--yes")
    assert code == 0, out
    assert old_fp in out and new_fp in out
    assert known.read_text().splitlines() == [*keep, f"[127.0.0.1]:{n2.port} {n2.host_pub}"]
    assert _real_ssh_ok(cfg, "n2", tmp_path) is True and _sparkctl_ok(cfg, "n2") is True
