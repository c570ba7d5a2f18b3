"""verify-model's rules over a checkpoint scan (probes/ckpt_scan.py): one node's scan in, a Report
(findings and a summary) out. Pure: no I/O except verify_dir(), which scans a folder on this machine.

One module, in four sections: the rules every reading shares (the Report, and the layout format below),
what both readings end with (optional and serving files, the deep hash), the reading of per-shard summaries
(the fast path for a sound checkpoint; NeedHeaders when only the headers can say what is wrong), and the
reading of full headers (verify_scan, verify_dir, verify_with). `verify_nodes` compares every node's folder
by fingerprint.

The rules are parameterised by a recipe's checkpoint `layout`, a plain dict (recipes/layouts/*.json):

    name              label used in messages, e.g. "glm53-3.00bpw"
    quant_method      expected quantization_config quant_method ("exl3")
    bits              expected quantization_config bits (3, or 2.75 for a mixed pack); omitted = any
    scope             expected quantization_config scope ("glm53_routed_experts_only")
    allowed_bits      widths the serving overlay can load at all ([3, 4, 5, 6]); others are errors
    codebooks         codebook markers the overlay understands (["mcg", "mul1"])
    mixed_codebooks   "warn" or "error" when more than one codebook is in use
    codebook_note     what serving a mixed-codebook pack requires (goes into the warning's fix)
    config            {config.json key: expected value}, e.g. {"num_hidden_layers": 78, ...}
    mtp_layer         the MTP block's layer index (78); its routed experts are class "mtp_expert"
    classes           {class: {"format": "exl3"|"native"|"any", "bits": [...], "codebooks": [...],
                       "uniform": bool}} for the module classes below; unlisted classes use
    default_format    (normally "native")
    kv_a_proj_width   stored output width of self_attn.kv_a_proj_with_mqa (576, or 640 when padded)
    shards            expected number of index shards (a warning when it differs)
    optional_files    {relative path: {"classes": {...}, "note": "..."}}: extra safetensors files
                      (e.g. the 6-bit head) checked with their own class rules when present
    serving_files     the chain's Dockerfiles in serving/ (reported as shipped / missing; a warning when missing)
    provenance        {rule key: "seed" | "vllm source" | "assumed"}: where each expected value comes
                      from ("seed": the model card states it; "vllm source": vLLM's source; the
                      figures with their sources are in docs/sources.md). A checkpoint that differs from an *assumed* value (quantization_config,
                      config.json, kv_a width) gets a warning saying what was found, never an error:
                      only what we know is an error. Structural facts read from the headers (bits per
                      tensor, codebooks, the shard set) stay errors whatever the provenance.

Module classes (from the tensor name): routed_expert, mtp_expert, shared_expert, dense_mlp, router,
attention (q_a/q_b/kv_a/o_proj), kv_b, indexer_q (indexer.wq_b), indexer (wk, weights_proj),
mtp_other (eh_proj, shared_head), embed, lm_head, other.
"""

from __future__ import annotations

import gc
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from itertools import compress, repeat
from operator import add, itemgetter
from pathlib import Path
from typing import Any

from ..facts.parsing import NotJson, parse_json
from ..probes.ckpt_scan import decode_blob
from ..probes.ckpt_scan import scan as scan_dir
from ..rules.findings import CLUSTER_ROW, FAIL, INFO, WARN, Finding
from .safetensors import DTYPE_BITS, Header, HeaderError, TensorKind, nbytes, parse_header

# ----------------------------------------------------------------------------------------------------------
# The rules every reading shares, the Report, the layout
# ---------------------------------------------------------------- names, findings and the report

INDEX = "model.safetensors.index.json"
EXL3_PARTS = ("trellis", "suh", "svh")
MARKERS = ("mcg", "mul1")
EXAMPLES = 3  # how many offending names a grouped finding quotes
_PART_SUFFIXES = (".suh", ".svh", ".mcg", ".mul1")
_Group = tuple[str, int | None, int, str]  # (class, layer, bits, codebook marker) of EXL3 linears
_Groups = dict[_Group, int]  # how many linears per group


# The checkpoint rules' findings: the cluster's `checkpoint` row, `code` naming the rule.
SHORT = {FAIL: "invalid", WARN: "warning", INFO: "info"}


def issue(status: str, code: str, message: str, fix: str = "", where: str = "") -> Finding:
    """A checkpoint finding: `status` FAIL, WARN or INFO, `message` the whole story, `where` the file,
    tensor or node it is about."""
    return Finding(CLUSTER_ROW, "checkpoint", status, SHORT[status], message, fix, code=code, where=where)


def finding_doc(f: Finding) -> dict[str, str]:
    """A checkpoint finding as verify-model's and model sync's JSON say it."""
    return {"severity": f.severity, "code": f.code, "message": f.reason, "fix": f.fix, "where": f.where}


