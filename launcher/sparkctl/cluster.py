"""Cluster access: one verified SSH connection per node, opened in parallel, reused for everything.

Every sparkctl command that touches nodes goes through here:

    with Cluster(["spark1", "spark2"], ssh_config) as cluster:
        results = cluster.run_all(["uname", "-m"])          # {node: RunResult | NodeError}
        version = cluster.node("spark1").docker_json(["version", "--format", "{{json .}}"])

- A node name is an SSH alias, resolved through an ssh_config file (HostName, User, Port,
  IdentityFile, IdentitiesOnly, UserKnownHostsFile, HostKeyAlias, HashKnownHosts).
- Each node gets ONE SSH transport per Cluster; every command, file upload (SFTP) and docker CLI
  call is a channel on it. (Benchmarks count sshd's "Accepted publickey" lines: N nodes, N lines.)
- Host keys are verified against known_hosts. An unknown, changed or revoked key fails that node
  with the key type, the SHA256 fingerprint and the command that trusts it (`sparkctl trust NODE`).
  Nothing here accepts a key silently; there is no switch to turn that off.
- argv is joined with shlex.join, so every value is one quoted word on the remote shell: a value
  like `$(touch /tmp/x)` or `;rm -rf /` is data.
- A node that fails (cannot connect, times out, dies mid-command) becomes a NodeError with a human
  reason and a fix; the other nodes carry on (Fabric's GroupResult idea: nothing is lost).
"""

from __future__ import annotations

import base64
import concurrent.futures
import getpass
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import select
import shlex
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, overload

import paramiko
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from .errors import CheckFailed, UsageError
from .identity import NodeIdentity, refuse_duplicates

# paramiko logs transport failures at ERROR; with no handler Python would print them (and
# tracebacks) on stderr. sparkctl reports failures itself, per node.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

DEFAULT_CONNECT_TIMEOUT = 10.0
DEFAULT_COMMAND_TIMEOUT = 60.0
MAX_OUTPUT_BYTES = 256 * 1024 * 1024  # per stream of one command; more means something is wrong
DEFAULT_SSH_CONFIG = "~/.ssh/config"
_DEFAULT_IDENTITIES = ("~/.ssh/id_ed25519", "~/.ssh/id_ecdsa", "~/.ssh/id_rsa")
_GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

T = TypeVar("T")


# --------------------------------------------------------------------------------------- errors


class NodeError(CheckFailed):
    """One node failed; `kind` says how (for rules and tests), `reason` and `fix` say it to a person.

    kinds: config dns refused timeout unreachable protocol auth hostkey-unknown hostkey-changed
           hostkey-revoked lost command-timeout docker output sftp error
    """

    def __init__(
        self,
        node: str,
        kind: str,
        reason: str,
        fix: str | None = None,
        *,
        key_type: str | None = None,
        fingerprint: str | None = None,
    ) -> None:
        super().__init__(f"{node}: {reason}", fix=fix)
        self.node = node
        self.kind = kind
        self.reason = reason
        self.key_type = key_type
        self.fingerprint = fingerprint

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"node": self.node, "kind": self.kind, "reason": self.reason, "fix": self.fix}
        if self.fingerprint:
            d.update(key_type=self.key_type, fingerprint=self.fingerprint)
        return d


class _Retryable(Exception):
    """A connection attempt that may succeed if tried again (sshd dropped us during the banner)."""


# ------------------------------------------------------------------------------ ssh_config lookup


