"""Connecting: TCP (or a channel through the ProxyJump hops, or a ProxyCommand's pipes), the SSH handshake, the host key judged
against known_hosts (hostkeys.py), public-key authentication. One verified transport per node, one
per distinct hop chain (Jumps)."""

from __future__ import annotations

import base64
import copy
import logging
import os
import socket
import threading
from collections.abc import Sequence

import paramiko
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from ..errors import NodeError
from .certs import CERT_SUFFIX, Cert, CertError, parse_cert
from .hostkeys import fingerprint, host_key_error, judge_host_key, knows_a_ca_for, read_known_hosts
from .proxycommand import ProxyCommandSocket
from .sshconfig import SshTarget

# paramiko logs transport failures at ERROR; with no handler Python would print them (and
# tracebacks) on stderr. sparkctl reports failures itself, per node.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_CONNECT_TIMEOUT = 10.0
_DEFAULT_IDENTITIES = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")
_UNSUPPORTED = "unsupported: "  # a KeyCache reason that names an option sparkctl cannot honour


class _Retryable(Exception):
    """A connection attempt that may succeed if tried again (sshd dropped us during the banner)."""


def _classify_socket_error(target: SshTarget, exc: OSError | UnicodeError) -> NodeError:
    addr = f"{target.hostname}:{target.port}"
    if isinstance(exc, socket.gaierror | UnicodeError):
        return NodeError(
            target.alias,
            "dns",
            f"cannot resolve host name {target.hostname!r}",
            f"check the HostName of {target.alias!r} in the ssh config (or the node name)",
        )
    if isinstance(exc, ConnectionRefusedError):
        return NodeError(
            target.alias,
            "refused",
            f"connection refused by {addr}: sshd is not running there",
            f"start sshd on {target.alias} (e.g. `systemctl start ssh`), or fix its Port in the ssh config",
        )
    if isinstance(exc, TimeoutError):
        return NodeError(
            target.alias,
            "timeout",
            f"no answer from {addr} within the connect timeout",
            f"check that {target.alias} is up and reachable from here",
        )
    return NodeError(
        target.alias,
        "unreachable",
        f"cannot reach {addr}: {exc}",
        f"check the network path to {target.alias}",
    )


def _host_key_algorithms(current: Sequence[str], known_types: set[str]) -> list[str]:
    """Put the algorithms of keys we already know for this host first, as ssh(1) does, so the
    host shows us the key we can verify rather than another it also has."""

    def key_type(alg: str) -> str:
        return "ssh-rsa" if alg.startswith("rsa-sha2-") else alg

    known = [a for a in current if key_type(a) in known_types]
    return known + [a for a in current if a not in known]


class _Transport(paramiko.Transport):
    """paramiko's Transport, asking for the host's certificate first when known_hosts has a CA for it
    (paramiko always lists the certificate algorithms after every plain one, so a host that has both
    would never show its certificate; ssh asks for it first)."""

    certs_first = False

    @property
    def preferred_keys(self) -> tuple[str, ...]:
        keys = tuple(super().preferred_keys)
        if not self.certs_first:
            return keys
        return tuple(k for k in keys if k.endswith(CERT_SUFFIX)) + tuple(k for k in keys if not k.endswith(CERT_SUFFIX))


def _through(jump: paramiko.Transport, target: SshTarget, timeout: float) -> paramiko.Channel:
    """A `direct-tcpip` channel on the jump host's connection to target's host:port: the socket of
    the next hop, as `ssh -J` opens it (the jump host makes the TCP connection)."""
    try:
        return jump.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=timeout)
    except (paramiko.SSHException, EOFError, OSError) as exc:
        raise NodeError(target.alias, "unreachable",
                        f"the jump host could not reach {target.hostname}:{target.port}: {exc or type(exc).__name__}",
                        f"check that {target.alias}'s address is reachable from its ProxyJump host "
                        "(and that its sshd allows TCP forwarding)") from None


