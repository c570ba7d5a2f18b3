from __future__ import annotations

import json

import pytest

from sparkctl.errors import CheckFailed, UsageError
from sparkctl.plan import kv_terms, make_plan, plan_for, read_checkpoint, require_fit
from sparkctl.settings import load_settings
from tests.conftest import GLM53_CONFIG, write_model

NODES = "spark1 spark2 spark3 spark4"


def settings_for(model, **extra):
    return load_settings(cli={}, environ={"NODES": NODES, "MODEL": str(model), **extra})


def test_kv_bytes_per_token_mla_fp8_with_indexer_and_mtp(tmp_path):
    terms = kv_terms(GLM53_CONFIG, "fp8", 4, 4, tmp_path)
    assert [(t.bytes_per_token_per_layer, t.layers) for t in terms] == [(576, 79), (132, 79)]
    assert sum(t.bytes_per_token for t in terms) == 79 * 708


def test_kv_bytes_bf16_and_fp8_ds_mla(tmp_path):
    assert kv_terms(GLM53_CONFIG, "bfloat16", 4, 4, tmp_path)[0].bytes_per_token_per_layer == 1152
    assert kv_terms(GLM53_CONFIG, "auto", 4, 4, tmp_path)[0].bytes_per_token_per_layer == 1152
    assert kv_terms(GLM53_CONFIG, "fp8_ds_mla", 4, 4, tmp_path)[0].bytes_per_token_per_layer == 656


def test_kv_bytes_for_ordinary_attention_split_over_tp(tmp_path):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (term,) = kv_terms(cfg, "bfloat16", 4, 4, tmp_path)
    assert term.bytes_per_token_per_layer == 2 * 2 * 128 * 2 and term.layers == 32


def test_seed_conclusion_3bpw_fits_four_gb10_at_1m_tokens(clean_env, model_308):
    plan = plan_for(settings_for(model_308))
    assert plan.weights_per_rank == 77_000_000_000
    assert plan.tokens_per_rank == 250_048  # ceil(1e6 / 4) rounded up to 64-token blocks
    assert plan.kv_cache_memory_bytes == 250_048 * 79 * 708
    assert plan.fits, plan.problems()
    require_fit(plan)


def test_4bit_experts_do_not_fit_and_say_by_how_much(clean_env, tmp_path):
    model = write_model(tmp_path / "m4", 404_000_000_000, 41)  # ≈101 GB per rank at TP4
    plan = plan_for(settings_for(model))
    assert not plan.fits
    with pytest.raises(CheckFailed) as exc:
        require_fit(plan)
    msg = str(exc.value)
    assert "101.0 GB weights" in msg and "short" in msg and "128.0 GB" in msg


def test_dcp_divides_the_kv_cache(clean_env, model_308):
    p4 = plan_for(settings_for(model_308))
    p1 = plan_for(settings_for(model_308, DCP="1"))
    assert p1.tokens_per_rank == 1_000_000 and p4.tokens_per_rank * 4 == pytest.approx(p1.tokens_per_rank, rel=1e-3)
    assert not p1.fits  # without DCP the MLA cache is duplicated on every rank: 55.9 GB of KV


def test_utilisation_above_the_cap_is_refused_with_the_reason(clean_env, model_308):
    plan = plan_for(settings_for(model_308, GPU_MEMORY_UTILIZATION="0.9"))
    (problem,) = plan.problems()
    assert "0.9 is above the recipe's cap 0.82" in problem and "startup guard" in problem


def test_node_memory_from_check_overrides_default(clean_env, model_308):
    s = settings_for(model_308)
    small = make_plan(s, read_checkpoint(model_308), node_memory_bytes=100_000_000_000)
    assert not small.fits and small.node_memory_bytes == 100_000_000_000


def test_missing_config_json_is_a_usage_error(clean_env, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="config.json not found"):
        plan_for(settings_for(tmp_path / "empty"))


def test_missing_model_folder_is_a_usage_error(clean_env, tmp_path):
    with pytest.raises(UsageError, match="is not a folder"):
        plan_for(settings_for(tmp_path / "nowhere"))


def test_garbage_config_and_index_are_usage_errors(clean_env, tmp_path):
    m = write_model(tmp_path / "m", 1000, 2)
    (m / "config.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        read_checkpoint(m)
    (m / "config.json").write_text(json.dumps({**GLM53_CONFIG, "kv_lora_rank": "big"}))
    with pytest.raises(UsageError, match="kv_lora_rank should be a non-negative integer"):
        plan_for(settings_for(m))
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(UsageError, match="plain file name"):
        read_checkpoint(m)


def test_missing_shard_is_noted_and_index_total_used(clean_env, model_308):
    (model_308 / "model-00003-of-00041.safetensors").unlink()
    plan = plan_for(settings_for(model_308))
    assert plan.weights_total == 308_000_000_000
    assert "missing" in plan.notes[0] and "model-00003-of-00041.safetensors" in plan.notes[0]
