"""The SSH layer's rules that its own tests left unstated (what its mutation run, bench/mutation.py, showed
untested): HostKeyAlias and the ProxyJump bound of `ssh -G` resolution, what authentication failures say,
each node through its own hop, host certificates judged by the CA known_hosts names, trust never
writing through a planted file, a ProxyCommand's end and its last words, and the bounds of a Session
and a Stream on real OpenSSH servers (test_cluster.py's sshlab)."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import paramiko
import pytest

from sparkctl.cluster import Cluster, NodeError, certs, hostkeys, proxycommand, transport
from sparkctl.cluster.channel import StreamLost
from sparkctl.cluster.sshconfig import SshConfig, SshTarget, resolve_target
from tests.unit import test_cluster
from tests.unit.test_cluster import SshLab, _drop_connections, _wait_inactive

sshlab = test_cluster.sshlab  # the fixture: real OpenSSH servers

needs_ssh = pytest.mark.skipif(not (shutil.which("ssh") and shutil.which("ssh-keygen")),
                               reason="needs OpenSSH's ssh and ssh-keygen")


def _target(tmp_path: Path, **kw: Any) -> SshTarget:
    base: dict[str, Any] = dict(alias="a", hostname="host-a", port=22, user="root", identity_files=(),
                                identities_only=True, known_hosts_files=(str(tmp_path / "known_hosts"),),
                                global_known_hosts_files=())
    return SshTarget(**{**base, **kw})


def _resolve(cfg: Path, alias: str) -> SshTarget:
    return resolve_target(alias, SshConfig(str(cfg), explicit=True), str(cfg))


# ---- ssh -G resolution ---------------------------------------------------------------------------

@needs_ssh
def test_host_key_alias_names_the_known_hosts_entry(tmp_path: Path) -> None:
    """HostKeyAlias (any name, whatever it sorts like) is the name the host key is looked up under."""
    cfg = tmp_path / "config"
    cfg.write_text("Host a\n  HostName 127.0.0.1\n  HostKeyAlias alpha\n")
    assert _resolve(cfg, "a").known_hosts_name == "alpha"


@needs_ssh
def test_a_proxyjump_chain_is_bounded_at_nine_hops(tmp_path: Path) -> None:
    """A chain of 9 ProxyJump hops resolves; one of 10 is refused as a loop (a loop would never end)."""
    cfg = tmp_path / "config"
    cfg.write_text("".join(f"Host h{k}\n  HostName 127.0.0.1\n  ProxyJump h{k + 1}\n" for k in range(10))
                   + "Host h10\n  HostName 127.0.0.1\n")
    assert [j.alias for j in _resolve(cfg, "h1").jumps] == [f"h{k}" for k in range(10, 1, -1)]
    with pytest.raises(NodeError, match="too deep"):
        _resolve(cfg, "h0")


def test_an_unresolvable_alias_quotes_the_last_400_characters_ssh_said(monkeypatch: pytest.MonkeyPatch) -> None:
    said = ["Pseudo-terminal will not be allocated because stdin is not a terminal.", "x" * 300, "y" * 300]

    def run(argv: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 255, "", "\n".join(said) + "\n")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(NodeError) as exc:
        resolve_target("a", SshConfig("/x/config", explicit=True))
    assert exc.value.node == "a" and exc.value.kind == "config"
    assert exc.value.reason == "ssh cannot resolve 'a': " + ("x" * 300 + " | " + "y" * 300)[-400:]


# ---- authentication: what a refusal says ---------------------------------------------------------

@pytest.fixture
def no_keys(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/id_*: nothing to offer
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


def _authenticate(target: SshTarget) -> NodeError:
    with pytest.raises(NodeError) as exc:
        transport._authenticate(None, target, transport.KeyCache())  # type: ignore[arg-type]  # nothing to offer
    return exc.value


@pytest.mark.usefixtures("no_keys")
def test_a_pkcs11_provider_is_named_as_unsupported_with_what_else_was_tried(tmp_path: Path) -> None:
    missing = tmp_path / "id-cert.pub"
    err = _authenticate(_target(tmp_path, pkcs11_provider="/usr/lib/opensc-pkcs11.so", certificate_files=(str(missing),)))
    assert err.node == "a" and err.kind == "unsupported"
    assert "PKCS11Provider /usr/lib/opensc-pkcs11.so is set" in err.reason
    assert err.reason.endswith(f"for root@host-a (CertificateFile {missing}: no such file)")
    assert "ssh-keygen -t ed25519" in (err.fix or "")


@pytest.mark.usefixtures("no_keys")
def test_no_key_accepted_says_where_to_put_the_public_key(tmp_path: Path) -> None:
    err = _authenticate(_target(tmp_path))
    assert err.kind == "auth" and "(no keys found)" in err.reason
    assert err.fix == "add your public key to ~root/.ssh/authorized_keys on a, or set IdentityFile for 'a' in the ssh config"



@needs_ssh
@pytest.mark.usefixtures("no_keys")
def test_a_missing_identity_file_is_named_as_ssh_names_it(tmp_path: Path) -> None:
    """An IdentityFile the ssh config names that is not there: ssh says `no such identity: PATH`; the fix is
    that path (create the key or fix it), not "set IdentityFile" (it is set). The defaults `ssh -G` lists
    when none is set are not named."""
    missing = tmp_path / "keys" / "id_gone"
    cfg = tmp_path / "config"
    cfg.write_text(f"Host a\n  HostName host-a\n  User root\n  IdentityFile {missing}\n  IdentitiesOnly yes\n"
                   "Host b\n  HostName host-b\n  User root\n")
    target = _resolve(cfg, "a")
    assert target.missing_identity_files == (str(missing),) and target.identity_files == ()
    assert _resolve(cfg, "b").missing_identity_files == ()
    err = _authenticate(target)
    assert err.kind == "auth" and f"no such identity: {missing}" in err.reason
    assert err.fix == (f"the IdentityFile {missing} (from the ssh config {cfg}) does not exist: create the key or "
                       "fix the path")


# ---- connecting: the error kinds, the hops -------------------------------------------------------

@pytest.mark.parametrize(("exc", "kind"), [(TimeoutError(), "timeout"), (ConnectionResetError(104, "reset"), "unreachable")])
def test_a_socket_error_is_classified_by_what_it_is(tmp_path: Path, exc: OSError, kind: str) -> None:
    err = transport._classify_socket_error(_target(tmp_path), exc)
    assert err.node == "a" and err.kind == kind and "host-a:22" in err.reason


def test_a_jump_host_that_drops_the_channel_is_the_nodes_error(tmp_path: Path) -> None:
    class Jump:
        def open_channel(self, *a: object, **kw: object) -> None:
            raise EOFError()

    with pytest.raises(NodeError) as exc:
        transport._through(Jump(), _target(tmp_path, hostname="10.0.0.9", port=2222), 1.0)  # type: ignore[arg-type]
    assert exc.value.node == "a" and exc.value.kind == "unreachable"
    assert "10.0.0.9:2222" in exc.value.reason and "ProxyJump host" in (exc.value.fix or "")


def test_each_node_goes_through_its_own_jump_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes behind two different hops: each gets its own hop's connection, never the other's."""
    monkeypatch.setattr(transport, "connect", lambda hop, **kw: f"connection to {hop.hostname}")
    jumps = transport.Jumps()
    hop_a, hop_b = _target(tmp_path, alias="ja", hostname="jump-a"), _target(tmp_path, alias="jb", hostname="jump-b")
    keys = transport.KeyCache()
    assert jumps.via([hop_a], timeout=1.0, keys=keys) == "connection to jump-a"
    assert jumps.via([hop_b], timeout=1.0, keys=keys) == "connection to jump-b"
    assert jumps.via([hop_a, hop_b], timeout=1.0, keys=keys) == "connection to jump-b"