@dataclass(frozen=True)
class SshTarget:
    """What an alias resolves to, the way ssh(1) would resolve it."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identities_only: bool
    known_hosts_files: tuple[str, ...]  # UserKnownHostsFile; `trust` writes to the first
    global_known_hosts_files: tuple[str, ...]
    host_key_alias: str | None = None
    hash_known_hosts: bool = False
    ssh_config: str | None = None  # the file it came from, for fix hints
    jumps: tuple[SshTarget, ...] = ()  # ProxyJump hops, in order (each resolved as its own alias)

    @property
    def known_hosts_name(self) -> str:
        """The name ssh looks the host key up under: HostKeyAlias, else host or [host]:port."""
        if self.host_key_alias:
            return self.host_key_alias
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def trust_command(self) -> str:
        parts = ["sparkctl"]
        if self.ssh_config and self.ssh_config != os.path.expanduser(DEFAULT_SSH_CONFIG):
            parts += ["--ssh-config", self.ssh_config]
        return shlex.join([*parts, "trust", self.alias])


@dataclass(frozen=True)
class SshConfig:
    """Which ssh_config OpenSSH reads: `ssh -F path` for a file the user named; for the default
    (~/.ssh/config) no -F, so ssh reads it and /etc/ssh/ssh_config as it always does."""

    path: str | None  # the file, for messages (None: there is no ~/.ssh/config)
    explicit: bool = False

    def ssh_argv(self) -> list[str]:
        return ["-F", self.path] if self.explicit and self.path else []


def load_ssh_config(path: str | Path | None) -> tuple[SshConfig, str | None]:
    """Which ssh_config to resolve aliases with. A missing default (~/.ssh/config) is fine (ssh has its
    defaults); a missing file the user named is a usage error."""
    explicit = path is not None and os.path.expanduser(str(path)) != os.path.expanduser(DEFAULT_SSH_CONFIG)
    resolved = os.path.expanduser(str(path if path is not None else DEFAULT_SSH_CONFIG))
    if not os.path.exists(resolved):
        if explicit:
            raise UsageError(
                f"ssh config {resolved} does not exist",
                fix="pass --ssh-config PATH (or set SPARKCTL_SSH_CONFIG) to the file that names your nodes",
            )
        return SshConfig(None), None
    return SshConfig(resolved, explicit), resolved


# `ssh -G` prints one `key value` line per option, every key lower-case; these may repeat.
_MULTI = {"identityfile", "certificatefile"}
SSH_G_TIMEOUT = 10.0


def ssh_g(alias: str, config: SshConfig) -> dict[str, list[str]]:
    """OpenSSH's own resolution of `alias` (`ssh -G`): Include, Match, Host patterns, canonicalisation,
    defaults — exactly what `ssh alias` would use. Raises NodeError when ssh cannot resolve it."""
    import subprocess

    argv = ["ssh", "-G", *config.ssh_argv(), "--", alias]  # `--`: an alias is never an option
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=SSH_G_TIMEOUT, stdin=subprocess.DEVNULL,
                           check=False)
    except FileNotFoundError:
        raise NodeError(alias, "config", "the OpenSSH client (`ssh`) is not installed: sparkctl resolves node "
                        "aliases with `ssh -G`, as ssh itself does", "install openssh-client") from None
    except subprocess.TimeoutExpired:
        raise NodeError(alias, "config", f"`ssh -G {alias}` did not answer in {SSH_G_TIMEOUT:g}s (a `Match exec` "
                        "that hangs?)", "fix the ssh config entry") from None
    if r.returncode != 0:
        why = " | ".join(ln for ln in r.stderr.strip().splitlines() if "Pseudo-terminal" not in ln)[-400:]
        raise NodeError(alias, "config", f"ssh cannot resolve {alias!r}: {why or f'exit {r.returncode}'}",
                        f"fix the ssh config ({config.path or '~/.ssh/config'}), e.g. `ssh -G {alias}` shows the problem")
    opts: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        key, _, value = line.strip().partition(" ")
        key = key.lower()
        if key in _MULTI:
            opts.setdefault(key, []).append(value.strip())
        elif key and key not in opts:
            opts[key] = [value.strip()]
    return opts


def _one(opts: Mapping[str, list[str]], key: str, default: str = "") -> str:
    values = opts.get(key)
    return values[0] if values else default


def _jump_specs(value: str) -> list[tuple[str | None, str, int | None]]:
    """ProxyJump's `[user@]host[:port]` (or `ssh://[user@]host[:port]`) list, comma-separated."""
    out: list[tuple[str | None, str, int | None]] = []
    for raw in value.split(","):
        spec = raw.strip().removeprefix("ssh://")
        user, _, hostport = spec.rpartition("@")
        host, port = hostport, None
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:]+)(?::(\d+))?", hostport)
        if m:
            host = m.group(1) or m.group(3)
            p = m.group(2) or m.group(4)
            port = int(p) if p else None
        out.append((user or None, host, port))
    return out


