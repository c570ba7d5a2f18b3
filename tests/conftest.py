"""Shared fixtures. Unit tests never touch the network; lab tests live in tests/lab/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

GLM53_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 78,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
    "n_routed_experts": 256,
    "first_k_dense_replace": 3,
    "hidden_size": 6144,
    "moe_intermediate_size": 2048,
}


def write_model(dest: Path, total_bytes: int, shards: int, config: dict | None = None) -> Path:
    """config.json + an index + sparse shards adding up to total_bytes (no headers: planner/render only)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config or GLM53_CONFIG))
    weight_map = {}
    per = total_bytes // shards
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        weight_map[f"tensor.{i}"] = name
        size = per if i < shards - 1 else total_bytes - per * (shards - 1)
        with open(dest / name, "wb") as fh:
            fh.truncate(size)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


@pytest.fixture
def model_308(tmp_path: Path) -> Path:
    return write_model(tmp_path / "GLM-5.3-EXL3", 308_000_000_000, 41)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """An empty process environment and a cwd without env/cluster.env."""
    monkeypatch.chdir(tmp_path)
    return {}
