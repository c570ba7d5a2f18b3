"""`sparkctl model sync`'s flow (`sync`): MODEL from one node to the ranks that lack it or differ, node to
node, with rsync. The steps (scan, refuse a shared folder, plan and check space, node-to-node keys,
the chain of rsyncs through the ranks or one per rank, compare) are in `sparkctl.checkpoint.sync_plan`'s docstring, beside the pure parts they use
(the file plan, the authorized_keys line, the rsync argv, its output's parsers, the report types).
"""

from __future__ import annotations

import functools
import posixpath
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

from ..checkpoint.relay import STREAMS, Relay, chain_order
from ..checkpoint.sync_plan import (
    INSTALL_KEY,
    LIFELINE,
    SCAN_TIMEOUT,
    SOURCE_KEY,
    SYNC_TIMEOUT,
    TOPOLOGIES,
    Progress,
    RankSync,
    SyncReport,
    authorized_line,
    files_list,
    key_tag,
    parse_progress,
    parse_sent,
    plan_bytes,
    plan_files,
    rsync_argv,
    same_folder,
    state_dir,
    why,
)
from ..checkpoint.verify import issue
from ..checkpoint.verify_nodes import compare_nodes
from ..cluster import Cluster, Node, NodeError
from ..errors import CheckFailed, UsageError
from ..facts.parsing import ParseError, parse_json
from ..rules.findings import FAIL
from ..spec.resources import probe_script
from ..threads import spawn, wait_all, wait_bounded
from .locking import lock_cluster


def scan_node(node: Node, model: str) -> dict[str, Any]:
    r = node.run_script(probe_script("ckpt_scan.py"), [model, "--headers", "none", "--fingerprints"],
                        interpreter=("python3", "-"), timeout=SCAN_TIMEOUT)
    try:
        doc = parse_json(r.stdout)
    except ParseError:
        doc = None
    if not r.ok or not isinstance(doc, dict):
        raise NodeError(node.name, "scan", f"the checkpoint scan of {model} failed (exit {r.exit_code}): "
                        f"{r.stderr.strip()[-300:]}", f"check that python3 (>= 3.8) exists on {node.name}")
    return doc


def describe_node(node: Node, model: str) -> dict[str, Any]:
    r = node.run_script(probe_script("model_node.py"), [model], interpreter=("python3", "-"), timeout=60)
    try:
        doc = parse_json(r.stdout)
    except ParseError:
        doc = None
    if not r.ok or not isinstance(doc, dict):
        raise NodeError(node.name, "probe", f"describing {model} failed (exit {r.exit_code}): {r.stderr.strip()[-300:]}",
                        f"check that python3 (>= 3.8) exists on {node.name}")
    return doc


def _resolve_ips(cluster: Cluster, settings: Any, names: Sequence[str]) -> dict[str, str]:
    """Fabric address per node: RANK<n>_FABRIC_IP when pinned, else discovered as `up` does."""
    ips: dict[str, str] = {}
    for rank, name in enumerate(settings.nodes):
        pinned = settings.rank_pins(rank).fabric_ip
        if pinned:
            ips[name] = str(pinned)
    if all(n in ips for n in names):
        return ips
    from .node_probe import live_pins

    for name, pins in zip(settings.nodes, live_pins(cluster, settings), strict=True):
        if pins.fabric_ip and name not in ips:
            ips[name] = pins.fabric_ip
    return ips


def _setup_auth(cluster: Cluster, settings: Any, src: str, targets: Sequence[str], ips: Mapping[str, str]) -> tuple[str, str]:
    """Key on the source, its public half on each target, the targets' host keys on the source."""
    state = state_dir(settings.cluster_name)
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
                            f"{res.stderr.strip()[-300:]}",
                            f"fix what the message names on {node.name} (its ~/.ssh and authorized_keys: "
                            "readable, a writable folder to hold it), then run `sparkctl model sync` again")

    for err in cluster.run_all(install, nodes=list(targets)).failed.values():
        raise err  # the first node that refused the key
    # rsync and the ssh it starts get absolute paths: neither promises which folder it runs in.
    return f"{home}/{key}", f"{home}/{known}"