@dataclass
class Summary:
    shards: int = 0
    expected_shards: int = 0
    bytes: int = 0
    tensors: int = 0
    quantized_by_bits: dict[int, int] = field(default_factory=dict)
    quantized_by_class: dict[str, dict[int, int]] = field(default_factory=dict)
    native_linears: int = 0
    codebooks: str = ""
    optional_files: list[str] = field(default_factory=list)
    deep: dict[str, str] = field(default_factory=dict)

    def quantized_line(self) -> str:
        if not self.quantized_by_bits:
            return "none"
        return " · ".join(f"{n:,} × {b}-bit" for b, n in sorted(self.quantized_by_bits.items()))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["quantized_by_bits"] = {str(k): v for k, v in sorted(self.quantized_by_bits.items())}
        d["quantized_by_class"] = {c: {str(k): v for k, v in sorted(b.items())}
                                   for c, b in sorted(self.quantized_by_class.items())}
        return d


@dataclass
class Report:
    findings: list[Finding]
    summary: Summary

    @property
    def ok(self) -> bool:
        return not any(f.status == FAIL for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary.to_dict(), "findings": [finding_doc(f) for f in self.findings]}




# ---------------------------------------------------------------- helpers


def ranges(layers: Iterable[int]) -> str:
    """[3] -> "layer 3"; [4, 5, 6, 9] -> "layers 4–6, 9"."""
    xs = sorted(set(layers))
    if not xs:
        return "no layers"
    parts: list[str] = []
    start = prev = xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}")
        if x is not None:
            start = prev = x
    return ("layer " if len(xs) == 1 else "layers ") + ", ".join(parts)


def classify(module: str, mtp_layer: int | None) -> tuple[str, int | None]:
    """(class, layer) of a linear module name such as model.layers.5.mlp.experts.7.up_proj."""
    parts = module.split(".")
    if len(parts) >= 4 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        layer = int(parts[2])
        rest = parts[3:]
        if rest[0] == "mlp":
            kind = rest[1] if len(rest) > 1 else ""
            if kind == "experts":
                return ("mtp_expert" if layer == mtp_layer else "routed_expert"), layer
            if kind == "shared_experts":
                return "shared_expert", layer
            if kind == "gate":
                return "router", layer
            return "dense_mlp", layer
        if rest[0] == "self_attn":
            if len(rest) > 1 and rest[1] == "kv_b_proj":
                return "kv_b", layer
            if len(rest) > 1 and rest[1] == "indexer":
                return ("indexer_q" if len(rest) > 2 and rest[2] == "wq_b" else "indexer"), layer
            return "attention", layer
        if rest[0] in ("eh_proj", "shared_head"):
            return "mtp_other", layer
        return "other", layer
    if parts[0] == "lm_head":
        return "lm_head", None
    if module.startswith("model.embed_tokens"):
        return "embed", None
    return "other", None


class _Issues:
    """Collects per-module problems and reports each (code, class) once, with a count and examples,
    so 57,600 broken experts make one readable finding, not 57,600."""

    def __init__(self) -> None:
        self.items: dict[tuple[str, str, str], list[tuple[str, int | None, str, int]]] = defaultdict(list)
        self.fixes: dict[tuple[str, str, str], str] = {}

    def add(self, severity: str, code: str, cls: str, module: str, layer: int | None, detail: str,
            fix: str, count: int = 1) -> None:
        key = (severity, code, cls)
        self.items[key].append((module, layer, detail, count))
        self.fixes.setdefault(key, fix)

    def findings(self, where: str) -> list[Finding]:
        out = []
        for (severity, code, cls), rows in self.items.items():
            layers = [r[1] for r in rows if r[1] is not None]
            scope = f" in {ranges(layers)}" if layers else ""
            total = sum(r[3] for r in rows)
            shown = rows[:EXAMPLES]
            ex = "; ".join(f"{m}{' etc.' if n > 1 else ''} ({d})" for m, _, d, n in shown)
            rest = total - sum(r[3] for r in shown)
            more = f"; and {rest:,} more" if rest > 0 else ""
            noun = "linear" if total == 1 else "linears"
            out.append(issue(severity, code, f"{total:,} {cls.replace('_', ' ')} {noun}{scope}: {ex}{more}",
                               self.fixes[(severity, code, cls)], where))
        return out




# ---------------------------------------------------------------- the checks


