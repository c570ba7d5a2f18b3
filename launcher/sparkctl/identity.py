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

from .errors import CheckFailed

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
