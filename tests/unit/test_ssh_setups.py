"""The SSH setups people reach their nodes with, on real OpenSSH servers (test_cluster.py's sshlab, and
one sshd of its own for certificates): ProxyCommand run as ssh(1) runs it, user certificates
(CertificateFile, `-cert.pub`), host certificates trusted through known_hosts `@cert-authority`, and
what stays unsupported refused by name.

ProxyCommand goes through the real `nc` (netcat-openbsd): skipped where it is missing and CI is not set;
.ci/run installs it, so under CI a missing nc fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkctl import cluster as cl
from sparkctl.cluster import Cluster, NodeError, RunResult
from tests.unit import test_cluster
from tests.unit.test_cluster import SSHD, Sshd, SshLab, _config, _free_port, _keygen

sshlab = test_cluster.sshlab  # the fixture: real OpenSSH servers

pytestmark = pytest.mark.skipif(
    not (shutil.which("ssh-keygen") and os.geteuid() == 0), reason="needs OpenSSH's sshd and ssh-keygen, run as root"
)


def _nc() -> str:
    path = shutil.which("nc")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("nc is not installed, and CI installs it (.ci/run): the ProxyCommand tests need it")
        pytest.skip("nc is not installed (apt-get install netcat-openbsd): these tests run a real ProxyCommand")
    return path


def _proxy_script(tmp_path: Path) -> tuple[Path, Path]:
    """A ProxyCommand that records its arguments and pid, then becomes `nc 127.0.0.1 PORT` (its 2nd argument)."""
    log = tmp_path / "proxy.log"
    script = tmp_path / "proxy.sh"
    script.write_text(f'#!/bin/sh\necho "$$ $*" >> {log}\nexec {_nc()} 127.0.0.1 "$2"\n')
    script.chmod(0o755)
    return script, log


def _known(sshlab: SshLab, tmp_path: Path, extra: str) -> Path:
    known = tmp_path / "known_hosts"
    known.write_text(sshlab.known_hosts.read_text() + extra)
    return known


# ------------------------------------------------------------------------------------------- ProxyCommand


def test_proxycommand_carries_the_connection_with_tokens_as_ssh_expands_them(
        sshlab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's HostName does not resolve: only the command can reach it. The command is run by the
    shell (its $VARIABLE expanded there) and gets %h %p %r %n %k and %% exactly as the real `ssh` gives
    them (the same script, run by ssh, records the same line); it runs in its own process group (a
    Ctrl-C at the terminal leaves the tunnel to cleanup) and is gone once the Cluster closes. The host
    key is still judged, under the HostName's known_hosts name."""
    n2 = sshlab.nodes["n2"]
    script, log = _proxy_script(tmp_path)
    monkeypatch.setenv("SPARKCTL_TEST_PROXY", str(script))
    known = _known(sshlab, tmp_path, f"[n2.behind.tunnel]:{n2.port} {n2.host_pub}\n")
    cfg = _config(sshlab, tmp_path, f"Host viacmd\n  HostName n2.behind.tunnel\n  Port {n2.port}\n"
                                     "  ProxyCommand $SPARKCTL_TEST_PROXY %h %p %r %n %k 100%%\n", known=known)
    before = n2.accepted()
    with Cluster(["viacmd"], cfg, connect_timeout=5) as cluster:
        r = cluster.run_all(["sh", "-c", "echo $SPARKCTL_TEST_NODE"])["viacmd"]
        assert not isinstance(r, NodeError) and r.stdout.strip() == "n2", r
        pid = int(log.read_text().split()[0])
        assert os.getpgid(pid) == pid != os.getpgid(0)  # its own group: the terminal's ^C is not its
    assert n2.accepted() == before + 1
    ours = log.read_text().split(maxsplit=1)[1]
    assert ours == f"n2.behind.tunnel {n2.port} root viacmd viacmd 100%\n", ours
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "the ProxyCommand outlived the Cluster"
    # the real ssh, same config: the same arguments
    log.unlink()
    subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", "viacmd", "true"], stdin=subprocess.DEVNULL,
                   capture_output=True, timeout=30, check=True)
    assert log.read_text().split(maxsplit=1)[1] == ours


