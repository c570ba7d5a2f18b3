"""OpenSSH certificates (PROTOCOL.certkeys): read one, and check a host's against a CA the way ssh(1) does.

paramiko carries certificates (a user's, offered with its key; a host's, received in the key exchange)
but checks nothing in them: its own docs say the server decides. For a host certificate the client
decides, so the checks ssh makes are made here: the CA's signature over the certificate, that it is a
host certificate, its validity period, that its principals name the host (HostKeyAlias, else HostName),
and that it has no critical options (ssh refuses a host certificate with any).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import paramiko

USER_CERT, HOST_CERT = 1, 2
CERT_SUFFIX = "-cert-v01@openssh.com"

# The key-specific fields between the nonce and the serial, by certificate type: how many strings
# (mpints are strings on the wire). ssh-rsa: e, n; ecdsa: curve, point; ed25519: the key.
_KEY_FIELDS = {"ssh-rsa": 2, "ssh-ed25519": 1, "ecdsa-sha2-nistp256": 2, "ecdsa-sha2-nistp384": 2,
               "ecdsa-sha2-nistp521": 2}


class CertError(ValueError):
    """Not a certificate this client can read (its reason is said to a person)."""


@dataclass(frozen=True)
class Cert:
    key_type: str  # the plain key's type, e.g. "ssh-ed25519"
    key_blob: bytes  # the certified public key, as a plain key blob (compare with known_hosts / a private key)
    serial: int
    cert_type: int  # USER_CERT or HOST_CERT
    key_id: str
    principals: tuple[str, ...]  # empty: valid for any
    valid_after: int
    valid_before: int
    critical_options: bytes
    ca_blob: bytes  # the signing CA's public key blob
    signature: bytes
    signed: bytes  # everything the signature covers

    @property
    def ca_type(self) -> str:
        return _Reader(self.ca_blob).string().decode("ascii", "replace")

    def validity(self, now: float | None = None) -> str | None:
        """None while valid; else why not, in words."""
        now = time.time() if now is None else now
        if now < self.valid_after:
            return f"not valid before {_when(self.valid_after)}"
        if now >= self.valid_before:
            return f"expired {_when(self.valid_before)}"
        return None

    def signature_ok(self) -> bool:
        try:
            ca = paramiko.PKey.from_type_string(self.ca_type, self.ca_blob)
            return bool(ca.verify_ssh_sig(self.signed, paramiko.Message(self.signature)))
        except Exception:  # a CA of a type paramiko lacks, a malformed key or signature: not verified
            return False


def _when(t: int) -> str:
    if t >= 2**63:
        return "forever"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise CertError("truncated certificate")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return int(struct.unpack(">I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack(">Q", self.take(8))[0])

    def string(self) -> bytes:
        return self.take(self.u32())


def _string(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def parse_cert(blob: bytes) -> Cert:
    """A certificate blob (what a `-cert.pub` file holds in base64, or what a host sends) read, not checked."""
    r = _Reader(blob)
    cert_name = r.string().decode("ascii", "replace")
    plain = cert_name.removesuffix(CERT_SUFFIX)
    if plain == cert_name or plain not in _KEY_FIELDS:
        raise CertError(f"{cert_name!r} is not a certificate type sparkctl reads")
    r.string()  # nonce
    start = r.pos
    for _ in range(_KEY_FIELDS[plain]):
        r.string()
    key_blob = _string(plain.encode()) + blob[start:r.pos]
    serial, cert_type = r.u64(), r.u32()
    key_id = r.string().decode("utf-8", "replace")
    p = _Reader(r.string())
    principals = []
    while p.pos < len(p.data):
        principals.append(p.string().decode("utf-8", "replace"))
    valid_after, valid_before = r.u64(), r.u64()
    critical = r.string()
    r.string()  # extensions
    r.string()  # reserved
    ca_blob = r.string()
    signed = blob[:r.pos]
    signature = r.string()
    return Cert(plain, key_blob, serial, cert_type, key_id, tuple(principals), valid_after, valid_before, critical,
                ca_blob, signature, signed)


def host_cert_problem(cert: Cert, name: str) -> str | None:
    """Why ssh would not accept this host certificate for `name` (HostKeyAlias, else HostName), once
    its CA is one known_hosts trusts for the host; None when it would."""
    if cert.cert_type != HOST_CERT:
        return "it is a user certificate, not a host certificate"
    if _Reader(cert.signature).string() == b"ssh-rsa":
        return "its CA signed it with SHA-1 (ssh-rsa), which ssh no longer accepts (CASignatureAlgorithms)"
    if not cert.signature_ok():
        return "its CA signature does not verify"
    if (why := cert.validity()) is not None:
        return f"it is {why}"
    if cert.principals and name not in cert.principals:
        return f"it names {', '.join(cert.principals)}, not {name}"
    if cert.critical_options:
        return "it has critical options (ssh accepts none in a host certificate)"
    return None
