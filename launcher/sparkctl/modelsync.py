"""`model sync`: MODEL from one node to the ranks that lack it or differ, node to node, with rsync.

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
  5. one rsync per rank, all at once, from the source over the ranks' fabric addresses:
     `--ignore-times` on exactly the planned files (the fingerprints decided), `--partial-dir` so a
     cut transfer is kept aside and resumed, never left under its final name;
  6. the cross-node fingerprint comparison of verify-model on the result.
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .cluster import Cluster, Node, NodeError
from .errors import CheckFailed, UsageError
from .findings import FAIL, Finding
from .resources import probe_script
from .threads import spawn, wait_all, wait_bounded
from .verify_nodes import compare_nodes
from .verify_rules import finding_doc, issue

PARTIAL_DIR = ".sparkctl-partial"
SCAN_TIMEOUT = 300.0
RSYNC_IO_TIMEOUT = 60  # rsync gives up on a rank that moves no data for this long
SYNC_TIMEOUT = 48 * 3600.0  # the whole copy of one rank; liveness is RSYNC_IO_TIMEOUT's job
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

INSTALL_KEY = r"""set -eu
line=$1; tag=$2
umask 077
mkdir -p "$HOME/.ssh"
f="$HOME/.ssh/authorized_keys"
touch "$f"
if grep -qxF -- "$line" "$f"; then echo present; exit 0; fi
tmp="$f.sparkctl.$$"
grep -vF -- "$tag" "$f" > "$tmp" || true
printf '%s\n' "$line" >> "$tmp"
mv "$tmp" "$f"
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


def ssh_command(key: str, known_hosts: str) -> str:
    """The `-e` of rsync on the source: its own key and known_hosts, nothing from ~/.ssh/config."""
    return shlex.join(["ssh", "-F", "/dev/null", "-i", key, "-o", "IdentitiesOnly=yes",
                       "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
                       "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
                       "-o", "ServerAliveCountMax=3", "-o", "Compression=no"])


def rsync_argv(src_dir: str, user: str, ip: str, dst_dir: str, list_file: str, key: str, known_hosts: str) -> list[str]:
    host = f"[{ip}]" if ":" in ip else ip
    return ["rsync", "-a", "--ignore-times", f"--partial-dir={PARTIAL_DIR}", "--mkpath",
            f"--timeout={RSYNC_IO_TIMEOUT}", f"--files-from={list_file}", "--info=progress2", "--stats",
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

    def as_dict(self) -> dict[str, Any]:
        return {"node": self.node, "status": self.status, "files": len(self.files), "need_bytes": self.need_bytes,
                "free_bytes": self.free_bytes, "bytes_sent": self.bytes_sent, "seconds": round(self.seconds, 3),
                "message": self.message, "partial_bytes": self.partial_bytes}


@dataclass
class SyncReport:
    source: str
    ranks: dict[str, RankSync]
    findings: list[Finding]
    seconds: float = 0.0
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(r.status in ("up-to-date", "complete") for r in self.ranks.values()) \
            and not any(f.severity == "error" for f in self.findings)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "source": self.source, "seconds": round(self.seconds, 3),
                "interrupted": self.interrupted, "ranks": [r.as_dict() for r in self.ranks.values()],
                "findings": [finding_doc(f) for f in self.findings]}


Progress = Callable[[RankSync], None]


# ---------------------------------------------------------------------------------- orchestration
def scan_node(node: Node, model: str) -> dict[str, Any]:
    r = node.run_script(probe_script("ckpt_scan.py"), [model, "--headers", "none", "--fingerprints"],
                        interpreter=("python3", "-"), timeout=SCAN_TIMEOUT)
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = None
    if not r.ok or not isinstance(doc, dict):
        raise NodeError(node.name, "scan", f"the checkpoint scan of {model} failed (exit {r.exit_code}): "
                        f"{r.stderr.strip()[-300:]}", f"check that python3 (>= 3.8) exists on {node.name}")
    return doc


def describe_node(node: Node, model: str) -> dict[str, Any]:
    r = node.run_script(probe_script("model_node.py"), [model], interpreter=("python3", "-"), timeout=60)
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = None
    if not r.ok or not isinstance(doc, dict):
        raise NodeError(node.name, "probe", f"describing {model} failed (exit {r.exit_code}): {r.stderr.strip()[-300:]}",
                        f"check that python3 (>= 3.8) exists on {node.name}")
    return doc


def _state_dir(cluster_name: str) -> str:
    return f".sparkctl/{cluster_name}"  # relative: the SSH user's home, on every node


def _resolve_ips(cluster: Cluster, settings: Any, names: Sequence[str]) -> dict[str, str]:
    """Fabric address per node: RANK<n>_FABRIC_IP when pinned, else discovered as `up` does."""
    ips: dict[str, str] = {}
    for rank, name in enumerate(settings.nodes):
        pinned = settings.rank_pins(rank).fabric_ip
        if pinned:
            ips[name] = str(pinned)
    if all(n in ips for n in names):
        return ips
    from .pins import live_pins

    for name, pins in zip(settings.nodes, live_pins(cluster, settings), strict=True):
        if pins.fabric_ip and name not in ips:
            ips[name] = pins.fabric_ip
    return ips


