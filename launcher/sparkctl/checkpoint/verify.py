"""verify-model's rules over a checkpoint scan (probes/ckpt_scan.py): one node's scan in, a Report
(findings and a summary) out. Pure: no I/O except verify_dir(), which scans a folder on this machine.

The pieces: `verify_rules` (the rules every reading shares, the Report, and the layout format the
rules take), this module (a scan with full headers), `verify_summary` (a scan of per-shard summaries:
the fast path for a sound checkpoint; NeedHeaders when only the headers can say what is wrong),
`verify_folder` (what both readings end with), `verify_nodes` (every node's folder compared by
fingerprint).
"""

from __future__ import annotations

import gc
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..probes.ckpt_scan import scan as scan_dir
from ..rules.findings import FAIL, WARN, Finding
from .safetensors import Header, TensorKind
from .verify_folder import _finish
from .verify_rules import (
    EXAMPLES,
    INDEX,
    NeedHeaders,
    Report,
    Summary,
    _check_abi,
    _config_checks,
    _expected_experts,
    _index_vs_folder,
    _Issues,
    _json_file,
    _mtp_layer,
    _shard_header,
    _total_size_finding,
    findings_have,
    issue,
)
from .verify_summary import _verify_summary


def verify_scan(scan: Mapping[str, Any], layout: Mapping[str, Any] | None = None) -> Report:
    """Turn one node's scan into findings and a summary. Never raises for any scan content, except
    NeedHeaders for a summary scan that shows a problem: scan with headers and verify that."""
    # ~300k small containers are built and nothing forms a cycle: the cyclic GC would only
    # burn a third of the time budget re-walking them.
    enabled = gc.isenabled()
    gc.disable()
    try:
        if scan.get("headers") == "summary" and not scan.get("error"):
            try:
                return _verify_summary(scan, layout or {})
            except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
                # what a node printed is malformed: the full headers (and their findings) decide
                raise NeedHeaders(f"the summary is malformed ({type(exc).__name__})") from None
        return _verify_scan(scan, layout)
    finally:
        if enabled:
            gc.enable()


