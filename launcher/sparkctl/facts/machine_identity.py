"""One machine, counted once: two node aliases that reach the same machine are refused.

Alias strings prove nothing: two `Host` entries with the same HostName (a typo), an `Include` that
collapses aliases, an IP and a DNS name of one box. What identifies the machine at the other end is
what it says about itself: its `/etc/machine-id` (systemd's machine-id(5), unique per installation)
and its SSH host key (the server's key of the verified connection). `Cluster.connect` reads both for
every node, and every command that connects refuses a cluster where two nodes share either, naming
both aliases and the HostName each resolved to.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import CheckFailed
from .parsing import ParseError, parse_json

_MACHINE_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class NodeIdentity:
    alias: str
    hostname: str  # what the alias resolved to (ssh config HostName)
    port: int
    host_key: str | None  # SHA256 fingerprint of the server's host key
    machine_id: str | None  # /etc/machine-id, when the node has a well-formed one


def parse_machine_id(text: str) -> str | None:
    """machine-id(5): 32 lower-case hex digits and a newline; anything else is unknown (None)."""
    value = text.strip()[:64]
    return value if _MACHINE_ID.fullmatch(value) else None


def same_machine(a: NodeIdentity, b: NodeIdentity) -> list[str]:
    """What says a and b are one machine (empty: nothing does)."""
    why = []
    if a.machine_id and a.machine_id == b.machine_id:
        why.append(f"the same /etc/machine-id {a.machine_id[:12]}…")
    if a.host_key and a.host_key == b.host_key:
        why.append(f"the same SSH host key {a.host_key}")
    return why


def duplicates(nodes: Sequence[NodeIdentity]) -> list[str]:
    """One line per pair of nodes that are one machine."""
    lines = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            why = same_machine(a, b)
            if why:
                lines.append(f"{a.alias} (HostName {a.hostname}, port {a.port}) and {b.alias} "
                             f"(HostName {b.hostname}, port {b.port}) are one machine: {' and '.join(why)}")
    return lines


def refuse_duplicates(nodes: Sequence[NodeIdentity], ssh_config: str | None) -> None:
    lines = duplicates(nodes)
    if lines:
        where = f" in {ssh_config}" if ssh_config else ""
        raise CheckFailed(
            "two node names reach the same machine, which would run two ranks there:\n  " + "\n  ".join(lines),
            fix=f"correct the HostName of one alias{where} (`ssh -G ALIAS` shows what it resolves to), "
                "or list each machine once in NODES; cloned machines need their own machine-id "
                "(systemd-machine-id-setup) and host keys (ssh-keygen -A)",
        )


# ------------------------------------------------------------------ who each node was at the last `up`

RECORD_NAME = "identity.json"  # under ~/.sparkctl/<cluster>/ on every node, written by a successful `up`
RECORD_MARK = "@@sparkctl-identity-record"
MAX_RECORD_CHARS = 64 * 1024  # one line per node of a few hundred bytes; more is not ours

# Prints the machine's /etc/machine-id, then this cluster's identity record (if any): one round trip.
WHOAMI = r'''cat /etc/machine-id 2>/dev/null; echo; echo "$2"; cat -- "$1" 2>/dev/null | head -c "$3"; exit 0'''
_WRITE = r'''f="$1"; umask 077 && mkdir -p -- "${f%/*}" && cat > "$f.tmp" && mv -f -- "$f.tmp" "$f"'''


def whoami_argv(record_path: str) -> list[str]:
    return ["sh", "-c", WHOAMI, "sparkctl-whoami", record_path, RECORD_MARK, str(MAX_RECORD_CHARS)]


def write_record_argv(record_path: str) -> list[str]:
    """The record comes on stdin."""
    return ["sh", "-c", _WRITE, "sparkctl-identity", record_path]


@dataclass(frozen=True)
class Seen:
    """A node as this command found it: who answered, and the record the last `up` left on that machine."""

    identity: NodeIdentity
    record: dict[str, dict[str, str | None]] | None  # alias -> {"machine_id", "host_key"}, from the record
    recorded_when: str = ""


def parse_whoami(identity: NodeIdentity, text: str) -> Seen:
    """WHOAMI's output (untrusted) -> what the machine is and the last `up`'s record on it."""
    head, _, rest = text.partition(RECORD_MARK)
    ident = NodeIdentity(identity.alias, identity.hostname, identity.port, identity.host_key,
                         parse_machine_id(head.strip().split("\n", 1)[0]) if head.strip() else None)
    try:
        doc = parse_json(rest.strip()[:MAX_RECORD_CHARS]) if rest.strip() else None
    except ParseError:
        doc = None
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, dict):
        return Seen(ident, None)
    record: dict[str, dict[str, str | None]] = {}
    for alias, v in list(nodes.items())[:1024]:
        if isinstance(alias, str) and isinstance(v, dict):
            mid, key = v.get("machine_id"), v.get("host_key")
            record[alias[:256]] = {"machine_id": mid[:64] if isinstance(mid, str) else None,
                                   "host_key": key[:128] if isinstance(key, str) else None}
    when = doc.get("when") if isinstance(doc, dict) else ""
    return Seen(ident, record, when[:40] if isinstance(when, str) else "")


def record_doc(identities: Sequence[NodeIdentity], when: str) -> str:
    """What `up` leaves on every node: every node's identity as this `up` saw it."""
    import json

    return json.dumps({"when": when, "nodes": {i.alias: {"machine_id": i.machine_id, "host_key": i.host_key}
                                               for i in identities}}, sort_keys=True)


