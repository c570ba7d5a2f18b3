"""The cluster lock and the audit trail (Kamal's idea: `mkdir` on the primary host is atomic).

The lock is a directory on every node of the cluster (where: below), holding an
`owner` file (who, where, when, what) and a `heartbeat` file the holder touches every LEASE_S/4
seconds. Every mutating command takes it on every node it changes and always releases it (signals
included: signals.py); a second command meanwhile is refused with the holder's name and node.

Why every node, and in which order: two operators' env files may name the same nodes in another
order, another head, or only some of the same nodes. A lock on "the head" would then be two locks.
Taken on every node, any two commands of one cluster (CLUSTER_NAME) that share a node meet on it.
`lock_nodes` takes the nodes one by one in one global order, by what each machine says it is
(`/etc/machine-id`, then the host key, then the alias), whatever the env file's order: so of two
commands that share nodes, the one that takes their first shared node first gets all of them, and the
other is refused there (at the latest) -- never both refused, never both holding half. Nothing
waits for a lock, so nothing can deadlock.

A holder that crashed cannot release it. The owner file says which process holds it: the machine
(machine-id, hostname, pid namespace), its boot id, the pid and the process's start time. The lock is
broken automatically (with an audit line on the node) only on positive evidence that its holder is
dead, and only by a command on the holder's own machine and boot:

- the owner's machine-id, boot id, hostname and pid namespace are all this process's, and
- the kernel says its pid is gone (kill(PID, 0) fails with ESRCH) or now another process
  (/proc/PID/stat readable, with another start time).

Nothing else is evidence. Another boot id is not: a cloned VM (a copied jump host) keeps the
original's /etc/machine-id and hostname, and every machine's initial pid namespace has the same
inode, so a clone differs from its original only by boot id -- exactly as a rebooted machine does.
A holder on another boot may be alive on the clone, so it is never judged. A pid that /proc does not
show (`hidepid=2`: another user's process) and that kill answers with EPERM exists: alive. A holder
that cannot be judged is reported as held -- its owner, host, pid, heartbeat age and the command
that breaks it -- and, when its heartbeat is older than its lease, as stale.

Where the lock lives: one per cluster per node, whoever logs in. `LOCK_ROOT/sparkctl-<cluster>.lock`
(/var/tmp: on every Linux a sticky, world-writable directory, root's, that survives a reboot),
made with `mkdir` (atomic) and mode 0755, its files 0644: every SSH user of that node meets the same
lock and can read who holds it; the sticky bit keeps any other user from removing or renaming it,
and the mode from writing into it. Only the SSH user who took it (or root) can break it: a break by
another user is refused, naming that user. The lock directory's owner is the SSH user that holds it,
which `lock status` shows. Older sparkctl took the lock in the SSH user's home,
`~/.sparkctl/<cluster>/lock/`; every command still takes that one too (after the shared one, with
the same owner), so an older sparkctl of the same SSH user is excluded both ways, and `lock status`
shows a lock found only there. The audit log is one line per action on every node,
`~/.sparkctl/<cluster>/audit.log`, which `sparkctl audit` merges.

Remote commands are fixed `sh -c` scripts that take every value as a positional argument, so no
value is ever parsed by a shell.
"""

from __future__ import annotations

import datetime as _dt
import functools
import getpass
import json
import os
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from .. import signals
from ..cluster import parallel
from ..errors import CheckFailed
from ..facts.parsing import ParseError, parse_json
from ..spec.builders import REMOTE_STATE_DIR
from ..threads import spawn, wait_bounded

