"""The KV planner's rules, figure by figure (what its mutation run, bench/mutation.py, showed untested).

Exact bytes, blocks and GB text; _cfg_int's bounds; what the refusals and notes say; the order of the
problems. The KV arithmetic itself is documented in planner.py's docstring and docs/sources.md and refereed by
tests/fidelity (vLLM's own planner): these tests pin what the planner reports, not a new formula.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from sparkctl.errors import CheckFailed, UsageError
from sparkctl.spec.planner import (
    GIB,
    MAX_CONFIG_INT,
    SM120_DTYPES,
    SM120_SPARSE,
    Plan,
    drafter_dir,
    gb,
    kv_layout,
    kv_terms,
    make_plan,
    read_checkpoint,
    require_fit,
)
from sparkctl.spec.settings import Settings, load_settings
from tests.conftest import GLM53_CONFIG, write_model

NODES = "spark1 spark2 spark3 spark4"
# DeepSeek-V3's attention: MLA (a latent + rope key) without the sparse-attention indexer.
DENSE_MLA = {k: v for k, v in GLM53_CONFIG.items() if k not in ("index_topk", "index_head_dim")}
DENSE_FP32 = {"torch_dtype": "float32", "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "hidden_size": 1024}


def runtime(text: str) -> str:
    """The string as the environment, a recipe or a file gives it at run time: a new object, not one of the
    interned literals of this file (the planner must compare by value)."""
    return "".join(list(text))


def settings_for(model: Path, **extra: str) -> Settings:
    return load_settings(cli={}, environ={"NODES": NODES, "MODEL": str(model), **extra})


def plan_of(model: Path, cc: str | None = None, node_memory: int | None = None, **extra: str) -> Plan:
    return make_plan(settings_for(model, **extra), read_checkpoint(model), node_memory_bytes=node_memory,
                     compute_capability=cc)


# --- what a node offers, and what is refused ---------------------------------------------------------------

def test_a_node_offers_its_memory_less_the_os_reserve(clean_env, model_308):
    """128 GiB of node memory, 4 GiB of OS reserve: 124 GiB for the rank, to the byte."""
    plan = plan_of(model_308, node_memory=128 * GIB)
    assert plan.available == 124 * GIB
    assert plan.headroom == 124 * GIB - plan.per_rank_total
    d = plan.to_dict()
    assert (d["available"], d["headroom"], d["fits"], d["problems"]) == (124 * GIB, plan.headroom, True, [])


def test_utilisation_at_the_cap_is_accepted(clean_env, model_308):
    """The cap is the largest value vLLM's startup guard lets through (check says `≤ cap`)."""
    plan = plan_of(model_308, GPU_MEMORY_UTILIZATION="0.82")
    assert plan.gpu_memory_utilization == plan.gpu_memory_utilization_cap == 0.82
    assert plan.problems() == [] and plan.fits


def test_the_utilisation_refusal_says_what_why_and_the_fix(clean_env, model_308):
    (problem,) = plan_of(model_308, GPU_MEMORY_UTILIZATION="0.83").problems()
    assert problem == (
        "GPU_MEMORY_UTILIZATION=0.83 is above the recipe's cap 0.82: vLLM's startup guard refuses it, because the "
        "worker already holds ~14 GiB of CUDA/NCCL state when it measures free memory; size the KV cache with "
        "--kv-cache-memory-bytes instead")


def test_both_problems_come_in_order_and_require_fit_lists_them(clean_env, model_308):
    """Does not fit first (the figures, and by how much), then the utilisation cap; require_fit refuses with both."""
    plan = plan_of(model_308, node_memory=100_000_000_000, GPU_MEMORY_UTILIZATION="0.9")
    short = plan.per_rank_total - (100_000_000_000 - 4 * GIB)
    assert plan.per_rank_total == 77_000_000_000 + 15_569_972_224 + 14 * GIB
    problems = plan.problems()
    assert problems[0] == (
        f"does not fit: per rank 77.0 GB weights + 15.6 GB KV + 15.0 GB overhead = 107.6 GB, but a node has "
        f"100.0 GB − 4.3 GB OS reserve = 95.7 GB ({gb(short)} short)")
    assert gb(short) == "11.9 GB"
    assert problems[1].startswith("GPU_MEMORY_UTILIZATION=0.9 is above the recipe's cap 0.82")
    assert len(problems) == 2 and not plan.fits
    with pytest.raises(CheckFailed) as exc:
        require_fit(plan)
    assert str(exc.value) == "plan refused: " + "\n  ".join(problems)


