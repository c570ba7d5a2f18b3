from __future__ import annotations

import json
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sparkctl.errors import CheckFailed, UsageError
from sparkctl.spec.planner import (
    kv_layout,
    kv_terms,
    make_plan,
    nodes_compute_capability,
    plan_for,
    read_checkpoint,
    require_fit,
)
from sparkctl.spec.settings import load_settings
from tests.conftest import GLM53_CONFIG, write_model

NODES = "spark1 spark2 spark3 spark4"


def settings_for(model, **extra):
    return load_settings(cli={}, environ={"NODES": NODES, "MODEL": str(model), **extra})


def test_kv_bytes_per_token_mla_fp8_with_indexer_and_mtp(tmp_path):
    terms = kv_terms(GLM53_CONFIG, "fp8", 4, tmp_path)
    assert [(t.bytes_per_token_per_layer, t.layers) for t in terms] == [(576, 79), (132, 79)]
    assert sum(t.bytes_per_token for t in terms) == 79 * 708


def test_kv_bytes_bf16_and_fp8_ds_mla(tmp_path):
    assert kv_terms(GLM53_CONFIG, "bfloat16", 4, tmp_path)[0].bytes_per_token_per_layer == 1152
    assert kv_terms(GLM53_CONFIG, "auto", 4, tmp_path)[0].bytes_per_token_per_layer == 1152
    assert kv_terms(GLM53_CONFIG, "fp8_ds_mla", 4, tmp_path)[0].bytes_per_token_per_layer == 656


def test_the_mtp_layer_counts_only_when_it_speculates(tmp_path):
    assert {t.layers for t in kv_terms(GLM53_CONFIG, "fp8_ds_mla", 4, tmp_path)} == {79}
    assert {t.layers for t in kv_terms(GLM53_CONFIG, "fp8_ds_mla", 4, tmp_path, mtp_layers=False)} == {78}


def test_kv_bytes_for_ordinary_attention_split_over_tp(tmp_path):
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (term,) = kv_terms(cfg, "bfloat16", 4, tmp_path)
    assert term.bytes_per_token_per_layer == 2 * 2 * 128 * 2 and term.layers == 32


@pytest.mark.parametrize("asked", ["fp8", "auto", "fp8_e4m3", "fp8_ds_mla"])
def test_gb10_stores_every_accepted_dtype_as_fp8_ds_mla(asked):
    layout = kv_layout(GLM53_CONFIG, "12.1", asked)
    assert (layout.backend, layout.dtype) == ("FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla")


@pytest.mark.parametrize("asked", ["bfloat16", "float16", "fp8_e5m2", "fp8_inc"])
def test_gb10_refuses_what_its_only_sparse_backend_cannot_store(asked):
    with pytest.raises(UsageError, match=f"KV_CACHE_DTYPE={asked} cannot be served on compute capability 12.1") as exc:
        kv_layout(GLM53_CONFIG, "12.1", asked)
    assert "KV_CACHE_DTYPE=fp8" in (exc.value.fix or "")


def test_sm10x_keeps_plain_fp8_and_bf16_for_auto():
    assert kv_layout(GLM53_CONFIG, "10.0", "fp8").dtype == "fp8"
    assert kv_layout(GLM53_CONFIG, "10.0", "auto").dtype == "fp8_e4m3"  # GLM-5's config hook on SM10x
    assert kv_layout(GLM53_CONFIG, "10.0", "fp8").block_tokens == 32
    assert kv_layout(GLM53_CONFIG, "10.0", "fp8_ds_mla").backend == "FLASHMLA_SPARSE"


def test_default_recipe_plans_the_minimum_vllm_accepts_on_gb10(clean_env, model_308):
    """docs/sources.md: 1,000,000 tokens at DCP 4 on GB10 = (3,907 + 1 null) blocks × 79 × 64 × (656 + 132) B."""
    plan = plan_for(settings_for(model_308))
    assert (plan.kv_backend, plan.kv_cache_dtype_effective, plan.compute_capability) == \
        ("FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla", "12.1")
    assert plan.kv_block_bytes == 3_984_128 and plan.kv_blocks_per_rank == 3_908
    assert plan.kv_cache_memory_bytes == 15_569_972_224


def test_the_cards_conclusion_3bpw_fits_four_gb10_at_1m_tokens(clean_env, model_308):
    plan = plan_for(settings_for(model_308))
    assert plan.weights_per_rank == 77_000_000_000
    assert plan.tokens_per_rank == 250_048  # ceil(1e6 / 4) rounded up to 64-token blocks
    assert plan.fits, plan.problems()
    # 77.0 GB weights + 15.6 GB KV + 15.0 GB (14 GiB) overhead = 107.6 GB of 128 GB − 4 GiB reserve
    assert plan.per_rank_total == 77_000_000_000 + 15_569_972_224 + 14 * 2**30
    assert 16e9 < plan.headroom < 16.2e9
    require_fit(plan)


def test_sm10x_plan_uses_576_byte_fp8(clean_env, model_308):
    plan = make_plan(settings_for(model_308), read_checkpoint(model_308), compute_capability="10.0")
    assert plan.kv_cache_dtype_effective == "fp8" and plan.kv_block_bytes == 32 * 79 * (576 + 132)
    assert plan.compute_capability_source == "the nodes' nvidia-smi"


def test_bfloat16_kv_on_gb10_is_refused_before_anything_runs(clean_env, model_308):
    with pytest.raises(UsageError, match="FLASHINFER_MLA_SPARSE_SM120"):
        plan_for(settings_for(model_308, KV_CACHE_DTYPE="bfloat16"))