def _verify_scan(scan: Mapping[str, Any], layout: Mapping[str, Any] | None) -> Report:
    layout = layout or {}
    findings: list[Finding] = []
    summary = Summary(expected_shards=int(layout.get("shards") or 0))
    if scan.get("error"):
        err = scan["error"]
        findings.append(issue(FAIL, str(err.get("code", "scan-failed")), str(err.get("message")),
                                "set MODEL to the checkpoint folder (the same path on every node)", str(scan.get("dir"))))
        return Report(findings, summary)

    index = _json_file(scan, INDEX, findings, required=True)
    config = _json_file(scan, "config.json", findings, required=True)
    qconf = _json_file(scan, "quantization_config.json", findings, required=False)
    shards_scan: Mapping[str, Any] = scan.get("shards") or {}

    weight_map: dict[str, str] = {}
    total_size = None
    if index is not None:
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not set(map(type, wm.values())) <= {str}:
            findings.append(issue(FAIL, "index-invalid", f"{INDEX} has no weight_map of tensor → shard names",
                                    "re-download the index", INDEX))
        else:
            weight_map = wm
        meta = index.get("metadata") if isinstance(index, dict) else None
        if isinstance(meta, dict) and isinstance(meta.get("total_size"), int):
            total_size = meta["total_size"]

    counts = Counter(weight_map.values())  # shard -> tensors the index puts there
    _index_vs_folder(counts, shards_scan, bool(weight_map), layout, summary, findings)

    # -- every shard's header
    headers: dict[str, Header] = {}
    main_shards = [n for n in sorted(shards_scan) if n in counts or (not weight_map and "/" not in n)]
    for sname in main_shards:
        entry = shards_scan[sname]
        summary.bytes += int(entry.get("size") or 0)
        header = _shard_header(sname, entry, findings)
        if header is not None:
            headers[sname] = header

    # -- index -> shard tensor presence, duplicates, total size
    data_total = sum(h.data_len for h in headers.values())
    summary.tensors = sum(len(h.kinds) for h in headers.values())
    merged: dict[str, TensorKind] = {}
    for h in headers.values():
        merged.update(h.kinds)
    # The index agrees with the headers iff it names as many tensors as they hold and puts each in
    # the shard that holds it: C-level passes in the usual case, and only when it does not are the
    # per-tensor loops below run to say what differs.
    wm_get = weight_map.get
    consistent = len(weight_map) == summary.tensors and all(
        list(map(wm_get, h.kinds)).count(sname) == len(h.kinds) for sname, h in headers.items())
    located: dict[str, str] = {}  # tensor -> shard as the headers say
    for sname, h in ([] if consistent else headers.items()):
        located.update(dict.fromkeys(h.kinds, sname))
    absent: dict[str, list[str]] = defaultdict(list)
    tensors_of = {s: h.kinds for s, h in headers.items()}
    for tname, sname in ([] if consistent else weight_map.items()):
        held = tensors_of.get(sname)
        if held is not None and tname not in held:
            absent[sname].append(tname)
    for sname, names in sorted(absent.items()):
        where_is = located
        ex = "; ".join(f"{n}" + (f" (found in {where_is[n]})" if n in where_is else " (in no shard)")
                       for n in names[:EXAMPLES])
        more = f"; and {len(names) - EXAMPLES:,} more" if len(names) > EXAMPLES else ""
        findings.append(issue(FAIL, "index-tensor-absent",
                                f"the index puts {len(names):,} tensors in {sname} that its header lacks: {ex}{more}",
                                "re-download the index and the shard from the same revision", sname))
    if len(merged) != summary.tensors:  # some name is in two shards
        seen: dict[str, str] = {}
        for sname, h in headers.items():
            dup = [t for t in h.kinds if t in seen]
            if dup:
                findings.append(issue(FAIL, "tensor-duplicate",
                                        f"{len(dup):,} tensors of {sname} are also stored in another shard, "
                                        f"e.g. {dup[0]} (also in {seen[dup[0]]})",
                                        "the folder mixes two revisions: re-download it", sname))
            seen.update(dict.fromkeys(h.kinds, sname))
    if weight_map:
        for sname, h in ([] if consistent else headers.items()):
            unindexed = set(h.kinds).difference(weight_map)  # not keys()-keys(): that walks weight_map
            if unindexed:
                findings.append(issue(WARN, "tensor-not-in-index",
                                        f"{len(unindexed):,} tensors of {sname} are not in the index, "
                                        f"e.g. {min(unindexed)}",
                                        "re-download the index from the shards' revision", sname))
        if not findings_have(findings, "shard-missing"):
            _total_size_finding(total_size, data_total, findings)

    _config_checks(config, qconf, layout, findings)

    # -- EXL3 ABI, scope and expected modules
    cfg = config if isinstance(config, dict) else {}
    mtp_layer = _mtp_layer(layout, cfg)
    issues = _Issues()
    codebook_layers: dict[int, set[str]] = {}
    rules = layout.get("classes") or {}
    present, widths = _check_abi(merged, rules, layout, issues, summary, codebook_layers, mtp_layer)
    _expected_experts(cfg, present, headers, len(headers) == len(main_shards), issues)
    _finish(scan, shards_scan, main_shards, layout, findings, summary, issues, codebook_layers, widths, mtp_layer)
    return Report(findings, summary)




def verify_dir(path: str | Path, layout: Mapping[str, Any] | None = None, *, fingerprints: bool = False,
               summary_cache: str | None = None, **scan_options: Any) -> Report:
    """Scan the folder on this machine and verify it: from its summaries (cached in `summary_cache`,
    "" for no cache), and from its headers when the summaries show a problem."""
    return verify_with(lambda headers: scan_dir(str(path), headers=headers, fingerprints=fingerprints,
                                                summary_cache=summary_cache, **scan_options), layout)


def verify_with(scan_fn: Callable[[str], Mapping[str, Any]], layout: Mapping[str, Any] | None) -> Report:
    """Verify what `scan_fn("summary")` returns; if the summaries show a problem, scan again with
    full headers (`scan_fn("raw")`, or "zlib" from a node: scan_fn chooses) and verify that."""
    try:
        return verify_scan(scan_fn("summary"), layout)
    except NeedHeaders:
        return verify_scan(scan_fn("raw"), layout)