def _setup_auth(cluster: Cluster, settings: Any, src: str, targets: Sequence[str], ips: Mapping[str, str]) -> tuple[str, str]:
    """Key on the source, its public half on each target, the targets' host keys on the source."""
    state = _state_dir(settings.cluster_name)
    key, known = f"{state}/sync_ed25519", f"{state}/sync_known_hosts"
    src_node = cluster.node(src)
    r = src_node.run(["sh", "-c", SOURCE_KEY, "sh", key, f"sparkctl-sync@{settings.cluster_name}"], timeout=60)
    if not r.ok or not r.stdout.strip():
        raise CheckFailed(f"{src}: could not make the sync key {key}: {r.stderr.strip()[-300:]}",
                          fix=f"check that ssh-keygen exists on {src} and its home is writable")
    home, pub = r.stdout.strip().splitlines()[0], r.stdout.strip().splitlines()[-1]
    line = authorized_line(pub, ips[src], key_tag(settings.cluster_name, src))
    lines = []
    for t in targets:
        ktype, b64 = cluster.node(t).host_key()
        lines.append(f"{ips[t]} {ktype} {b64}")
    src_node.put_bytes(known, ("\n".join(lines) + "\n").encode(), mode=0o600)

    def install(node: Node) -> None:
        res = node.run(["sh", "-c", INSTALL_KEY, "sh", line, key_tag(settings.cluster_name, src)], timeout=60)
        if not res.ok:
            raise NodeError(node.name, "sync-key", f"could not add the sync key to ~/.ssh/authorized_keys: "
                            f"{res.stderr.strip()[-300:]}", f"check {node.name}'s home and ~/.ssh permissions")

    for err in cluster.run_all(install, nodes=list(targets)).failed.values():
        raise err  # the first node that refused the key
    # rsync and the ssh it starts get absolute paths: neither promises which folder it runs in.
    return f"{home}/{key}", f"{home}/{known}"


def _push(node: Node, argv: list[str], rank: RankSync, progress: Progress, stop: threading.Event) -> None:
    """rsync on the source for one rank, reporting as it goes; stop -> the lifeline ends it."""
    started = time.monotonic()
    session = node.start(["sh", "-c", LIFELINE, "sh", *argv], timeout=SYNC_TIMEOUT)
    text = ""
    running = True
    try:
        while running:
            if stop.is_set():
                session.close()
                rank.status, rank.message = "resumable", "interrupted"
                return
            running = session.poll(0.5)
            chunk = bytes(session.out).decode("utf-8", "replace")
            del session.out[:]
            text = (text + chunk)[-65536:]
            got = parse_progress(chunk)
            if got:
                rank.bytes_done, rank.rate = got
            rank.seconds = time.monotonic() - started
            progress(rank)
        result = session.finish()
    finally:
        rank.seconds = time.monotonic() - started
    rank.bytes_sent = parse_sent(text)
    if result.exit_code == 0:
        rank.status, rank.bytes_done = "complete", rank.need_bytes
    else:
        rank.status = "resumable"
        rank.message = f"rsync exit {result.exit_code}: {why(bytes(session.err).decode('utf-8', 'replace'))}"
    progress(rank)