def resolve_target(alias: str, config: SshConfig, config_path: str | None = None, *,
                   _depth: int = 0) -> SshTarget:
    """Resolve one alias exactly as ssh(1) does (`ssh -G`), ProxyJump hops included. What sparkctl
    cannot honour is refused, never ignored: ProxyCommand (each hop's host key is verified here)."""
    opts = ssh_g(alias, config)
    try:
        port = int(_one(opts, "port", "22"))
    except ValueError:
        raise NodeError(alias, "config", f"bad Port {_one(opts, 'port')!r} in the ssh config",
                        "fix its Port line") from None
    user = _one(opts, "user") or getpass.getuser()
    hostname = _one(opts, "hostname", alias)
    tokens = {"%d": os.path.expanduser("~"), "%u": getpass.getuser(), "%h": hostname, "%n": alias,
              "%p": str(port), "%r": user, "%k": _one(opts, "hostkeyalias", hostname)}
    proxy_command = _one(opts, "proxycommand", "none")
    proxy_jump = _one(opts, "proxyjump", "none")
    if proxy_command.lower() != "none" and proxy_jump.lower() == "none":
        raise NodeError(alias, "config", f"ProxyCommand is not supported ({proxy_command!r}): sparkctl opens and "
                        "verifies every hop itself", f"use ProxyJump for {alias!r} in the ssh config")
    jumps: list[SshTarget] = []
    if proxy_jump.lower() != "none":
        if _depth > 8:
            raise NodeError(alias, "config", "ProxyJump chain too deep (a loop?)", "fix the ssh config")
        for juser, jhost, jport in _jump_specs(proxy_jump):
            hop = resolve_target(jhost, config, config_path, _depth=_depth + 1)
            jumps += [*hop.jumps, replace(hop, user=juser or hop.user, port=jport or hop.port, jumps=())]
    # ssh -G lists the default identity files when none is set: only those that exist are candidates
    # (ssh itself skips the missing ones).
    identities = tuple(p for p in _split_paths(" ".join(opts.get("identityfile", [])), tokens) if os.path.exists(p))
    known = _split_paths(_one(opts, "userknownhostsfile"), tokens) or (os.path.expanduser("~/.ssh/known_hosts"),)
    global_known = _split_paths(_one(opts, "globalknownhostsfile"), tokens) or _GLOBAL_KNOWN_HOSTS
    host_key_alias = _one(opts, "hostkeyalias")
    return SshTarget(
        alias=alias,
        hostname=hostname,
        port=port,
        user=user,
        identity_files=identities,
        identities_only=_one(opts, "identitiesonly", "no").lower() == "yes",
        known_hosts_files=tuple(p for p in known if p != "/dev/null"),
        global_known_hosts_files=tuple(p for p in global_known if p != "/dev/null"),
        host_key_alias=host_key_alias if host_key_alias and host_key_alias.lower() != "none" else None,
        hash_known_hosts=_one(opts, "hashknownhosts", "no").lower() == "yes",
        ssh_config=config_path,
        jumps=tuple(jumps),
    )


def _split_paths(value: str | None, tokens: Mapping[str, str]) -> tuple[str, ...]:
    if not value:
        return ()
    out = []
    for raw in value.split():
        for tok, rep in tokens.items():
            raw = raw.replace(tok, rep)
        out.append(os.path.expanduser(raw.replace("%%", "%")))
    return tuple(out)


# ------------------------------------------------------------------------------------ known_hosts


def fingerprint(key_blob: bytes) -> str:
    """OpenSSH's SHA256 fingerprint of a public key blob (what `ssh-keygen -lf` prints)."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(key_blob).digest()).decode().rstrip("=")


@dataclass(frozen=True)
class KnownHost:
    patterns: tuple[str, ...]
    key_type: str
    key_blob: bytes
    path: str
    line: int
    marker: str | None = None  # "revoked" or "cert-authority" (the latter is not used for plain keys)

    def matches(self, name: str) -> bool:
        return host_matches(self.patterns, name)


def read_known_hosts(paths: Sequence[str]) -> list[KnownHost]:
    """Every parseable entry of the given known_hosts files (missing files are simply empty)."""
    entries = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UsageError(
                f"cannot read known_hosts file {path}: {exc.strerror}", fix=f"check {path}"
            ) from None
        for n, line in enumerate(lines, 1):
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            marker = None
            if fields[0].startswith("@"):
                marker, fields = fields[0][1:], fields[1:]
            if len(fields) < 3:
                continue
            try:
                blob = base64.b64decode(fields[2], validate=True)
            except ValueError:
                continue
            entries.append(KnownHost(tuple(fields[0].split(",")), fields[1], blob, path, n, marker))
    return entries


def host_matches(patterns: Sequence[str], name: str) -> bool:
    """ssh's host-pattern matching: hashed |1|salt|hash entries, * and ? wildcards, !negation."""
    matched = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        if pat.startswith("|1|"):
            hit = _hashed_match(pat, name)
        else:
            regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pat.lower())
            hit = re.fullmatch(regex, name.lower()) is not None
        if hit and negate:
            return False
        matched = matched or hit
    return matched


def _hashed_match(entry: str, name: str) -> bool:
    try:
        _, _, salt_b64, hash_b64 = entry.split("|", 3)
        salt, want = base64.b64decode(salt_b64), base64.b64decode(hash_b64)
    except ValueError:
        return False
    return hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), want)


def hash_hostname(name: str) -> str:
    """A `|1|salt|hash` known_hosts name, as `ssh-keygen -H` / HashKnownHosts=yes writes it."""
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


@dataclass(frozen=True)
class HostKeyVerdict:
    status: str  # "trusted" | "unknown" | "changed" | "revoked"
    key_type: str
    fingerprint: str
    known: tuple[KnownHost, ...] = ()  # for "changed": the entries that disagree


def judge_host_key(target: SshTarget, key_type: str, key_blob: bytes) -> HostKeyVerdict:
    """Compare the key a host offered with what known_hosts says about target.known_hosts_name."""
    name = target.known_hosts_name
    entries = [e for e in read_known_hosts([*target.known_hosts_files, *target.global_known_hosts_files])]
    fp = fingerprint(key_blob)
    if any(e.marker == "revoked" and e.key_blob == key_blob for e in entries):
        return HostKeyVerdict("revoked", key_type, fp)
    mine = [e for e in entries if e.marker is None and e.matches(name)]
    if any(e.key_blob == key_blob and e.key_type == key_type for e in mine):
        return HostKeyVerdict("trusted", key_type, fp)
    same_type = tuple(e for e in mine if e.key_type == key_type)
    if same_type:
        return HostKeyVerdict("changed", key_type, fp, same_type)
    return HostKeyVerdict("unknown", key_type, fp, tuple(mine))


