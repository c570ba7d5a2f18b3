"""`model sync`'s pure parts: MODEL from one node to the ranks that lack it or differ, node to node, with
rsync. The flow that runs it (`sync`) is orchestrate/model_sync.py; here: the file plan, the
authorized_keys line, the rsync argv, its output's parsers, the report types and the scripts.

How it goes (the user's machine only orchestrates; no checkpoint byte passes through it):
  1. every node's MODEL is scanned in parallel (probes/ckpt_scan.py fingerprints: name, size, header
     sha256, first/last MiB) and described (probes/model_node.py: free space, identity, mount);
  2. a rank whose MODEL *is* the source's folder (an NFS view of the head's export, a bind mount:
     same inode and ctime) is refused before anything is copied -- syncing it would copy files onto
     themselves;
  3. per rank, the files whose fingerprint differs (plan_files); the bytes they need are checked
     against the rank's free space, and any rank short of space stops the sync before the first byte;
  4. node-to-node SSH: the source holds its own key (~/.sparkctl/<cluster>/sync_ed25519, made once);
     each rank's ~/.ssh/authorized_keys gets its public half restricted to the source's fabric
     address (`restrict,from="IP"`), and the source's known_hosts for the sync
     (~/.sparkctl/<cluster>/sync_known_hosts) lists each rank's fabric address with the host key our
     own connection verified -- no trust on first use anywhere;
  5. the copy, over the ranks' fabric addresses, by rsync: along a chain (the default: the source sends to
     the first rank, each rank forwards what it received to the next while it receives the rest; each sender
     holds its own key, installed on the next rank only, from the sender's address: sparkctl.checkpoint.relay),
     or as a star (one rsync per rank from the source, all at once): `--ignore-times` on exactly the planned
     files (the fingerprints decided), `--partial-dir` so a cut transfer is kept aside and resumed, never
     left under its final name;
  6. the cross-node fingerprint comparison of verify-model on the result.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckFailed
from ..rules.findings import Finding
from .verify import finding_doc

PARTIAL_DIR = ".sparkctl-partial"
SCAN_TIMEOUT = 300.0
RSYNC_IO_TIMEOUT = 60  # rsync gives up on a rank that moves no data for this long
SYNC_TIMEOUT = 48 * 3600.0  # the whole copy of one rank; liveness is RSYNC_IO_TIMEOUT's job
TOPOLOGIES = ("chain", "star")
SHARD_FP = ("size", "header_sha256", "head_sha256", "tail_sha256")

# The source runs rsync under this: stdin is a lifeline -- when sparkctl goes away (Ctrl-C, a lost
# connection) the read ends and rsync gets SIGTERM, which makes it keep the partial file aside.
# (A background job's stdin is /dev/null in sh, hence the session's stdin kept on fd 3 for `cat`.)
LIFELINE = 'exec 3<&0; "$@" </dev/null & pid=$!; ' \
           '( cat <&3 >/dev/null 2>&1; kill -TERM "$pid" 2>/dev/null ) >/dev/null 2>&1 & ' \
           'exec 3<&-; wait "$pid"; rc=$?; exit "$rc"'

SOURCE_KEY = r"""set -eu
key=$1; comment=$2
dir=$(dirname "$key")
mkdir -p "$dir"; chmod 700 "$dir"
[ -f "$key" ] || ssh-keygen -q -t ed25519 -N '' -C "$comment" -f "$key" >/dev/null </dev/null
printf '%s\n' "$HOME"
cat "$key.pub"
"""

# A rank's ~/.ssh/authorized_keys holds its operators' keys: every line but this source's own sync key
# (the line whose last field is exactly the tag) survives byte for byte, whatever its bytes (LC_ALL=C:
# no locale calls a line binary); a symlink is written through (temp file beside the target, renamed
# over it) and the file keeps its mode and owner; grep's or awk's error stops it, the file unchanged.
INSTALL_KEY = r"""set -eu
LC_ALL=C; export LC_ALL
line=$1; tag=$2
umask 077
mkdir -p "$HOME/.ssh"
f="$HOME/.ssh/authorized_keys"
if [ -L "$f" ]; then
  f=$(readlink -f -- "$f") || { echo "cannot resolve the symlink $HOME/.ssh/authorized_keys" >&2; exit 1; }
