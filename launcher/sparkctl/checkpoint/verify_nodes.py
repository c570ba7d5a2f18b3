"""verify-model across nodes: every node's checkpoint folder compared by fingerprint (probes/ckpt_scan.py
scanned with fingerprints). Pure."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import Any

from ..rules.findings import FAIL, Finding
from .verify import issue

_FP_FIELDS = (("size", "size"), ("header_sha256", "header"), ("head_sha256", "first MiB"),
              ("tail_sha256", "last MiB"))


def fingerprints(scan: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Per file: (size, header hash, first/last MiB hashes, full hash) as far as the scan has them."""
    out: dict[str, tuple[Any, ...]] = {}
    deep = scan.get("deep") or {}
    for name, e in (scan.get("shards") or {}).items():
        if e.get("error"):
            out[name] = ("error", e["error"].get("code"))
            continue
        out[name] = (*(e.get(k) for k, _ in _FP_FIELDS), (deep.get(name) or {}).get("sha256"))
    for name, e in (scan.get("json") or {}).items():
        if not e.get("missing"):
            out[name] = ("json", e.get("sha256"))
    return out


def _what_differs(mine: tuple[Any, ...] | None, ref: tuple[Any, ...] | None) -> str:
    if mine is None:
        return "missing"
    if ref is None:
        return "extra"
    if mine[0] in ("error", "json") or ref[0] in ("error", "json"):
        return "unreadable" if mine[0] == "error" else "content"
    labels = [label for _, label in _FP_FIELDS] + ["content"]
    diffs = [label for a, b, label in zip(mine, ref, labels, strict=False) if a is not None and b is not None and a != b]
    return ", ".join(diffs) or "content"


def compare_nodes(scans: Mapping[str, Mapping[str, Any]], head: str | None = None) -> list[Finding]:
    """Compare every node's folder by fingerprint; name each node that differs and its files.

    The reference for each file is what most nodes hold; on a tie, the head's (first node by default).
    """
    if not scans:
        return []
    head = head if head in scans else next(iter(scans))
    findings: list[Finding] = []
    fps: dict[str, dict[str, tuple[Any, ...]]] = {}
    for node, s in scans.items():
        if s.get("error"):
            err = s["error"]
            findings.append(issue(FAIL, "node-scan-failed", f"{node}: {err.get('message')}",
                                    f"make MODEL exist at the same path on {node} (shared storage mounted, or "
                                    "the NFS server bind-mounting its export there)", node))
            continue
        fps[node] = fingerprints(s)
    if len(fps) < 2:
        return findings
    names = sorted({n for fp in fps.values() for n in fp})
    diffs: dict[str, list[str]] = defaultdict(list)
    for name in names:
        values = {node: fp.get(name) for node, fp in fps.items()}
        counts = Counter(values.values())
        top = max(counts.values())
        candidates = [v for v, c in counts.items() if c == top]
        ref = values[head] if head in values and values[head] in candidates else candidates[0]
        for node, v in values.items():
            if v != ref:
                diffs[node].append(f"{name} ({_what_differs(v, ref)})")
    for node, files in diffs.items():
        more = f", and {len(files) - 8} more" if len(files) > 8 else ""
        findings.append(issue(FAIL, "node-differs",
                                f"{node}: {len(files)} file(s) differ from the other nodes' (reference: majority, "
                                f"then {head}): {', '.join(files[:8])}{more}",
                                f"re-sync {node}'s copy from {head} (or fix its mount so it sees the shared folder)",
                                node))
    return findings