def _json_file(scan: Mapping[str, Any], name: str, findings: list[Finding], *, required: bool) -> Any:
    entry = (scan.get("json") or {}).get(name) or {"missing": True}
    if entry.get("missing"):
        if required:
            findings.append(issue(FAIL, "file-missing", f"{name} is missing from the checkpoint folder",
                                    "download the complete checkpoint (it ships with the shards)", name))
        return None
    if entry.get("error"):
        findings.append(issue(FAIL, "json-unreadable", f"{name}: {entry['error'].get('message')}",
                                "re-download the file", name))
        return None
    try:
        raw = decode_blob(entry.get("data"))
        return None if raw is None else parse_json(raw)
    except ValueError as exc:  # NotJson, or a blob that does not decode
        why = exc.reason if isinstance(exc, NotJson) else str(exc)
        findings.append(issue(FAIL, "json-invalid", f"{name} is not valid JSON: {why[:120]}",
                                "re-download the file (it is damaged)", name))
        return None


def _shard_header(name: str, entry: Mapping[str, Any], findings: list[Finding]) -> Header | None:
    fix = f"re-download {name}: the file is damaged or not a safetensors file"
    if entry.get("error"):
        err = entry["error"]
        findings.append(issue(FAIL, str(err.get("code", "shard-unreadable")),
                                f"{name}: {err.get('message')}", fix, name))
        return None
    try:
        raw = decode_blob(entry.get("header"))
        if raw is None:
            return None
        header = parse_header(raw)
    except HeaderError as exc:
        findings.append(issue(FAIL, exc.code, f"{name}: {exc.message}", fix, name))
        return None
    except ValueError as exc:  # a damaged transfer of the header blob
        findings.append(issue(FAIL, "header-transfer", f"{name}: header blob unreadable ({exc})", fix, name))
        return None
    _size_findings(name, int(entry.get("size", 0)), header.file_size, findings)
    return header


def _size_findings(name: str, size: int, want: int, findings: list[Finding]) -> None:
    """The file on disk vs the size its header says it has."""
    if size < want:
        findings.append(issue(FAIL, "shard-truncated",
                                f"{name} is {want - size:,} bytes short: {size:,} on disk, the header says {want:,}",
                                f"re-download {name} (an interrupted copy leaves it short)", name))
    elif size > want:
        findings.append(issue(FAIL, "shard-oversize",
                                f"{name} has {size - want:,} bytes after its last tensor ({size:,} on disk, "
                                f"the header says {want:,})", f"re-download {name}", name))


def _exl3_modules(tensors: Mapping[str, TensorKind], trellis_mods: list[str], mtp_layer: int | None,
                  issues: _Issues, reload: str) -> tuple[_Groups, dict[_Group, str], dict[str, int], int]:
    """The per-module EXL3 checks, module by module: every structural problem becomes an issue.
    Returns (modules per group, first module per group, kv_a widths, parts accounted for)."""
    accounted = 0
    groups: _Groups = {}
    example: dict[_Group, str] = {}
    widths: dict[str, int] = {}
    get = tensors.get
    for mod in trellis_mods:
        cls, layer = classify(mod, mtp_layer)
        tr, suh, svh = tensors[mod + ".trellis"], get(mod + ".suh"), get(mod + ".svh")
        has_mcg, has_mul1 = mod + ".mcg" in tensors, mod + ".mul1" in tensors
        accounted += (suh is not None) + (svh is not None) + has_mcg + has_mul1
        if suh is None or svh is None:
            issues.add(FAIL, "exl3-incomplete", cls, mod, layer,
                       "no " + " and no ".join(p for p, t in ((".suh", suh), (".svh", svh)) if t is None), reload)
            continue
        if not (has_mcg or has_mul1):
            issues.add(FAIL, "exl3-marker-missing", cls, mod, layer, "trellis without .mcg/.mul1 marker",
                       "re-quantize these layers: the overlay reads the codebook from the marker tensor")
        elif has_mcg and has_mul1:
            issues.add(FAIL, "exl3-marker-duplicate", cls, mod, layer, "both .mcg and .mul1",
                       "keep exactly one codebook marker per linear (the one the quantizer used)")
        shape = tr.shape
        if tr.dtype != "I16" or len(shape) != 3 or shape[2] % 16 or not shape[2]:
            issues.add(FAIL, "exl3-trellis", cls, mod, layer, f"trellis {tr.dtype}{list(shape)}",
                       "expected int16 [in/16, out/16, 16·bits]: " + reload)
            continue
        bits = shape[2] >> 4
        if suh.shape != (shape[0] * 16,) or svh.shape != (shape[1] * 16,):
            issues.add(FAIL, "exl3-scales", cls, mod, layer,
                       f"suh {list(suh.shape)} / svh {list(svh.shape)} vs trellis in={shape[0] * 16} "
                       f"out={shape[1] * 16}", reload)
        if mod + ".weight" in tensors:
            issues.add(FAIL, "exl3-and-native", cls, mod, layer, "both .weight and .trellis",
                       "remove the stale .weight (a partly re-quantized pack)")
        if mod.endswith("kv_a_proj_with_mqa"):
            widths[mod] = shape[1] * 16
        marker = "mcg" if has_mcg and not has_mul1 else "mul1" if has_mul1 and not has_mcg else ""
        key = (cls, layer, bits, marker)
        groups[key] = groups.get(key, 0) + 1
        example.setdefault(key, mod)
    return groups, example, widths, accounted


