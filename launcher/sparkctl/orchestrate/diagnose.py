"""`sparkctl diagnose`'s flow: one redacted, bounded .tar.gz for a bug report, with a manifest.

Over one SSH connection per node (a node that does not answer is named in the manifest, with why), in
parallel:
  - every node runs probes/diagnose.sh (one round trip, read-only, each command under a timeout):
    kernel, OS release, nvidia-smi, GPU compute apps, meminfo, the fabric ports (RDMA devices, firmware,
    GIDs, MTU, speed, carrier, addresses), `ethtool -i`, the kernel's lines about OOM/Xid/NVRM/mlx5,
    Docker and nvidia-container-toolkit versions, `docker inspect` of this cluster's containers, their
    last log lines, and the image's inspect (the versions `build` recorded);
  - the existing flows, on the same connections: `check` (run_check), `status` (collect_status), the
    lock (lock_states), the history (read_history, on the head) and the audit (audit_tail_argv).
Then, locally: the settings (as_dict, redacted), the env files, the rendered env.tp4 and argv (from
check's plan and pins), nccl-report of the ranks' logs, and per rank its state with the kernel's word on
its death (rules/death.py).

Every file passes through spec.redaction.redact (the settings' secret values and anything shaped like a
token) before it is archived; each is capped at `file_cap` bytes and the archive at `total_cap`; the
manifest says what each file is, where it came from (node, command), its size, and whether it was capped
or is missing and why.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import io
import json
import secrets as _secrets
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..cluster import Cluster, Node, NodeError, parallel
from ..errors import SparkctlError
from ..facts import inspect_raw
from ..facts import node_facts as F
from ..rules import death, nccl
from ..spec.redaction import redact
from ..spec.resources import probe_script
from ..spec.settings import Settings

FILE_CAP = 2 * 1024 * 1024
TOTAL_CAP = 32 * 1024 * 1024
REDACTION = ("every value of a setting named *TOKEN*, *KEY*, *SECRET*, *PASSWORD*; hf_/sk-/gh*_ tokens, "
             "Bearer/Basic credentials, AWS key IDs; the value after a secret-named key (KEY=, \"key\":, "
             "--api-key) and long base64/hex after key=/token=-like words: each replaced by [REDACTED]")

PROBE_FILES = {  # the probe's section -> (the file, what it is)
    "kernel": ("kernel.txt", "kernel release, command line, uname -a"),
    "os-release": ("os-release.txt", "/etc/os-release"),
    "nvidia-smi": ("nvidia-smi.txt", "nvidia-smi (driver and CUDA versions, GPUs)"),
    "gpu-apps": ("gpu-apps.csv", "processes holding GPU memory (nvidia-smi --query-compute-apps)"),
    "meminfo": ("meminfo.txt", "/proc/meminfo"),
    "fabric": ("fabric.txt", "RDMA devices (firmware, port state, GIDs) and their netdevs (MTU, speed, carrier, addresses)"),
    "fabric-document": ("fabric.json", "the fabric document `sparkctl setup` recorded on this node (missing: setup "
                                       "never ran here)"),
    "ethtool": ("ethtool-i.txt", "ethtool -i of each fabric port (driver, firmware-version)"),
    "kernel-lines": ("kernel-lines.txt", "the kernel's lines about OOM, Xid, NVRM, mlx5 (dmesg or journalctl -k)"),
    "docker-version": ("docker-version.txt", "docker version"),
    "container-toolkit": ("container-toolkit.txt", "nvidia-container-toolkit version"),
    "docker-inspect": ("docker-inspect.json", "docker inspect of this cluster's containers (env redacted)"),
    "docker-logs": ("docker-logs.txt", "each container's last log lines"),
    "image-inspect": ("image-inspect.json", "docker image inspect of the serving image (labels: its versions)"),
}


@dataclass
class Entry:
    """One file of the bundle, before redaction and caps."""

    path: str
    what: str
    node: str | None  # None: this machine (or the cluster as a whole)
    command: str
    data: bytes = b""
    missing: str | None = None  # why there is no such file


@dataclass
class Bundle:
    entries: list[Entry] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)

    def add(self, path: str, what: str, node: str | None, command: str, data: Any = None,
            missing: str | None = None) -> None:
        if isinstance(data, (dict, list)):
            data = json.dumps(data, indent=1, default=str, sort_keys=True) + "\n"
        if isinstance(data, str):
            data = data.encode("utf-8", errors="backslashreplace")
        self.entries.append(Entry(path, what, node, command, data or b"", missing))


def _why(exc: BaseException) -> str:
    if isinstance(exc, (NodeError, SparkctlError)):
        return exc.message[:300]
    return f"{type(exc).__name__}: {exc}"[:300]


def _guard(job: Callable[[], Any]) -> Any:
    try:
        return job()
    except Exception as exc:  # one source failing costs its file, never the bundle
        return exc


def collect(settings: Settings, ssh_config: Any, *, tail: int = 200, klines: int = 200, timeout: float = 20.0,
            connect_timeout: float = 5.0, local_files: Sequence[Path] = (), with_check: bool = True) -> Bundle:
    """Gather every file of the bundle (unredacted, uncapped: write_archive does both)."""
    b = Bundle()
    start = time.monotonic()
    s = settings
    b.add("settings.json", "the resolved settings and where each came from (secrets redacted)", None,
          "sparkctl config --json", s.as_dict())
    for p in local_files:
        try:
            b.add(f"local/{p.name}", f"local file {p}", None, f"cat {p}", p.read_bytes())
        except OSError as exc:
            b.add(f"local/{p.name}", f"local file {p}", None, f"cat {p}", missing=exc.strerror or str(exc))
    with Cluster(s.nodes, ssh_config, connect_timeout=connect_timeout, command_timeout=timeout) as cluster:
        b.timing["connect"] = time.monotonic() - start
        b.unreachable = {n: e.message[:300] for n, e in cluster.errors.items()}
        jobs = [functools.partial(_probe_all, cluster, s, tail, klines, timeout),
                functools.partial(_status, cluster, s),
                functools.partial(_lock, cluster, s),
                functools.partial(_history, cluster, s),
                functools.partial(_audit, cluster, s, tail, timeout),
                functools.partial(_check, cluster, s, ssh_config, timeout) if with_check else (lambda: None)]
        probes, status, lock, history, audit, check = parallel([functools.partial(_guard, j) for j in jobs])
    b.timing["gather"] = time.monotonic() - start
    _cluster_files(b, s, status, lock, history, audit, check)
    logs: dict[str, str] = {}
    for n in s.nodes:
        got = probes.get(n) if isinstance(probes, dict) else probes
        _node_files(b, n, got, logs)
    _nccl_file(b, logs)
    b.timing["total"] = time.monotonic() - start
    return b


PROBE_SLACK_S = 10.0
"""The probe's deadline on a node is the per-command timeout plus this (its commands run one after another)."""