def _rsync(node: Node, argv: list[str], seen: Callable[[int, str], None], stop: threading.Event) -> tuple[int | None, str, str]:
    """One rsync on `node` under the lifeline, `seen(bytes so far, rate)` as it reports: (its exit code, or
    None when `stop` ended it; its output's last 64 KiB; its stderr)."""
    session = node.start(["sh", "-c", LIFELINE, "sh", *argv], timeout=SYNC_TIMEOUT)
    text = ""
    running = True
    while running:
        if stop.is_set():
            session.close()
            return None, text, ""
        running = session.poll(0.5)
        chunk = bytes(session.out).decode("utf-8", "replace")
        del session.out[:]
        text = (text + chunk)[-65536:]
        got = parse_progress(chunk)
        if got:
            seen(*got)
    result = session.finish()
    return result.exit_code, text, bytes(session.err).decode("utf-8", "replace")


def _push(node: Node, argv: list[str], rank: RankSync, progress: Progress, stop: threading.Event) -> None:
    """rsync on the source for one rank (the star), reporting as it goes; stop -> the lifeline ends it."""
    started = time.monotonic()

    def seen(done: int, rate: str) -> None:
        rank.bytes_done, rank.rate = done, rate
        rank.seconds = time.monotonic() - started
        progress(rank)

    try:
        code, text, err = _rsync(node, argv, seen, stop)
    finally:
        rank.seconds = time.monotonic() - started
    if code is None:
        rank.status, rank.message = "resumable", "interrupted"
        return
    rank.bytes_sent = parse_sent(text)
    if code == 0:
        rank.status, rank.bytes_done = "complete", rank.need_bytes
    else:
        rank.status = "resumable"
        rank.message = f"rsync exit {code}: {why(err)}"
    progress(rank)


def _relay(cluster: Cluster, settings: Any, src: str, todo: Sequence[str], report: SyncReport, sizes: Mapping[str, int],
           ips: Mapping[str, str], progress: Progress, stop: threading.Event, streams: int) -> None:
    """The chain (sparkctl.checkpoint.relay): each hop's rsync runs on its sender, `streams` batches at once.
    Every sender's key is on every rank after it: a hop whose sender is lost reroutes upstream."""
    model = str(settings.model)
    chain = chain_order(src, todo)
    relay = Relay(chain, {t: report.ranks[t].files for t in todo}, sizes)
    auth = {sender: _setup_auth(cluster, settings, sender, chain[i + 1:], ips) for i, sender in enumerate(chain[:-1])}
    lock = threading.Lock()
    done = {t: 0 for t in todo}
    inflight: dict[tuple[str, int], int] = {}
    started = time.monotonic()

    def report_rank(t: str) -> None:
        r = report.ranks[t]
        with lock:
            r.bytes_done = done[t] + sum(v for (n, _), v in inflight.items() if n == t)
        r.seconds = time.monotonic() - started
        progress(r)

    def send(sender: str, receiver: str, stream: int, batch: list[str]) -> tuple[int | None, str]:
        """One batch by rsync on the sender: (its exit code, None when stopped; why it failed)."""
        node, r = cluster.node(sender), report.ranks[receiver]
        key, known = auth[sender]
        lst = f"{posixpath.dirname(key)}/relay-{receiver}-{stream}.list"
        node.put_bytes(lst, files_list(batch))

        def seen(got: int, rate: str) -> None:
            with lock:
                inflight[(receiver, stream)] = got
            r.rate = rate
            report_rank(receiver)

        user = cluster.target(receiver).user or "root"
        try:
            code, text, err = _rsync(node, rsync_argv(model, user, ips[receiver], model, lst, key, known), seen, stop)
        finally:
            with lock:
                inflight.pop((receiver, stream), None)
        if code == 0:
            with lock:
                done[receiver] += sum(sizes.get(n, 0) for n in batch)
                r.bytes_sent = (r.bytes_sent or 0) + (parse_sent(text) or 0)
        return code, f"{sender} -> {receiver}: rsync exit {code}: {why(err)}"

    def reachable(sender: str) -> bool:
        try:
            return cluster.node(sender).run(["true"], timeout=15).ok
        except NodeError:
            return False

    def hop(receiver: str, stream: int) -> None:
        while not stop.is_set():
            got = relay.take(receiver, 0.5)
            if got is None:
                return
            sender, batch = got
            if not batch:
                continue
            try:
                code, reason = send(sender, receiver, stream, batch)
            except NodeError as exc:
                code, reason = -1, f"{sender} -> {receiver}: {exc.reason}"
            if code is None:
                return  # stopped: the batch stays where rsync left it (its partial kept aside)
            if code != 0:
                relay.failed(receiver, sender, batch, reason, sender_lost=not reachable(sender))
                continue
            relay.arrived(receiver, batch)
            report_rank(receiver)

    def guarded(receiver: str, stream: int) -> None:
        try:
            hop(receiver, stream)
        except Exception as exc:  # a bug must not leave the hops after it waiting: they reroute
            relay.failed(receiver, relay.hops[receiver].sender, [], f"{type(exc).__name__}: {exc}")

    workers: list[threading.Event] = []
    try:
        for t in todo:
            for stream in range(streams):
                workers.append(spawn(functools.partial(guarded, t, stream), f"relay-{t}-{stream}"))
        wait_all(workers, 0.2)
    except KeyboardInterrupt:
        stop.set()
        report.interrupted = True
        wait_bounded(workers, 10 * len(workers))
    for t in todo:
        r = report.ranks[t]
        r.via = list(relay.hops[t].senders)
        r.seconds = r.seconds or time.monotonic() - started
        if relay.complete(t):
            r.status, r.bytes_done = "complete", r.need_bytes
        else:
            r.status = "resumable"
            r.message = "interrupted" if stop.is_set() else relay.why(t) or "not every file arrived"
        progress(r)