# classify() reads only the first six components of a name, and nothing after an "experts"
# component decides anything; so every name is classified like its text up to the first
# ".experts." (a routed expert linear like its layer's "model.layers.L.mlp.experts.").
# (A literal replacement: a template like r"\1" would call Python code per match.)
_EXPERT_TAIL = re.compile(r"\.experts\.[^\n]*")


def _exl3_groups(tensors: Mapping[str, TensorKind], trellis_mods: list[str],
                 mtp_layer: int | None) -> tuple[_Groups, dict[_Group, str], dict[str, int]] | None:
    """_exl3_modules for the usual case, in bulk: None when any module has a structural problem
    (the caller then runs _exl3_modules, which says which and why). The caller has checked that
    no module has both .trellis and .weight.

    Modules are counted by (class key, the kinds of their parts), a few hundred distinct values
    for 57,600 experts, so the checks and classify() run per distinct value, not per module.
    """
    get, has = tensors.get, tensors.__contains__

    def part(suffix: str) -> Iterator[str]:
        return map(add, trellis_mods, repeat(suffix))

    keys = _EXPERT_TAIL.sub(".experts.", "\n".join(trellis_mods)).split("\n")
    if len(keys) != len(trellis_mods):
        return None  # a name with a newline in it: let the per-module loop have it
    pairs = list(zip(keys, zip(map(tensors.__getitem__, part(".trellis")), map(get, part(".suh")),
                               map(get, part(".svh")), map(has, part(".mcg")), map(has, part(".mul1")),
                               strict=True), strict=True))
    first = dict(zip(reversed(pairs), reversed(trellis_mods), strict=True))  # the first module of each pair
    groups: _Groups = {}
    example: dict[_Group, str] = {}
    classes: dict[str, tuple[str, int | None]] = {}
    for (key, (tr, suh, svh, mcg, mul1)), count in Counter(pairs).items():  # in first-seen order
        shape = tr.shape
        if (suh is None or svh is None or mcg == mul1 or tr.dtype != "I16" or len(shape) != 3
                or shape[2] % 16 or not shape[2] or suh.shape != (shape[0] * 16,) or svh.shape != (shape[1] * 16,)):
            return None
        cls_layer = classes.get(key)
        if cls_layer is None:
            cls_layer = classes[key] = classify(key, mtp_layer)
        group = (*cls_layer, shape[2] >> 4, "mcg" if mcg else "mul1")
        groups[group] = groups.get(group, 0) + count
        example.setdefault(group, first[(key, (tr, suh, svh, mcg, mul1))])
    widths = {mod: tensors[mod + ".trellis"].shape[1] * 16 for mod in trellis_mods
              if mod.endswith("kv_a_proj_with_mqa")}
    return groups, example, widths


def _with_suffix(names: list[str], suffix: str) -> list[str]:
    """The names ending in `suffix`, without it (C-level passes: this runs over 232k names)."""
    return list(map(itemgetter(slice(None, -len(suffix))), compress(names, map(str.endswith, names, repeat(suffix)))))


def _check_abi(tensors: Mapping[str, TensorKind], rules: Mapping[str, Any], layout: Mapping[str, Any],
               issues: _Issues, summary: Summary, codebook_layers: dict[int, set[str]],
               mtp_layer: int | None) -> tuple[set[str], dict[str, int]]:
    """EXL3 ABI and scope per module class. Returns (modules present, out-width per kv_a module).

    Structural checks run per module; the scope/bits/codebook rules run once per group of
    (class, layer, bits, codebook), which keeps 57,600 expert linears cheap.
    """
    reload = "re-quantize or re-download the affected layers: a loader cannot guess the missing part"
    names = list(tensors)
    trellis_mods = _with_suffix(names, ".trellis")
    native = _with_suffix(names, ".weight")
    n_parts = sum(map(str.endswith, names, repeat(_PART_SUFFIXES)))
    fast = _exl3_groups(tensors, trellis_mods, mtp_layer) if set(native).isdisjoint(trellis_mods) else None
    if fast is not None:
        groups, example, widths = fast
        accounted = 3 * len(trellis_mods)  # suh, svh and one marker each
    else:
        groups, example, widths, accounted = _exl3_modules(tensors, trellis_mods, mtp_layer, issues, reload)

    if n_parts > accounted:  # some .suh/.svh/marker belongs to no trellis: find which (rare, slow path)
        has_trellis = set(trellis_mods)
        for n in tensors:
            mod, _, suffix = n.rpartition(".")
            if suffix in ("suh", "svh", "mcg", "mul1") and mod not in has_trellis:
                has_trellis.add(mod)  # report each such module once
                cls, layer = classify(mod, mtp_layer)
                issues.add(FAIL, "exl3-incomplete", cls, mod, layer, "no .trellis", reload)
    _group_rules(groups, example, rules, layout, issues, summary, codebook_layers)

    present = set(trellis_mods)
    for mod in native:
        t = tensors[mod + ".weight"]
        if len(t.shape) != 2 or mod in present:
            continue
        present.add(mod)
        cls, layer = classify(mod, mtp_layer)
        if cls == "attention" and mod.endswith("kv_a_proj_with_mqa"):
            widths[mod] = t.shape[0]
        _native_rule(cls, mod, layer, t, 1, rules, layout, issues, summary)
    return present, widths