def test_proxycommand_host_key_is_still_verified(sshlab: SshLab, tmp_path: Path) -> None:
    n2 = sshlab.nodes["n2"]
    script, log = _proxy_script(tmp_path)
    cfg = _config(sshlab, tmp_path, f"Host viacmd\n  HostName n2.behind.tunnel\n  Port {n2.port}\n"
                                     f"  ProxyCommand {script} %h %p\n")
    before = n2.accepted()
    with Cluster(["viacmd"], cfg, connect_timeout=5) as cluster:
        err = cluster.run_all(["true"])["viacmd"]
    assert isinstance(err, NodeError) and err.kind == "hostkey-unknown", err
    assert f"[n2.behind.tunnel]:{n2.port}" in err.reason and "trust viacmd" in (err.fix or "")
    assert log.exists() and n2.accepted() == before  # it went through the command, and no further


def test_proxycommand_none_means_direct_and_a_failing_command_says_why(
        sshlab: SshLab, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`ProxyCommand none` first wins over a later ProxyCommand (ssh takes the first value); a command
    that fails is the node's `proxy` error with its exit status and what it said on stderr, which
    also reached our stderr as it came (as under ssh: a tunnel's login prompt must be seen)."""
    canary = tmp_path / "canary"
    n1 = sshlab.nodes["n1"]
    cfg = _config(sshlab, tmp_path, f"Host direct\n  ProxyCommand none\n"
                                     f"Host direct failing\n  HostName 127.0.0.1\n  Port {n1.port}\n"
                                     f"  ProxyCommand sh -c 'touch {canary}; echo tunnel refused by policy >&2; exit 3'\n")
    with Cluster(["direct"], cfg, connect_timeout=5) as cluster:
        assert cluster.node("direct").run(["true"]).ok
    assert not canary.exists()
    with Cluster(["failing"], cfg, connect_timeout=5) as cluster:
        err = cluster.run_all(["true"])["failing"]
    assert canary.exists()
    assert isinstance(err, NodeError) and err.kind == "proxy", err
    assert "exited with status 3" in err.reason and "tunnel refused by policy" in err.reason, err
    assert "ProxyCommand" in (err.fix or "")
    assert "failing: ProxyCommand: tunnel refused by policy" in capsys.readouterr().err


def test_proxycommand_with_a_token_ssh_does_not_expand_is_refused_unrun(
        sshlab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # were it run, `touch … %C` would leave a file named %C here
    canary = tmp_path / "canary"
    cfg = _config(sshlab, tmp_path, f"Host badtok\n  HostName 127.0.0.1\n  ProxyCommand touch {canary} %C\n")
    with Cluster(["badtok"], cfg, connect_timeout=5) as cluster:
        err = cluster.run_all(["true"])["badtok"]
    assert isinstance(err, NodeError) and err.kind == "config", err
    assert "ProxyCommand" in err.reason and "'%C'" in err.reason and not canary.exists()
    # the real ssh refuses it too
    r = subprocess.run(["ssh", "-F", str(_config(sshlab, tmp_path, "")), "-o", f"ProxyCommand=touch {canary} %C",
                        "n1", "true"], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode != 0 and "%C" in r.stderr and not canary.exists()


def test_a_proxyjump_hop_reached_through_its_own_proxycommand(sshlab: SshLab, tmp_path: Path) -> None:
    """`ProxyJump hop` where the hop itself needs a ProxyCommand (a bastion behind a tunnel): the hop
    through its command, the node through the hop, each host key judged."""
    n1, n2 = sshlab.nodes["n1"], sshlab.nodes["n2"]
    script, log = _proxy_script(tmp_path)
    known = _known(sshlab, tmp_path, f"[bastion.behind.tunnel]:{n1.port} {n1.host_pub}\n")
    cfg = _config(sshlab, tmp_path, f"Host bastion\n  HostName bastion.behind.tunnel\n  Port {n1.port}\n"
                                     f"  ProxyCommand {script} %h %p\n"
                                     f"Host inner\n  HostName 127.0.0.1\n  Port {n2.port}\n  ProxyJump bastion\n",
                  known=known)
    with Cluster(["inner"], cfg, connect_timeout=5) as cluster:
        r = cluster.run_all(["sh", "-c", "echo $SPARKCTL_TEST_NODE"])["inner"]
    assert not isinstance(r, NodeError) and r.stdout.strip() == "n2", r
    assert log.read_text().split()[1:] == ["bastion.behind.tunnel", str(n1.port)]


def test_resolve_target_expands_proxycommand_tokens(sshlab: SshLab, tmp_path: Path) -> None:
    cfg = _config(sshlab, tmp_path, "Host tok\n  HostName Tok.Example\n  Port 2201\n  User alice\n"
                                     "  HostKeyAlias tokkey\n  ProxyCommand nc -X connect %h:%p %r %n %k %%h\n")
    t = cl.resolve_target("tok", *cl.load_ssh_config(cfg))
    assert t.proxy_command == "nc -X connect tok.example:2201 alice tok tokkey %h"
    assert cl.resolve_target("n1", *cl.load_ssh_config(cfg)).proxy_command is None


# ----------------------------------------------------------------------------------------- certificates


@dataclass
class CertLab:
    dir: Path
    sshd: Sshd
    user_ca: Path  # signs user certificates (sshd's TrustedUserCAKeys)
    host_ca: Path  # signed the host's certificate (sshd's HostCertificate)
    key: Path  # the client's key: NOT in any authorized_keys; only a certificate opens the door

    def sign_user(self, key: Path, *, principals: str = "root", validity: str = "-5m:+1h", ca: Path | None = None,
                  out: Path | None = None) -> Path:
        """`ssh-keygen -s CA` on key.pub: the certificate next to the key (`KEY-cert.pub`) or at `out`."""
        cert = key.parent / f"{key.name}-cert.pub"
        subprocess.run(["ssh-keygen", "-q", "-s", str(ca or self.user_ca), "-I", f"test-{key.name}", "-n", principals,
                        "-V", validity, f"{key}.pub"], check=True, timeout=20, capture_output=True)
        if out is not None:
            cert.rename(out)
            return out
        return cert

    def config(self, tmp_path: Path, extra: str = "", known: str | None = None, name: str = "ssh_config") -> Path:
        """An ssh config whose alias `certnode` is this sshd; known_hosts: `known` (default: the host CA
        trusted for [127.0.0.1]:*)."""
        kh = tmp_path / f"{name}.known_hosts"
        kh.write_text(known if known is not None else f"@cert-authority [127.0.0.1]:* {_pub(self.host_ca)}\n")
        cfg = tmp_path / name
        cfg.write_text(f"Host certnode\n  HostName 127.0.0.1\n  Port {self.sshd.port}\n  User root\n"
                       f"  IdentitiesOnly yes\n  UserKnownHostsFile {kh}\n  GlobalKnownHostsFile /dev/null\n{extra}")
        return cfg


def _pub(key: Path) -> str:
    return " ".join(Path(f"{key}.pub").read_text().split()[:2])


@pytest.fixture(scope="module")
def certlab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CertLab]:
    """One sshd that accepts users by certificate only (TrustedUserCAKeys, no authorized_keys) and offers
    a host certificate signed by the host CA for the principal 127.0.0.1."""
    if not os.path.exists(SSHD):
        pytest.skip("needs OpenSSH's sshd")
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    base = tmp_path_factory.mktemp("certlab")
    for name in ("user_ca", "host_ca", "id_ed25519", "host_ed25519"):
        _keygen(base / name)
    subprocess.run(["ssh-keygen", "-q", "-s", str(base / "host_ca"), "-I", "certnode-host", "-h", "-n", "127.0.0.1",
                    "-V", "-5m:+1h", str(base / "host_ed25519.pub")], check=True, timeout=20, capture_output=True)
    port = _free_port()
    (base / "sshd_config").write_text(
        f"""Port {port}
ListenAddress 127.0.0.1
HostKey {base}/host_ed25519
HostCertificate {base}/host_ed25519-cert.pub
TrustedUserCAKeys {base}/user_ca.pub
AuthorizedKeysFile none
PidFile {base}/sshd.pid
StrictModes no
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
LogLevel VERBOSE
SetEnv SPARKCTL_TEST_NODE=certnode
"""
    )
    sshd = Sshd("certnode", port, base, _pub(base / "host_ed25519"))
    try:
        sshd.start()
    except RuntimeError as exc:
        sshd.stop()
        pytest.skip(f"cannot run a private sshd here: {exc}")
    yield CertLab(base, sshd, base / "user_ca", base / "host_ca", base / "id_ed25519")
    sshd.stop()


def _run(cfg: Path, alias: str = "certnode") -> RunResult | NodeError:
    with Cluster([alias], cfg, connect_timeout=5) as cluster:
        return cluster.run_all(["sh", "-c", "echo $SPARKCTL_TEST_NODE"])[alias]


def _real_ssh(cfg: Path, alias: str = "certnode") -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", alias, "true"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=30, check=False)


def test_a_user_certificate_opens_the_door_its_plain_key_does_not(certlab: CertLab, tmp_path: Path) -> None:
    """The key is in no authorized_keys: sshd lets it in only with a certificate of the user CA. Named by
    CertificateFile (tokens expanded), or found as the key's own `-cert.pub` (as ssh finds it)."""
    key = tmp_path / "id_ed25519"
    shutil.copy(certlab.key, key)
    shutil.copy(f"{certlab.key}.pub", f"{key}.pub")
    plain = certlab.config(tmp_path, f"  IdentityFile {key}\n", name="plain")
    err = _run(plain)
    assert isinstance(err, NodeError) and err.kind == "auth", err  # the plain key alone: refused
    certlab.sign_user(key, out=tmp_path / "user-root.cert")
    named = certlab.config(tmp_path, f"  IdentityFile {key}\n  CertificateFile {tmp_path}/user-%r.cert\n", name="named")
    before = certlab.sshd.accepted()
    r = _run(named)
    assert isinstance(r, RunResult) and r.stdout.strip() == "certnode", r
    assert certlab.sshd.accepted() == before + 1
    assert "Accepted publickey for root" in certlab.sshd.log.read_text() and "ED25519-CERT" in certlab.sshd.log.read_text()
    assert _real_ssh(named).returncode == 0
    (tmp_path / "user-root.cert").rename(f"{key}-cert.pub")  # no CertificateFile: the key's own -cert.pub
    r = _run(plain)
    assert not isinstance(r, NodeError), r
    assert _real_ssh(plain).returncode == 0
    # a CertificateFile is named (here one that is missing): ssh then does not look for -cert.pub; nor do we
    err = _run(named)
    assert isinstance(err, NodeError) and "user-root.cert: no such file" in err.reason, err
    assert _real_ssh(named).returncode == 255


def test_a_certificate_for_another_user_or_expired_is_said_so(certlab: CertLab, tmp_path: Path) -> None:
    key = tmp_path / "id_ed25519"
    shutil.copy(certlab.key, key)
    shutil.copy(f"{certlab.key}.pub", f"{key}.pub")
    cert = certlab.sign_user(key, principals="alice", out=tmp_path / "alice.cert")
    err = _run(certlab.config(tmp_path, f"  IdentityFile {key}\n  CertificateFile {cert}\n"))
    assert isinstance(err, NodeError) and err.kind == "auth", err
    assert f"with {cert} (certificate 'test-id_ed25519' for alice): refused" in err.reason, err
    assert "TrustedUserCAKeys" in (err.fix or "")
    certlab.sign_user(key, validity="20000101:20010101", out=cert)
    err = _run(certlab.config(tmp_path, f"  IdentityFile {key}\n  CertificateFile {cert}\n"))
    assert isinstance(err, NodeError) and "expired 2001-01-01" in err.reason, err


def test_a_certificate_file_for_another_key_is_named_not_offered(certlab: CertLab, tmp_path: Path) -> None:
    other = tmp_path / "other"
    _keygen(other)
    cert = certlab.sign_user(other, out=tmp_path / "other.cert")
    err = _run(certlab.config(tmp_path, f"  IdentityFile {certlab.key}\n  CertificateFile {cert}\n"
                                        f"  CertificateFile {tmp_path}/missing.cert\n"))
    assert isinstance(err, NodeError) and err.kind == "auth", err
    assert f"CertificateFile {cert}: certifies ssh-ed25519" in err.reason and "which none of the keys is" in err.reason
    assert f"CertificateFile {tmp_path}/missing.cert: no such file" in err.reason
    assert f"{certlab.key}: refused" in err.reason  # the key went plain, not with another key's certificate


def _user_cert_config(certlab: CertLab, tmp_path: Path, extra: str = "", known: str | None = None) -> Path:
    key = tmp_path / "id_ed25519"
    shutil.copy(certlab.key, key)
    shutil.copy(f"{certlab.key}.pub", f"{key}.pub")
    certlab.sign_user(key)  # id_ed25519-cert.pub
    return certlab.config(tmp_path, f"  IdentityFile {key}\n{extra}", known=known)


def test_a_host_certificate_is_trusted_through_a_cert_authority_line(certlab: CertLab, tmp_path: Path) -> None:
    """known_hosts holds no key of the host, only `@cert-authority [127.0.0.1]:* CA`: the host's
    certificate (asked for first, as ssh asks) is checked and accepted; the real ssh agrees."""
    cfg = _user_cert_config(certlab, tmp_path)
    assert "@cert-authority" in (tmp_path / "ssh_config.known_hosts").read_text()
    with Cluster(["certnode"], cfg, connect_timeout=5) as cluster:
        assert cluster.node("certnode").run(["true"]).ok
    assert _real_ssh(cfg).returncode == 0


def test_a_cert_authority_line_for_other_hosts_or_another_ca_trusts_nothing(certlab: CertLab, tmp_path: Path) -> None:
    ca = _pub(certlab.host_ca)
    other_ca = tmp_path / "other_ca"
    _keygen(other_ca)
    for known, said in ((f"@cert-authority other.example {ca}\n", ""),
                        (f"@cert-authority [127.0.0.1]:* {_pub(other_ca)}\n", "offered a host certificate signed by CA"),
                        # the host's CA, but for other hosts; another CA for this one (its certificate is asked for)
                        (f"@cert-authority other.example {ca}\n@cert-authority [127.0.0.1]:* {_pub(other_ca)}\n",
                         "which no @cert-authority line trusts for [127.0.0.1]:")):
        cfg = _user_cert_config(certlab, tmp_path, known=known)
        err = _run(cfg)
        assert isinstance(err, NodeError) and err.kind == "hostkey-unknown", err
        assert said in err.reason and "trust certnode" in (err.fix or ""), err
        assert _real_ssh(cfg).returncode == 255


def test_a_host_certificate_that_does_not_name_the_host_is_refused(certlab: CertLab, tmp_path: Path) -> None:
    """HostKeyAlias is the name the certificate must carry (ssh checks the principals against it): the
    host's certificate names 127.0.0.1, so under the alias `spark-a` it is refused, loudly; ssh agrees."""
    cfg = _user_cert_config(certlab, tmp_path, "  HostKeyAlias spark-a\n",
                            known=f"@cert-authority spark-a {_pub(certlab.host_ca)}\n")
    err = _run(cfg)
    assert isinstance(err, NodeError) and err.kind == "hostkey-cert", err
    assert "it names 127.0.0.1, not spark-a" in err.reason and "'certnode-host'" in err.reason, err
    assert "ssh-keygen -s CA_KEY -h -n spark-a" in (err.fix or "")
    assert _real_ssh(cfg).returncode == 255


def test_a_revoked_ca_is_revoked(certlab: CertLab, tmp_path: Path) -> None:
    ca = _pub(certlab.host_ca)
    cfg = _user_cert_config(certlab, tmp_path, known=f"@cert-authority [127.0.0.1]:* {ca}\n@revoked * {ca}\n")
    err = _run(cfg)
    assert isinstance(err, NodeError) and err.kind == "hostkey-revoked", err
    assert _real_ssh(cfg).returncode == 255


def _cert_of(tmp_path: Path, ca: Path, *args: str) -> cl.certs.Cert:
    key = tmp_path / f"k{len(list(tmp_path.iterdir()))}"
    _keygen(key)
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", "c", *args, f"{key}.pub"], check=True, timeout=20,
                   capture_output=True)
    import base64
    return cl.certs.parse_cert(base64.b64decode(Path(f"{key}-cert.pub").read_text().split()[1]))


def test_host_certificate_checks_as_ssh_makes_them(certlab: CertLab, tmp_path: Path) -> None:
    """Certificates made by ssh-keygen, judged by the checks ssh makes (sshconnect.c check_host_cert)."""
    from dataclasses import replace

    from sparkctl.cluster.certs import host_cert_problem

    ca = certlab.host_ca
    good = _cert_of(tmp_path, ca, "-h", "-n", "spark1,spark1.lab", "-V", "-5m:+1h")
    assert good.principals == ("spark1", "spark1.lab") and good.key_id == "c"
    assert good.ca_blob == __import__("base64").b64decode(_pub(ca).split()[1])
    assert host_cert_problem(good, "spark1") is None and host_cert_problem(good, "spark1.lab") is None
    assert host_cert_problem(good, "spark2") == "it names spark1, spark1.lab, not spark2"
    anyone = _cert_of(tmp_path, ca, "-h", "-V", "-5m:+1h")  # no principals: any host
    assert host_cert_problem(anyone, "whatever") is None
    assert host_cert_problem(_cert_of(tmp_path, ca, "-n", "spark1"), "spark1") == \
        "it is a user certificate, not a host certificate"
    assert "expired 2001-01-01" in (host_cert_problem(_cert_of(tmp_path, ca, "-h", "-V", "20000101:20010101"), "x") or "")
    assert "not valid before 2200" in (host_cert_problem(_cert_of(tmp_path, ca, "-h", "-V", "22000101:22010101"), "x") or "")
    assert host_cert_problem(_cert_of(tmp_path, ca, "-h", "-O", "force-command=true"), "x") == \
        "it has critical options (ssh accepts none in a host certificate)"
    forged = replace(good, principals=("spark2",), signed=good.signed.replace(b"spark1.lab", b"spark2.lab"))
    assert host_cert_problem(forged, "spark2") == "its CA signature does not verify"


# ------------------------------------------------------------------------- what stays unsupported, by name


def _security_key_file(path: Path) -> None:
    """A FIDO `sk-ssh-ed25519@openssh.com` private key file, laid out as ssh-keygen -t ed25519-sk writes one
    (openssh-key-v1; the key handle is what the authenticator needs, here random bytes)."""
    import base64
    import struct

    def s(b: bytes) -> bytes:
        return struct.pack(">I", len(b)) + b

    kt = b"sk-ssh-ed25519@openssh.com"
    pub = s(kt) + s(os.urandom(32)) + s(b"ssh:")
    private = struct.pack(">II", 7, 7) + pub + b"\x01" + s(os.urandom(64)) + s(b"") + s(b"test")
    private += bytes(range(1, 1 + (-len(private)) % 8))  # padded to the block size, 1 2 3 ...
    blob = b"openssh-key-v1\0" + s(b"none") + s(b"none") + s(b"") + struct.pack(">I", 1) + s(pub) + s(private)
    b64 = base64.b64encode(blob).decode()
    path.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n"
                    + "".join(b64[i:i + 70] + "\n" for i in range(0, len(b64), 70))
                    + "-----END OPENSSH PRIVATE KEY-----\n")
    path.chmod(0o600)


def _only_key(sshlab: SshLab, tmp_path: Path, identity_lines: str, alias: str = "n1") -> Path:
    lab = sshlab.ssh_config.read_text().replace(f"  IdentityFile {sshlab.dir}/id_ed25519\n", "")
    cfg = tmp_path / "only_key_config"
    cfg.write_text(f"Host {alias}\n{identity_lines}\n" + lab)
    return cfg


def test_a_fido_security_key_is_named_with_what_to_do(sshlab: SshLab, tmp_path: Path) -> None:
    sk = tmp_path / "id_ed25519_sk"
    _security_key_file(sk)
    said = subprocess.run(["ssh-keygen", "-y", "-f", str(sk)], capture_output=True, text=True, timeout=20, check=True)
    assert said.stdout.startswith("sk-ssh-ed25519@openssh.com ")  # OpenSSH reads it as a security key
    with Cluster(["n1"], _only_key(sshlab, tmp_path, f"  IdentityFile {sk}\n"), connect_timeout=5) as cluster:
        err = cluster.run_all(["true"])["n1"]
    assert isinstance(err, NodeError) and err.kind == "unsupported", err
    assert f"IdentityFile {sk} is a FIDO security key (sk-ssh-ed25519@openssh.com)" in err.reason, err
    assert "no key was accepted" not in err.reason and "ssh-keygen -t ed25519" in (err.fix or "")
    # beside a key that works, it is no obstacle
    cfg = _only_key(sshlab, tmp_path, f"  IdentityFile {sk}\n  IdentityFile {sshlab.dir}/id_ed25519\n")
    with Cluster(["n1"], cfg, connect_timeout=5) as cluster:
        assert cluster.node("n1").run(["true"]).ok


def test_pkcs11_provider_is_named_when_no_other_key_opens(sshlab: SshLab, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong"
    _keygen(wrong)
    cfg = _only_key(sshlab, tmp_path, f"  PKCS11Provider {tmp_path}/opensc-pkcs11.so\n  IdentityFile {wrong}\n")
    with Cluster(["n1"], cfg, connect_timeout=5) as cluster:
        err = cluster.run_all(["true"])["n1"]
    assert isinstance(err, NodeError) and err.kind == "unsupported", err
    assert f"PKCS11Provider {tmp_path}/opensc-pkcs11.so" in err.reason and f"{wrong}: refused" in err.reason, err
    assert "ssh-add -s" in (err.fix or "")


def test_proxy_use_fdpass_is_refused_by_name(sshlab: SshLab, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    cfg = _config(sshlab, tmp_path, f"Host fdpass\n  HostName 127.0.0.1\n  ProxyCommand touch {canary}\n"
                                     "  ProxyUseFdpass yes\n")
    with Cluster(["fdpass"], cfg, connect_timeout=5) as cluster:
        err = cluster.run_all(["true"])["fdpass"]
    assert isinstance(err, NodeError) and err.kind == "config" and "ProxyUseFdpass yes is not supported" in err.reason
    assert "ProxyUseFdpass no" in (err.fix or "") and not canary.exists()


# ------------------------------------------------------------------------ `none`: no agent, no key file


def test_identity_agent_none_and_identity_file_none_mean_none_as_for_ssh(
        sshlab: SshLab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ssh-agent holds the only key that opens the node, and a file named `none` in the current
    directory is that key too. `IdentityAgent none` asks no agent and `IdentityFile none` names no file: the
    real ssh is refused, and so is sparkctl; without `IdentityAgent none` both log in through the agent."""
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir(mode=0o700)
    sock = agent_dir / "sock"
    started = subprocess.run(["ssh-agent", "-s", "-a", str(sock)], capture_output=True, text=True, timeout=20,
                             check=True)
    pid = int(started.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    try:
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        subprocess.run(["ssh-add", "-q", str(sshlab.dir / "id_ed25519")], capture_output=True, timeout=20, check=True)
        cwd = tmp_path / "cwd"
        cwd.mkdir()
        shutil.copy(sshlab.dir / "id_ed25519", cwd / "none")
        (cwd / "none").chmod(0o600)
        monkeypatch.chdir(cwd)
        for agent_line, opens in (("  IdentityAgent none\n", False), ("", True)):
            cfg = _only_key(sshlab, tmp_path, f"{agent_line}  IdentityFile none\n  IdentitiesOnly no\n")
            real = subprocess.run(["ssh", "-F", str(cfg), "-o", "BatchMode=yes", "n1", "true"], cwd=cwd,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30, check=False)
            assert (real.returncode == 0) is opens, real.stderr
            with Cluster(["n1"], cfg, connect_timeout=5) as cluster:
                res = cluster.run_all(["true"])["n1"]
            assert isinstance(res, RunResult) is opens, res
            if not opens:
                assert isinstance(res, NodeError) and res.kind == "auth", res
    finally:
        os.kill(pid, 15)