def host_key_error(target: SshTarget, verdict: HostKeyVerdict) -> NodeError:
    where = f"{target.known_hosts_name} ({target.hostname} port {target.port})"
    files = ", ".join(target.known_hosts_files) or "(none)"
    trust = target.trust_command()
    if verdict.status == "changed":
        old = "; ".join(f"{fingerprint(e.key_blob)} at {e.path}:{e.line}" for e in verdict.known)
        return NodeError(
            target.alias,
            "hostkey-changed",
            f"HOST KEY CHANGED for {where}: POSSIBLE MAN-IN-THE-MIDDLE ATTACK (or the host was reinstalled). "
            f"It offered {verdict.key_type} {verdict.fingerprint}; known_hosts has {old}",
            f"verify the new fingerprint out of band; if the change is expected, run `{trust}` to replace it",
            key_type=verdict.key_type,
            fingerprint=verdict.fingerprint,
        )
    if verdict.status == "revoked":
        return NodeError(
            target.alias,
            "hostkey-revoked",
            f"host key {verdict.key_type} {verdict.fingerprint} of {where} is marked @revoked in known_hosts",
            "do not connect; find out why this host offers a revoked key",
            key_type=verdict.key_type,
            fingerprint=verdict.fingerprint,
        )
    other = (
        f" (known_hosts has only {', '.join(sorted({e.key_type for e in verdict.known}))} for it)"
        if verdict.known
        else ""
    )
    return NodeError(
        target.alias,
        "hostkey-unknown",
        f"host key of {where} is not in known_hosts ({files}){other}: it offered {verdict.key_type} {verdict.fingerprint}",
        f"check that fingerprint out of band, then run `{trust}`",
        key_type=verdict.key_type,
        fingerprint=verdict.fingerprint,
    )


def record_host_key(target: SshTarget, key_type: str, key_blob: bytes) -> str:
    """Append the key to the first UserKnownHostsFile (hashed when HashKnownHosts=yes), first
    removing this host's entries of the same type (the `trust` of a changed key). Returns the file."""
    if not target.known_hosts_files:
        raise UsageError(f"{target.alias}: UserKnownHostsFile is /dev/null; nowhere to record the key")
    path = Path(target.known_hosts_files[0])
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = target.known_hosts_name
    kept = []
    if path.exists():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            fields = line.split()
            drop = (
                len(fields) >= 3
                and not fields[0].startswith(("#", "@"))
                and fields[1] == key_type
                and host_matches(fields[0].split(","), name)
            )
            if not drop:
                kept.append(line)
    entry_name = hash_hostname(name) if target.hash_known_hosts else name
    kept.append(f"{entry_name} {key_type} {base64.b64encode(key_blob).decode()}")
    tmp = path.with_name(f".{path.name}.sparkctl-{secrets.token_hex(4)}")
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if not path.exists() else path.stat().st_mode & 0o777
    )
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(kept) + "\n")
    os.replace(tmp, path)
    return str(path)


# ------------------------------------------------------------------------------------ connecting


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


def open_transport(target: SshTarget, timeout: float, via: paramiko.Transport | None = None) -> paramiko.Transport:
    """TCP connect (or a channel through `via`, the last ProxyJump hop) + SSH key exchange, with the
    host key offered in the order ssh would ask. Does NOT verify the host key and does not
    authenticate: see connect()."""
    sock: socket.socket | paramiko.Channel
    if via is not None:
        sock = _through(via, target, timeout)
    else:
        try:
            sock = socket.create_connection((target.hostname, target.port), timeout=timeout)
        except (OSError, UnicodeError) as exc:  # UnicodeError: not even a valid host name
            raise _classify_socket_error(target, exc) from None
        # Many small packets (a channel request, then the script on stdin) answered by one reply: with
        # Nagle on, the second waits for the peer's delayed ACK -- 40 ms per command on Linux. OpenSSH's
        # own client turns Nagle off for interactive sessions for the same reason.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport = paramiko.Transport(sock)
    transport.banner_timeout = transport.handshake_timeout = transport.auth_timeout = timeout
    known = read_known_hosts([*target.known_hosts_files, *target.global_known_hosts_files])
    opts = transport.get_security_options()
    opts.key_types = _host_key_algorithms(
        opts.key_types, {e.key_type for e in known if e.marker is None and e.matches(target.known_hosts_name)}
    )
    try:
        transport.start_client(timeout=timeout)
    except (paramiko.SSHException, EOFError, ConnectionResetError) as exc:
        transport.close()
        # sshd drops connections over MaxStartups during its banner: worth one more try.
        raise _Retryable(
            f"SSH handshake with {target.hostname}:{target.port} failed: {exc or type(exc).__name__}"
        ) from None
    except OSError as exc:
        transport.close()
        raise _classify_socket_error(target, exc) from None
    return transport


