"""The cluster lock and the audit trail (Kamal's idea: `mkdir` on the primary host is atomic).

The lock is a directory on the head node, `~/.sparkctl/<cluster>/lock/`, holding an `owner` file
(who, where, when, what). Every mutating command takes it and always releases it; a second `up`
meanwhile is refused with the holder's name. The audit log is one line per action on every node,
`~/.sparkctl/<cluster>/audit.log`, which `sparkctl audit` merges.

Remote commands are fixed `sh -c` scripts that take every value as a positional argument, so no
value is ever parsed by a shell.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from .builders import REMOTE_STATE_DIR
from .errors import CheckFailed

_ACQUIRE = r'''
d="$1"; owner="$2"
umask 077
mkdir -p "$(dirname "$d")" || exit 3
if mkdir "$d" 2>/dev/null; then
  printf '%s\n' "$owner" > "$d/owner"; exit 0
fi
cat "$d/owner" 2>/dev/null; exit 1
'''
_RELEASE = r'''
d="$1"; me="$2"
[ -d "$d" ] || exit 0
if [ -n "$me" ] && ! grep -qF -- "$me" "$d/owner" 2>/dev/null; then cat "$d/owner" 2>/dev/null; exit 1; fi
rm -rf -- "$d"
'''
_SHOW = r'''d="$1"; [ -d "$d" ] || exit 0; cat "$d/owner" 2>/dev/null || echo '{}'; exit 1'''
_AUDIT_APPEND = r'''f="$1"; shift; umask 077 && mkdir -p "$(dirname "$f")" && printf '%s\n' "$@" >> "$f"'''
_AUDIT_TAIL = r'''f="$1"; n="$2"; [ -f "$f" ] && tail -n "$n" -- "$f" || true'''


MAX_OWNER_CHARS = 4096  # an owner line is ~200 characters; more is not ours


class Runner(Protocol):
    """What the lock needs from a node: run an argv (joined with shlex.join by the cluster layer)."""

    def run(self, argv: list[str], *, timeout: float | None = ...) -> Any: ...


def state_dir(cluster: str) -> str:
    return f"{REMOTE_STATE_DIR}/{cluster}"


def lock_dir(cluster: str) -> str:
    return f"{state_dir(cluster)}/lock"


def audit_file(cluster: str) -> str:
    return f"{state_dir(cluster)}/audit.log"


def whoami() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid{os.getuid()}"
    return f"{user}@{socket.gethostname()}"


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class LockOwner:
    who: str
    pid: int
    since: str
    command: str
    token: str  # unique per acquisition: only the holder releases without --force

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def parse(cls, text: str) -> LockOwner | None:
        """The owner file as the head printed it (untrusted): None unless it is the JSON object we write."""
        first = text.lstrip()[:MAX_OWNER_CHARS].split("\n", 1)[0].strip()
        try:
            d = json.loads(first) if first else None
        except (ValueError, RecursionError):
            return None
        if not isinstance(d, dict):
            return None
        fields = [d.get(k) for k in ("who", "since", "command", "token")]
        pid = d.get("pid")
        if not all(isinstance(f, str) for f in fields) or isinstance(pid, bool) or not isinstance(pid, int):
            return None
        who, since, command, token = (str(f)[:256] for f in fields)
        return cls(who, pid if 0 <= pid < 2**32 else -1, since, command, token)

    def describe(self) -> str:
        return f"{self.who} (pid {self.pid}) since {self.since}, running `{self.command}`"


def acquire_argv(cluster: str, owner: LockOwner) -> list[str]:
    return ["sh", "-c", _ACQUIRE, "sparkctl-lock", lock_dir(cluster), owner.to_json()]


def release_argv(cluster: str, token: str) -> list[str]:
    return ["sh", "-c", _RELEASE, "sparkctl-unlock", lock_dir(cluster), token]


def show_argv(cluster: str) -> list[str]:
    return ["sh", "-c", _SHOW, "sparkctl-lock-status", lock_dir(cluster)]


def audit_append_argv(cluster: str, lines: list[str]) -> list[str]:
    return ["sh", "-c", _AUDIT_APPEND, "sparkctl-audit", audit_file(cluster), *lines]


def audit_tail_argv(cluster: str, n: int) -> list[str]:
    return ["sh", "-c", _AUDIT_TAIL, "sparkctl-audit", audit_file(cluster), str(int(n))]


def audit_line(*, action: str, config_hash: str | None = None, rank: int | None = None, detail: str = "",
               who: str | None = None, when: str | None = None) -> str:
    """One audit line: JSON, so it survives any value and is easy to merge and filter."""
    doc: dict[str, Any] = {"when": when or now_iso(), "who": who or whoami(), "action": action}
    if rank is not None:
        doc["rank"] = rank
    if config_hash:
        doc["config_hash"] = config_hash
    if detail:
        doc["detail"] = detail.replace("\n", " ")[:500]
    return json.dumps(doc, sort_keys=True)


def new_owner(command: str) -> LockOwner:
    token = os.urandom(8).hex()
    return LockOwner(who=whoami(), pid=os.getpid(), since=now_iso(), command=command, token=token)


def lock_status(head: Runner, cluster: str) -> LockOwner | None:
    r = head.run(show_argv(cluster), timeout=20)
    if r.exit_code == 0:
        return None
    return LockOwner.parse(r.stdout) or LockOwner("unknown", 0, "unknown", "unknown", "")


def force_unlock(head: Runner, cluster: str) -> LockOwner | None:
    held = lock_status(head, cluster)
    head.run(release_argv(cluster, ""), timeout=20)
    return held


@contextmanager
def cluster_lock(head: Runner, head_name: str, cluster: str, command: str) -> Iterator[LockOwner]:
    """Hold the cluster lock on the head for the duration of a mutating command; always release it."""
    owner = new_owner(command)
    r = head.run(acquire_argv(cluster, owner), timeout=20)
    if r.exit_code != 0:
        held = LockOwner.parse(r.stdout)
        who = held.describe() if held else "an unknown holder (no owner file)"
        raise CheckFailed(
            f"the cluster {cluster!r} is locked on {head_name} by {who}",
            fix="wait for it to finish, check with `sparkctl lock status`, or if that process is gone: "
                "`sparkctl lock --force-unlock`",
        )
    try:
        yield owner
    finally:
        head.run(release_argv(cluster, owner.token), timeout=20)