@dataclass(frozen=True)
class ProbeOutput:
    """One node's probe sections; `cut` says why the sections after the last one read are missing (the
    probe did not finish in time), None when it ran to the end."""

    sections: dict[str, F.Section]
    cut: str | None = None


def _probe_all(cluster: Cluster, s: Settings, tail: int, klines: int, timeout: float) -> dict[str, Any]:
    nonce = _secrets.token_hex(8)
    image = s.get("IMAGE")
    argv = ["sh", "-s", "--", nonce, s.cluster_name, str(int(tail)), str(int(klines)), *([image] if image else [])]
    script = probe_script("kernel_lines.sh") + b"\n" + probe_script("diagnose.sh")

    def probe(node: Node) -> tuple[str, str, str | None]:
        """The probe's output; on a timeout, what it printed before (its finished sections still count)."""
        session = node.start(argv, timeout=timeout + PROBE_SLACK_S)
        try:
            r = session.finish(script)
        except NodeError as exc:
            if exc.kind != "command-timeout":
                raise
            return (bytes(session.out).decode("utf-8", "replace"), bytes(session.err).decode("utf-8", "replace"),
                    exc.reason)
        return r.stdout, r.stderr, None

    results = cluster.run_all(probe)
    out: dict[str, Any] = {}
    for n, r in results.items():
        if isinstance(r, NodeError):
            out[n] = r
            continue
        stdout, stderr, cut = r
        try:
            out[n] = ProbeOutput(F.parse_probe_sections(stdout, nonce, stderr), cut)
        except F.ParseError as exc:
            out[n] = NodeError(n, "output", f"the diagnose probe's output could not be read: {exc}")
    return out