class _KeyCache:
    """Private keys loaded once per Cluster (the same key usually opens every node)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, paramiko.PKey | str] = {}

    def get(self, path: str) -> paramiko.PKey | str:
        """The key, or a one-line reason it could not be used."""
        with self._lock:
            if path not in self._keys:
                try:
                    self._keys[path] = paramiko.PKey.from_path(path)
                except FileNotFoundError:
                    self._keys[path] = f"{path}: no such file"
                except paramiko.PasswordRequiredException:
                    self._keys[path] = f"{path}: encrypted (load it into ssh-agent)"
                except Exception as exc:  # unknown key type, corrupt file, permissions
                    self._keys[path] = f"{path}: {exc}"
            return self._keys[path]


def _authenticate(transport: paramiko.Transport, target: SshTarget, keys: _KeyCache) -> None:
    tried: list[str] = []
    paths = target.identity_files or tuple(
        p for p in (os.path.expanduser(d) for d in _DEFAULT_IDENTITIES) if os.path.exists(p)
    )
    candidates: list[tuple[str, paramiko.PKey]] = []
    for path in paths:
        key = keys.get(path)
        if isinstance(key, str):
            tried.append(key)
        else:
            candidates.append((path, key))
    if not target.identities_only and os.environ.get("SSH_AUTH_SOCK"):
        try:
            candidates += [(f"agent key {k.fingerprint}", k) for k in paramiko.Agent().get_keys()]
        except paramiko.SSHException:
            tried.append("ssh-agent: not reachable")
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
    raise NodeError(
        target.alias,
        "auth",
        f"no key was accepted for {target.user}@{target.hostname} ({'; '.join(tried) or 'no keys found'})",
        f"add your public key to ~{target.user}/.ssh/authorized_keys on {target.alias}, "
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
        self._open: dict[tuple[tuple[str, int, str], ...], paramiko.Transport | NodeError] = {}

    def via(self, hops: Sequence[SshTarget], *, timeout: float, keys: _KeyCache) -> paramiko.Transport | None:
        """The transport of the last hop (None without hops); a hop that fails fails every node behind it."""
        via: paramiko.Transport | None = None
        for i, hop in enumerate(hops):
            key = tuple((h.hostname, h.port, h.user) for h in hops[: i + 1])
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


def connect(target: SshTarget, *, timeout: float, keys: _KeyCache | None = None,
            via: paramiko.Transport | None = None, jumps: Jumps | None = None) -> paramiko.Transport:
    """One verified, authenticated SSH transport to `target` (through its ProxyJump hops, each
    verified too), or a NodeError saying why not."""
    keys = keys or _KeyCache()
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
        verdict = judge_host_key(target, server_key.get_name(), server_key.asbytes())
        if verdict.status != "trusted":
            raise host_key_error(target, verdict)
        _authenticate(transport, target, keys)
        transport.set_keepalive(15)
        return transport
    except BaseException:
        transport.close()
        raise


def fetch_host_key(target: SshTarget, *, timeout: float = DEFAULT_CONNECT_TIMEOUT,
                   jumps: Jumps | None = None) -> tuple[str, bytes]:
    """The (key type, key blob) a host offers, without trusting it and without logging in (its
    ProxyJump hops are connected as usual: verified and authenticated)."""
    via = jumps.via(target.jumps, timeout=timeout, keys=_KeyCache()) if target.jumps and jumps else None
    if target.jumps and via is None:
        raise NodeError(target.alias, "config", "ProxyJump needs the cluster's hop pool", "")
    transport = _handshake(target, timeout, attempts=1, via=via)
    try:
        key = transport.get_remote_server_key()
        return key.get_name(), key.asbytes()
    finally:
        transport.close()


# ------------------------------------------------------------------------------------ one node


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    exit_code: int
    elapsed: float
    command: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


NodeResult = RunResult  # what run_all gives per node for an argv job


def remote_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The string the remote shell runs: every value one shell-quoted word (env via `env K=V`)."""
    if isinstance(argv, str):
        raise TypeError("argv must be a list of words, not a string (it would be run by the shell)")
    words = [str(a) for a in argv]
    if env:
        for name in env:
            if not _ENV_NAME.fullmatch(name):
                raise UsageError(f"bad environment variable name {name!r}")
        words = ["env", *(f"{k}={v}" for k, v in env.items()), *words]
    return shlex.join(words)


