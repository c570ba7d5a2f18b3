"""`sparkctl verify-model`'s flow: the checkpoint's layout and EXL3 ABI, from its headers.

`verify_cluster` ships probes/ckpt_scan.py to every node over its SSH connection: the head sends its
shards' summaries (cached there: an unchanged checkpoint is not re-read), the others only
fingerprints; the head's scan is verified against the layout and every node's fingerprints are
compared. When the summaries show a problem, the head sends its full headers (compressed) so the
finding names the tensor and the shard. `verify_local` does the same on a folder of this machine.
Flags, the layout's resolution and printing: commands/verify_model.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.verify import NeedHeaders, Report, Summary, issue, verify_scan, verify_with
from ..checkpoint.verify_nodes import compare_nodes
from ..cluster import Cluster
from ..facts.parsing import ParseError, parse_json
from ..probes.ckpt_scan import scan
from ..rules.findings import FAIL, Finding
from ..spec.resources import probe_script

DEEP_TIMEOUT = 6 * 3600.0  # 308 GB over NFS at a few hundred MB/s, with room to spare
SCAN_TIMEOUT = 120.0


def verify_local(directory: Path, layout: dict[str, Any] | None, deep: bool, workers: int | None,
                 max_header: int, progress: Callable[[int], None] | None = None) -> tuple[Report, dict[str, Any]]:
    """A folder of this machine, from the shards' summaries (cached in ~/.cache/sparkctl), the headers when
    they show a problem; `progress` is told the bytes hashed (--deep)."""
    report = verify_with(lambda headers: scan(str(directory), headers=headers, deep=deep, workers=workers,
                                              max_header_bytes=max_header, progress=progress), layout)
    return report, {}


def verify_cluster(settings: Any, ssh_config: Any, layout: dict[str, Any] | None, deep: bool,
                   max_header: int) -> tuple[Report, dict[str, Any]]:
    """MODEL on every node of `settings` (its `nodes` and `model`; the first node is the head)."""
    nodes = list(settings.nodes)
    head = nodes[0]
    model = str(settings.model)
    script = probe_script("ckpt_scan.py")

    def job(node: Any, headers: str = "") -> Any:
        args = [model, "--headers", headers or ("summary" if node.name == head else "none"), "--fingerprints",
                "--max-header-bytes", str(max_header)]
        if deep:
            args.append("--deep")
        return node.run_script(script, args, interpreter=("python3", "-"),
                               timeout=DEEP_TIMEOUT if deep else SCAN_TIMEOUT)

    with Cluster(nodes, ssh_config) as cluster:
        results = cluster.run_all(job, nodes=nodes)
        scans, findings = _scans(results)
        report = Report([], Summary())
        if head in scans:
            try:
                report = verify_scan(scans[head], layout)
            except NeedHeaders:  # the summaries show a problem: the head's full headers name it
                again, more = _scans(cluster.run_all(lambda node: job(node, "zlib"), nodes=[head]))
                findings += more
                if head in again:
                    report = verify_scan(again[head], layout)
    report.findings = findings + compare_nodes(scans, head) + report.findings
    nodes_doc = {n: {"host": s.get("host"), "shards": len(s.get("shards") or {})} for n, s in scans.items()}
    return report, {"nodes": nodes_doc, "head": head, "asked": nodes}


def _scans(results: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[Finding]]:
    """Each node's scan document, and a finding for each node that gave none."""
    scans: dict[str, dict[str, Any]] = {}
    findings: list[Finding] = []
    for node, r in results.items():
        if isinstance(r, Exception):
            findings.append(issue(FAIL, "node-unreachable", f"{node}: {getattr(r, 'reason', None) or r}",
                                    getattr(r, "fix", None) or f"check that {node} is up and reachable over SSH",
                                    node))
            continue
        try:
            doc = parse_json(r.stdout) if r.ok else None
        except ParseError:
            doc = None
        if not isinstance(doc, dict):
            findings.append(issue(FAIL, "node-scan-failed",
                                    f"{node}: the checkpoint scan failed (exit {r.exit_code}): {r.stderr.strip()[-300:]}",
                                    f"check that python3 (>= 3.10) exists on {node}", node))
            continue
        scans[node] = doc
    return scans, findings