fi
[ -e "$f" ] || : > "$f"
rc=0; grep -qxF -- "$line" "$f" || rc=$?
case $rc in
  0) echo present; exit 0 ;;
  1) ;;
  *) echo "grep could not read $f (exit $rc); it was left unchanged" >&2; exit 1 ;;
esac
tmp=$(mktemp "$(dirname -- "$f")/.authorized_keys.sparkctl.XXXXXX")
trap 'rm -f -- "$tmp"' EXIT
TAG=$tag awk '$NF != ENVIRON["TAG"]' "$f" > "$tmp" || { echo "awk could not read $f; it was left unchanged" >&2; exit 1; }
printf '%s\n' "$line" >> "$tmp"
chmod "$(stat -c %a -- "$f")" "$tmp"
own=$(stat -c %u:%g -- "$f")
if [ "$(stat -c %u:%g -- "$tmp")" != "$own" ]; then
  chown "$own" "$tmp" || { echo "cannot keep $f's owner ($own); it was left unchanged" >&2; exit 1; }
fi
mv -f -- "$tmp" "$f"
trap - EXIT
echo installed
"""


# ---------------------------------------------------------------------------------- pure parts
def shard_fp(entry: Mapping[str, Any]) -> tuple[Any, ...] | None:
    if not entry or entry.get("error"):
        return None
    return tuple(entry.get(k) for k in SHARD_FP)


def plan_files(src: Mapping[str, Any], dst: Mapping[str, Any] | None) -> list[str]:
    """The files of the source's scan that the destination lacks or holds differently.

    Shards by (size, header sha256, first/last MiB sha256) -- verify-model's fingerprint; the JSON
    files by sha256; anything else by size and mtime (rsync keeps mtimes). Files only the
    destination has are left alone (the final comparison names them)."""
    dst = dst or {}
    d_files = dst.get("files") or {}
    d_shards = dst.get("shards") or {}
    d_json = dst.get("json") or {}
    out = []
    for name, meta in sorted((src.get("files") or {}).items()):
        if name in (src.get("shards") or {}):
            mine = shard_fp(src["shards"][name])
            if mine is None or mine != shard_fp(d_shards.get(name) or {}):
                out.append(name)
        elif name in (src.get("json") or {}):
            if (src["json"][name] or {}).get("sha256") != (d_json.get(name) or {}).get("sha256"):
                out.append(name)
        else:
            theirs = d_files.get(name) or {}
            if (meta.get("size"), meta.get("mtime_ns", 0) // 10**9) != \
                    (theirs.get("size"), (theirs.get("mtime_ns") or 0) // 10**9):
                out.append(name)
    return out


def plan_bytes(src: Mapping[str, Any], names: Sequence[str]) -> int:
    files = src.get("files") or {}
    return sum(int((files.get(n) or {}).get("size") or 0) for n in names)


def same_folder(src_desc: Mapping[str, Any], dst_desc: Mapping[str, Any]) -> bool:
    """Two nodes see one folder (NFS of the source's export, a bind mount): same inode and ctime."""
    a, b = src_desc.get("identity"), dst_desc.get("identity")
    return bool(a) and a == b


def key_tag(cluster: str, source_node: str) -> str:
    return f"sparkctl-sync:{cluster}:{source_node}"


def authorized_line(pubkey: str, source_ip: str, tag: str) -> str:
    """The rank's authorized_keys line: the source's sync key, from its fabric address only, no
    forwarding, no pty (`restrict`)."""
    parts = pubkey.split()
    if len(parts) < 2 or not re.fullmatch(r"[A-Za-z0-9+/=]+", parts[1]) or not re.fullmatch(r"[\w.:-]+", source_ip):
        raise CheckFailed(f"unexpected sync key or address ({parts[:1]}, {source_ip!r})")
    return f'restrict,from="{source_ip}" {parts[0]} {parts[1]} {tag}'


def files_list(names: Sequence[str]) -> bytes:
    """The `--files-from` list of one rank's planned files, as the source's rsync reads it (`--from0`): each
    name ends with NUL, the one byte no file name holds, so a name with a newline is one file, not two."""
    return b"".join(n.encode("utf-8", "surrogateescape") + b"\0" for n in names)


def ssh_command(key: str, known_hosts: str) -> str:
    """The `-e` of rsync on the source: its own key and known_hosts, nothing from ~/.ssh/config."""
    return shlex.join(["ssh", "-F", "/dev/null", "-i", key, "-o", "IdentitiesOnly=yes",
                       "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
                       "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
                       "-o", "ServerAliveCountMax=3", "-o", "Compression=no"])


def rsync_argv(src_dir: str, user: str, ip: str, dst_dir: str, list_file: str, key: str, known_hosts: str) -> list[str]:
    """`-s` (--protect-args, since 3.3 --secluded-args): the destination goes to the rank's rsync through
    rsync's protocol, never on its shell's command line, where an rsync before 3.2.4 put it unescaped (a
    MODEL with spaces split, one with `$(…)` run on the rank)."""
    host = f"[{ip}]" if ":" in ip else ip
    return ["rsync", "-a", "-s", "--ignore-times", f"--partial-dir={PARTIAL_DIR}", "--mkpath",
            f"--timeout={RSYNC_IO_TIMEOUT}", f"--files-from={list_file}", "--from0", "--info=progress2", "--stats",
            "--no-human-readable", "-e", ssh_command(key, known_hosts),
            src_dir.rstrip("/") + "/", f"{user}@{host}:{dst_dir.rstrip('/')}/"]


def why(stderr: str) -> str:
    """The line that says why rsync failed: ssh's own words (auth, host key, refused) over rsync's summary."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    own = [ln for ln in lines if not ln.startswith("rsync")]
    return (own[-1] if own else lines[-1] if lines else "no message")[:300]


_PROGRESS_RE = re.compile(r"^\s*(\d+)\s+(\d+)%\s+(\S+/s)\s+(\d+:\d+:\d+)")
_SENT_RE = re.compile(r"Total bytes sent:\s*([\d,]+)")


def parse_progress(text: str) -> tuple[int, str] | None:
    """The last `--info=progress2` figure in text: (bytes so far, rate), or None."""
    last = None
    for piece in re.split(r"[\r\n]", text):
        m = _PROGRESS_RE.match(piece)
        if m:
            last = (int(m.group(1)), m.group(3))
    return last


def parse_sent(text: str) -> int | None:
    m = _SENT_RE.search(text)
    return int(m.group(1).replace(",", "")) if m else None


# ---------------------------------------------------------------------------------- results
@dataclass
class RankSync:
    node: str
    files: list[str] = field(default_factory=list)
    need_bytes: int = 0
    free_bytes: int | None = None
    status: str = "pending"  # up-to-date | complete | resumable | failed | refused | unreachable
    bytes_done: int = 0
    bytes_sent: int | None = None
    rate: str = ""
    seconds: float = 0.0
    message: str = ""
    partial_bytes: int = 0
    via: list[str] = field(default_factory=list)  # the nodes it got files from: the source, or the rank before it
    # in the chain (then the one before that, had that rank been lost midway)

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "status": self.status, "from": self.via, "files": len(self.files), "need_bytes": self.need_bytes,
                "free_bytes": self.free_bytes, "bytes_sent": self.bytes_sent, "seconds": round(self.seconds, 3),
                "message": self.message, "partial_bytes": self.partial_bytes}


@dataclass
class SyncReport:
    source: str
    ranks: dict[str, RankSync]
    findings: list[Finding]
    seconds: float = 0.0
    interrupted: bool = False
    topology: str = "chain"

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(r.status in ("up-to-date", "complete") for r in self.ranks.values()) \
            and not any(f.severity == "error" for f in self.findings)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "source": self.source, "topology": self.topology, "seconds": round(self.seconds, 3),
                "interrupted": self.interrupted, "ranks": [r.as_dict() for r in self.ranks.values()],
                "findings": [finding_doc(f) for f in self.findings]}


Progress = Callable[[RankSync], None]


# ------------------------------------------------------------------------- where its state lives
def state_dir(cluster_name: str) -> str:
    return f".sparkctl/{cluster_name}"  # relative: the SSH user's home, on every node
