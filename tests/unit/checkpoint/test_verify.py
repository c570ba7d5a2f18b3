"""verify-model's rules on generated packs: good packs pass with the right summary, every fault
ckptgen can make gives its finding and exit 1, never a traceback."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from sparkctl.checkpoint.safetensors import _validate, read_header
from sparkctl.checkpoint.verify import (
    _EXPERT_TAIL,
    Report,
    _exl3_groups,
    _exl3_modules,
    _Issues,
    classify,
    ranges,
    verify_dir,
)
from sparkctl.checkpoint.verify_nodes import compare_nodes
from sparkctl.cli import cli
from sparkctl.lab import ckptgen
from sparkctl.probes import ckpt_scan
from sparkctl.spec.recipes import load_layout
from sparkctl.spec.resources import probe_script
from tests.conftest import run_cli

TINY = load_layout("tiny")


@pytest.fixture(scope="module")
def full300(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ckptgen.make_checkpoint(tmp_path_factory.mktemp("p300") / "ckpt", "3.00bpw")


def codes(report: Report, severity: str = "error") -> set[str]:
    return {f.code for f in report.findings if f.severity == severity}


def tiny(tmp_path: Path) -> Path:
    return ckptgen.make_checkpoint(tmp_path / "tiny")


def test_ranges() -> None:
    assert ranges([3]) == "layer 3"
    assert ranges(range(4, 78)) == "layers 4–77"
    assert ranges([1, 2, 3, 7]) == "layers 1–3, 7"


def test_good_tiny_pack(tmp_path: Path) -> None:
    r = verify_dir(tiny(tmp_path), TINY)
    assert r.ok, r.findings
    s = r.summary
    assert (s.shards, s.tensors, s.quantized_by_bits) == (3, 446, {3: 72})
    assert s.codebooks == "mcg: layer 3 · mul1: layers 4–5"
    assert codes(r, "warn") == {"codebook-mixed"}


def test_good_300_pack_has_the_cards_summary(full300: Path) -> None:
    r = verify_dir(full300, load_layout("glm53-3.00bpw"))
    assert r.ok, r.findings
    s = r.summary
    assert s.shards == 41 and s.tensors > 58_000 and s.bytes == 330_939_232_352
    assert s.quantized_by_bits == {3: 57_600}
    assert s.codebooks == "mcg: layer 3 · mul1: layers 4–77"
    warn = next(f for f in r.findings if f.code == "codebook-mixed")
    assert "mul1" in warn.fix and "overlay" in warn.fix and warn.severity == "warn"


def test_good_275_pack(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "p", "2.75bpw")
    r = verify_dir(d, load_layout("glm53-2.75bpw"))
    assert r.ok and not [f for f in r.findings if f.severity != "info"], r.findings
    s = r.summary
    assert s.shards == 81 and s.codebooks == "mul1: layers 0–78"
    assert s.quantized_by_class["routed_expert"] == {2: 21_600, 3: 28_800, 4: 7_200}
    assert s.quantized_by_class["mtp_expert"] == {8: 768}
    assert s.optional_files == ["lm_head-6bit/lm_head-6bit.safetensors: lm_head 6-bit"]
    (d / "lm_head-6bit" / "lm_head-6bit.safetensors").unlink()  # optional: absent is fine
    assert verify_dir(d, load_layout("glm53-2.75bpw")).ok


def test_4bit_pack_fails_the_300_rules(tmp_path: Path) -> None:
    r = verify_dir(ckptgen.make_checkpoint(tmp_path / "p", "4bit"), load_layout("glm53-3.00bpw"))
    assert {"exl3-bits-mismatch", "quant-config-mismatch"} <= codes(r)


Fault = Callable[[Path], Any]


@pytest.mark.parametrize(("fault", "code", "where"), [
    (lambda d: ckptgen.remove_shard(d, 2), "shard-missing", "model-00002-of-00003.safetensors"),
    (lambda d: ckptgen.truncate_shard(d, 1, 100), "shard-truncated", "model-00001-of-00003.safetensors"),
    (lambda d: ckptgen.retarget_tensor(d, "model.norm.weight"), "index-tensor-absent", "model-00001-of-00003"),
    (lambda d: ckptgen.overlap_offsets(d, 2), "offsets-overlap", "model-00002-of-00003.safetensors"),
    (lambda d: ckptgen.header_past_eof(d, 3), "header-past-eof", "model-00003-of-00003.safetensors"),
    (lambda d: ckptgen.garbage_header(d, 1), "header-json", "model-00001-of-00003.safetensors"),
    (lambda d: ckptgen.drop_marker(d), "exl3-marker-missing", "model.layers.3.mlp.experts.0.gate_proj"),
    (lambda d: ckptgen.add_marker(d), "exl3-marker-duplicate", "model.layers.3.mlp.experts.0.gate_proj"),
    (lambda d: ckptgen.set_expert_bits(d, 7, layer=4), "exl3-bits-unsupported", "layer 4"),
    (lambda d: ckptgen.quantize_mtp(d), "exl3-out-of-scope", "mtp expert linears in layer 6"),
])
def test_faults(tmp_path: Path, fault: Fault, code: str, where: str, capsys: pytest.CaptureFixture[str]) -> None:
    d = tiny(tmp_path)
    fault(d)
    r = verify_dir(d, TINY)
    assert not r.ok
    hit = [f for f in r.findings if f.code == code]
    assert hit, r.findings
    assert where in hit[0].reason + hit[0].where
    assert hit[0].fix
    # and the command line says the same, with exit 1 and one JSON document (sparkctl's entry point prints
    # the failure's document)
    status, out, err = run_cli(["--json", "verify-model", "--local", str(d), "--layout", "tiny"], capsys)
    assert status == 1, (out, err)
    doc = json.loads(out)
    assert code in {f["code"] for f in doc["findings"]} and doc["ok"] is False


def test_quantized_mtp_under_300_rules(tmp_path: Path) -> None:
    # One full-size pack for this one: the rule is the 3.00 bpw recipe's, on layer 78.
    d = ckptgen.make_checkpoint(tmp_path / "p", "3.00bpw", serving=False)
    ckptgen.quantize_mtp(d)
    r = verify_dir(d, load_layout("glm53-3.00bpw"))
    f = next(f for f in r.findings if f.code == "exl3-out-of-scope")
    assert "768 mtp expert linears in layer 78" in f.reason and "native" in f.fix


def test_garbage_header_reads_little(tmp_path: Path) -> None:
    d = tiny(tmp_path)
    ckptgen.garbage_header(d, 1)
    doc = ckpt_scan.scan(str(d), headers="none")
    assert doc["shards"]["model-00001-of-00003.safetensors"]["error"]["code"] == "header-json"


def test_missing_files_and_garbage_json(tmp_path: Path) -> None:
    d = tiny(tmp_path)
    (d / "config.json").write_text("{not json")
    (d / "serving" / "Dockerfile.v145").unlink()
    (d / ckptgen.INDEX).unlink()
    r = verify_dir(d, TINY)
    assert {"file-missing", "json-invalid"} <= codes(r)
    assert "serving-file-missing" in codes(r, "warn")
    chain = next(f for f in r.findings if f.code == "serving-chain")
    assert chain.reason == ("image chain in serving/: ships Dockerfile.dcp, Dockerfile.mul1, Dockerfile.keys, "
                             "Dockerfile.keys3; missing Dockerfile.v145")


def test_no_layout_is_structure_only(tmp_path: Path) -> None:
    assert verify_dir(tiny(tmp_path), None).ok


def test_hostile_scan_documents_never_raise() -> None:
    from sparkctl.checkpoint.verify import verify_scan

    for doc in ({}, {"error": {}}, {"shards": {"a.safetensors": {"header": "!!notb64"}}},
                {"json": {ckptgen.INDEX: {"data": b'{"weight_map": {"a": 1}}'}}},
                {"json": {"config.json": {"data": b"[]"}}, "shards": {"x/y.safetensors": {"error": {}}}}):
        report = verify_scan(doc, TINY)
        # None of these is a checkpoint: each is an error finding (not a crash, not a pass).
        assert not report.ok and any(f.severity == "error" for f in report.findings), doc


def test_compare_nodes_names_the_odd_node(tmp_path: Path) -> None:
    a = tiny(tmp_path / "a")
    b = ckptgen.copy_pack(a, tmp_path / "b")
    c = ckptgen.copy_pack(a, tmp_path / "c")
    ckptgen.truncate_shard(c, 2, 10)
    scans = {n: ckpt_scan.scan(str(p), headers="none", fingerprints=True)
             for n, p in (("spark1", a), ("spark2", b), ("spark3", c))}
    assert compare_nodes({"spark1": scans["spark1"], "spark2": scans["spark2"]}) == []
    found = compare_nodes(scans)
    assert [f.where for f in found] == ["spark3"]
    assert "model-00002-of-00003.safetensors (size, " in found[0].reason
    missing = compare_nodes({**scans, "spark4": {"error": {"message": "/models/x is not a folder"}}})
    assert "node-scan-failed" in {f.code for f in missing}


def test_probe_runs_standalone_over_stdin(tmp_path: Path) -> None:
    import subprocess
    import sys

    d = tiny(tmp_path)
    out = subprocess.run([sys.executable, "-I", "-", str(d), "--fingerprints"], input=probe_script("ckpt_scan.py").decode(),
                         capture_output=True, text=True, check=True, cwd="/")
    doc = json.loads(out.stdout)
    assert len(doc["shards"]) == 3 and doc["json"]["config.json"]["sha256"]
    from sparkctl.checkpoint.verify import verify_scan
    assert verify_scan(doc, TINY).ok  # zlib headers decode to the same verdict


def test_deep_hashes_are_cached(tmp_path: Path) -> None:
    d = tiny(tmp_path)
    cache = tmp_path / "cache.json"
    paths = [str(p) for p in ckptgen.shards(d)]
    first = ckpt_scan.deep_hashes(paths, cache_file=str(cache), workers=2)
    import hashlib
    assert first[paths[0]]["sha256"] == hashlib.sha256(Path(paths[0]).read_bytes()).hexdigest()
    assert not any(v["cached"] for v in first.values())
    second = ckpt_scan.deep_hashes(paths, cache_file=str(cache))
    assert all(v["cached"] for v in second.values())
    os.utime(paths[0], ns=(1, 1))  # a touched file is re-hashed
    assert not ckpt_scan.deep_hashes(paths, cache_file=str(cache))[paths[0]]["cached"]


def test_cli_human_output_and_cluster_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    d = tiny(tmp_path)
    res = CliRunner().invoke(cli, ["verify-model", "--local", str(d), "--layout", "tiny", "--deep"])
    assert res.exit_code == 0, res.output
    assert "mcg: layer 3 · mul1: layers 4–5" in res.output and "OK" in res.output
    res = CliRunner().invoke(cli, ["verify-model", "--local", str(d), "--layout", "nope"])
    from sparkctl.errors import UsageError
    assert isinstance(res.exception, UsageError) and res.exception.exit_code == 2


# -- the bulk EXL3 checks must give what the per-module loop gives


def _merged(d: Path) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for p in sorted(d.glob("model-*.safetensors")):
        merged.update(read_header(p).kinds)
    return merged


def _both(tensors: dict[str, Any], mtp_layer: int) -> tuple[Any, Any, _Issues]:
    mods = [n[: -len(".trellis")] for n in tensors if n.endswith(".trellis")]
    issues = _Issues()
    return _exl3_groups(tensors, mods, mtp_layer), _exl3_modules(tensors, mods, mtp_layer, issues, "fix"), issues


def test_bulk_exl3_checks_match_the_per_module_loop(full300: Path, tmp_path: Path) -> None:
    fast, (groups, example, widths, accounted), issues = _both(_merged(full300), 78)
    assert fast == (groups, example, widths) and not issues.items
    assert accounted == 3 * sum(groups.values()) == 3 * 57_600
    d = ckptgen.make_checkpoint(tmp_path / "p275", "2.75bpw", serving=False)
    fast, (groups, example, widths, _), issues = _both(_merged(d), 78)
    assert fast == (groups, example, widths) and not issues.items
    assert set(widths.values()) == {640} and list(fast[0]) == list(groups)  # same groups, same order


@pytest.mark.parametrize("fault", [ckptgen.drop_marker, ckptgen.add_marker,
                                   lambda d: ckptgen.set_expert_bits(d, 7, layer=4)])
def test_bulk_exl3_checks_defer_to_the_loop_on_a_broken_module(tmp_path: Path, fault: Fault) -> None:
    d = tiny(tmp_path)
    fault(d)
    fast, (groups, example, widths, _), issues = _both(_merged(d), 6)
    if issues.items:  # a structural problem: the bulk path must not decide it
        assert fast is None
    else:  # 7-bit experts are well-formed: a scope rule, decided per group
        assert fast == (groups, example, widths)


@pytest.mark.parametrize("name", [
    "model.layers.5.mlp.experts.7.up_proj", "model.layers.78.mlp.experts.0.down_proj", "model.layers.5.experts.7.x",
    "model.layers.5.self_attn.indexer.experts.3", "model.layers.5.self_attn.experts.wq_b", "model.layers.experts.1",
    "lm_head.experts.1", "model.embed_tokens.experts.2", "model.embed.experts.tokens", "experts.3.x",
    "model.layers.5.mlp.experts.", "model.layers.5.mlp.shared_experts.gate_proj", "a.experts.b.experts.c",
])
def test_classify_only_reads_up_to_experts(name: str) -> None:
    key = _EXPERT_TAIL.sub(".experts.", name)
    for mtp in (None, 5, 78):
        assert classify(key, mtp) == classify(name, mtp)


def test_lazy_offsets_match_the_json_reading(full300: Path) -> None:
    p = next(full300.glob("model-00007-*.safetensors"))
    h = read_header(p)
    with open(p, "rb") as f:
        raw = f.read(8 + h.header_len)[8:]
    assert h.tensors == _validate(json.loads(raw), len(raw)).tensors
    assert read_header(p) == h


@pytest.mark.parametrize("name", ["glm53-3.00bpw", "glm53-2.75bpw", "tiny"])
def test_every_layout_rule_says_where_its_value_comes_from(name: str) -> None:
    from sparkctl.checkpoint.verify import PROVENANCES

    layout = load_layout(name)
    rules = set(layout) - {"name", "description", "codebook_note", "provenance", "provenance_note"}
    prov = layout["provenance"]
    assert set(prov) == rules, f"{name}: rules without provenance {rules - set(prov)}, stray {set(prov) - rules}"
    assert set(prov.values()) <= set(PROVENANCES)


def test_an_assumed_scope_that_differs_is_a_warning_naming_what_was_found(tmp_path: Path) -> None:
    """The 2.75 bpw card (docs/sources.md) never states the 2.75 bpw pack's quantization_config scope: a real pack with another
    string must not be refused."""
    d = ckptgen.make_checkpoint(tmp_path / "p", "2.75bpw")
    qc = json.loads((d / "quantization_config.json").read_text())
    (d / "quantization_config.json").write_text(json.dumps({**qc, "scope": "glm53_whatever_the_card_says"}))
    r = verify_dir(d, load_layout("glm53-2.75bpw"))
    assert r.ok, r.findings
    (w,) = [f for f in r.findings if f.code == "quant-config-mismatch"]
    assert w.severity == "warn" and "'glm53_whatever_the_card_says'" in w.reason and "assumes" in w.reason


def test_a_card_stated_scope_that_differs_stays_an_error(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "p", "3.00bpw")
    qc = json.loads((d / "quantization_config.json").read_text())
    (d / "quantization_config.json").write_text(json.dumps({**qc, "scope": "glm53_mixed_k"}))
    r = verify_dir(d, load_layout("glm53-3.00bpw"))
    assert not r.ok and "quant-config-mismatch" in codes(r)