def test_gb_text_is_decimal_gigabytes_to_one_place():
    assert (gb(15_569_972_224), gb(0), gb(4 * GIB), gb(-1_050_000_000)) == ("15.6 GB", "0.0 GB", "4.3 GB", "-1.1 GB")


def test_a_ranks_share_of_the_weights_rounds_up(clean_env, tmp_path):
    """308,000,000,001 B over TP 4 is 77,000,000,000.25 B: the rank holds 77,000,000,001 (never plan a byte short)."""
    plan = plan_of(write_model(tmp_path / "m", 308_000_000_001, 41))
    assert plan.weights_total == 308_000_000_001 and plan.weights_per_rank == 77_000_000_001


# --- _cfg_int: the config's integers -----------------------------------------------------------------------

@pytest.mark.parametrize("layers", [0, 1, MAX_CONFIG_INT])
def test_config_integers_from_0_to_2_pow_24_are_accepted(tmp_path, layers):
    cfg = {**GLM53_CONFIG, "num_hidden_layers": layers, "num_nextn_predict_layers": 0}
    assert {t.layers for t in kv_terms(cfg, "fp8_ds_mla", 4, tmp_path)} == {layers}


@pytest.mark.parametrize("bad", [-1, MAX_CONFIG_INT + 1, True, False, 78.0, "78", None])
def test_config_integers_outside_0_to_2_pow_24_or_not_int_are_refused(tmp_path, bad):
    with pytest.raises(UsageError) as exc:
        kv_terms({**GLM53_CONFIG, "num_hidden_layers": bad}, "fp8_ds_mla", 4, tmp_path)
    assert str(exc.value).startswith(
        f"{tmp_path / 'config.json'}: num_hidden_layers should be a non-negative integer (at most 16777216), "
        f"got {str(bad)!r}")


def test_a_refused_config_value_is_shown_cut_to_40_characters(tmp_path):
    with pytest.raises(UsageError) as exc:
        kv_terms({**GLM53_CONFIG, "kv_lora_rank": "9" * 100}, "fp8", 4, tmp_path)
    assert f"kv_lora_rank should be a non-negative integer (at most 16777216), got {'9' * 40!r}" in str(exc.value)
    assert "9" * 41 not in str(exc.value)


# --- the backend and what it stores ------------------------------------------------------------------------

