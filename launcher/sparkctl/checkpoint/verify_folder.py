"""What every reading of a checkpoint ends with (verify_rules' rules, the Report's last findings): the
kv_a widths, the grouped issues, the codebooks, the folder's optional and serving files, the deep
hashes, and the findings in severity order. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..rules.findings import FAIL, INFO, WARN, Finding
from .verify_rules import (
    Summary,
    _abi_from_groups,
    _check_abi,
    _expected_severity,
    _Issues,
    _merge_groups,
    _shard_header,
    _size_findings,
    classify,
    issue,
    ranges,
)


def _finish(scan: Mapping[str, Any], shards_scan: Mapping[str, Any], main_shards: list[str],
            layout: Mapping[str, Any], findings: list[Finding], summary: Summary, issues: _Issues,
            codebook_layers: dict[int, set[str]], widths: Mapping[str, int], mtp_layer: int | None) -> None:
    """What every path ends with: kv_a widths, the grouped issues, codebooks, optional and serving
    files, deep hashes, and the findings in severity order."""
    want_w = layout.get("kv_a_proj_width")
    if isinstance(want_w, int):
        for mod, w in sorted(widths.items()):
            if w != want_w:
                issues.add(_expected_severity(layout, "kv_a_proj_width"), "kv-a-width", "attention", mod, classify(mod, mtp_layer)[1],
                           f"{w} wide, expected {want_w}", "use the checkpoint this recipe is for")
    findings.extend(issues.findings("shards"))

    labels = {layer: "+".join(sorted(cbs)) for layer, cbs in codebook_layers.items()}
    summary.codebooks = " · ".join(f"{label}: {ranges(ls)}" for label, ls in _runs(labels))
    used = {cb for cbs in codebook_layers.values() for cb in cbs}
    if len(used) > 1:
        sev = FAIL if layout.get("mixed_codebooks") == "error" else WARN
        findings.append(issue(sev, "codebook-mixed", f"codebooks are mixed ({summary.codebooks})",
                                layout.get("codebook_note") or "serve with an overlay that detects the codebook "
                                "per layer", "shards"))

    _optional_files(scan, shards_scan, set(main_shards), layout, findings, summary, mtp_layer)
    _serving_files(scan, layout, findings)
    _deep(scan, findings, summary)
    order = {FAIL: 0, WARN: 1, INFO: 2}
    findings.sort(key=lambda f: order.get(f.status, 3))


def _runs(labels: Mapping[int, str]) -> list[tuple[str, list[int]]]:
    """Group layers into runs of the same label, in layer order: [("mcg", [3]), ("mul1", [4..77])]."""
    out: list[tuple[str, list[int]]] = []
    for layer in sorted(labels):
        if out and out[-1][0] == labels[layer] and out[-1][1][-1] == layer - 1:
            out[-1][1].append(layer)
        else:
            out.append((labels[layer], [layer]))
    return out


def _optional_files(scan: Mapping[str, Any], shards_scan: Mapping[str, Any], main: set[str],
                    layout: Mapping[str, Any], findings: list[Finding], summary: Summary,
                    mtp_layer: int | None) -> None:
    optional: Mapping[str, Any] = layout.get("optional_files") or {}
    for rel in sorted(set(shards_scan) - main):
        if "/" not in rel:
            continue  # top-level extras were reported against the index
        spec = optional.get(rel)
        if spec is None:
            findings.append(issue(INFO, "file-ignored", f"{rel} is not part of the index or the layout; "
                                    "vLLM will not load it", "", rel))
            continue
        entry = shards_scan[rel]
        issues = _Issues()
        sub = Summary()
        rules, sub_layout = spec.get("classes") or {}, {**layout, "default_format": "any"}
        if isinstance(entry.get("summary"), dict) and not entry.get("error"):
            summ = entry["summary"]
            _size_findings(rel, int(entry.get("size", 0)),
                           8 + int(entry.get("header_len") or 0) + int(summ.get("data_len") or 0), findings)
            _abi_from_groups(_merge_groups([summ]), rules, sub_layout, issues, sub, {}, mtp_layer)
        else:
            header = _shard_header(rel, entry, findings)
            if header is None:
                continue
            _check_abi(header.kinds, rules, sub_layout, issues, sub, {}, mtp_layer)
        findings.extend(issues.findings(rel))
        desc = ", ".join(f"{c} {'/'.join(map(str, sorted(b)))}-bit" for c, b in sub.quantized_by_class.items())
        summary.optional_files.append(f"{rel}: {desc or 'no EXL3 linears'}")
    for rel, spec in optional.items():
        if rel not in shards_scan:
            findings.append(issue(INFO, "optional-absent", f"optional {rel} is not present"
                                    + (f" ({spec.get('note')})" if spec.get("note") else ""), "", rel))


def _serving_files(scan: Mapping[str, Any], layout: Mapping[str, Any], findings: list[Finding]) -> None:
    """The checkpoint's image chain (serving/Dockerfile.* that `build` builds): which it ships, which not."""
    files = scan.get("files") or {}
    wanted = list(layout.get("serving_files") or [])
    shipped = [name for name in wanted if f"serving/{name}" in files]
    for name in wanted:
        if name not in shipped:
            findings.append(issue(WARN, "serving-file-missing",
                                    f"serving/{name} is missing: `sparkctl build` cannot build the image layer it defines",
                                    "download the checkpoint's serving/ folder too", f"serving/{name}"))
    if wanted:
        missing = [n for n in wanted if n not in shipped]
        findings.append(issue(INFO, "serving-chain",
                                f"image chain in serving/: ships {', '.join(shipped) or 'none'}"
                                + (f"; missing {', '.join(missing)}" if missing else ""), "", "serving/"))


def _deep(scan: Mapping[str, Any], findings: list[Finding], summary: Summary) -> None:
    for name, entry in sorted((scan.get("deep") or {}).items()):
        if entry.get("error"):
            findings.append(issue(FAIL, "deep-unreadable", f"{name}: {entry['error'].get('message')}",
                                    "check the file's permissions and the disk", name))
        elif entry.get("sha256"):
            summary.deep[name] = entry["sha256"]
