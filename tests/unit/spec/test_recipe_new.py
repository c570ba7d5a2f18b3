"""`recipe new`'s choices from a config.json: TP from the heads, the fit per rank with the planner's GB10
figures, the largest max_model_len whose KV fits, refusals with the numbers; and the recipe it writes loads."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from sparkctl.errors import UsageError
from sparkctl.spec.planner import GIB
from sparkctl.spec.recipe_new import GB10_NODE_MEMORY_BYTES, ModelSource, draft, recipe_text

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


def real(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def test_qwen3_dense_gqa_on_two_nodes_plans_the_largest_context_that_fits():
    src = ModelSource(real("qwen3-4b"), 8_044_000_000, "/models/Qwen3-4B", repo="Qwen/Qwen3-4B")
    d = draft(src, 2)
    assert d.tp == 2 and d.kv_cache_dtype == "auto" and d.kv_block_tokens == 16
    # 36 layers × 2 (K,V) × 4 KV heads per rank × 128 × 2 B = 73,728 B per token on a rank
    per_token = 36 * 2 * 4 * 128 * 2
    budget = GB10_NODE_MEMORY_BYTES - 4 * GIB - 14 * GIB - math.ceil(8_044_000_000 / 2)
    fits = budget // per_token // 16 * 16 - 16
    assert d.max_model_len == min(262_144, fits // 1024 * 1024)
    assert d.kv_bytes == (d.max_model_len // 16 + 1) * 16 * per_token <= budget
    assert "8 KV heads ÷ 2 = 4 per rank" in d.why["TP"]


def test_kv_heads_fewer_than_tp_are_replicated():
    cfg = dict(real("qwen3-4b"), num_key_value_heads=2, num_attention_heads=32)
    d = draft(ModelSource(cfg, 8_000_000_000, "/m"), 4)
    assert "replicated on 2 ranks" in d.why["TP"]
    assert "1 heads × 128" in d.why["KV"]


def test_heads_that_do_not_split_are_refused_with_the_numbers():
    with pytest.raises(UsageError) as exc:
        draft(ModelSource(real("qwen3-4b"), 8_000_000_000, "/m"), 3)
    assert "num_attention_heads=32 is not divisible by TP=3" in exc.value.message


def test_a_model_too_big_for_the_nodes_is_refused_with_the_numbers():
    with pytest.raises(UsageError) as exc:
        draft(ModelSource(real("qwen3-4b"), 240_000_000_000, "/m"), 2)
    msg = exc.value.message
    assert "does not fit on 2 node(s)" in msg and "120.0 GB weights (240.0 GB ÷ TP=2)" in msg
    assert "--nodes 4" in (exc.value.fix or "")


def test_gpt_oss_sliding_window_layers_hold_the_window_not_the_context():
    src = ModelSource(real("gpt-oss-20b"), 13_800_000_000, "/m", repo="openai/gpt-oss-20b")
    d = draft(src, 2)
    assert d.max_model_len == 131_072  # capped at max_position_embeddings: 12 sliding layers hold 128 + a batch
    per_layer = 2 * 4 * 64 * 2
    null_block = 16 * per_layer * 12  # vLLM's one null block of the shared pool (a group of 12 layers)
    full = 131_072 * per_layer * 12
    # the window (127 tokens) + two batches in flight (async scheduling) + 1 block, per sliding layer
    sliding = (math.ceil((128 - 1 + 2 * 8192) / 16) + 1) * 16 * per_layer * 12
    assert d.kv_bytes == null_block + full + sliding
    assert "--max-num-batched-tokens" in d.extra_args
    assert "12 full, 12 sliding" in d.why["KV"]


def test_hybrid_linear_attention_state_is_per_sequence_in_pages_of_the_aligned_block():
    # A config written here, shaped like Qwen3-Next (every 4th layer full attention): not a real file.
    cfg = {"model_type": "qwen3_next", "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 2,
           "head_dim": 256, "hidden_size": 2048, "full_attention_interval": 4, "linear_num_key_heads": 16,
           "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    d = draft(ModelSource(cfg, 1_000_000_000, "/m"), 2)
    state = ((2 * 16 * 128 + 32 * 128) // 2 * 3 + 16 * 128 * 128) * 2  # conv + recurrent, bf16: 548,864 B
    per_layer = 2 * 1 * 256 * 2  # one attention layer's K+V per token on a rank: 1,024 B
    # vLLM aligns the block to 64 tokens whose page holds a state page: ⌈548,864 ÷ (64 × 1,024)⌉ = 9 → 576 tokens
    assert d.kv_block_tokens == 576 and 576 * per_layer >= state > 512 * per_layer
    # groups of 2 layers (2 full, 6 state: 6 is not below 1.5 × 2): 1 attention group holding ⌈4,096 ÷ 576⌉ = 8
    # blocks, 3 state groups holding 3 blocks each; + the null block; one block is a page of each of 2 layers
    assert d.kv_bytes == (8 + 3 * 3 + 1) * 576 * per_layer * 2 == 21_233_664
    assert "2 full, 6 state" in d.why["KV"]
    assert "576 × 1,024 B = 589,824 B" in d.why["block"] and "3 state blocks per sequence" in d.why["block"]


def test_the_written_recipe_loads_and_explains_each_choice(tmp_path):
    from sparkctl.spec.recipes import load_recipe

    src = ModelSource(real("qwen3-4b"), 8_044_000_000, "/models/Qwen3-4B", repo="Qwen/Qwen3-4B")
    d = draft(src, 2)
    text = recipe_text(d, src, 2, image="vllm/vllm-openai@sha256:" + "a" * 64)
    path = tmp_path / "r.toml"
    path.write_text(text)
    r = load_recipe(str(path))
    assert r.prebuilt is not None and not r.layers
    assert r.defaults["TP"] == 2 and r.defaults["MAX_MODEL_LEN"] == d.max_model_len
    assert r.defaults["MODEL_REPO"] == "Qwen/Qwen3-4B"
    for what in ("# TP=2:", "# KV per token per layer:", "# Memory per rank:", "# MAX_MODEL_LEN:", "# KV_CACHE_DTYPE:",
                 "# Quantization:", "# Flags:"):
        assert what in text
    assert tomllib.loads(text)["defaults"]["IMAGE"].startswith("vllm/vllm-openai@sha256:")


def test_layer_kinds_follow_layer_types_else_the_interval():
    from sparkctl.spec.planner import layer_kinds

    kinds = layer_kinds(real("gpt-oss-20b"), Path("/m"))
    assert kinds[:4] == ["sliding", "full", "sliding", "full"] and len(kinds) == 24
    # full_attention_interval 4: layers 3, 7, ... are full attention (Qwen3-Next's layer_types say the same)
    assert layer_kinds({"num_hidden_layers": 8, "full_attention_interval": 4}, Path("/m")) == \
        ["state", "state", "state", "full"] * 2
    with pytest.raises(UsageError, match=r"layer_types\[1\] is 'moe_attention'"):
        layer_kinds({"num_hidden_layers": 2, "layer_types": ["full_attention", "moe_attention"]}, Path("/m"))


def test_the_description_names_the_stored_dtype_or_the_quantization():
    """An unquantized checkpoint is named by what it stores (bf16), never "(none)"; a quantized one by its method."""
    plain = draft(ModelSource(real("qwen3-4b"), 8_044_000_000, "/models/Qwen3-4B", repo="Qwen/Qwen3-4B"), 2)
    quant = draft(ModelSource(real("gpt-oss-20b"), 13_800_000_000, "/models/gpt-oss-20b", repo="openai/gpt-oss-20b"), 2)
    assert plain.weights_kind == "bf16" and quant.weights_kind == "gptq"  # this mirror's method (fixtures README)
    text = recipe_text(plain, ModelSource(real("qwen3-4b"), 8_044_000_000, "/m", repo="Qwen/Qwen3-4B"), 2,
                       image="vllm/vllm-openai@sha256:" + "a" * 64)
    assert 'description = "Qwen3-4B (bf16), 2x DGX Spark' in text and "(none)" not in text


def test_like_takes_the_platform_of_the_base_and_plans_the_model_on_its_memory_model(tmp_path):
    """`--like lab-vllm`: the base's image (its chain's BASE_IMAGE, run prebuilt), memory profile, node memory,
    container, env, ports and fabric test; the model's TP, length, KV dtype and served name planned on that
    memory model (the CPU engine's 128-token pages, its 2 GiB overhead, its 16 GB nodes); it loads."""
    from sparkctl.spec.recipe_new import base_plan_inputs, recipe_like_text
    from sparkctl.spec.recipes import load_recipe, recipes_dir

    base_path = recipes_dir() / "lab-vllm.toml"
    base = tomllib.loads(base_path.read_text())
    src = ModelSource(real("qwen3-4b"), 8_044_000_000, "/models/Qwen3-4B", repo="Qwen/Qwen3-4B")
    memory, profile, seqs = base_plan_inputs(base)
    assert (memory, profile.overhead_gib, profile.kv_block_tokens, seqs) == (16_000_000_000, 2, 128, 4)
    d = draft(src, 2, node_memory=memory, profile=profile, dense_block=profile.kv_block_tokens, max_full_seqs=seqs)
    per_token = 36 * 2 * 4 * 128 * 2
    budget = memory - 1 * GIB - 2 * GIB - math.ceil(8_044_000_000 / 2)
    assert d.kv_block_tokens == 128 and d.kv_bytes <= budget
    assert d.kv_bytes == (math.ceil(d.max_model_len / 128) * 4 + 1) * 128 * per_token
    text = recipe_like_text(d, src, 2, base, "lab-vllm")
    path = tmp_path / "like.toml"
    path.write_text(text)
    r, b = load_recipe(str(path)), load_recipe("lab-vllm")
    assert r.prebuilt is not None and not r.layers and r.tag_prefix != b.tag_prefix
    assert r.defaults["IMAGE"] == b.defaults["BASE_IMAGE"] and "BASE_IMAGE" not in r.defaults
    assert (r.memory.overhead_gib, r.memory.os_reserve_gib, r.memory.kv_block_tokens) == (2, 1, 128)
    assert r.container == b.container and r.fabric == b.fabric and r.vllm_extra_args == b.vllm_extra_args
    for key in ("PORT", "MASTER_PORT", "NODE_MEMORY_BYTES", "ULIMIT_NOFILE", "SHM_SIZE"):
        assert r.defaults[key] == b.defaults[key], key
    assert (r.defaults["TP"], r.defaults["MAX_MODEL_LEN"], r.defaults["SERVED_MODEL_NAME"]) == (2, d.max_model_len,
                                                                                                 "Qwen3-4B")
    assert r.defaults["MODEL_REPO"] == "Qwen/Qwen3-4B" and r.layout_name == "hf-safetensors"
    assert "is lab-vllm's" in text and "# KV per token per layer:" in text


def test_like_refuses_a_chain_with_nothing_to_run_prebuilt():
    from sparkctl.spec.recipe_new import recipe_like_text

    src = ModelSource(real("qwen3-4b"), 8_044_000_000, "/m")
    base = {"name": "b", "defaults": {"TP": 2}, "images": {"layers": [{"name": "x"}]}}
    with pytest.raises(UsageError, match="no BASE_IMAGE"):
        recipe_like_text(draft(src, 2), src, 2, base, "b")