def _differs(now: NodeIdentity, was: dict[str, str | None]) -> bool:
    return any(cur and old and cur != old for cur, old in ((now.machine_id, was.get("machine_id")),
                                                            (now.host_key, was.get("host_key"))))


def _is(now: NodeIdentity, was: dict[str, str | None]) -> bool:
    same = [cur == old for cur, old in ((now.machine_id, was.get("machine_id")), (now.host_key, was.get("host_key")))
            if cur and old]
    return bool(same) and all(same)


@dataclass(frozen=True)
class Swap:
    node: str  # the alias
    was: str | None  # the alias whose machine it reaches now (None: a machine not in the cluster then)
    detail: str

    def describe(self) -> str:
        if self.was:
            return f"{self.node} now reaches the machine that was {self.was} at the last `up` ({self.detail})"
        return f"{self.node} now reaches another machine than at the last `up` ({self.detail})"

    def as_dict(self) -> dict[str, str | None]:
        return {"node": self.node, "was": self.was, "detail": self.detail}


def _short(v: str | None) -> str:
    return (v[:12] + "…") if v and len(v) > 12 else (v or "unknown")


def swaps(seen: dict[str, Seen]) -> list[Swap]:
    """Each node whose machine is not the one the last `up` recorded under its name. The reference is
    the newest record found on any of the nodes (every node holds the same one after an `up`), so a
    swapped head is found too."""
    records = [s for s in seen.values() if s.record is not None]
    if not records:
        return []
    ref = max(records, key=lambda s: s.recorded_when).record
    assert ref is not None
    found = []
    for alias, s in seen.items():
        was = ref.get(alias)
        if was is None or not _differs(s.identity, was):
            continue
        other = next((a for a, w in ref.items() if a != alias and _is(s.identity, w)), None)
        now_id = s.identity.machine_id or s.identity.host_key
        old_id = was.get("machine_id") if s.identity.machine_id else was.get("host_key")
        kind = "machine-id" if s.identity.machine_id else "host key"
        found.append(Swap(alias, other, f"HostName {s.identity.hostname}: {kind} {_short(now_id)}, "
                                        f"recorded {_short(old_id)}"))
    return found


def refuse_swaps(found: Sequence[Swap], command: str, ssh_config: str | None) -> None:
    if not found:
        return
    where = f" in {ssh_config}" if ssh_config else ""
    raise CheckFailed(
        f"{command} refused: {len(found)} node name(s) reach another machine than at the last `up`:\n  "
        + "\n  ".join(s.describe() for s in found),
        node=found[0].node if len(found) == 1 else None,
        fix=f"correct the HostName of those aliases{where} (`ssh -G ALIAS` shows what each resolves to); "
            f"or, to act on the machines the names reach now, `sparkctl {command} --force`",
    )
