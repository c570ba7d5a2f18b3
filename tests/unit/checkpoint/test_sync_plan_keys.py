"""`model sync`'s key install on a rank: the real script (modelsync.INSTALL_KEY) under the real `sh`, grep and
awk, on a temporary HOME, in a UTF-8 locale (where GNU grep calls a line with one Latin-1 byte binary).
Every line that is not this source's sync key survives byte for byte; the file keeps its mode, owner and
symlink; an error is an exit status, never a quiet "installed"."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from sparkctl.checkpoint import sync_plan as modelsync

TAG = modelsync.key_tag("c", "spark1")
LINE = modelsync.authorized_line("ssh-ed25519 AAAAC3NzaNEW sparkctl-sync@c", "10.0.0.1", TAG)
OPERATOR = (
    b"ssh-ed25519 AAAAC3NzaOP1 operator@caf\xe9\n"                                      # Latin-1: not UTF-8
    b'restrict,from="10.0.0.10" ssh-ed25519 AAAAC3NzaTEN sparkctl-sync:c:spark10\n'    # another source
    b"ssh-rsa AAAAB3NzaOP2 sparkctl-sync:c:spark1-is-not-me\n"
    b"# a comment naming sparkctl-sync:c:spark1 in the middle\n"
    b"\n"
    b"ssh-ed25519 AAAAC3NzaOP3 crlf@host\r\n"
)
OLD_OWN = b'restrict,from="10.0.0.99" ssh-ed25519 AAAAC3NzaOLD ' + TAG.encode() + b"\n"


def _install(home: Path, *, path: str | None = None, line: str = LINE) -> subprocess.CompletedProcess[bytes]:
    env = {"HOME": str(home), "PATH": path or os.environ.get("PATH", "/usr/bin:/bin"),
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    return subprocess.run(["sh", "-c", modelsync.INSTALL_KEY, "sh", line, TAG], env=env, capture_output=True,
                          timeout=30)


@pytest.fixture()
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    (h / ".ssh").mkdir(parents=True)
    return h


def test_the_utf8_locale_really_calls_the_latin1_line_binary(home: Path) -> None:
    """The premise: without LC_ALL=C, GNU grep in this locale does not print that line back."""
    f = home / "f"
    f.write_bytes(OPERATOR)
    r = subprocess.run(["grep", "-v", "nothing-matches-this", str(f)], capture_output=True,
                       env={"PATH": os.environ.get("PATH", ""), "LC_ALL": "C.UTF-8"})
    if r.stdout == OPERATOR:
        pytest.skip("this grep prints non-UTF-8 lines in a UTF-8 locale")
    assert r.stdout != OPERATOR


def test_every_other_line_survives_byte_for_byte_and_only_the_own_tag_is_replaced(home: Path) -> None:
    f = home / ".ssh" / "authorized_keys"
    f.write_bytes(OPERATOR + OLD_OWN)
    r = _install(home)
    assert r.returncode == 0 and r.stdout == b"installed\n", r
    assert f.read_bytes() == OPERATOR + LINE.encode() + b"\n"
    # run again: nothing changes
    r = _install(home)
    assert r.returncode == 0 and r.stdout == b"present\n", r
    assert f.read_bytes() == OPERATOR + LINE.encode() + b"\n"


def test_a_new_file_is_made_private(home: Path) -> None:
    r = _install(home)
    f = home / ".ssh" / "authorized_keys"
    assert r.returncode == 0, r
    assert f.read_bytes() == LINE.encode() + b"\n"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600


def test_a_last_line_without_newline_is_kept_whole(home: Path) -> None:
    f = home / ".ssh" / "authorized_keys"
    f.write_bytes(b"ssh-ed25519 AAAAC3NzaOP1 no-newline")
    assert _install(home).returncode == 0
    assert f.read_bytes() == b"ssh-ed25519 AAAAC3NzaOP1 no-newline\n" + LINE.encode() + b"\n"


def test_a_symlinked_file_is_written_through_keeping_mode_and_owner(home: Path, tmp_path: Path) -> None:
    real_dir = tmp_path / "managed"
    real_dir.mkdir()
    real = real_dir / "keys"
    real.write_bytes(OPERATOR)
    os.chmod(real, 0o640)
    if os.geteuid() == 0:
        os.chown(real, 4321, 8765)
    link = home / ".ssh" / "authorized_keys"
    link.symlink_to(real)
    r = _install(home)
    assert r.returncode == 0, r
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == OPERATOR + LINE.encode() + b"\n"
    st = real.stat()
    assert stat.S_IMODE(st.st_mode) == 0o640
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (4321, 8765)
    assert sorted(p.name for p in real_dir.iterdir()) == ["keys"]  # no temp file left beside it
    assert sorted(p.name for p in (home / ".ssh").iterdir()) == ["authorized_keys"]


@pytest.mark.parametrize("tool", ["grep", "awk"])
def test_a_failing_tool_fails_the_install_and_leaves_the_file_alone(home: Path, tmp_path: Path, tool: str) -> None:
    """grep or awk exiting with an error (unreadable file, I/O error) is an exit status the flow reports,
    never "installed" over a file rewritten from partial output."""
    shims = tmp_path / "bin"
    shims.mkdir()
    shim = shims / tool
    shim.write_text("#!/bin/sh\necho \"$0: simulated read error\" >&2\nexit 2\n")
    shim.chmod(0o755)
    f = home / ".ssh" / "authorized_keys"
    f.write_bytes(OPERATOR + OLD_OWN)
    r = _install(home, path=f"{shims}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    assert r.returncode != 0 and b"installed" not in r.stdout, r
    assert f.read_bytes() == OPERATOR + OLD_OWN
    assert sorted(p.name for p in (home / ".ssh").iterdir()) == ["authorized_keys"]


def test_the_flow_names_the_node_whose_install_failed_and_how_to_fix_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flow's key step on local nodes (every script really runs under `sh`): one rank whose awk fails
    makes it stop with that node, the tool's words and a fix; its authorized_keys is unchanged."""
    from types import SimpleNamespace

    from sparkctl.cluster import Cluster, NodeError
    from sparkctl.cluster.channel import Node
    from sparkctl.orchestrate import model_sync
    from tests.unit.localnodes import local_nodes

    names = ["spark1", "spark2", "spark10"]
    with local_nodes(monkeypatch, tmp_path / "lab", names) as ln:
        monkeypatch.setattr(Node, "host_key", lambda self: ("ssh-ed25519", "AAAAC3NzaHOST"))
        for n in names[1:]:
            (ln.home(n) / ".ssh").mkdir()
            (ln.home(n) / ".ssh" / "authorized_keys").write_bytes(OPERATOR)
        broken = tmp_path / "lab" / "hw" / "spark10" / "bin" / "awk"
        broken.write_text("#!/bin/sh\necho 'awk: read error (simulated)' >&2\nexit 2\n")
        broken.chmod(0o755)
        ips = {"spark1": "10.0.0.1", "spark2": "10.0.0.2", "spark10": "10.0.0.10"}
        with Cluster(names, str(tmp_path / "lab" / "ssh_config")) as cluster, pytest.raises(NodeError) as err:
            model_sync._setup_auth(cluster, SimpleNamespace(cluster_name="c"), "spark1", names[1:], ips)
        assert err.value.node == "spark10" and "awk could not read" in err.value.reason
        assert "sparkctl model sync" in (err.value.fix or "")
        assert (ln.home("spark10") / ".ssh" / "authorized_keys").read_bytes() == OPERATOR
        got = (ln.home("spark2") / ".ssh" / "authorized_keys").read_bytes()
        assert got.startswith(OPERATOR) and got.endswith(TAG.encode() + b"\n") and got.count(b"\n") == 7