def _native_rule(cls: str, mod: str, layer: int | None, t: TensorKind, count: int, rules: Mapping[str, Any],
                 layout: Mapping[str, Any], issues: _Issues, summary: Summary) -> None:
    """`count` native (2-D .weight) linears like `mod`: counted, and an error where the layout wants EXL3."""
    if cls == "embed":
        return
    summary.native_linears += count
    if rules.get(cls, {"format": layout.get("default_format", "any")}).get("format") == "exl3":
        issues.add(FAIL, "native-in-scope", cls, mod, layer, f"{t.dtype}{list(t.shape)}",
                   f"{layout.get('name', 'this layout')} expects {cls.replace('_', ' ')} linears as EXL3: use the "
                   "checkpoint this recipe is for", count)


def _index_vs_folder(counts: Mapping[str, int], shards_scan: Mapping[str, Any], has_map: bool,
                     layout: Mapping[str, Any], summary: Summary, findings: list[Finding]) -> set[str]:
    """Shards the index names (with how many tensors) vs the folder's: missing, extra, how many."""
    top_level = {n for n in shards_scan if "/" not in n}
    for sname in sorted(set(counts) - top_level):
        findings.append(issue(FAIL, "shard-missing",
                                f"{sname} is named by the index ({counts[sname]:,} tensors) but is not in the folder",
                                f"download {sname} into the checkpoint folder", sname))
    if has_map:
        for sname in sorted(top_level - set(counts)):
            findings.append(issue(WARN, "shard-extra", f"{sname} is in the folder but not in the index; "
                                    "loaders that glob *.safetensors would load it twice or from another revision",
                                    f"remove {sname} or re-download the index that lists it", sname))
    summary.shards = len(top_level & set(counts)) if has_map else len(top_level)
    if summary.expected_shards and counts and len(counts) != summary.expected_shards:
        findings.append(issue(WARN, "shard-count",
                                f"the index names {len(counts)} shards; {layout.get('name')} expects "
                                f"{summary.expected_shards}", "check that MODEL is the checkpoint this recipe is for",
                                INDEX))

    return top_level


def _total_size_finding(total_size: Any, data_total: int, findings: list[Finding]) -> None:
    if isinstance(total_size, int) and total_size != data_total:
        findings.append(issue(WARN, "index-total-size",
                                f"index metadata.total_size is {total_size:,} but the shards hold {data_total:,} bytes",
                                "re-download the index from the shards' revision", INDEX))


def _mtp_layer(layout: Mapping[str, Any], cfg: Mapping[str, Any]) -> int | None:
    """The MTP block's layer index: the layout's, else config.json's num_hidden_layers."""
    mtp_layer = layout.get("mtp_layer", cfg.get("num_hidden_layers"))
    return mtp_layer if isinstance(mtp_layer, int) else None


def _config_checks(config: Any, qconf: Any, layout: Mapping[str, Any], findings: list[Finding]) -> None:
    """config.json and the quantization config vs the layout."""
    if isinstance(config, dict):
        for key, want in (layout.get("config") or {}).items():
            got = config.get(key)
            if got != want:
                findings.append(issue(_expected_severity(layout, "config"), "config-mismatch",
                                        f"config.json {key} is {got!r}; {layout.get('name')} expects {want!r}"
                                        + _assumed_note(layout, "config"),
                                        "use the checkpoint this recipe is for, or pick the matching RECIPE",
                                        "config.json"))
        if qconf is None and isinstance(config.get("quantization_config"), dict):
            qconf = config["quantization_config"]
    elif config is not None:
        findings.append(issue(FAIL, "json-invalid", "config.json is not a JSON object", "re-download it",
                                "config.json"))
    if layout.get("quant_method"):
        if not isinstance(qconf, dict):
            findings.append(issue(FAIL, "quant-config-missing",
                                    "no quantization_config.json and no quantization_config in config.json",
                                    "download the checkpoint's quantization_config.json", "quantization_config.json"))
        else:
            for key in ("quant_method", "bits", "scope"):
                want = layout.get(key)
                if want is not None and qconf.get(key) != want:
                    findings.append(issue(_expected_severity(layout, key), "quant-config-mismatch",
                                            f"quantization config {key} is {qconf.get(key)!r}; "
                                            f"{layout.get('name')} expects {want!r}" + _assumed_note(layout, key),
                                            "use the checkpoint this recipe is for, or pick the matching RECIPE",
                                            "quantization_config.json"))