# `show DIR WHERE`: the owner file, the heartbeat's age by the node's clock, and who owns the lock
# directory (the SSH user that took it) beside who is looking (this SSH user).
_SHOW_FN = r'''show() {
cat -- "$1/owner" 2>/dev/null
echo "@@sparkctl-lock-age $(date +%s) $(stat -c %Y -- "$1/heartbeat" "$1/owner" 2>/dev/null | head -n 1)"
echo "@@sparkctl-lock-user $2 $(stat -c %U -- "$1" 2>/dev/null || echo '?') $(id -un 2>/dev/null || echo '?')"
}
there() { [ -e "$1" ] || [ -L "$1" ]; }
'''
# The shared lock first (mode 0755, files 0644: every SSH user reads it, none but its own writes it),
# then the one in the SSH user's home that older sparkctl takes; either held: nothing is kept, exit 1.
# Exit 3: the lock could not be made at all (no LOCK_ROOT, a full disk), said on stderr.
_ACQUIRE = _SHOW_FN + r'''d="$1"; home="$2"; owner="$3"
root=$(dirname -- "$d")
[ -d "$root" ] || mkdir -p -m 1777 -- "$root" 2>/dev/null
umask 022
if ! mkdir -- "$d" 2>/dev/null; then
  if there "$d"; then show "$d" shared; exit 1; fi
  echo "cannot make $d: $(mkdir -- "$d" 2>&1)" >&2; exit 3
fi
if ! { printf '%s\n' "$owner" > "$d/owner" && : > "$d/heartbeat"; }; then rm -rf -- "$d"; echo "cannot write in $d" >&2; exit 3; fi
umask 077
if mkdir -p -- "$(dirname -- "$home")" && mkdir -- "$home" 2>/dev/null; then
  printf '%s\n' "$owner" > "$home/owner" && : > "$home/heartbeat" && exit 0
  rm -rf -- "$home"
fi
rm -rf -- "$d"
if there "$home"; then show "$home" home; exit 1; fi
echo "cannot make $home" >&2; exit 3
'''
# Remove each lock whose owner file holds the token (every lock with an empty token: --force-unlock).
# Exit 1: a lock is someone else's (its owner printed); 2: one could not be removed (another SSH user's:
# the sticky LOCK_ROOT keeps it), with a @@sparkctl-lock-kept line naming its owner.
_RELEASE = r'''d="$1"; home="$2"; me="$3"; rc=0
for x in "$d" "$home"; do
  [ -e "$x" ] || [ -L "$x" ] || continue
  if [ -n "$me" ] && ! grep -qF -- "$me" "$x/owner" 2>/dev/null; then
    cat -- "$x/owner" 2>/dev/null; [ "$rc" = 2 ] || rc=1; continue
  fi
  rm -rf -- "$x" 2>/dev/null
  if [ -e "$x" ] || [ -L "$x" ]; then
    echo "@@sparkctl-lock-kept $(stat -c %U -- "$x" 2>/dev/null || echo '?') $x"; rc=2
  fi
done
exit $rc
'''
_SHOW = _SHOW_FN + r'''if there "$1"; then show "$1" shared; exit 1; fi
if there "$2"; then show "$2" home; exit 1; fi
exit 0'''
# Touch the heartbeat only while the lock is still ours (someone may have broken it).
_HEARTBEAT = r'''me="$3"; rc=1
for x in "$1" "$2"; do grep -qF -- "$me" "$x/owner" 2>/dev/null && touch -- "$x/heartbeat" && rc=0; done
exit $rc'''
_AUDIT_APPEND = r'''f="$1"; shift; umask 077 && mkdir -p "$(dirname "$f")" && printf '%s\n' "$@" >> "$f"'''
_AUDIT_TAIL = r'''f="$1"; n="$2"; [ -f "$f" ] && tail -n "$n" -- "$f" || true'''


MAX_OWNER_CHARS = 4096  # an owner line is ~200 characters; more is not ours
LEASE_S = 60  # a holder that has not touched its heartbeat for this long is stale
AGE_MARK = "@@sparkctl-lock-age"
USER_MARK = "@@sparkctl-lock-user"
KEPT_MARK = "@@sparkctl-lock-kept"
# Where every SSH user of a node meets the cluster's lock: sticky and world-writable on every Linux, kept
# across reboots. (The unit tests point it at a folder of each test node's own.)
LOCK_ROOT = "/var/tmp"