def _status(cluster: Cluster, s: Settings) -> Any:
    from ..remote import readiness, service
    from .status import collect_status

    docs = []
    for view in s.replicas():
        try:
            url = service.head_base_url(cluster, view)
        except Exception:  # noqa: BLE001 - the head is gone: its alias stands in, the ranks' states still read
            url = f"http://{view.head}:{view.getint('PORT')}"
        api = readiness.HeadApi(url, view.get("VLLM_API_KEY"), timeout=3)
        docs.append({"replica": view.replica_index, **collect_status(cluster, view, api)})
    return docs[0] if len(docs) == 1 else {"replicas": docs}


def _lock(cluster: Cluster, s: Settings) -> Any:
    from .locking import lock_states

    states = lock_states(cluster, cluster.connected, s.cluster_name)
    return {"nodes": {n: st.as_dict() for n, st in states.items()},
            "unreachable": sorted(cluster.errors)}


def _history(cluster: Cluster, s: Settings) -> Any:
    from ..remote.releases import read_history

    return [r.as_dict() for r in read_history(cluster.node(s.head), s.cluster_name)]


def _audit(cluster: Cluster, s: Settings, tail: int, timeout: float) -> Any:
    from ..remote.lockdir import audit_tail_argv

    res = cluster.run_all(audit_tail_argv(s.cluster_name, tail), nodes=cluster.connected, timeout=timeout)
    return {n: (r.stdout if not isinstance(r, NodeError) else r) for n, r in res.items()}


def _check(cluster: Cluster, s: Settings, ssh_config: Any, timeout: float) -> Any:
    from .check import run_check

    return run_check(s, ssh_config, command_timeout=timeout, cluster=cluster)


def check_doc(report: Any) -> dict[str, Any]:
    """The check report as JSON (as `check --json` says it: findings, pins, plan, timing)."""
    return {"ok": report.ok, "nodes": report.nodes, "findings": [f.to_dict() for f in report.findings],
            "pins": {str(r): dataclasses.asdict(p) for r, p in report.pins.items()},
            "plan": dataclasses.asdict(report.plan) if report.plan is not None else None,
            "timing": report.timing}


def _cluster_files(b: Bundle, s: Settings, status: Any, lock: Any, history: Any, audit: Any,
                   check: Any) -> None:
    def put(path: str, what: str, command: str, value: Any, node: str | None = None) -> None:
        if isinstance(value, BaseException):
            b.add(path, what, node, command, missing=_why(value))
        elif value is None:
            b.add(path, what, node, command, missing="not asked (--no-check)")
        else:
            b.add(path, what, node, command, value)

    put("check.json", "sparkctl check --json: every node's preflight findings", "sparkctl check --json",
        check_doc(check) if check is not None and not isinstance(check, BaseException) else check)
    put("status.json", "sparkctl status --json: the ranks' containers, the head's health", "sparkctl status --json",
        status)
    put("lock.json", "sparkctl lock status --json: who holds the cluster lock", "sparkctl lock status --json", lock)
    put("history.json", "sparkctl history: the releases `up` recorded on the head", "sparkctl history --json",
        history, s.head)
    if isinstance(audit, dict):
        for n, text in audit.items():
            put(f"nodes/{n}/audit.jsonl", "the audit lines sparkctl wrote on this node", "sparkctl audit", text, n)
    else:
        put("audit.jsonl", "the audit lines sparkctl wrote", "sparkctl audit", audit)
    _rendered(b, s, check)