class Node:
    """A connected node. Every method runs over the node's one SSH transport."""

    def __init__(self, target: SshTarget, transport: paramiko.Transport, *, command_timeout: float) -> None:
        self.name = target.alias
        self.target = target
        self._transport = transport
        self._command_timeout = command_timeout
        self._sftp: paramiko.SFTPClient | None = None
        self._sftp_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Node {self.name} {self.target.user}@{self.target.hostname}:{self.target.port}>"

    def identity(self, machine_id: str | None = None) -> NodeIdentity:
        """Who answered: the verified host key of this connection (and a machine-id, when read)."""
        try:
            key: str | None = fingerprint(self._transport.get_remote_server_key().asbytes())
        except Exception:  # a transport without a key (tests' stand-ins): unknown, not a match
            key = None
        return NodeIdentity(self.name, self.target.hostname, self.target.port, key, machine_id)

    def _lost(self, exc: BaseException) -> NodeError:
        return NodeError(
            self.name,
            "lost",
            f"SSH connection lost: {exc or type(exc).__name__}",
            f"check {self.name} and its sshd, then run the command again",
        )

    def _channel(self, timeout: float) -> paramiko.Channel:
        try:
            return self._transport.open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc) from None

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run argv on the node and wait for it. A non-zero exit is a RunResult, not an error;
        a timeout or a lost connection is a NodeError."""
        return self.start(argv, timeout=timeout, env=env).finish(stdin or b"")

    def start(
        self, argv: Sequence[str], *, timeout: float | None = None, env: Mapping[str, str] | None = None
    ) -> Session:
        """Start argv on the node and return its Session, to talk to it in turns (see Session)."""
        return Session(self, remote_command(argv, env), self._command_timeout if timeout is None else timeout)

    def run_script(
        self,
        script: bytes,
        args: Sequence[str] = (),
        *,
        interpreter: Sequence[str] = ("sh", "-s", "--"),
        timeout: float | None = None,
    ) -> RunResult:
        """Ship a script on stdin: `sh -s -- ARGS < script` (or `python3 - ARGS`): one round trip,
        nothing written to the node's disk."""
        return self.run([*interpreter, *args], stdin=script, timeout=timeout)

    def stream(
        self, argv: Sequence[str], *, stop: threading.Event | None = None, timeout: float | None = None
    ) -> Iterator[str]:
        """Yield the output lines (stdout and stderr together) of a long-running command such as
        `docker logs -f`, until it ends, `stop` is set, or `timeout` seconds pass (None: no limit)."""
        command = remote_command(argv)
        deadline = None if timeout is None else time.monotonic() + timeout
        chan = self._channel(self._command_timeout)
        buf = b""
        try:
            chan.set_combine_stderr(True)
            chan.exec_command(command)
            chan.shutdown_write()
            while not (stop is not None and stop.is_set()):
                if deadline is not None and time.monotonic() > deadline:
                    return
                select.select([chan], [], [], 0.2)
                while chan.recv_ready():
                    buf += chan.recv(65536)
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    yield line.decode("utf-8", errors="replace")
                if (chan.eof_received or chan.closed) and not chan.recv_ready():
                    break
            if buf and not (stop is not None and stop.is_set()):
                yield buf.decode("utf-8", errors="replace")
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc) from None
        finally:
            chan.close()

    def put_bytes(self, path: str, data: bytes, mode: int = 0o600) -> None:
        """Write `data` to `path` on the node over SFTP (same connection): the file gets `mode`
        before any byte is written, and appears atomically (written aside, then renamed)."""
        tmp = f"{path}.sparkctl-{secrets.token_hex(4)}"
        try:
            with self._sftp_lock:
                if self._sftp is None:
                    self._sftp = self._transport.open_sftp_client()
                sftp = self._sftp
            assert sftp is not None
            with sftp.open(tmp, "wb") as f:
                f.chmod(mode)
                f.write(data)
            sftp.posix_rename(tmp, path)
        except OSError as exc:  # SFTP reports remote failures as IOError with the server's message
            raise NodeError(
                self.name,
                "sftp",
                f"cannot write {path}: {exc}",
                f"check that the folder exists and is writable for {self.target.user} on {self.name}",
            ) from None
        except (paramiko.SSHException, EOFError) as exc:
            raise self._lost(exc) from None

    def docker(
        self, args: Sequence[str], *, stdin: bytes | None = None, timeout: float | None = None
    ) -> RunResult:
        """The docker CLI on the node, talking to the engine the SSH session's DOCKER_HOST names."""
        return self.run(["docker", *args], stdin=stdin, timeout=timeout)

    def docker_json(self, args: Sequence[str], *, timeout: float | None = None) -> Any:
        """`docker ARGS` whose output is JSON: one document, or one per line (`--format '{{json .}}'`
        on a list command) returned as a list."""
        res = self.docker(args, timeout=timeout)
        if not res.ok:
            first = next((ln for ln in res.stderr.splitlines() if ln.strip()), f"exit status {res.exit_code}")
            raise NodeError(
                self.name,
                "docker",
                f"`docker {_short(shlex.join(args))}` failed: {first[:300]}",
                f"check the Docker engine on {self.name} (`docker version` there, DOCKER_HOST)",
            )
        text = res.stdout.strip()
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            pass
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise NodeError(
                self.name,
                "output",
                f"`docker {_short(shlex.join(args))}` printed something that is not JSON ({exc.msg})",
            ) from None

    def host_key(self) -> tuple[str, str]:
        """(type, base64) of the host key this connection verified against known_hosts."""
        key = self._transport.get_remote_server_key()
        return key.get_name(), key.get_base64()

    def close(self) -> None:
        with self._sftp_lock:
            if self._sftp is not None:
                self._sftp.close()
        self._transport.close()


