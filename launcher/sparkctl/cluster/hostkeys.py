"""known_hosts: the host-key policy. A key is trusted only when known_hosts says so; an unknown, changed
or revoked key is that node's NodeError naming the key type, its SHA256 fingerprint and the command that
trusts it. `sparkctl trust` records keys here (record_host_key)."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import NodeError, UsageError
from .certs import Cert, host_cert_problem
from .sshconfig import SshTarget


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
    marker: str | None = None  # "revoked" or "cert-authority" (a CA: trusted for the host certificates it signs)

    def matches(self, name: str) -> bool:
        return host_matches(self.patterns, name)


def read_known_hosts(paths: Sequence[str]) -> list[KnownHost]:
    """Every parseable entry of the given known_hosts files (missing files are simply empty). A file is
    parsed once per process while it stays the same file (inode, size, mtime): a Cluster of 16 nodes
    reads it for each connection."""
    entries: list[KnownHost] = []
    for path in paths:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UsageError(f"cannot read known_hosts file {path}: {exc.strerror}", fix=f"check {path}") from None
        entries += _parse_known_hosts(path, (st.st_ino, st.st_size, st.st_mtime_ns))
    return entries


@functools.lru_cache(maxsize=32)
def _parse_known_hosts(path: str, version: tuple[int, int, int]) -> tuple[KnownHost, ...]:
    del version  # part of the cache key only
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return ()
    except OSError as exc:
        raise UsageError(f"cannot read known_hosts file {path}: {exc.strerror}", fix=f"check {path}") from None
    entries = []
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
    return tuple(entries)


def host_matches(patterns: Sequence[str], name: str) -> bool:
    """ssh's host-pattern matching: hashed |1|salt|hash entries, * and ? wildcards, !negation."""
    matched = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat[1:] if negate else pat
        if pat.startswith("|1|"):
            hit = _hashed_match(pat, name)
        else:
            pat = pat.lower()
            regex = _wildcard(pat)
            hit = pat == name.lower() if regex is None else regex.fullmatch(name.lower()) is not None
        if hit and negate:
            return False
        matched = matched or hit
    return matched


@functools.lru_cache(maxsize=4096)
def _wildcard(pat: str) -> re.Pattern[str] | None:
    """A lower-case pattern with `*`/`?` as a compiled regex; None for a plain name (compared as text).
    Every node's verdict reads every known_hosts entry: compiled once per pattern, not per node."""
    if "*" not in pat and "?" not in pat:
        return None
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pat))


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
    status: str  # "trusted" | "unknown" | "changed" | "revoked" | "cert-invalid"
    key_type: str
    fingerprint: str
    known: tuple[KnownHost, ...] = ()  # for "changed": the entries that disagree; "cert-invalid": the CA's
    cert: Cert | None = None  # the host certificate it offered, if it offered one
    problem: str = ""  # for "cert-invalid": why ssh would not accept the certificate


def knows_a_ca_for(target: SshTarget, entries: Sequence[KnownHost]) -> bool:
    """Whether known_hosts has an @cert-authority line for this host (then its certificate is asked for)."""
    return any(e.marker == "cert-authority" and e.matches(target.known_hosts_name) for e in entries)