def sync(settings: Any, ssh_config: str, *, source_node: str | None = None, progress: Progress | None = None,
         stop: threading.Event | None = None, only: Sequence[str] | None = None, topology: str = "chain",
         streams: int = STREAMS) -> SyncReport:
    """Copy MODEL from `source_node` (the head) to the ranks that lack it or differ: along a chain through the
    ranks (the default: sparkctl.checkpoint.relay), or one rsync per rank from the source ("star")."""
    if topology not in TOPOLOGIES:
        raise UsageError(f"topology {topology!r}: expected one of {', '.join(TOPOLOGIES)}", fix="--topology chain")
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
    report = SyncReport(src, {t: RankSync(t) for t in targets}, [], topology=topology)
    with Cluster(nodes, ssh_config) as cluster, ExitStack() as held:
        if src in cluster.errors:
            err = cluster.errors[src]
            raise CheckFailed(f"the source {src} is unreachable: {err.reason}", fix=err.fix)
        # The cluster lock on the source and every target, for the whole sync (its plan included).
        held.enter_context(lock_cluster(cluster, [src, *targets], settings.cluster_name, "model sync"))

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
            if topology == "chain":
                sizes = {n: int(m.get("size") or 0) for n, m in (src_scan.get("files") or {}).items()}
                _relay(cluster, settings, src, todo, report, sizes, ips, progress, stop, streams)
            else:
                _star(cluster, settings, src, todo, report, ips, progress, stop)
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


def _star(cluster: Cluster, settings: Any, src: str, todo: Sequence[str], report: SyncReport, ips: Mapping[str, str],
          progress: Progress, stop: threading.Event) -> None:
    """One rsync per rank from the source, all at once (every copy leaves the source)."""
    model = str(settings.model)
    key, known = _setup_auth(cluster, settings, src, todo, ips)
    state = state_dir(settings.cluster_name)
    src_node = cluster.node(src)
    for t in todo:
        report.ranks[t].via = [src]
        src_node.put_bytes(f"{state}/sync-{t}.list", files_list(report.ranks[t].files))

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


def _guard(push: Callable[[Node, str], None], node: Node, t: str, rank: RankSync) -> None:
    try:
        push(node, t)
    except NodeError as exc:
        rank.status, rank.message = "resumable", exc.reason
    except Exception as exc:  # a bug must not take the other ranks down with it
        rank.status, rank.message = "failed", f"{type(exc).__name__}: {exc}"