def wait_channel(chan: paramiko.Channel, timeout: float) -> None:
    """Wait up to `timeout` for a channel's output or its end. After EOF the channel stays readable
    for select, which would then return at once, over and over, until the exit status comes: wait
    for that (or the close) instead."""
    if chan.eof_received:
        chan.status_event.wait(timeout)
    else:
        select.select([chan], [], [], timeout)


class Session:
    """One command on a node, talked to in turns: send some input and read until a marker shows up
    on stdout (`read_until`), then send the rest and wait for the end (`finish`). `check` uses it so
    that one probe per node does both rounds: the facts, then -- once every node's facts are in and
    the fabric addresses are known -- the reach test, on the same channel. `timeout` bounds it all."""

    def __init__(self, node: Node, command: str, timeout: float) -> None:
        self.node, self.command, self.timeout = node, command, timeout
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.out, self.err = bytearray(), bytearray()
        self._chan = node._channel(timeout)
        try:
            self._chan.exec_command(command)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self._chan.close()
            raise node._lost(exc) from None

    def _pump(self, stdin: bytes, *, eof: bool, marker: bytes | None) -> bool:
        """Feed stdin (then EOF, when `eof`) as the window allows while draining stdout and stderr
        -- a remote that writes a lot before reading would otherwise deadlock with us -- until
        `marker` is on stdout (True) or the command has ended and all is read (False)."""
        chan, pending = self._chan, memoryview(stdin)
        if eof and not pending:
            chan.shutdown_write()
        while True:
            if marker is not None and not pending and marker in self.out:
                return True
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise NodeError(
                    self.node.name,
                    "command-timeout",
                    f"`{_short(self.command)}` did not finish within {self.timeout:g}s",
                    f"check what hangs on {self.node.name}; raise the timeout if it is just slow",
                )
            while pending and chan.send_ready():
                n = chan.send(bytes(pending[:65536]))
                pending = pending[n:]
                if not pending and eof:
                    chan.shutdown_write()
            wait_channel(chan, 0.005 if pending else min(left, 0.2))
            while chan.recv_ready():
                self.out += chan.recv(65536)
            while chan.recv_stderr_ready():
                self.err += chan.recv_stderr(65536)
            if len(self.out) > MAX_OUTPUT_BYTES or len(self.err) > MAX_OUTPUT_BYTES:
                raise NodeError(
                    self.node.name, "output", f"`{_short(self.command)}` printed more than {MAX_OUTPUT_BYTES} bytes"
                )
            if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                if not chan.recv_ready() and not chan.recv_stderr_ready():
                    return False

    def read_until(self, marker: bytes, stdin: bytes = b"") -> bool:
        """Send stdin (keeping the input open) and read until `marker` is on stdout: True, or False
        when the command ended first. The output so far is in .out and .err."""
        try:
            return self._pump(stdin, eof=False, marker=marker)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self.close()
            raise self.node._lost(exc) from None
        except NodeError:
            self.close()
            raise

    def finish(self, stdin: bytes = b"") -> RunResult:
        """Send the rest of the input, close it, and wait for the command to end."""
        try:
            self._pump(stdin, eof=True, marker=None)
            code = self._chan.recv_exit_status()
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self.node._lost(exc) from None
        finally:
            self._chan.close()
        return RunResult(
            self.out.decode("utf-8", errors="replace"),
            self.err.decode("utf-8", errors="replace"),
            code,
            time.monotonic() - self.started,
            self.command,
        )

    def poll(self, seconds: float) -> bool:
        """Read what the command prints for up to `seconds`, its input left open (for commands that
        run long and report as they go): True while it runs, False once it has ended and all is read.
        The caller may consume .out/.err between polls."""
        chan, end = self._chan, time.monotonic() + seconds
        try:
            while True:
                wait_channel(chan, max(0.0, min(0.2, end - time.monotonic())))
                while chan.recv_ready():
                    self.out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    self.err += chan.recv_stderr(65536)
                if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                    if not chan.recv_ready() and not chan.recv_stderr_ready():
                        return False
                if time.monotonic() >= end:
                    return True
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self.close()
            raise self.node._lost(exc) from None

    def close(self) -> None:
        """Abandon the command (its channel closes; the remote end sees EOF and a hangup)."""
        self._chan.close()