def _rendered(b: Bundle, s: Settings, check: Any) -> None:
    """env.tp4 and every rank's docker argv, rendered as `up` renders them from check's plan and pins."""
    from ..spec.renderer import render_all, resolve_pins

    cmd = "sparkctl render (from check's plan and pins)"
    if check is None or isinstance(check, BaseException) or check.plan is None:
        why = "no check report" if check is None or isinstance(check, BaseException) else "check made no plan"
        b.add("rendered/env.tp4", "the rendered env.tp4", None, cmd, missing=why)
        b.add("rendered/argv.json", "every rank's rendered docker argv", None, cmd, missing=why)
        return
    try:
        env_tp4, argv = [], []
        for view in s.replicas():
            found = {k: check.pins[view.rank_offset + k] for k in range(len(view.nodes))
                     if view.rank_offset + k in check.pins}
            r = render_all(view, check.plan, resolve_pins(view, found), source="sparkctl diagnose")
            env_tp4.append(r.env_tp4)
            argv += [{"replica": view.replica_index, "rank": sp.rank, "node": sp.node, "docker_argv": a}
                     for sp, a in zip(r.specs, r.docker_argv, strict=True)]
        b.add("rendered/env.tp4", "the rendered env.tp4", None, cmd, "\n".join(env_tp4))
        b.add("rendered/argv.json", "every rank's rendered docker argv", None, cmd, argv)
    except Exception as exc:  # pins or plan that cannot be rendered: say why
        b.add("rendered/env.tp4", "the rendered env.tp4", None, cmd, missing=_why(exc))
        b.add("rendered/argv.json", "every rank's rendered docker argv", None, cmd, missing=_why(exc))


def _node_files(b: Bundle, n: str, got: Any, logs: dict[str, str]) -> None:
    cmd = "sh -s < probes/diagnose.sh"
    if not isinstance(got, ProbeOutput):
        why = _why(got) if isinstance(got, BaseException) else "the probe did not run"
        for _section, (name, what) in PROBE_FILES.items():
            b.add(f"nodes/{n}/{name}", what, n, cmd, missing=why)
        b.add(f"nodes/{n}/ranks.json", "this node's ranks: state, exit code, OOM-killed, why", n, cmd, missing=why)
        return
    cut = f"cut short: {got.cut}" if got.cut else "no output (the probe was cut short)"
    for section, (name, what) in PROBE_FILES.items():
        sec = got.sections.get(section)
        if sec is None:
            b.add(f"nodes/{n}/{name}", what, n, f"{cmd}: {section}", missing=cut)
            continue
        text = sec.stdout
        if sec.rc != 0:
            err = sec.stderr.strip() or f"exit status {sec.rc}"
            if not text.strip():
                b.add(f"nodes/{n}/{name}", what, n, f"{cmd}: {section}", missing=err[:300])
                continue
            text += f"\n[exit status {sec.rc}: {err[:300]}]\n"
        b.add(f"nodes/{n}/{name}", what, n, f"{cmd}: {section}", text)
    _rank_files(b, n, got.sections, logs)