# ---- certificates --------------------------------------------------------------------------------

def _keygen(path: Path) -> bytes:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, timeout=20)
    return base64.b64decode(path.with_name(path.name + ".pub").read_text().split()[1])


def _host_cert(tmp_path: Path, ca: Path, validity: str) -> certs.Cert:
    host = tmp_path / f"host-{validity.replace(':', '_')}"
    _keygen(host)
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", "node-a", "-h", "-n", "host-a", "-V", validity,
                    str(host) + ".pub"], check=True, timeout=20)
    return certs.parse_cert(base64.b64decode(Path(str(host) + "-cert.pub").read_text().split()[1]))


@needs_ssh
def test_a_host_certificate_is_read_and_its_validity_told_in_dates(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    _keygen(ca)
    now = _host_cert(tmp_path, ca, "-1h:+1h")
    assert (now.key_id, now.principals, now.key_type) == ("node-a", ("host-a",), "ssh-ed25519")
    assert now.validity() is None and now.signature_ok()
    old = _host_cert(tmp_path, ca, "20200101:20200102")
    assert old.validity() == "expired 2020-01-02 00:00:00 UTC"
    assert old.validity(now=old.valid_after - 1) == "not valid before 2020-01-01 00:00:00 UTC"
    blob = base64.b64decode(Path(str(tmp_path / "host--1h_+1h") + "-cert.pub").read_text().split()[1])
    for cut in (4, len(blob) - 1):  # a length with nothing after it; a signature one byte short
        with pytest.raises(certs.CertError, match="truncated"):
            certs.parse_cert(blob[:cut])
    with pytest.raises(certs.CertError, match="truncated"):
        certs.parse_cert(blob[:4] + b"\x00\x00\x00\x01")  # a 1-byte string that is not there


@needs_ssh
def test_a_host_certificate_is_trusted_only_through_the_ca_known_hosts_names(tmp_path: Path) -> None:
    ca1, ca2 = tmp_path / "ca1", tmp_path / "ca2"
    blobs = {ca1: _keygen(ca1), ca2: _keygen(ca2)}
    low, high = sorted(blobs, key=lambda p: blobs[p])
    known = tmp_path / "known_hosts"
    target = _target(tmp_path)
    cert = _host_cert(tmp_path, low, "-1h:+1h")
    # the CA that signed it is trusted for the host: trusted
    known.write_text(f"@cert-authority host-a ssh-ed25519 {base64.b64encode(blobs[low]).decode()}\n")
    assert hostkeys.judge_host_key(target, "ssh-ed25519-cert-v01@openssh.com", cert.key_blob, cert).status == "trusted"
    # another CA (whatever its key sorts like) is trusted: the certificate counts for nothing, its key is unknown
    known.write_text(f"@cert-authority host-a ssh-ed25519 {base64.b64encode(blobs[high]).decode()}\n")
    assert hostkeys.judge_host_key(target, "ssh-ed25519-cert-v01@openssh.com", cert.key_blob, cert).status == "unknown"


# ---- trust: the known_hosts rewrite --------------------------------------------------------------

def test_trust_never_writes_through_a_file_planted_at_its_temporary_name(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    known, victim = tmp_path / "known_hosts", tmp_path / "victim"
    known.write_text("other ssh-ed25519 AAAA\n")
    victim.write_text("precious\n")
    monkeypatch.setattr(hostkeys.secrets, "token_hex", lambda n: "feedbeef")
    (tmp_path / ".known_hosts.sparkctl-feedbeef").symlink_to(victim)
    with pytest.raises(FileExistsError):
        hostkeys.record_host_key(_target(tmp_path), "ssh-ed25519", os.urandom(51))
    assert victim.read_text() == "precious\n" and known.read_text() == "other ssh-ed25519 AAAA\n"


# ---- ProxyCommand --------------------------------------------------------------------------------

def test_a_proxycommand_is_ended_by_close_and_its_own_end_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHELL", "/bin/sh")
    running = proxycommand.ProxyCommandSocket("sleep 30", "n1")
    try:
        started = time.monotonic()
        running.close()
        assert running.closed and time.monotonic() - started < 10
        assert running.exited() is None  # close() ended it: its status says nothing about the command
    finally:
        if running.process.poll() is None:
            running.process.kill()
            running.process.wait(5)
    ended = proxycommand.ProxyCommandSocket("sh -c 'for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo line$i >&2; done; exit 3'", "n1")
    ended.process.wait(10)
    assert ended.exited() == 3
    assert ended.why() == " | ".join(f"line{i}" for i in range(5, 13))  # its last 8 lines
    ended.close()


# ---- Session and Stream on real sshd -------------------------------------------------------------

def test_a_session_is_bounded_by_its_timeout_and_says_which_command(sshlab: SshLab) -> None:
    with Cluster(["n1"], sshlab.ssh_config) as cluster:
        node = cluster.node("n1")
        r = node.start(["sleep", "0.3"], timeout=30).finish()
        assert r.ok and 0.3 <= r.elapsed < 30
        s = node.start(["sh", "-c", "sleep 6; : " + "x" * 500], timeout=1.5)
        started = time.monotonic()
        with pytest.raises(NodeError) as exc:
            s.read_until(b"NEVER")  # the command outlives its timeout: the timeout ends the wait
        assert time.monotonic() - started < 5
        err = exc.value
        assert err.node == "n1" and err.kind == "command-timeout" and "raise the timeout" in (err.fix or "")
        quoted = err.reason.split("`")[1]
        assert len(quoted) == 120 and quoted.endswith("...") and quoted.startswith("sh -c")


def _bounded(fn: Any, seconds: float = 20) -> Any:
    """fn() in a thread, which must end within `seconds` (a read that spins is a failure, not a hang)."""
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert box, f"did not return within {seconds}s"
    return box[0]


def test_a_stream_read_returns_at_most_its_limit_and_waits_for_output(sshlab: SshLab) -> None:
    with Cluster(["n1"], sshlab.ssh_config) as cluster:
        node = cluster.node("n1")
        with node.open_stream(["sh", "-c", "sleep 0.3; echo hi"]) as s:
            assert _bounded(lambda: s.read(10)) == (b"hi\n", b"")  # waits for it, however long it takes
        with node.open_stream(["sh", "-c", "head -c 1500000 /dev/zero; echo done >&2; sleep 5"]) as s:
            got, err = bytearray(), b""
            deadline = time.monotonic() + 20
            while b"done" not in err and time.monotonic() < deadline:  # 1 byte of stdout per read
                out, e = s.read(0.2, limit=1)
                got += out
                err += e
            assert b"done" in err
            out, _ = _bounded(lambda: s.read(limit=300_000))  # more than that has arrived
            assert len(out) == 300_000
            got += out
            out, _ = _bounded(lambda: s.read())  # by default, at most 1 MiB at once
            assert len(out) == 1 << 20
            got += out
            while len(got) < 1_500_000 and time.monotonic() < deadline:
                got += s.read(0.2)[0]
            assert got == b"\0" * 1_500_000


def test_a_stream_whose_command_cannot_start_is_lost(sshlab: SshLab, monkeypatch: pytest.MonkeyPatch) -> None:
    class Chan:
        closed = False

        def settimeout(self, t: float | None) -> None: ...

        def exec_command(self, command: str) -> None:
            raise OSError("Socket is closed")

        def close(self) -> None:
            self.closed = True

    chan = Chan()
    with Cluster(["n1"], sshlab.ssh_config) as cluster:
        node = cluster.node("n1")
        monkeypatch.setattr(node, "_channel", lambda timeout: chan)
        with pytest.raises(StreamLost) as exc:
            node.open_stream(["true"])
        assert exc.value.kind == "lost" and exc.value.node == "n1" and chan.closed
        # a connection that is fine said no such cause (nothing "had ended")
        assert exc.value.reason == "SSH connection lost: Socket is closed"


def test_threads_that_find_one_dead_connection_share_its_one_reconnect(sshlab: SshLab) -> None:
    with Cluster(["n1"], sshlab.ssh_config) as cluster:
        node = cluster.node("n1")
        dead = node._transport
        _drop_connections(sshlab.nodes["n1"])
        _wait_inactive(node)
        assert node.run(["true"]).ok and node.reconnects == 1  # this thread reconnected
        fresh = node._transport
        assert fresh is not dead and isinstance(fresh, paramiko.Transport)
        assert node._fresh_transport(dead) is fresh  # another that held the dead one gets the new one