def docker_json(node: Node, args: Sequence[str], *, timeout: float | None = None) -> Any:
    return node.docker_json(args, timeout=timeout)


def _short(command: str, limit: int = 120) -> str:
    return command if len(command) <= limit else command[: limit - 3] + "..."


# --------------------------------------------------------------------------------------- cluster


class Cluster:
    """Connections to a set of nodes. Use as a context manager: entering connects to every node in
    parallel (one SSH connection each); leaving closes them all."""

    def __init__(
        self,
        nodes: Sequence[str],
        ssh_config: str | Path | None = None,
        *,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        command_timeout: float = DEFAULT_COMMAND_TIMEOUT,
    ) -> None:
        if not nodes:
            raise UsageError("no nodes given", fix="set NODES (or --nodes) to the SSH aliases of your nodes")
        dupes = sorted({n for n in nodes if list(nodes).count(n) > 1})
        if dupes:
            raise UsageError(f"node(s) listed twice: {', '.join(dupes)}", fix="list each node once in NODES")
        self.names: list[str] = list(nodes)
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self._config, self.ssh_config_path = load_ssh_config(ssh_config)
        self._nodes: dict[str, Node] = {}
        self.errors: dict[str, NodeError] = {}
        self._keys = _KeyCache()
        self._jumps = Jumps()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(64, len(nodes)), thread_name_prefix="node"
        )
        self.connect_seconds: float = 0.0

    def __enter__(self) -> Cluster:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def target(self, name: str) -> SshTarget:
        return resolve_target(name, self._config, self.ssh_config_path)

    def connect(self) -> None:
        """Open every node's connection in parallel. Failures land in .errors, never raise."""
        start = time.monotonic()

        def one(name: str) -> Node:
            target = self.target(name)
            transport = connect(target, timeout=self.connect_timeout, keys=self._keys, jumps=self._jumps)
            return Node(target, transport, command_timeout=self.command_timeout)

        todo = [n for n in self.names if n not in self._nodes and n not in self.errors]
        for name, result in zip(todo, self._pool.map(lambda n: _capture(n, one), todo), strict=True):
            if isinstance(result, NodeError):
                self.errors[name] = result
            else:
                self._nodes[name] = result
        self.connect_seconds = time.monotonic() - start
        # One machine reached under two names would run two ranks: refuse it (identity.py).
        refuse_duplicates([n.identity() for n in self._nodes.values()], self.ssh_config_path)

    @property
    def connected(self) -> list[str]:
        return [n for n in self.names if n in self._nodes]

    def node(self, name: str) -> Node:
        """The connected node, or its NodeError raised (why it could not be reached)."""
        if name in self.errors:
            raise self.errors[name]
        if name not in self._nodes:
            raise UsageError(f"{name!r} is not one of this cluster's nodes ({' '.join(self.names)})")
        return self._nodes[name]

    @overload
    def run_all(
        self,
        job: Sequence[str],
        *,
        stdin: bytes | None = ...,
        timeout: float | None = ...,
        env: Mapping[str, str] | None = ...,
        nodes: Sequence[str] | None = ...,
    ) -> dict[str, RunResult | NodeError]: ...

    @overload
    def run_all(
        self,
        job: Callable[[Node], T],
        *,
        stdin: bytes | None = ...,
        timeout: float | None = ...,
        env: Mapping[str, str] | None = ...,
        nodes: Sequence[str] | None = ...,
    ) -> dict[str, T | NodeError]: ...

    def run_all(
        self,
        job: Sequence[str] | Callable[[Node], Any],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        nodes: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Run an argv (or call fn(node)) on every node at once. The answer has every node, in
        order: its result, or the NodeError that stopped it (unreachable nodes included)."""
        names = list(nodes) if nodes is not None else self.names
        if callable(job):
            fn = job
        else:
            argv = list(job)
            remote_command(argv, env)  # bad input fails here, once, not once per node

            def fn(node: Node) -> RunResult:
                return node.run(argv, stdin=stdin, timeout=timeout, env=env)

        def one(name: str) -> Any:
            return fn(self.node(name))

        return dict(zip(names, self._pool.map(lambda n: _capture(n, one), names), strict=True))

    def close(self) -> None:
        for node in self._nodes.values():
            try:
                node.close()
            except Exception:  # closing is best effort; the process is ending anyway
                pass
        self._nodes.clear()
        self._jumps.close()  # after the nodes: their connections run through the hops
        self._pool.shutdown(wait=False, cancel_futures=True)


def _capture(name: str, fn: Callable[[str], T]) -> T | NodeError:
    """fn(name), with any failure turned into that node's NodeError (nothing is lost in a fan-out)."""
    try:
        return fn(name)
    except NodeError as exc:
        return exc
    except (UsageError, CheckFailed) as exc:
        return NodeError(name, "error", exc.message, exc.fix)
    except Exception as exc:
        return NodeError(
            name, "error", f"{type(exc).__name__}: {exc}", "run with -vv and report this as a sparkctl bug"
        )