def _proxy_failed(target: SshTarget, proxy: ProxyCommandSocket, status: int, exc: BaseException) -> NodeError:
    said = proxy.why()
    return NodeError(
        target.alias,
        "proxy",
        f"its ProxyCommand ({target.proxy_command}) exited with status {status} before the SSH handshake "
        f"was done ({exc or type(exc).__name__})" + (f": {said}" if said else ""),
        f"run that ProxyCommand by hand to see why it cannot reach {target.hostname} port {target.port}; "
        f"or fix the ProxyCommand of {target.alias!r} in the ssh config",
    )


def open_transport(target: SshTarget, timeout: float, via: paramiko.Transport | None = None) -> paramiko.Transport:
    """TCP connect (or a channel through `via`, the last ProxyJump hop, or the target's ProxyCommand)
    + SSH key exchange, with the host key offered in the order ssh would ask. Does NOT verify the host
    key and does not authenticate: see connect()."""
    sock: socket.socket | paramiko.Channel | ProxyCommandSocket
    if via is not None:
        sock = _through(via, target, timeout)
    elif target.proxy_command is not None:
        try:
            sock = ProxyCommandSocket(target.proxy_command, target.alias)
        except OSError as exc:  # no shell to run it with
            raise NodeError(target.alias, "proxy", f"cannot start its ProxyCommand ({target.proxy_command}): {exc}",
                            "check $SHELL and the ProxyCommand in the ssh config") from None
    else:
        try:
            sock = socket.create_connection((target.hostname, target.port), timeout=timeout)
        except (OSError, UnicodeError) as exc:  # UnicodeError: not even a valid host name
            raise _classify_socket_error(target, exc) from None
        # Many small packets (a channel request, then the script on stdin) answered by one reply: with
        # Nagle on, the second waits for the peer's delayed ACK -- 40 ms per command on Linux. OpenSSH's
        # own client turns Nagle off for interactive sessions for the same reason.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport = _Transport(sock)
    transport.banner_timeout = transport.handshake_timeout = transport.auth_timeout = timeout
    known = read_known_hosts([*target.known_hosts_files, *target.global_known_hosts_files])
    transport.certs_first = knows_a_ca_for(target, known)
    opts = transport.get_security_options()
    # AES-GCM first: its tag is checked inside `cryptography`, where paramiko's CTR+HMAC path compares
    # every packet's MAC byte by byte in Python (4-5 ms of client CPU per node per command).
    opts.ciphers = tuple(sorted(opts.ciphers, key=lambda c: not c.endswith("-gcm@openssh.com")))
    opts.key_types = _host_key_algorithms(
        opts.key_types, {e.key_type for e in known if e.marker is None and e.matches(target.known_hosts_name)}
    )
    try:
        transport.start_client(timeout=timeout)
    except (paramiko.SSHException, EOFError, OSError) as exc:
        # a ProxyCommand that failed says why (its exit status, its last stderr lines); asked before the
        # close below, which ends one that still runs
        status = sock.exited() if isinstance(sock, ProxyCommandSocket) else None
        transport.close()
        sock.close()  # Transport.close() skips it once the handshake has ended the transport
        if isinstance(sock, ProxyCommandSocket) and status:
            raise _proxy_failed(target, sock, status, exc) from None
        if isinstance(exc, OSError) and not isinstance(exc, ConnectionResetError):
            raise _classify_socket_error(target, exc) from None
        # sshd drops connections over MaxStartups during its banner: worth one more try.
        raise _Retryable(
            f"SSH handshake with {target.hostname}:{target.port} failed: {exc or type(exc).__name__}"
        ) from None
    return transport