def _group_rules(groups: _Groups, example: Mapping[_Group, str], rules: Mapping[str, Any],
                 layout: Mapping[str, Any], issues: _Issues, summary: Summary,
                 codebook_layers: dict[int, set[str]]) -> None:
    """The scope/bits/codebook rules, once per group of (class, layer, bits, codebook) EXL3 linears."""
    allowed = set(layout.get("allowed_bits") or [])
    known_cbs = set(layout.get("codebooks") or MARKERS)
    default = {"format": layout.get("default_format", "any")}
    name = layout.get("name", "this layout")
    class_bits: dict[str, set[int]] = defaultdict(set)
    for (cls, layer, bits, marker), count in groups.items():
        mod = example[(cls, layer, bits, marker)]
        rule = rules.get(cls, default)
        summary.quantized_by_bits[bits] = summary.quantized_by_bits.get(bits, 0) + count
        by_cls = summary.quantized_by_class.setdefault(cls, {})
        by_cls[bits] = by_cls.get(bits, 0) + count
        class_bits[cls].add(bits)
        if marker and layer is not None:
            codebook_layers.setdefault(layer, set()).add(marker)
        if marker and marker not in known_cbs:
            issues.add(FAIL, "codebook-unsupported", cls, mod, layer, f"codebook {marker}",
                       f"the overlay understands {', '.join(sorted(known_cbs))}: re-quantize with one of them", count)
        fmt = rule.get("format", "any")
        if fmt == "native":
            issues.add(FAIL, "exl3-out-of-scope", cls, mod, layer, f"EXL3 {bits}-bit",
                       f"{name} keeps {cls.replace('_', ' ')} linears native (bf16/fp16): use a checkpoint "
                       f"quantized to the recipe's scope ({layout.get('scope', '?')}) or the recipe that "
                       "matches this pack", count)
            continue
        if allowed and bits not in allowed:
            issues.add(FAIL, "exl3-bits-unsupported", cls, mod, layer, f"{bits}-bit",
                       f"the serving overlay loads {', '.join(map(str, sorted(allowed)))}-bit EXL3 only: "
                       "re-quantize to a supported width", count)
        elif rule.get("bits") and bits not in rule["bits"]:
            issues.add(FAIL, "exl3-bits-mismatch", cls, mod, layer,
                       f"{bits}-bit, the layout expects {'/'.join(map(str, rule['bits']))}",
                       "use the checkpoint this recipe is for, or the recipe that matches the checkpoint", count)
        if rule.get("codebooks") and marker and marker in known_cbs and marker not in rule["codebooks"]:
            issues.add(FAIL, "codebook-mismatch", cls, mod, layer,
                       f"{marker}, the layout expects {'/'.join(rule['codebooks'])}",
                       "use the checkpoint this recipe is for", count)
    for cls, bitset in class_bits.items():
        if rules.get(cls, default).get("uniform") and len(bitset) > 1:
            issues.add(FAIL, "exl3-bits-not-uniform", cls, cls, None, f"widths {sorted(bitset)} mixed",
                       f"the overlay needs one width for all {cls.replace('_', ' ')} linears: use the "
                       "checkpoint this recipe is for")


# ---------------------------------------------------------------- expected values


PROVENANCES = ("seed", "vllm source", "assumed")


def _expected_severity(layout: Mapping[str, Any], key: str) -> str:
    """An expected value the layout only assumes is checked as a warning; a known one as an error."""
    return WARN if (layout.get("provenance") or {}).get(key) == "assumed" else FAIL


def _assumed_note(layout: Mapping[str, Any], key: str) -> str:
    if _expected_severity(layout, key) == FAIL:
        return ""
    return " (the recipe only assumes this value: no model card states it, so this is not an error)"


def findings_have(findings: Iterable[Finding], code: str) -> bool:
    return any(f.code == code for f in findings)


def _expected_expert_count(cfg: Mapping[str, Any]) -> int | None:
    """How many routed-expert linears config.json implies (three per expert per MoE layer, MTP
    included); None when its values are missing or nonsense (the config checks report those)."""
    n, first, layers = cfg.get("n_routed_experts"), cfg.get("first_k_dense_replace"), cfg.get("num_hidden_layers")
    mtp = cfg.get("num_nextn_predict_layers", 0)
    if not all(isinstance(x, int) and x >= 0 for x in (n, first, layers, mtp)):
        return None
    assert isinstance(n, int) and isinstance(first, int) and isinstance(layers, int) and isinstance(mtp, int)
    if n > 4096 or layers > 1024:
        return None
    return (layers + mtp - first) * n * 3