def test_a_kv_layout_is_a_value():
    """The layout the planner picked cannot be altered after the fact (the plan's figures derive from it)."""
    layout = kv_layout(GLM53_CONFIG, "12.1", "fp8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.dtype = "bfloat16"  # type: ignore[misc]
    assert hash(layout) == hash(kv_layout(GLM53_CONFIG, "12.1", "fp8"))


def test_mla_without_the_indexer_is_not_sparse_mla():
    """DeepSeek-V3's MLA has no indexer: not a sparse-MLA model, so GB10's fp8_ds_mla rule does not apply and
    bfloat16 is not refused."""
    layout = kv_layout(DENSE_MLA, "12.1", "bfloat16")
    assert (layout.backend, layout.dtype) == ("(dense attention)", "bfloat16")
    assert layout.why == "not a sparse-MLA model: the dtype is stored as given"


@pytest.mark.parametrize("asked", SM120_DTYPES)
def test_gb10_says_which_dtype_it_turned_into_fp8_ds_mla(asked):
    """fp8/auto/fp8_e4m3 are stored as fp8_ds_mla and the reason says so; asked for fp8_ds_mla itself, the reason
    does not claim a conversion."""
    layout = kv_layout(GLM53_CONFIG, "12.1", runtime(asked))
    head = f"SM121: vLLM's only sparse-MLA backend is {SM120_SPARSE}"
    assert (layout.backend, layout.dtype, layout.block_tokens) == (SM120_SPARSE, "fp8_ds_mla", 64)
    if asked == "fp8_ds_mla":
        assert layout.why == head
    else:
        assert layout.why == f"{head}, which stores {asked} as fp8_ds_mla (656 B per token per layer)"


def test_sm10x_auto_is_fp8_e4m3_by_the_models_config_hook(clean_env, model_308):
    layout = kv_layout(GLM53_CONFIG, "10.0", runtime("auto"))
    assert (layout.backend, layout.dtype, layout.block_tokens) == ("FLASHINFER_MLA_SPARSE", "fp8_e4m3", 32)
    assert layout.why.endswith("in blocks of 32 tokens (the model's config hook turns auto into fp8_e4m3)")
    plan = plan_of(model_308, cc="10.0", KV_CACHE_DTYPE=runtime("auto"))
    assert plan.kv_cache_dtype_effective == "fp8_e4m3" and plan.kv_block_bytes == 32 * 79 * (576 + 132)


@pytest.mark.parametrize("asked", ["fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"])
def test_sm10x_names_the_config_hook_only_for_auto(asked):
    layout = kv_layout(GLM53_CONFIG, "10.0", runtime(asked))
    assert layout.dtype == asked
    assert layout.why == (f"SM10x: FLASHINFER_MLA_SPARSE is preferred for a quantized cache and keeps plain {asked} "
                          "(kv_lora_rank + rope bytes) in blocks of 32 tokens")


# --- bytes per token ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("torch_dtype", "width"), [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_auto_stores_the_models_own_dtype(clean_env, tmp_path, torch_dtype, width):
    """KV_CACHE_DTYPE=auto on a dense model: K and V in the model's dtype (float32: 4 B an element)."""
    cfg = {**DENSE_FP32, "torch_dtype": torch_dtype}
    (term,) = kv_terms(cfg, runtime("auto"), 4, tmp_path)
    assert (term.bytes_per_token_per_layer, term.layers) == (2 * 1 * 128 * width, 4)
    assert term.name == f"K+V (1 heads × 128 × 2 × {width} B)"
    plan = plan_of(write_model(tmp_path / "dense", 4_000_000, 4, cfg), KV_CACHE_DTYPE=runtime("auto"))
    assert plan.kv_backend == "(dense attention)" and plan.kv_bytes_per_token == 4 * 2 * 128 * width


@pytest.mark.parametrize(("dim", "per_layer"), [(128, 132), (132, 136), (256, 264), (4224, 4356)])
def test_the_indexer_holds_its_width_in_fp8_plus_a_4_byte_scale_per_128(tmp_path, dim, per_layer):
    """deepseek_v2.py: index_head_dim fp8 bytes + index_head_dim // 128 fp32 scales (GLM-5: 128 + 4 = 132)."""
    terms = kv_terms({**GLM53_CONFIG, "index_head_dim": dim}, "fp8_ds_mla", 4, tmp_path)
    assert terms[1].bytes_per_token_per_layer == per_layer
    assert terms[1].name == f"indexer ({dim} fp8 + {per_layer - dim} B scales)"


# --- the notes ---------------------------------------------------------------------------------------------

def _dcp_notes(plan: Plan) -> list[str]:
    return [n for n in plan.notes if n.startswith("DCP=")]


@pytest.mark.parametrize("dcp", [2, 4])
def test_dcp_on_gb10_notes_that_stock_vllm_refuses_it(clean_env, model_308, dcp):
    plan = plan_of(model_308, DCP=str(dcp))
    assert _dcp_notes(plan) == [
        f"DCP={dcp} on SM12.1: stock vLLM 0.33's {SM120_SPARSE} does not support decode context parallelism "
        "(it refuses the model); the image chain's `dcp` layer is what enables it"]


@pytest.mark.parametrize(("cc", "kv", "dcp"), [("12.1", "fp8", "1"), ("10.0", "fp8", "4"), ("10.0", "fp8_ds_mla", "4")])
def test_no_dcp_note_without_dcp_or_off_gb10s_backend(clean_env, model_308, cc, kv, dcp):
    plan = plan_of(model_308, cc=cc, KV_CACHE_DTYPE=kv, DCP=dcp)
    assert plan.notes == []


def test_no_dcp_note_for_a_dense_model_on_gb10(clean_env, tmp_path):
    plan = plan_of(write_model(tmp_path / "dense", 4_000_000, 4, DENSE_FP32), KV_CACHE_DTYPE="bfloat16")
    assert plan.dcp == 4 and plan.notes == []


@pytest.mark.parametrize(("gone", "listed"), [
    (1, "model-00001-of-00041.safetensors"),
    (3, "model-00001-of-00041.safetensors, model-00002-of-00041.safetensors, model-00003-of-00041.safetensors"),
    (4, "model-00001-of-00041.safetensors, model-00002-of-00041.safetensors, model-00003-of-00041.safetensors…"),
    (5, "model-00001-of-00041.safetensors, model-00002-of-00041.safetensors, model-00003-of-00041.safetensors…"),
])
def test_missing_shards_note_names_the_first_three_and_the_fix(clean_env, model_308, gone, listed):
    for i in range(gone):
        (model_308 / f"model-{i + 1:05d}-of-00041.safetensors").unlink()
    plan = plan_of(model_308, DCP="1")
    assert plan.notes == [f"{gone} shard(s) named by the index are missing ({listed}); run `sparkctl verify-model`"]
    assert plan.weights_total == 308_000_000_000  # the index's total, not the shards still there


# --- the drafter -------------------------------------------------------------------------------------------

def test_the_drafter_folder_is_asked_for_only_with_dspark(clean_env, model_308, tmp_path):
    drafter = tmp_path / "dspark"
    s = settings_for(model_308, RECIPE="glm53-exl3-2.75bpw", SPEC_METHOD=runtime("dspark"), DSPARK=str(drafter))
    assert drafter_dir(s) == drafter
    assert drafter_dir(settings_for(model_308, SPEC_METHOD=runtime("mtp"))) is None
    assert drafter_dir(settings_for(model_308, SPEC_METHOD="off")) is None
    assert drafter_dir(without_spec_method(settings_for(model_308))) is None


def without_spec_method(s: Settings) -> Settings:
    """The settings of a recipe that sets no SPEC_METHOD (none of ours: a user's recipe may leave it out)."""
    return dataclasses.replace(s, values={k: v for k, v in s.values.items() if k != "SPEC_METHOD"})


def test_a_recipe_without_spec_method_plans_no_speculation(clean_env, model_308):
    """SPEC_METHOD unset: no MTP layer, no drafter, the same plan as `off`."""
    unset = make_plan(without_spec_method(settings_for(model_308)), read_checkpoint(model_308))
    assert unset.kv_block_bytes == 64 * 78 * (656 + 132) == plan_of(model_308, SPEC_METHOD="off").kv_block_bytes
    assert [t.layers for t in unset.kv_terms] == [78, 78]


def test_a_blank_spec_method_is_refused_not_read_as_off(clean_env, model_308):
    """`SPEC_METHOD=` in the environment would hide the recipe's `mtp`: refused, saying how to use it."""
    with pytest.raises(UsageError, match=r"SPEC_METHOD is blank \(from environment\), which would hide recipe "
                                         r"glm53-exl3-tp4's SPEC_METHOD=mtp: unset it to use it, or give a value"):
        settings_for(model_308, SPEC_METHOD="")


# --- what the second mutation sample after these tests showed untested -------------------------------------


def test_an_unquantized_mla_latent_is_the_lora_rank_plus_the_rope_dim(tmp_path):
    """kv_lora_rank + qk_rope_head_dim elements per token per layer (96 + 32: bits that overlap, so a XOR is
    caught; GLM-5's 512 + 64 are disjoint)."""
    cfg = {**GLM53_CONFIG, "kv_lora_rank": 96, "qk_rope_head_dim": 32}
    latent = kv_terms(cfg, "bfloat16", 4, tmp_path)[0]
    assert latent.bytes_per_token_per_layer == (96 + 32) * 2


def test_a_kv_term_is_a_value(tmp_path):
    term = kv_terms(GLM53_CONFIG, "fp8", 4, tmp_path)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        term.layers = 1  # type: ignore[misc]


def test_sm10x_fp8_ds_mla_is_paged_in_blocks_of_64_tokens(clean_env, model_308):
    """FLASHMLA_SPARSE (SM10x, fp8_ds_mla asked for) pages by 64 tokens; FLASHINFER_MLA_SPARSE's fp8 by 32."""
    assert kv_layout(GLM53_CONFIG, "10.0", "fp8_ds_mla").block_tokens == 64
    plan = plan_of(model_308, cc="10.0", KV_CACHE_DTYPE="fp8_ds_mla")
    assert plan.kv_block_tokens == 64 and plan.kv_block_bytes == 64 * plan.kv_bytes_per_token


def test_one_attention_head_without_head_dim_holds_the_whole_hidden_size(tmp_path):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 1, "hidden_size": 256}
    (term,) = kv_terms(cfg, "bfloat16", 1, tmp_path)
    assert term.bytes_per_token_per_layer == 2 * 1 * 256 * 2
