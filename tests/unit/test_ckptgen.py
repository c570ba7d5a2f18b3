"""The test checkpoint generator: packs with honest shapes, consistent index and config, fast."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from sparkctl.checkpoint.safetensors import read_header
from sparkctl.lab import ckptgen


def test_tiny_pack_is_small_real_and_consistent(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "tiny")
    shards = ckptgen.shards(d)
    assert len(shards) == 3
    index = json.loads((d / ckptgen.INDEX).read_text())
    config = json.loads((d / "config.json").read_text())
    total = 0
    for p in shards:
        h = read_header(p)
        assert p.stat().st_size == h.file_size
        assert p.stat().st_blocks * 512 >= p.stat().st_size // 2  # real bytes, not a hole
        total += h.data_len
        for name in h.tensors:
            assert index["weight_map"][name] == p.name
    assert index["metadata"]["total_size"] == total < 10_000_000
    assert config["num_hidden_layers"] == 6 and config["first_k_dense_replace"] == 3
    wm = index["weight_map"]
    assert "model.layers.6.mlp.experts.0.gate_proj.weight" in wm  # MTP layer = num_hidden_layers, bf16
    assert "model.layers.3.mlp.experts.0.gate_proj.mcg" in wm
    assert "model.layers.4.mlp.experts.0.gate_proj.mul1" in wm
    h = read_header(d / wm["model.layers.3.mlp.experts.7.down_proj.trellis"])
    t = h.tensors["model.layers.3.mlp.experts.7.down_proj.trellis"]
    assert t.dtype == "I16" and t.shape == (config["moe_intermediate_size"] // 16, config["hidden_size"] // 16, 48)
    qc = json.loads((d / "quantization_config.json").read_text())
    assert qc == {"quant_method": "exl3", "bits": 3, "scope": "glm53_routed_experts_only"}


def test_serving_ships_the_chain_and_its_payload_as_code(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "tiny")
    names = sorted(p.relative_to(d / "serving").as_posix() for p in (d / "serving").rglob("*") if p.is_file())
    assert names == ["Dockerfile.dcp", "Dockerfile.keys", "Dockerfile.keys3", "Dockerfile.mul1", "Dockerfile.v145",
                     "ablit_runtime.py", "exl3.py", "patch_dcp.py", "patch_keys3.py", "v145/build.sh",
                     "v145/exllamav3/__init__.py", "v145/patch_aarch64.py"]
    for name in names:
        text = (d / "serving" / name).read_text()
        if name.endswith(".py"):
            ast.parse(text)
        elif name.endswith(".sh"):
            subprocess.run(["sh", "-n", str(d / "serving" / name)], check=True)
        else:
            assert "ARG BASE\nFROM ${BASE}\n" in text, name
    assert not (ckptgen.make_checkpoint(tmp_path / "bare", serving=False) / "serving").exists()


def test_codebook_switch(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "t", codebook_switch_layer=None)
    wm = json.loads((d / ckptgen.INDEX).read_text())["weight_map"]
    assert not any(n.endswith(".mul1") for n in wm)


@pytest.mark.parametrize(("pack", "shards", "gib_per_rank"), [("3.00bpw", 41, 77.1), ("4bit", 54, 98.1)])
def test_full_packs_sparse_fast_and_sized(tmp_path: Path, pack: str, shards: int, gib_per_rank: float) -> None:
    d = ckptgen.make_checkpoint(tmp_path / pack, pack)  # its speed: bench/suite_timings.py
    files = ckptgen.shards(d)
    assert len(files) == shards
    size = sum(p.stat().st_size for p in files)
    disk = sum(p.stat().st_blocks * 512 for p in files)
    assert disk < 100_000_000 < size  # sparse: headers only on disk
    assert size / 4 / 2**30 == pytest.approx(gib_per_rank, abs=0.1)
    index = json.loads((d / ckptgen.INDEX).read_text())
    assert len(index["weight_map"]) > 58_000
    assert index["metadata"]["total_size"] == sum(read_header(p).data_len for p in files)
    cfg = json.loads((d / "config.json").read_text())
    assert {k: cfg[k] for k in ("num_hidden_layers", "kv_lora_rank", "n_routed_experts", "hidden_size")} == \
        {"num_hidden_layers": 78, "kv_lora_rank": 512, "n_routed_experts": 256, "hidden_size": 6144}


def test_275_pack(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "p", "2.75bpw", serving=False)
    assert len(ckptgen.shards(d)) == 81
    assert sum(p.stat().st_size for p in ckptgen.shards(d)) / 2**30 == pytest.approx(257.6, abs=0.1)
    head = read_header(d / "lm_head-6bit" / "lm_head-6bit.safetensors")
    assert set(head.tensors) == {"lm_head.trellis", "lm_head.suh", "lm_head.svh", "lm_head.mul1"}
    assert head.tensors["lm_head.trellis"].shape[2] == 96


def test_fault_injectors_keep_files_consistent(tmp_path: Path) -> None:
    d = ckptgen.make_checkpoint(tmp_path / "t")
    mod = ckptgen.drop_marker(d)
    wm = json.loads((d / ckptgen.INDEX).read_text())["weight_map"]
    assert f"{mod}.mcg" not in wm and f"{mod}.trellis" in wm
    for p in ckptgen.shards(d):
        assert p.stat().st_size == read_header(p).file_size
    assert ckptgen.set_expert_bits(d, 7, layer=5) == 24
    assert ckptgen.quantize_mtp(d) == 24
    with pytest.raises(ValueError, match="unknown pack"):
        ckptgen.make_checkpoint(tmp_path / "x", "5bit")