def _expected_experts(cfg: Mapping[str, Any], present: set[str], headers: Mapping[str, Header], complete: bool,
                      issues: _Issues) -> None:
    """Every MoE layer (first_k_dense_replace .. last incl. MTP) has all routed experts' three linears."""
    want = _expected_expert_count(cfg)
    if not complete or want is None:
        return  # a shard that could not be read is already an error; don't pile on
    if sum(1 for m in present if ".mlp.experts." in m) == want:
        return  # the usual case: as many expert linears as expected; enumerate only when not
    n, first, layers = cfg["n_routed_experts"], cfg["first_k_dense_replace"], cfg["num_hidden_layers"]
    mtp = cfg.get("num_nextn_predict_layers", 0)
    for layer in range(first, layers + mtp):
        for e in range(n):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                mod = f"model.layers.{layer}.mlp.experts.{e}.{proj}"
                if mod not in present:
                    issues.add(FAIL, "expert-missing", "routed_expert", mod, layer, "not in any shard",
                               "the checkpoint is incomplete: re-download it (config.json expects "
                               f"{n} routed experts in layers {first}–{layers + mtp - 1})")




# ---------------------------------------------------------------- grouped tensors (summaries)


class NeedHeaders(Exception):
    """The scan holds summaries, and they show something irregular that only the full headers can
    say precisely (which tensor, which shard): scan again with headers and verify that."""


_Key = tuple[str, str | None]  # (prefix, tail) of a numbered expert tensor, or (name, None)
_Merged = dict[_Key, list[tuple[TensorKind, list[list[int]]]]]


def _merge_groups(summaries: Iterable[Mapping[str, Any]]) -> _Merged:
    """Every shard's groups (ckpt_scan.summarize_kinds) as one map: name pattern -> [(kind, id ranges)]."""
    merged: _Merged = {}
    kinds: dict[tuple[str, tuple[int, ...]], TensorKind] = {}
    for summ in summaries:
        groups = summ.get("groups")
        if not isinstance(groups, list):
            raise NeedHeaders("a shard summary has no groups")
        for g in groups:
            try:
                pre, tail, dtype, shape, ids = g
                shp = tuple(shape)
                if not (isinstance(pre, str) and (tail is None or isinstance(tail, str)) and dtype in DTYPE_BITS
                        and all(type(d) is int and d >= 0 for d in shp) and len(shp) <= 8
                        and (ids is None) == (tail is None)):
                    raise ValueError
                rng = None if ids is None else [[int(a), int(b)] for a, b in ids]
            except (TypeError, ValueError):
                raise NeedHeaders("a shard summary is malformed") from None
            kind = kinds.get((dtype, shp))
            if kind is None:
                kind = kinds[(dtype, shp)] = TensorKind(dtype, shp, nbytes(dtype, shp))
            merged.setdefault((pre, tail), []).append((kind, rng or []))
    return merged


def _kinds(merged: _Merged, key: _Key) -> list[tuple[TensorKind, frozenset[int] | None]]:
    """The kinds of the tensors named by `key`, each with its ids (None for a plain name); [] if none.
    NeedHeaders if one name is there twice (the full headers say in which shards)."""
    got = merged.get(key)
    if not got:
        return []
    if key[1] is None:
        if len(got) != 1:
            raise NeedHeaders(f"{key[0]} is in two shards")
        return [(got[0][0], None)]
    by_kind: dict[TensorKind, set[int]] = {}
    n = 0
    for kind, rng in got:
        ids = by_kind.setdefault(kind, set())
        for a, b in rng:
            if not 0 <= a <= b < 10**9:
                raise NeedHeaders("a summary's id range is malformed")
            ids.update(range(a, b + 1))
            n += b - a + 1
    if n != sum(map(len, by_kind.values())):
        raise NeedHeaders(f"{key[0]}*.{key[1]} is in two shards")
    return [(kind, frozenset(ids)) for kind, ids in by_kind.items()]


def _single(merged: _Merged, key: _Key) -> tuple[TensorKind, frozenset[int] | None] | None:
    """The one kind of `key` and its ids; None if absent; NeedHeaders if its tensors differ in kind."""
    got = _kinds(merged, key)
    if len(got) > 1:
        raise NeedHeaders(f"{key[0]}*.{key[1]} has {len(got)} kinds")
    return got[0] if got else None