class Runner(Protocol):
    """What the lock needs from a node: run an argv (joined with shlex.join by the cluster layer)."""

    def run(self, argv: list[str], *, timeout: float | None = ...) -> Any: ...


def state_dir(cluster: str) -> str:
    return f"{REMOTE_STATE_DIR}/{cluster}"


def lock_dir(cluster: str) -> str:
    """The cluster's lock on a node, the same path for every SSH user."""
    return f"{LOCK_ROOT}/sparkctl-{cluster}.lock"


def home_lock_dir(cluster: str) -> str:
    """Where sparkctl before the shared lock took it (relative to the SSH user's home); still taken too."""
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
    # Which process, provably (empty in locks written by older sparkctl):
    host: str = ""
    machine_id: str = ""
    boot_id: str = ""
    pidns: str = ""
    start_ticks: int = -1  # /proc/PID/stat field 22: the pid's start time, so a reused pid is told apart
    lease_s: int = LEASE_S

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def parse(cls, text: str) -> LockOwner | None:
        """The owner file as the head printed it (untrusted): None unless it is the JSON object we write."""
        first = text.lstrip()[:MAX_OWNER_CHARS].split("\n", 1)[0].strip()
        try:
            d = parse_json(first) if first else None
        except ParseError:
            return None
        if not isinstance(d, dict):
            return None
        fields = [d.get(k) for k in ("who", "since", "command", "token")]
        pid = d.get("pid")
        if not all(isinstance(f, str) for f in fields) or isinstance(pid, bool) or not isinstance(pid, int):
            return None
        who, since, command, token = (str(f)[:256] for f in fields)
        extra = {k: str(d[k])[:128] for k in ("host", "machine_id", "boot_id", "pidns") if isinstance(d.get(k), str)}
        return cls(who, pid if 0 <= pid < 2**32 else -1, since, command, token, **extra,
                   start_ticks=_bounded(d.get("start_ticks"), 0, 2**63, -1),
                   lease_s=_bounded(d.get("lease_s"), 1, 10**6, LEASE_S))

    def describe(self) -> str:
        where = f" on {self.host}" if self.host else ""
        return f"{self.who} (pid {self.pid}{where}) since {self.since}, running `{self.command}`"

    def public(self) -> dict[str, Any]:
        """What `lock status --json` shows (never the token: it releases the lock)."""
        return {k: v for k, v in self.__dict__.items() if k != "token"}


