"""`model sync`'s copy as the source runs it: modelsync.rsync_argv with the real rsync and ssh, to a private
OpenSSH server whose authorized_keys holds the sync key's line (modelsync.authorized_line: `restrict`, from
the source's address only). MODEL may be any path, shell syntax included: it must arrive as a path."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkctl.checkpoint import sync_plan as modelsync
from tests.unit.test_cluster import SSHD, Sshd, _free_port, _keygen

pytestmark = pytest.mark.skipif(
    not (SSHD and shutil.which("rsync") and shutil.which("ssh") and os.geteuid() == 0),
    reason="needs OpenSSH's sshd, ssh and rsync, run as root",
)

HOSTILE = "m x;$(touch CANARY) `touch CANARY` 'q' \"d\" * ? & | > ~"


@dataclass
class Rank:
    sshd: Sshd
    key: Path
    known_hosts: Path


@pytest.fixture()
def rank(tmp_path: Path) -> Iterator[Rank]:
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    d = tmp_path / "rank"
    d.mkdir()
    pub = _keygen(tmp_path / "sync_ed25519")
    line = modelsync.authorized_line(pub, "127.0.0.1", modelsync.key_tag("c", "src"))
    (d / "authorized_keys").write_text(line + "\n")
    host_pub = _keygen(d / "host_ed25519")
    port = _free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_ed25519\nPidFile {d}/sshd.pid\n"
        f"AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nLogLevel INFO\n")
    known = tmp_path / "sync_known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {' '.join(host_pub.split()[:2])}\n")
    s = Sshd("rank", port, d, host_pub)
    try:
        s.start()
    except RuntimeError as exc:
        pytest.skip(f"cannot run a private sshd here: {exc}")
    try:
        yield Rank(s, tmp_path / "sync_ed25519", known)
    finally:
        s.stop()


# rsync before 3.2.4 put the remote arguments on the remote shell's command line as they were; later ones
# escape them, unless RSYNC_OLD_ARGS=1 (or --old-args) asks for the old way: that is how an older source
# is played here.
OLD_RSYNC = {"RSYNC_OLD_ARGS": "1"}


def _run(argv: list[str], port: int, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The argv as the source runs it; only the port is added to its ssh (the rank's sshd is not on 22)."""
    argv = list(argv)
    i = argv.index("-e") + 1
    argv[i] = shlex.join([*shlex.split(argv[i]), "-p", str(port)])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd, env={**os.environ, **env})


def _scene(tmp_path: Path, name: str = HOSTILE) -> tuple[Path, Path, Path]:
    src = tmp_path / "src"
    src.mkdir(parents=True)
    (src / "a.bin").write_bytes(b"shard bytes")
    dst = tmp_path / "dst" / name.replace("CANARY", str(tmp_path / "canary"))
    lst = tmp_path / "sync.list"
    lst.write_bytes(modelsync.files_list(["a.bin"]))
    return src, dst, lst


def test_the_rsync_argv_sends_its_arguments_through_the_protocol() -> None:
    """On an rsync older than 3.2.4 the remote shell reads the destination: `-s` (--protect-args, today
    --secluded-args) sends it through rsync's protocol on every version."""
    argv = modelsync.rsync_argv("/m", "root", "10.0.0.2", "/m", "l", "k", "kh")
    assert "-s" in argv[: argv.index("-e")]
    assert "--old-args" not in argv


@pytest.mark.parametrize("env", [{}, OLD_RSYNC], ids=["rsync", "rsync-before-3.2.4"])
def test_a_destination_full_of_shell_syntax_arrives_verbatim(rank: Rank, tmp_path: Path, env: dict[str, str]) -> None:
    src, dst, lst = _scene(tmp_path)
    argv = modelsync.rsync_argv(str(src), "root", "127.0.0.1", str(dst), str(lst), str(rank.key), str(rank.known_hosts))
    r = _run(argv, rank.sshd.port, tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert (dst / "a.bin").read_bytes() == b"shard bytes"
    assert not list(tmp_path.glob("canary*")) and not list(Path.home().glob("canary*"))
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == [dst.relative_to(tmp_path / "dst").parts[0]]


def test_without_protection_an_old_rsync_lets_the_rank_s_shell_read_the_destination(rank: Rank, tmp_path: Path) -> None:
    """Why `-s` (and proof that the old way is really played above): the same copy without `-s`, from a
    source that sends the destination on the remote shell's command line, runs the path's `$(…)` there."""
    src, dst, lst = _scene(tmp_path, "m x;$(touch CANARY)")
    argv = modelsync.rsync_argv(str(src), "root", "127.0.0.1", str(dst), str(lst), str(rank.key), str(rank.known_hosts))
    old = [a for a in argv if a not in ("-s", "--protect-args", "--secluded-args")]
    _run(old, rank.sshd.port, tmp_path, OLD_RSYNC)
    assert (tmp_path / "canary").exists()  # the rank's shell ran it
    assert not (dst / "a.bin").exists()


def test_a_planned_name_with_a_newline_is_one_file_of_the_list(rank: Rank, tmp_path: Path) -> None:
    """The list crosses to rsync NUL-framed (`--from0`): a file named `x<LF>a.bin` is sent as itself, and
    `a.bin`, not planned, is not sent."""
    src, dst, lst = _scene(tmp_path, "m")
    odd = "x\na.bin"
    (src / odd).write_bytes(b"odd")
    lst.write_bytes(modelsync.files_list([odd]))
    argv = modelsync.rsync_argv(str(src), "root", "127.0.0.1", str(dst), str(lst), str(rank.key), str(rank.known_hosts))
    r = _run(argv, rank.sshd.port, tmp_path, {})
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in dst.iterdir()) == [odd]