def _rank_files(b: Bundle, n: str, got: dict[str, Any], logs: dict[str, str]) -> None:
    ins, lg, kl = got.get("docker-inspect"), got.get("docker-logs"), got.get("kernel-lines")
    try:
        ranks = inspect_raw.rank_summaries(ins.stdout) if ins is not None and ins.rc == 0 else []
    except F.ParseError as exc:
        b.add(f"nodes/{n}/ranks.json", "this node's ranks", n, "docker inspect", missing=str(exc))
        return
    by_id = inspect_raw.split_logs(lg.stdout) if lg is not None else {}
    klines = death.relevant(kl.stdout.splitlines(), 50) if kl is not None else []
    for r in ranks:
        text = by_id.get(r["id"], "")
        logs[f"{n}/{r['name']}"] = text
        r["last_log_lines"] = text.splitlines()[-20:]
        if r.get("status") == "exited":
            r["why"] = death.why(r.get("exit_code"), r.get("oom_killed"), klines)
            r["kernel_lines"] = klines[-10:]
        b.add(f"nodes/{n}/logs/{r['name']}.log", f"the last log lines of {r['name']} (rank {r['rank']})", n,
              f"docker logs --tail N {r['name']}", text)
    b.add(f"nodes/{n}/ranks.json", "this node's ranks: state, exit code, OOM-killed, why, last lines", n,
          "docker inspect", ranks)


def _nccl_file(b: Bundle, logs: dict[str, str]) -> None:
    cmd = "sparkctl nccl-report (the ranks' logs)"
    merged = nccl.NcclLog()
    for source, text in logs.items():
        one = nccl.parse(text, source=source)
        merged.ranks += one.ranks
        merged.events += one.events
        merged.lines += one.lines
        merged.nccl_lines += one.nccl_lines
    if not merged.ranks and not merged.events:
        b.add("nccl-report.json", "nccl-report of the ranks' logs", None, cmd,
              missing=f"no NCCL_DEBUG=INFO line in the ranks' logs ({merged.lines} lines read)")
        return
    findings = nccl.report(merged)
    b.add("nccl-report.json", "nccl-report of the ranks' logs", None, cmd,
          {"ranks": [r.to_dict() for r in merged.ranks], "fabric_events": merged.events,
           "findings": [f.to_dict() for f in findings]})


def write_archive(bundle: Bundle, out: Path, secret_values: Sequence[str], *, file_cap: int = FILE_CAP,
                  total_cap: int = TOTAL_CAP, cluster: str = "", nodes: Sequence[str] = ()) -> dict[str, Any]:
    """Redact, cap and archive every entry (plus manifest.json, first) into OUT (.tar.gz, written to a
    temporary name, then renamed); return the manifest."""
    files: list[dict[str, Any]] = []
    payload: list[tuple[str, bytes]] = []
    used = 0
    for e in bundle.entries:
        row: dict[str, Any] = {"path": e.path, "what": e.what, "node": e.node, "command": e.command}
        if e.missing is not None:
            row |= {"missing": True, "why": redact(e.missing, secret_values)}
            files.append(row)
            continue
        data = redact(e.data.decode("utf-8", errors="backslashreplace"), secret_values).encode()
        row["original_bytes"] = len(data)
        capped = ""
        if len(data) > file_cap:
            data, capped = data[-file_cap:], f"kept the last {file_cap} bytes of {len(data)}"
        if used + len(data) > total_cap:
            row |= {"missing": True, "why": f"the archive's cap ({total_cap} bytes) was reached"}
            files.append(row)
            continue
        used += len(data)
        row |= {"bytes": len(data), "capped": bool(capped), **({"cap": capped} if capped else {})}
        files.append(row)
        payload.append((e.path, data))
    manifest = {
        "sparkctl": __version__, "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "cluster": cluster, "nodes": list(nodes),
        "unreachable": {n: redact(w, secret_values) for n, w in bundle.unreachable.items()},
        "caps": {"file_bytes": file_cap, "archive_bytes": total_cap}, "redaction": REDACTION,
        "timing_s": {k: round(v, 3) for k, v in bundle.timing.items()}, "files": files,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{_secrets.token_hex(4)}.tmp")
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for name, data in [("manifest.json", (json.dumps(manifest, indent=1) + "\n").encode()), *payload]:
                info = tarfile.TarInfo(f"sparkctl-diagnose/{name}")
                info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        tmp.chmod(0o600)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return manifest
