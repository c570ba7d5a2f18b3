"""verify-model from summaries: a scan made with headers="summary" (probes/ckpt_scan.py) checked by
the same rules (verify_rules) from a few thousand groups instead of every tensor entry. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..rules.findings import Finding
from .verify_folder import _finish
from .verify_rules import (
    INDEX,
    NeedHeaders,
    Report,
    Summary,
    _abi_from_groups,
    _config_checks,
    _expected_expert_count,
    _index_vs_folder,
    _Issues,
    _json_file,
    _merge_groups,
    _mtp_layer,
    _size_findings,
    _total_size_finding,
)


def _verify_summary(scan: Mapping[str, Any], layout: Mapping[str, Any]) -> Report:
    """verify_scan for a scan made with headers="summary" (ckpt_scan): the same report for a sound
    checkpoint, read from a few thousand groups instead of 232k tensor entries; NeedHeaders when
    the summaries show a problem that only the headers can pin down."""
    findings: list[Finding] = []
    summary = Summary(expected_shards=int(layout.get("shards") or 0))
    entry = (scan.get("json") or {}).get(INDEX) or {"missing": True}
    isumm = entry.get("summary")
    if entry.get("missing") or entry.get("error") or not isinstance(isumm, dict) or isumm.get("error") \
            or not isumm.get("weight_map"):
        raise NeedHeaders("the index is missing or unreadable")
    config = _json_file(scan, "config.json", findings, required=True)
    qconf = _json_file(scan, "quantization_config.json", findings, required=False)
    shards_scan: Mapping[str, Any] = scan.get("shards") or {}
    ishards = isumm.get("shards")
    if not isinstance(ishards, dict):
        raise NeedHeaders("the index summary is malformed")
    counts = {str(k): int(v.get("count", -1)) for k, v in ishards.items() if isinstance(v, dict)}
    top_level = _index_vs_folder(counts, shards_scan, True, layout, summary, findings)
    if set(counts) - top_level:
        raise NeedHeaders("a shard the index names is missing")  # the headers say which tensors went with it
    main_shards = sorted(set(counts) & set(shards_scan))
    summaries = []
    data_total = 0
    for sname in main_shards:
        e = shards_scan[sname]
        summ = e.get("summary")
        if e.get("error") or not isinstance(summ, dict):
            raise NeedHeaders(f"{sname} could not be summarised")
        if summ.get("tensors") != counts[sname] or summ.get("names_sha256") != ishards[sname].get("names_sha256"):
            raise NeedHeaders(f"{sname} and the index disagree")
        summary.bytes += int(e.get("size") or 0)
        data_len = int(summ.get("data_len") or 0)
        data_total += data_len
        _size_findings(sname, int(e.get("size", 0)), 8 + int(e.get("header_len") or 0) + data_len, findings)
        summaries.append(summ)
    summary.tensors = sum(int(x.get("tensors") or 0) for x in summaries)
    if summary.tensors != isumm.get("tensors"):
        raise NeedHeaders("the index names tensors no shard holds")
    _total_size_finding(isumm.get("total_size"), data_total, findings)
    _config_checks(config, qconf, layout, findings)
    cfg = config if isinstance(config, dict) else {}
    mtp_layer = _mtp_layer(layout, cfg)
    issues = _Issues()
    codebook_layers: dict[int, set[str]] = {}
    experts, widths = _abi_from_groups(_merge_groups(summaries), layout.get("classes") or {}, layout, issues,
                                       summary, codebook_layers, mtp_layer)
    want = _expected_expert_count(cfg)
    if want is not None and experts != want:
        raise NeedHeaders("routed experts are missing")  # the per-module path names them
    _finish(scan, shards_scan, main_shards, layout, findings, summary, issues, codebook_layers, widths, mtp_layer)
    return Report(findings, summary)