def _security_key_type(path: str) -> str | None:
    """The key type when `path` holds a FIDO security-key private key (`sk-…@openssh.com`), which
    paramiko cannot sign with: it needs the authenticator (ssh's SecurityKeyProvider)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(16384)
        body = "".join(ln for ln in text.splitlines() if ln and not ln.startswith("-----"))
        blob = base64.b64decode(body)
        if not blob.startswith(b"openssh-key-v1\0"):
            return None
        msg = paramiko.Message(blob[len(b"openssh-key-v1\0"):])
        for _ in range(3):  # cipher, kdf, kdf options
            msg.get_string()
        msg.get_int()  # number of keys
        key_type = paramiko.Message(msg.get_string()).get_text()
    except (OSError, ValueError, UnicodeError, IndexError, TypeError):
        return None
    return key_type if key_type.startswith("sk-") else None


class KeyCache:
    """Private keys loaded once per Cluster (the same key usually opens every node)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, paramiko.PKey | str] = {}

    def get(self, path: str) -> paramiko.PKey | str:
        """The key, or a one-line reason it could not be used."""
        with self._lock:
            if path not in self._keys:
                try:
                    key = paramiko.PKey.from_path(path)
                    # from_path also loads a `-cert.pub` beside the key, whatever the config says: the
                    # key is kept plain, and _with_certificates pairs certificates as ssh does
                    key.public_blob = None
                    self._keys[path] = key
                except FileNotFoundError:
                    self._keys[path] = f"{path}: no such file"
                except paramiko.PasswordRequiredException:
                    self._keys[path] = f"{path}: encrypted (load it into ssh-agent)"
                except Exception as exc:  # unknown key type, corrupt file, permissions
                    sk = _security_key_type(path)
                    self._keys[path] = (f"{_UNSUPPORTED}IdentityFile {path} is a FIDO security key ({sk}), which "
                                        "sparkctl's SSH client (paramiko) cannot sign with" if sk else f"{path}: {exc}")
            return self._keys[path]


def _read_cert(path: str) -> Cert | str:
    """A `-cert.pub` file's certificate, or why it cannot be used."""
    try:
        with open(path, encoding="utf-8") as f:
            fields = f.read().split()
        return parse_cert(base64.b64decode(fields[1], validate=True))
    except FileNotFoundError:
        return "no such file"
    except (OSError, IndexError, ValueError) as exc:  # CertError is a ValueError
        return f"not an OpenSSH certificate ({exc})"


def _cert_label(cert: Cert) -> str:
    why = cert.validity()
    return (f"certificate {cert.key_id!r} for {','.join(cert.principals) or 'any user'}"
            + (f", {why}" if why else ""))


def _with_certificates(label: str, key: paramiko.PKey, path: str | None, certs: list[tuple[str, Cert | str]],
                       used: set[str]) -> list[tuple[str, paramiko.PKey]]:
    """The key offered with each certificate that certifies it, each before the plain key: as ssh pairs
    them, the CertificateFile ones; without any CertificateFile, the key file's own `-cert.pub`."""
    own_path = f"{path}-cert.pub"
    own = [(own_path, _read_cert(own_path))] if path and not certs and os.path.exists(own_path) else []
    out: list[tuple[str, paramiko.PKey]] = []
    for cpath, cert in [*certs, *own]:
        if isinstance(cert, str) or cert.key_blob != key.asbytes():
            continue
        used.add(cpath)
        certified = copy.copy(key)  # the cached key stays plain for the nodes that take it plain
        certified.load_certificate(cpath)
        out.append((f"{label} with {cpath} ({_cert_label(cert)})", certified))
    return [*out, (label, key)]