def _abi_from_groups(merged: _Merged, rules: Mapping[str, Any], layout: Mapping[str, Any], issues: _Issues,
                     summary: Summary, codebook_layers: dict[int, set[str]],
                     mtp_layer: int | None) -> tuple[int, dict[str, int]]:
    """_check_abi from the grouped names: the same groups, counts and findings for a structurally
    sound checkpoint; NeedHeaders for any structural problem (which the per-module path explains).
    Returns (expert linears present, out-width per kv_a module)."""
    groups: _Groups = {}
    example: dict[_Group, str] = {}
    widths: dict[str, int] = {}
    experts = parts = accounted = 0
    trellis_mods: set[tuple[str, str | None]] = set()
    for key in merged:
        name = key[1] if key[1] is not None else key[0]
        if name.endswith(_PART_SUFFIXES):
            parts += sum(1 if ids is None else len(ids) for _, ids in _kinds(merged, key))
        if not name.endswith(".trellis"):
            continue
        base = (key[0][: -len(".trellis")], None) if key[1] is None else (key[0], key[1][: -len(".trellis")])
        trellis_mods.add(base)

        def part(suffix: str, base: tuple[str, str | None] = base) -> _Key:
            return (base[0] + suffix, None) if base[1] is None else (base[0], base[1] + suffix)

        suh, svh, mcg, mul1 = (_single(merged, part(x)) for x in (".suh", ".svh", ".mcg", ".mul1"))
        trellis = _kinds(merged, part(".trellis"))
        ids: frozenset[int] | None = None if base[1] is None else frozenset().union(*(i or () for _, i in trellis))
        if (suh is None or svh is None or suh[1] != ids or svh[1] != ids or merged.get(part(".weight"))
                or not (mcg or mul1)):
            raise NeedHeaders(f"EXL3 module {base} is irregular")
        if ids is None:
            if mcg and mul1:
                raise NeedHeaders(f"EXL3 module {base[0]} has two markers")
            markers: list[tuple[str, frozenset[int] | None]] = [("mcg" if mcg else "mul1", None)]
        else:
            m1 = (mcg[1] if mcg else None) or frozenset()
            m2 = (mul1[1] if mul1 else None) or frozenset()
            if m1 & m2 or (m1 | m2) != ids:
                raise NeedHeaders(f"EXL3 modules {base[0]}*.{base[1]} have missing or duplicate markers")
            markers = [(m, sub) for m, sub in (("mcg", m1), ("mul1", m2)) if sub]
        for kind, tids in trellis:
            shape = kind.shape
            if (kind.dtype != "I16" or len(shape) != 3 or shape[2] % 16 or not shape[2]
                    or suh[0].shape != (shape[0] * 16,) or svh[0].shape != (shape[1] * 16,)):
                raise NeedHeaders(f"EXL3 module {base} has an irregular trellis")
            accounted += 3 * (1 if tids is None else len(tids))
            for marker, mids in markers:
                sub = tids if mids is None else (tids or frozenset()) & mids
                if sub is not None and not sub:
                    continue
                mod = base[0] if sub is None else f"{base[0]}{min(sub)}.{base[1]}"
                cls, layer = classify(mod, mtp_layer)
                group = (cls, layer, shape[2] >> 4, marker)
                count = 1 if sub is None else len(sub)
                groups[group] = groups.get(group, 0) + count
                example.setdefault(group, mod)
                if ".mlp.experts." in mod:
                    experts += count
            if base[1] is None and base[0].endswith("kv_a_proj_with_mqa"):
                widths[base[0]] = shape[1] * 16
    if parts != accounted:
        raise NeedHeaders("some EXL3 part belongs to no trellis")
    _group_rules(groups, example, rules, layout, issues, summary, codebook_layers)
    for key in merged:
        name = key[1] if key[1] is not None else key[0]
        if not name.endswith(".weight"):
            continue
        base = (key[0][: -len(".weight")], None) if key[1] is None else (key[0], key[1][: -len(".weight")])
        if base in trellis_mods:
            continue  # both .weight and .trellis: raised above
        for kind, ids in _kinds(merged, key):
            if len(kind.shape) != 2:
                continue
            mod = base[0] if ids is None else f"{base[0]}{min(ids)}.{base[1]}"
            cls, layer = classify(mod, mtp_layer)
            if cls == "attention" and mod.endswith("kv_a_proj_with_mqa"):
                widths[mod] = kind.shape[0]
            count = 1 if ids is None else len(ids)
            if ".mlp.experts." in mod:
                experts += count
            _native_rule(cls, mod, layer, kind, count, rules, layout, issues, summary)
    return experts, widths


# ----------------------------------------------------------------------------------------------------------
# What every reading of a checkpoint ends with (the rules above' rules, the Report's last findings): the kv_a
# widths, the grouped issues, the codebooks, the folder's optional and serving files, the deep hashes, and the
# findings in severity order. Pure.
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


# ----------------------------------------------------------------------------------------------------------
# verify-model from summaries: a scan made with headers="summary" (probes/ckpt_scan.py) checked by the same
# rules from a few thousand groups instead of every tensor entry. Pure.
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


# ----------------------------------------------------------------------------------------------------------
# A scan with full headers: verify_scan, verify_dir, verify_with
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