def sync(settings: Any, ssh_config: str, *, source_node: str | None = None, progress: Progress | None = None,
         stop: threading.Event | None = None, only: Sequence[str] | None = None) -> SyncReport:
    started = time.monotonic()
    progress = progress or (lambda r: None)
    stop = stop or threading.Event()
    nodes = list(settings.nodes)
    src = source_node or nodes[0]
    if src not in nodes:
        raise UsageError(f"--from {src}: not one of NODES ({' '.join(nodes)})", fix="name one of the nodes")
    targets = [n for n in nodes if n != src and (not only or n in only)]
    if not targets:
        raise UsageError("only one node: nothing to sync to", fix="set NODES to the head and its ranks")
    model = str(settings.model)
    report = SyncReport(src, {t: RankSync(t) for t in targets}, [])
    with Cluster(nodes, ssh_config) as cluster:
        if src in cluster.errors:
            err = cluster.errors[src]
            raise CheckFailed(f"the source {src} is unreachable: {err.reason}", fix=err.fix)

        def look(node: Node) -> tuple[dict[str, Any], dict[str, Any]]:
            return scan_node(node, model), describe_node(node, model)

        seen = cluster.run_all(look, nodes=[src, *targets])
        answered, lost = seen.ok, seen.failed
        if src in lost:
            raise lost[src]
        src_scan, src_desc = answered[src]
        if src_scan.get("error") or not src_scan.get("shards"):
            raise UsageError(f"{src}:{model} holds no checkpoint to sync "
                             f"({(src_scan.get('error') or {}).get('message', 'no shards')})",
                             fix="run `sparkctl model pull` first, or name the node that has it with --from")
        scans: dict[str, dict[str, Any]] = {src: src_scan}
        refused: list[str] = []
        for t in targets:
            r = report.ranks[t]
            if t in lost:
                r.status, r.message = "unreachable", f"{lost[t].reason}"
                continue
            scan, desc = answered[t]
            scans[t] = scan
            r.free_bytes = int(desc.get("free_bytes") or 0)
            r.partial_bytes = int((desc.get("partial") or {}).get("bytes") or 0)
            if same_folder(src_desc, desc):
                mount = desc.get("mount") or {}
                r.status = "refused"
                r.message = (f"{t}:{model} is {src}'s own folder ({mount.get('fstype', '?')} mount of "
                             f"{mount.get('source', '?')} on {mount.get('mountpoint', '?')}): copying would write "
                             "every file onto itself")
                refused.append(r.message)
                continue
            if not desc.get("rsync"):
                r.status, r.message = "refused", f"{t} has no rsync"
                refused.append(f"{t}: rsync is not installed (apt-get install rsync)")
                continue
            r.files = plan_files(src_scan, scan if not scan.get("error") else None)
            r.need_bytes = plan_bytes(src_scan, r.files)
            if not r.files:
                r.status = "up-to-date"
        if refused:
            raise UsageError("model sync refused before copying anything:\n  " + "\n  ".join(refused),
                             fix="a rank that shares the head's folder (NFS) needs no sync: leave it out of "
                                 "NODES for the sync, or give it MODEL on its own disk")
        if not src_desc.get("rsync"):
            raise UsageError(f"{src} has no rsync", fix=f"apt-get install rsync on {src}")
        short = [r for r in report.ranks.values() if r.files and r.free_bytes is not None and r.need_bytes > r.free_bytes]
        if short:
            lines = [f"{r.node}: needs {r.need_bytes:,} B for {len(r.files)} file(s), has {r.free_bytes:,} B free on "
                     f"{model}'s filesystem" for r in short]
            raise CheckFailed("not enough disk, nothing was copied:\n  " + "\n  ".join(lines),
                              fix="free space on those ranks (or point MODEL at a bigger disk), then run "
                                  "`sparkctl model sync` again")
        todo = [t for t, r in report.ranks.items() if r.files]
        if todo:
            ips = _resolve_ips(cluster, settings, [src, *todo])
            missing = [n for n in [src, *todo] if n not in ips]
            if missing:
                raise CheckFailed(f"no fabric address for {', '.join(missing)}",
                                  fix="run `sparkctl check` (it writes RANK<n>_FABRIC_IP) or set them")
            key, known = _setup_auth(cluster, settings, src, todo, ips)
            state = _state_dir(settings.cluster_name)
            src_node = cluster.node(src)
            for t in todo:
                src_node.put_bytes(f"{state}/sync-{t}.list", ("\n".join(report.ranks[t].files) + "\n").encode())

            def push(node: Node, t: str) -> None:
                r = report.ranks[t]
                argv = rsync_argv(model, cluster.target(t).user or "root", ips[t], model,
                                  f"{posixpath.dirname(key)}/sync-{t}.list", key, known)
                _push(node, argv, r, progress, stop)

            # One channel per rank on the source's one connection, all at once.
            # (waited for through Events, not join: a join that Ctrl-C interrupts stops waiting for
            # good, and the rank's final report would be lost: sparkctl.threads)
            workers: list[threading.Event] = []
            try:
                for t in todo:
                    workers.append(spawn(functools.partial(_guard, push, src_node, t, report.ranks[t]), f"sync-{t}"))
                wait_all(workers, 0.2)
            except KeyboardInterrupt:
                stop.set()
                report.interrupted = True
                wait_bounded(workers, 10 * len(workers))
        # The end: verify-model's cross-node comparison on what every node holds now (the scans
        # already taken when nothing was copied).
        if not todo:
            report.findings = compare_nodes(scans, src)
        elif not report.interrupted:
            again = cluster.run_all(lambda n: scan_node(n, model), nodes=[src, *targets])
            report.findings = compare_nodes(again.ok, src)
            for n, e in again.failed.items():
                report.findings.append(issue(FAIL, "node-unreachable", f"{n}: {e.reason}", e.fix or "", n))
    report.seconds = time.monotonic() - started
    return report


def _guard(push: Callable[[Node, str], None], node: Node, t: str, rank: RankSync) -> None:
    try:
        push(node, t)
    except NodeError as exc:
        rank.status, rank.message = "resumable", exc.reason
    except Exception as exc:  # a bug must not take the other ranks down with it
        rank.status, rank.message = "failed", f"{type(exc).__name__}: {exc}"