def _authenticate(transport: paramiko.Transport, target: SshTarget, keys: KeyCache) -> None:
    tried: list[str] = []
    paths = target.identity_files or tuple(
        p for p in (os.path.expanduser(d) for d in _DEFAULT_IDENTITIES) if os.path.exists(p)
    )
    certs = [(p, _read_cert(p)) for p in target.certificate_files]
    used: set[str] = set()
    candidates: list[tuple[str, paramiko.PKey]] = []
    for path in paths:
        key = keys.get(path)
        if isinstance(key, str):
            tried.append(key)
        else:
            candidates += _with_certificates(path, key, path, certs, used)
    if not target.identities_only and target.agent and os.environ.get("SSH_AUTH_SOCK"):
        try:
            for k in paramiko.Agent().get_keys():
                candidates += _with_certificates(f"agent key {k.fingerprint}", k, None, certs, used)
        except paramiko.SSHException:
            tried.append("ssh-agent: not reachable")
    for cpath, cert in certs:
        if isinstance(cert, str):
            tried.append(f"CertificateFile {cpath}: {cert}")
        elif cpath not in used:
            tried.append(f"CertificateFile {cpath}: certifies {cert.key_type} {fingerprint(cert.key_blob)}, "
                         "which none of the keys is")
    unsupported = [t.removeprefix(_UNSUPPORTED) for t in tried if t.startswith(_UNSUPPORTED)]
    if target.pkcs11_provider:
        unsupported.append(f"PKCS11Provider {target.pkcs11_provider} is set, and sparkctl's SSH client (paramiko) "
                           "has no PKCS#11")
    tried = [t for t in tried if not t.startswith(_UNSUPPORTED)]
    for label, key in candidates:
        try:
            transport.auth_publickey(target.user, key)
        except paramiko.AuthenticationException:
            tried.append(f"{label}: refused")
            continue
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise NodeError(
                target.alias,
                "auth",
                f"authentication as {target.user} failed: {exc}",
                f"check sshd's log on {target.alias}",
            ) from None
        if transport.is_authenticated():
            return
    if unsupported:  # what could have opened the door is what sparkctl cannot use: say that, not "no key"
        raise NodeError(
            target.alias,
            "unsupported",
            f"{'; '.join(unsupported)}; no other key was accepted for {target.user}@{target.hostname}"
            + (f" ({'; '.join(tried)})" if tried else ""),
            "give these nodes a key sparkctl can use: an ed25519/ECDSA/RSA key without a security key or "
            "token (`ssh-keygen -t ed25519 -f ~/.ssh/id_sparkctl`), its .pub in ~/.ssh/authorized_keys on each "
            f"node, `IdentityFile ~/.ssh/id_sparkctl` for {target.alias!r}; or hold the token's keys in ssh-agent "
            "(`ssh-add -s PROVIDER` for PKCS#11)",
        )
    if target.missing_identity_files:  # ssh: "no such identity: PATH"; the fix is the path, not "set IdentityFile"
        path = target.missing_identity_files[0]
        tried = [f"no such identity: {p}" for p in target.missing_identity_files] + tried
        raise NodeError(
            target.alias,
            "auth",
            f"no key was accepted for {target.user}@{target.hostname} ({'; '.join(tried)})",
            f"the IdentityFile {path} (from the ssh config{f' {target.ssh_config}' if target.ssh_config else ''}) "
            "does not exist: create the key or fix the path",
        )
    raise NodeError(
        target.alias,
        "auth",
        f"no key was accepted for {target.user}@{target.hostname} ({'; '.join(tried) or 'no keys found'})",
        (f"check that sshd on {target.alias} trusts your certificate's CA (TrustedUserCAKeys), that the "
         f"certificate names {target.user} and is valid now; " if any(not isinstance(c, str) for _, c in certs) else "")
        + f"add your public key to ~{target.user}/.ssh/authorized_keys on {target.alias}, "
        f"or set IdentityFile for {target.alias!r} in the ssh config",
    )


def _handshake(target: SshTarget, timeout: float, attempts: int,
               via: paramiko.Transport | None = None) -> paramiko.Transport:
    """The SSH transport (host key not yet judged). Retried, bounded, only when sshd dropped us
    mid-handshake; what still fails is the node's NodeError."""

    @retry(
        retry=retry_if_exception_type(_Retryable),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.2, max=1.0),
        reraise=True,
    )
    def attempt() -> paramiko.Transport:
        return open_transport(target, timeout, via)

    try:
        return attempt()
    except _Retryable as exc:
        raise NodeError(
            target.alias, "protocol", str(exc), f"check that sshd on {target.alias} is healthy"
        ) from None