def _bounded(v: Any, lo: int, hi: int, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi else default


def heartbeat_age(text: str) -> int | None:
    """Seconds since the holder's last heartbeat, by the head's own clock (no skew), from the
    `@@sparkctl-lock-age NOW MTIME` line; None when the head did not say."""
    for line in text[-4096:].splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == AGE_MARK and all(p.isascii() and p.isdigit() for p in parts[1:]):
            return max(0, int(parts[1]) - int(parts[2]))
    return None


# ------------------------------------------------------------------------- is the holder alive?


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(4096).strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (proc(5), stat field 22); None when /proc/PID
    cannot be read: no such pid, or one this user may not see (hidepid)."""
    stat = _read(f"/proc/{pid}/stat")
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _no_such_pid(pid: int) -> bool:
    """True only when the kernel says there is no process `pid` in this pid namespace (ESRCH). EPERM
    means it exists and belongs to another user; anything else says nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def holder_verdict(owner: LockOwner) -> str | None:
    """Why the holder is provably dead ("pid 123 on HOST is gone", ...), or None: alive, or no proof.

    Proof needs the holder's whole identity to be this process's -- machine-id, boot id, hostname and
    pid namespace -- and then the kernel's word about its pid: /proc/PID/stat readable with another
    start time (the pid was reused), or kill(PID, 0) failing with ESRCH (no such process). A pid whose
    /proc entry cannot be read (hidepid) and that kill answers with EPERM exists: alive. Another boot id
    is no proof (this module's docstring says why)."""
    if owner.pid <= 0 or owner.start_ticks < 0:
        return None
    mine = (_read("/etc/machine-id"), _read("/proc/sys/kernel/random/boot_id"), socket.gethostname(), _pidns())
    theirs = (owner.machine_id, owner.boot_id, owner.host, owner.pidns)
    if not all(theirs) or theirs != mine:
        return None
    ticks = _start_ticks(owner.pid)
    if ticks is not None:
        return None if ticks == owner.start_ticks else \
            f"pid {owner.pid} on {owner.host} is now another process (started later)"
    if _no_such_pid(owner.pid):
        return f"pid {owner.pid} on {owner.host} is gone"
    return None


def acquire_argv(cluster: str, owner: LockOwner) -> list[str]:
    return ["sh", "-c", _ACQUIRE, "sparkctl-lock", lock_dir(cluster), home_lock_dir(cluster), owner.to_json()]


def heartbeat_argv(cluster: str, token: str) -> list[str]:
    return ["sh", "-c", _HEARTBEAT, "sparkctl-lock-heartbeat", lock_dir(cluster), home_lock_dir(cluster), token]


def release_argv(cluster: str, token: str) -> list[str]:
    return ["sh", "-c", _RELEASE, "sparkctl-unlock", lock_dir(cluster), home_lock_dir(cluster), token]


def show_argv(cluster: str) -> list[str]:
    return ["sh", "-c", _SHOW, "sparkctl-lock-status", lock_dir(cluster), home_lock_dir(cluster)]


def audit_append_argv(cluster: str, lines: list[str]) -> list[str]:
    return ["sh", "-c", _AUDIT_APPEND, "sparkctl-audit", audit_file(cluster), *lines]


def audit_tail_argv(cluster: str, n: int) -> list[str]:
    return ["sh", "-c", _AUDIT_TAIL, "sparkctl-audit", audit_file(cluster), str(int(n))]


def audit_line(*, action: str, config_hash: str | None = None, rank: int | None = None, detail: str = "",
               who: str | None = None, when: str | None = None, container: str | None = None) -> str:
    """One audit line: JSON, so it survives any value and is easy to merge and filter. `container`:
    the full container ID (an `up` line with it is what makes a container not an orphan: cleanup.py)."""
    doc: dict[str, Any] = {"when": when or now_iso(), "who": who or whoami(), "action": action}
    if rank is not None:
        doc["rank"] = rank
    if container:
        doc["container"] = container[:128]
    if config_hash:
        doc["config_hash"] = config_hash
    if detail:
        doc["detail"] = detail.replace("\n", " ")[:500]
    return json.dumps(doc, sort_keys=True)


def new_owner(command: str) -> LockOwner:
    token = os.urandom(8).hex()
    pid = os.getpid()
    return LockOwner(who=whoami(), pid=pid, since=now_iso(), command=command, token=token,
                     host=socket.gethostname(), machine_id=_read("/etc/machine-id"),
                     boot_id=_read("/proc/sys/kernel/random/boot_id"), pidns=_pidns(),
                     start_ticks=_start_ticks(pid) or -1)


def _names(text: str, mark: str, n: int) -> list[str] | None:
    """The `n` words after `mark` on its own line (the node's, untrusted: short printable words only)."""
    for line in text[-4096:].splitlines():
        parts = line.split()
        if len(parts) >= n + 1 and parts[0] == mark:
            return [p[:64] if p.isprintable() else "?" for p in parts[1:n + 1]]
    return None


@dataclass(frozen=True)
class LockState:
    """The lock as a node shows it: its holder, the heartbeat's age, whether the holder is provably dead,
    the SSH user that owns the lock (who took it there), who is looking, and where it was found: the
    shared lock, or only in the SSH user's home (taken by an older sparkctl)."""

    owner: LockOwner
    age_s: int | None
    dead: str | None  # why the holder is provably dead (same machine), else None
    ssh_user: str = ""
    viewer: str = ""
    where: str = "shared"

    @property
    def stale(self) -> bool:
        return self.dead is None and self.age_s is not None and self.age_s > self.owner.lease_s

    @property
    def others(self) -> bool:
        """Held by another SSH user than the one looking: only that user (or root) can remove it."""
        return bool(self.ssh_user and self.viewer and self.ssh_user != self.viewer and self.viewer != "root")

    def describe(self) -> str:
        text = self.owner.describe()
        if self.ssh_user:
            text += f", as SSH user {self.ssh_user}"
        if self.where == "home":
            text += " (in that user's home: taken by an older sparkctl)"
        if self.dead:
            return f"{text}; its holder is dead ({self.dead})"
        if self.age_s is not None:
            text += f"; last heartbeat {self.age_s}s ago"
            if self.stale:
                text += f" (stale: the lease is {self.owner.lease_s}s; its holder has probably crashed)"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {**self.owner.public(), "heartbeat_age_s": self.age_s, "stale": self.stale, "dead": self.dead,
                "ssh_user": self.ssh_user or None, "where": self.where}


def _state_from(text: str) -> LockState:
    owner = LockOwner.parse(text) or LockOwner("unknown", 0, "unknown", "unknown", "")
    where, ssh_user, viewer = _names(text, USER_MARK, 3) or ["shared", "", ""]
    return LockState(owner, heartbeat_age(text), holder_verdict(owner), "" if ssh_user == "?" else ssh_user,
                     "" if viewer == "?" else viewer, "home" if where == "home" else "shared")


def lock_state(head: Runner, cluster: str) -> LockState | None:
    r = head.run(show_argv(cluster), timeout=20)
    return None if r.exit_code == 0 else _state_from(r.stdout)


def lock_status(head: Runner, cluster: str) -> LockOwner | None:
    st = lock_state(head, cluster)
    return st.owner if st else None


def kept_by(text: str) -> str | None:
    """The SSH user whose lock a release could not remove (`@@sparkctl-lock-kept USER PATH`), or None."""
    got = _names(text, KEPT_MARK, 1)
    return got[0] if got else None


def force_unlock(head: Runner, cluster: str) -> tuple[LockState | None, str | None]:
    """Break the lock on this node, whoever holds it: (what was held, the SSH user whose lock stayed
    because this SSH user may not remove it -- None when it is gone)."""
    held = lock_state(head, cluster)
    if held is None:
        return None, None
    r = head.run(release_argv(cluster, ""), timeout=20)
    return held, (kept_by(r.stdout) or held.ssh_user or "another user") if r.exit_code == 2 else None


FORCE_UNLOCK = "sparkctl lock --force-unlock"


def only_its_user(node: str, user: str, cluster: str) -> str:
    """The fix for a lock another SSH user owns: only that user, or root, can remove it."""
    return (f"only SSH user {user} (or root) can remove it: run `{FORCE_UNLOCK}` as {user} (User {user} "
            f"for {node} in the ssh config), or as root on {node}: `rm -rf -- {lock_dir(cluster)}`")


def _acquire(head: Runner, head_name: str, cluster: str, owner: LockOwner) -> None:
    """Take the lock, breaking it first (audited) when its holder is provably dead."""
    for _ in range(2):
        r = head.run(acquire_argv(cluster, owner), timeout=20)
        if r.exit_code == 0:
            return
        if r.exit_code == 3:
            raise CheckFailed(f"cannot take the cluster lock on {head_name}: "
                              f"{(r.stderr.strip() or r.stdout.strip())[:300] or 'no reason given'}",
                              fix=f"on {head_name}, {LOCK_ROOT} must be a directory every user may write "
                                  "(mode 1777, as Linux makes it), and the SSH user's home writable")
        held = _state_from(r.stdout)
        if not held.dead or not held.owner.token:
            break
        # Only that holder's token matches, so two commands breaking it at once cannot both win.
        gone = head.run(release_argv(cluster, held.owner.token), timeout=20)
        if gone.exit_code == 2:
            user = kept_by(gone.stdout) or held.ssh_user or "another user"
            raise CheckFailed(f"the cluster {cluster!r} is locked on {head_name} by {held.describe()}",
                              fix=only_its_user(head_name, user, cluster))
        head.run(audit_append_argv(cluster, [audit_line(
            action="lock-broken", detail=f"{held.owner.describe()}: {held.dead}; broken by pid {owner.pid}")]),
            timeout=20)
    made = f", made by SSH user {held.ssh_user}" if held.ssh_user else ""
    who = held.describe() if LockOwner.parse(r.stdout) else f"an unknown holder (no owner file{made})"
    if held.stale:
        fix = f"if that run is really gone, break the lock: `{FORCE_UNLOCK}`"
    else:
        fix = (f"wait for it to finish, check with `sparkctl lock status`, or if that process is gone: "
               f"`{FORCE_UNLOCK}`")
    if held.others:
        fix += f"; {only_its_user(head_name, held.ssh_user, cluster)}"
    raise CheckFailed(f"the cluster {cluster!r} is locked on {head_name} by {who}", fix=fix)


class _Heartbeat:
    """Touch the lock's heartbeat every lease/4 seconds on every node that holds it, in the background."""

    def __init__(self, nodes: Sequence[Runner], cluster: str, owner: LockOwner) -> None:
        self._stop = threading.Event()
        self._argv = heartbeat_argv(cluster, owner.token)
        self._nodes = list(nodes)
        self._every = max(1.0, owner.lease_s / 4)
        self._ended = spawn(self._run, "lock-heartbeat")

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            for node in self._nodes:
                try:
                    node.run(self._argv, timeout=min(20.0, self._every))
                except Exception:  # a lost node fails the command's own steps; the lease just ages
                    pass

    def stop(self) -> None:
        self._stop.set()
        wait_bounded([self._ended], 5)


def _release_all(nodes: Sequence[Runner], cluster: str, token: str) -> None:
    """Release on every node at once (a node that is gone keeps it until its lease ages)."""
    def one(node: Runner) -> None:
        try:
            node.run(release_argv(cluster, token), timeout=20)
        except Exception:  # unreachable: `lock status` shows it, its holder dead, and the next command breaks it
            pass

    if len(nodes) == 1:
        one(nodes[0])
        return
    parallel([functools.partial(one, node) for node in nodes], limit=32)


@contextmanager
def nodes_lock(nodes: Sequence[tuple[str, Runner]], cluster: str, command: str) -> Iterator[LockOwner]:
    """Hold the cluster lock on every one of `nodes` (name, node), taken one by one in the order given
    (lock_order's), for the duration of a mutating command; always release it, signals included
    (taking and releasing it are shielded: a signal meanwhile is delivered after). A node whose lock
    another live command holds refuses the whole command, naming that node and the holder; what was
    taken is given back first."""
    owner = new_owner(command)
    held: list[Runner] = []
    beat: _Heartbeat | None = None
    try:
        # A signal while taking it is delivered when the lock is ours: inside this try, so released.
        with signals.shielded():
            for name, node in nodes:
                _acquire(node, name, cluster, owner)
                held.append(node)
            beat = _Heartbeat(held, cluster, owner)
        yield owner
    finally:
        with signals.shielded():
            if beat is not None:
                beat.stop()
            if held:
                _release_all(held, cluster, owner.token)


@contextmanager
def cluster_lock(head: Runner, head_name: str, cluster: str, command: str) -> Iterator[LockOwner]:
    """The cluster lock on one node (tests, and commands that change only that node)."""
    with nodes_lock([(head_name, head)], cluster, command) as owner:
        yield owner


def lock_order(names: Sequence[str], identities: Mapping[str, tuple[str | None, str | None]]) -> list[str]:
    """The one global order in which every command takes the nodes' locks: by machine-id, then host key,
    then alias -- what the machines are, not how an env file lists them."""
    def key(n: str) -> tuple[str, str, str]:
        machine_id, host_key = identities.get(n, (None, None))
        return (machine_id or "~", host_key or "~", n)

    return sorted(names, key=key)