def test_max_full_seqs_holds_that_many_full_sequences_plus_the_null_block(clean_env, model_308):
    plan = plan_for(settings_for(model_308, MAX_FULL_SEQS="3"))
    assert plan.kv_blocks_per_rank == 3 * 3_907 + 1


def test_spec_off_drops_the_mtp_layer(clean_env, model_308):
    plan = plan_for(settings_for(model_308, SPEC_METHOD="off"))
    assert plan.kv_block_bytes == 64 * 78 * 788


def test_dspark_plans_the_drafters_cache_and_not_the_mtp_layer(clean_env, model_308, tmp_path):
    drafter = tmp_path / "dspark"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({**GLM53_CONFIG, "num_hidden_layers": 2}))
    s = settings_for(model_308, RECIPE="glm53-exl3-2.75bpw", SPEC_METHOD="dspark", DSPARK=str(drafter))
    plan = plan_for(s)
    assert [(t.layers, t.bytes_per_token_per_layer) for t in plan.kv_terms] == [(78, 656), (78, 132), (2, 656), (2, 132)]
    assert plan.kv_block_bytes == 64 * 80 * 788


def test_dspark_without_a_readable_drafter_config_is_refused(clean_env, model_308, tmp_path):
    s = settings_for(model_308, RECIPE="glm53-exl3-2.75bpw", SPEC_METHOD="dspark", DSPARK=str(tmp_path / "none"))
    with pytest.raises(UsageError, match="cannot read the drafter's config.json"):
        plan_for(s)


def test_nodes_compute_capability_agrees_or_says_who_differs():
    assert nodes_compute_capability({"a": "12.1", "b": "12.1", "c": None}) == ("12.1", None)
    assert nodes_compute_capability({"a": None}) == (None, None)
    cc, problem = nodes_compute_capability({"a": "12.1", "b": "10.0"})
    assert cc is None and problem and "a 12.1" in problem and "b 10.0" in problem


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
    assert not p1.fits  # without DCP the MLA cache is duplicated on every rank: 62.3 GB of KV


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


def test_a_length_dcp_does_not_divide_is_rounded_up_per_rank(clean_env, model_308):
    """vLLM gives each DCP rank ceil(MAX_MODEL_LEN / DCP) tokens of every sequence: 256,001 tokens at DCP 4
    are 64,001 per rank, 1,001 blocks of 64 (1,000 would hold 64,000: one token short), + the null block."""
    plan = plan_for(settings_for(model_308, MAX_MODEL_LEN="256001", DCP="4", MAX_FULL_SEQS="1"))
    assert plan.kv_block_tokens == 64 and plan.kv_blocks_per_rank == 1_002
    assert plan.tokens_per_rank == 1_001 * 64 >= 64_001
    plan = plan_for(settings_for(model_308, MAX_MODEL_LEN="256000", DCP="4", MAX_FULL_SEQS="1"))
    assert plan.kv_blocks_per_rank == 1_001  # 64,000 per rank: exactly 1,000 blocks


@settings(max_examples=80)
@given(dcp=st.sampled_from([2, 4]),
       quotient=st.integers(0, 2_000_000) | st.integers(0, 30_000).map(lambda b: 64 * b),
       rest=st.integers(0, 6), seqs=st.integers(1, 8), cc=st.sampled_from(["12.1", "10.0"]))
@example(dcp=4, quotient=64_000, rest=0, seqs=1, cc="12.1")  # 256,001
@example(dcp=2, quotient=0, rest=0, seqs=1, cc="12.1")  # 1 token
def test_kv_per_rank_holds_every_full_sequence_at_lengths_dcp_does_not_divide(clean_env, model_308, dcp, quotient,
                                                                               rest, seqs, cc):
    """tokens per rank >= MAX_FULL_SEQS x ceil(MAX_MODEL_LEN / DCP), with less than one block to spare per
    sequence, at lengths DCP leaves a remainder of (half of them just past a whole number of blocks per
    rank, where rounding down loses a block)."""
    max_len = dcp * quotient + rest % (dcp - 1) + 1  # a remainder of 1 to DCP - 1
    assert max_len % dcp
    ckpt = read_checkpoint(model_308)
    s = settings_for(model_308, MAX_MODEL_LEN=str(max_len), DCP=str(dcp), MAX_FULL_SEQS=str(seqs))
    plan = make_plan(s, ckpt, compute_capability=cc)
    per_seq = math.ceil(max_len / dcp)
    block = plan.kv_block_tokens
    assert plan.tokens_per_rank >= seqs * per_seq
    assert plan.tokens_per_rank < seqs * (per_seq + block)
    assert plan.tokens_per_rank % block == 0
    assert plan.kv_blocks_per_rank == plan.tokens_per_rank // block + 1  # and the null block


def test_plan_says_which_node_memory_figure_it_planned_against(clean_env, model_308):
    """`plan` never reads a node's memory; it says whether the figure is --node-memory or
    NODE_MEMORY_BYTES (and where that came from), in its text and its JSON."""
    import json
    import os
    import subprocess
    import sys

    env = {"PATH": os.environ["PATH"], "NODES": "a b c d", "MODEL": str(model_308), "HOME": str(model_308.parent)}
    base = [sys.executable, "-m", "sparkctl"]
    r = subprocess.run([*base, "--json", "plan", "--local"], env=env, capture_output=True, text=True, timeout=60)
    doc = json.loads(r.stdout)
    assert doc["node_memory"]["bytes"] == doc["plan"]["node_memory_bytes"]
    assert doc["node_memory"]["from"].startswith("NODE_MEMORY_BYTES=") and "not read from the nodes" in \
        doc["node_memory"]["from"]
    r = subprocess.run([*base, "plan", "--local", "--node-memory", "120000000000"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert "planned against node memory 120.0 GB: --node-memory" in r.stdout + r.stderr