class Jumps:
    """ProxyJump hops, each connected (host key verified, authenticated) once per Cluster however many
    nodes sit behind it: one connection per distinct hop chain."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[tuple[str, int, str, str | None], ...], paramiko.Transport | NodeError] = {}

    def via(self, hops: Sequence[SshTarget], *, timeout: float, keys: KeyCache) -> paramiko.Transport | None:
        """The transport of the last hop (None without hops); a hop that fails fails every node behind it."""
        via: paramiko.Transport | None = None
        for i, hop in enumerate(hops):
            key = tuple((h.hostname, h.port, h.user, h.proxy_command) for h in hops[: i + 1])
            with self._lock:  # one connect per chain, even when many nodes ask at once
                got = self._open.get(key)
                if got is None or (isinstance(got, paramiko.Transport) and not got.is_active()):
                    try:
                        got = connect(hop, timeout=timeout, keys=keys, via=via)
                    except NodeError as exc:
                        got = exc
                    self._open[key] = got
            if isinstance(got, NodeError):
                raise got
            via = got
        return via

    def close(self) -> None:
        with self._lock:
            for t in reversed(list(self._open.values())):
                if isinstance(t, paramiko.Transport):
                    t.close()
            self._open.clear()


def connect(target: SshTarget, *, timeout: float, keys: KeyCache | None = None,
            via: paramiko.Transport | None = None, jumps: Jumps | None = None) -> paramiko.Transport:
    """One verified, authenticated SSH transport to `target` (through its ProxyJump hops, each
    verified too), or a NodeError saying why not."""
    keys = keys or KeyCache()
    if via is None and target.jumps:
        if jumps is None:
            raise NodeError(target.alias, "config", "ProxyJump needs the cluster's hop pool", "")
        try:
            via = jumps.via(target.jumps, timeout=timeout, keys=keys)
        except NodeError as exc:  # said for the node, naming the hop that failed
            raise NodeError(target.alias, exc.kind, f"through its ProxyJump host {exc.node}: {exc.reason}", exc.fix,
                            key_type=exc.key_type, fingerprint=exc.fingerprint) from None
    transport = _handshake(target, timeout, attempts=3, via=via)
    try:
        server_key = transport.get_remote_server_key()
        verdict = judge_host_key(target, server_key.get_name(), server_key.asbytes(), _host_cert(target, server_key))
        if verdict.status != "trusted":
            raise host_key_error(target, verdict)
        _authenticate(transport, target, keys)
        transport.set_keepalive(15)
        return transport
    except BaseException:
        transport.close()
        raise


def _host_cert(target: SshTarget, server_key: paramiko.PKey) -> Cert | None:
    """The certificate the host offered with its key (paramiko keeps it as the key's public_blob)."""
    blob = getattr(server_key, "public_blob", None)
    if blob is None or not blob.key_type.endswith(CERT_SUFFIX):
        return None
    try:
        return parse_cert(blob.key_blob)
    except CertError as exc:
        raise NodeError(target.alias, "protocol", f"its host certificate cannot be read: {exc}",
                        f"check the HostCertificate of sshd on {target.alias}") from None


def fetch_host_key(target: SshTarget, *, timeout: float = DEFAULT_CONNECT_TIMEOUT,
                   jumps: Jumps | None = None) -> tuple[str, bytes]:
    """The (key type, key blob) a host offers, without trusting it and without logging in (its
    ProxyJump hops are connected as usual: verified and authenticated)."""
    via = jumps.via(target.jumps, timeout=timeout, keys=KeyCache()) if target.jumps and jumps else None
    if target.jumps and via is None:
        raise NodeError(target.alias, "config", "ProxyJump needs the cluster's hop pool", "")
    transport = _handshake(target, timeout, attempts=1, via=via)
    try:
        key = transport.get_remote_server_key()
        return key.get_name(), key.asbytes()
    finally:
        transport.close()