def judge_host_key(target: SshTarget, key_type: str, key_blob: bytes, cert: Cert | None = None) -> HostKeyVerdict:
    """Compare the key a host offered with what known_hosts says about target.known_hosts_name, as ssh
    does: a certificate signed by a CA that an @cert-authority line trusts for the host is judged by
    its CA signature, type, validity and principals; any other certificate by its plain key."""
    name = target.known_hosts_name
    entries = [e for e in read_known_hosts([*target.known_hosts_files, *target.global_known_hosts_files])]
    fp = fingerprint(key_blob)
    revoked = {e.key_blob for e in entries if e.marker == "revoked"}
    if key_blob in revoked or (cert is not None and cert.ca_blob in revoked):
        return HostKeyVerdict("revoked", key_type, fp, cert=cert)
    if cert is not None:
        cas = tuple(e for e in entries if e.marker == "cert-authority" and e.key_blob == cert.ca_blob
                    and e.matches(name))
        if cas:
            problem = host_cert_problem(cert, target.host_key_alias or target.hostname)
            if problem is None:
                return HostKeyVerdict("trusted", key_type, fp, cas, cert)
            return HostKeyVerdict("cert-invalid", key_type, fp, cas, cert, problem)
    mine = [e for e in entries if e.marker is None and e.matches(name)]
    if any(e.key_blob == key_blob and e.key_type == key_type for e in mine):
        return HostKeyVerdict("trusted", key_type, fp, cert=cert)
    same_type = tuple(e for e in mine if e.key_type == key_type)
    if same_type:
        return HostKeyVerdict("changed", key_type, fp, same_type, cert)
    return HostKeyVerdict("unknown", key_type, fp, tuple(mine), cert)


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
            f"verify the new fingerprint out of band; if the change is expected, run `{trust} --replace`",
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
    if verdict.status == "cert-invalid" and verdict.cert is not None:
        ca = verdict.known[0]
        return NodeError(
            target.alias,
            "hostkey-cert",
            f"host certificate of {where} is not accepted: {verdict.problem} (key {verdict.key_type} "
            f"{verdict.fingerprint}, id {verdict.cert.key_id!r}, signed by the CA of @cert-authority at {ca.path}:{ca.line})",
            f"have the host's certificate reissued (`ssh-keygen -s CA_KEY -h -n "
            f"{target.host_key_alias or target.hostname} ...` on its host key) and installed as sshd's HostCertificate",
            key_type=verdict.key_type,
            fingerprint=verdict.fingerprint,
        )
    other = (
        f" (known_hosts has only {', '.join(sorted({e.key_type for e in verdict.known}))} for it)"
        if verdict.known
        else ""
    )
    if verdict.cert is not None:
        ca_fp = fingerprint(verdict.cert.ca_blob)
        other += (f"; it also offered a host certificate signed by CA {verdict.cert.ca_type} {ca_fp}, which no "
                  f"@cert-authority line trusts for {target.known_hosts_name}")
    fix = f"check that fingerprint out of band, then run `{trust}`"
    if not target.known_hosts_files:
        fix = (f"the ssh config sets `UserKnownHostsFile none` (or /dev/null) for {target.alias}: set it to a file "
               f"(e.g. ~/.ssh/known_hosts) in {target.ssh_config or '~/.ssh/config'}, check that fingerprint out of "
               f"band, then run `{trust}`")
    return NodeError(
        target.alias,
        "hostkey-unknown",
        f"host key of {where} is not in known_hosts ({files}){other}: it offered {verdict.key_type} {verdict.fingerprint}",
        fix,
        key_type=verdict.key_type,
        fingerprint=verdict.fingerprint,
    )


def no_known_hosts_file(target: SshTarget) -> UsageError:
    """The refusal of `trust` for a host whose ssh config names no file to record keys in."""
    where = target.ssh_config or "~/.ssh/config"
    return UsageError(
        f"{target.alias}: the ssh config sets `UserKnownHostsFile none` (or /dev/null) for it: there is no "
        "known_hosts file to record its host key in (OpenSSH reads no file then, and neither does sparkctl)",
        fix=f"set UserKnownHostsFile to a file (e.g. ~/.ssh/known_hosts) in the entry for {target.alias} in "
            f"{where}, then run `{target.trust_command()}`",
    )


def record_host_key(target: SshTarget, key_type: str, key_blob: bytes) -> str:
    """Append the key to the first UserKnownHostsFile (hashed when HashKnownHosts=yes), first
    removing this host's entries of the same type (the `trust --replace` of a changed key); every other
    line stays byte for byte. The file is replaced atomically (a new file, renamed over it), written
    through a symlink to its target, with its mode (and, as root, its owner) kept. Returns the file."""
    if not target.known_hosts_files:
        raise no_known_hosts_file(target)
    path = Path(os.path.realpath(target.known_hosts_files[0]))
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = target.known_hosts_name
    kept: list[bytes] = []
    try:
        st: os.stat_result | None = path.stat()
    except FileNotFoundError:
        st = None
    if st is not None:
        lines = path.read_bytes().split(b"\n")
        if lines[-1] == b"":
            lines.pop()  # the last line's newline (or an empty file)
        for line in lines:
            fields = line.decode("utf-8", "replace").split()
            drop = (
                len(fields) >= 3
                and not fields[0].startswith(("#", "@"))
                and fields[1] == key_type
                and host_matches(fields[0].split(","), name)
            )
            if not drop:
                kept.append(line)
    entry_name = hash_hostname(name) if target.hash_known_hosts else name
    kept.append(f"{entry_name} {key_type} {base64.b64encode(key_blob).decode()}".encode())
    tmp = path.with_name(f".{path.name}.sparkctl-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            if st is not None:
                os.fchmod(f.fileno(), st.st_mode & 0o7777)
                if os.geteuid() == 0:
                    os.fchown(f.fileno(), st.st_uid, st.st_gid)
            f.write(b"\n".join(kept) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return str(path)
