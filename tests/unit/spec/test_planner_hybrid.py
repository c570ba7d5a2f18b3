"""The planner's paging of a hybrid (full attention mixed with Gated DeltaNet state, Qwen3-Next), worked by hand
from vLLM 0.33's code (planner.py says which function each step comes from; the fidelity suite runs those
functions on the shipped Qwen3-Next recipes):

- the attention block is the least multiple of lcm(16, 64) = 64 tokens (the attention kernel's block and
  FlashInfer's GDN prefill checkpoint grid, prefix caching's "align" mode) whose page of one attention layer holds
  one state layer's page (platforms/interface.py `_align_hybrid_block_size`); the state page is padded to it;
- layers of one kind form groups of the fewest layers of any kind, or of the most when those are below 1.5 × the
  fewest (kv_cache_planning.py `_get_kv_cache_groups_uniform_page_size`); one pool block is a page of each slot;
- a state group holds 3 blocks per sequence (MambaSpec.max_memory_usage_bytes, align mode: 2 + 1 prefill
  checkpoint block), an attention group ⌈tokens ÷ block⌉; plus one null block for the pool.

Qwen3-Next-80B-A3B (tests/fixtures/configs/): 12 full-attention layers (2 KV heads × 256, bf16) and 36 Gated
DeltaNet layers (16 key heads, 32 value heads, 128 × 128, conv kernel 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkctl.spec.planner import (
    aligns_to_state,
    hybrid_block_tokens,
    kv_group_layers,
    kv_terms,
    make_plan,
    read_checkpoint,
)
from sparkctl.spec.settings import load_settings
from tests.conftest import write_model

CONFIG = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "configs" /
                     "qwen3-next-80b-a3b-thinking.json").read_text())
# One Gated DeltaNet layer's state per sequence on a rank, bf16: conv (2 × 16 × 128 + 32 × 128) ÷ TP × (4 − 1)
# values + recurrent 32 ÷ TP value heads × 128 × 128 values.
STATE = {2: (8192 // 2 * 3 + 16 * 128 * 128) * 2, 4: (8192 // 4 * 3 + 8 * 128 * 128) * 2}
ATTENTION = 1 * 256 * 2 * 2  # K+V of the one KV head a rank holds (2 heads ÷ TP 2; replicated at TP 4), bf16


def test_the_state_pages_as_worked_by_hand():
    assert STATE == {2: 548_864, 4: 274_432}
    terms = kv_terms(CONFIG, "auto", 2, Path("/m"))
    assert [(t.bytes_per_token_per_layer, t.state_bytes_per_layer, t.layers) for t in terms] == \
        [(ATTENTION, 0, 12), (0, STATE[2], 36)]


@pytest.mark.parametrize(("tp", "kv", "block"), [
    (2, "auto", 576),   # 548,864 ÷ 1,024 = 536 tokens of attention → 9 × 64
    (4, "auto", 320),   # 274,432 ÷ 1,024 = 268 → 5 × 64
    (2, "fp8", 1088),   # fp8 halves the attention page (512 B), not the bf16 state: 1,072 → 17 × 64
    (4, "fp8", 576),    # 274,432 ÷ 512 = 536 → 9 × 64
])
def test_the_attention_block_is_the_least_64_token_multiple_whose_page_holds_a_state(tp, kv, block):
    terms = kv_terms(CONFIG, kv, tp, Path("/m"))
    per_layer = ATTENTION // (2 if kv == "fp8" else 1)
    assert hybrid_block_tokens(terms) == block
    assert block * per_layer >= STATE[tp] > (block - 64) * per_layer


@pytest.mark.parametrize(("counts", "group"), [
    ([12, 36], 12),   # Qwen3-Next: 36 is not below 1.5 × 12, so groups of 12 (1 attention + 3 state groups)
    ([12, 12], 12),   # gpt-oss: 12 full + 12 sliding
    ([12, 17], 17),   # 17 < 18: groups of the most, one padded slot
    ([12, 18], 12),   # 18 is not below 18
    ([2, 3], 2),
])
def test_layers_per_kv_cache_group(counts, group):
    assert kv_group_layers(counts) == group


def plan(tmp_path: Path, recipe: str, tp: int = 2, **knobs: str):
    model = write_model(tmp_path / "Qwen3-Next", 160_000_000_000, 4, config=CONFIG)
    env = {"NODES": " ".join(f"spark{i + 1}" for i in range(tp)), "MODEL": str(model), "RECIPE": recipe, **knobs}
    return make_plan(load_settings(cli={}, environ=env), read_checkpoint(model), compute_capability="12.1")


@pytest.mark.parametrize(("recipe", "block", "blocks"), [
    # ⌈262,144 ÷ 576⌉ = 456 attention blocks + 3 state groups × 3 blocks + 1 null block
    ("qwen3-next-80b-a3b-thinking-tp2", 576, 456 + 3 * 3 + 1),
    # ⌈262,144 ÷ 320⌉ = 820 + 9 + 1
    ("qwen3-next-80b-a3b-thinking-tp4", 320, 820 + 3 * 3 + 1),
])
def test_the_shipped_qwen3_next_recipes_plan_vllms_minimum(clean_env, tmp_path, recipe, block, blocks):
    p = plan(tmp_path, recipe, int(recipe.rsplit("tp", 1)[1]))
    assert p.kv_block_tokens == block and not any("kv_block_tokens" in n for n in p.notes)
    assert p.kv_block_bytes == block * ATTENTION * 12  # a page of each of the 12 slots of a group
    assert p.kv_group_layers == 12
    assert p.kv_blocks_per_rank == blocks
    assert p.kv_cache_memory_bytes == blocks * block * ATTENTION * 12
    assert p.kv_cache_memory_bytes == {576: 3_298_295_808, 320: 3_263_692_800}[block]
    assert p.fits


def test_several_sequences_and_a_short_context(clean_env, tmp_path):
    """3 sequences of 8,192 tokens at TP 2: each ⌈8,192 ÷ 576⌉ = 15 attention blocks + 9 state blocks; + 1 null."""
    p = plan(tmp_path, "qwen3-next-80b-a3b-thinking-tp2", MAX_MODEL_LEN="8192", MAX_FULL_SEQS="3")
    assert p.kv_blocks_per_rank == 3 * (15 + 9) + 1
    assert p.kv_cache_memory_bytes == 73 * 576 * ATTENTION * 12


def test_fp8_kv_raises_the_block_and_keeps_the_state_in_bf16(clean_env, tmp_path):
    """fp8 at TP 2: 1,088-token blocks of 512 B per layer (557,056 B pages, the 548,864 B bf16 state padded to it);
    ⌈262,144 ÷ 1,088⌉ = 241 attention blocks + 9 + 1."""
    p = plan(tmp_path, "qwen3-next-80b-a3b-thinking-tp2", KV_CACHE_DTYPE="fp8")
    assert p.kv_block_tokens == 1088
    assert p.kv_cache_memory_bytes == (241 + 9 + 1) * 1088 * 512 * 12


def test_a_recipe_with_another_block_is_planned_with_vllms_and_says_so(clean_env, tmp_path):
    recipe = Path(__file__).resolve().parents[3] / "launcher" / "sparkctl" / "recipes" / \
        "qwen3-next-80b-a3b-thinking-tp2.toml"
    own = tmp_path / "mine.toml"
    own.write_text(recipe.read_text().replace("kv_block_tokens = 576", "kv_block_tokens = 16"))
    p = plan(tmp_path, str(own))
    assert p.kv_block_tokens == 576
    assert any("kv_block_tokens=16 is not the block vLLM 0.33 pages this hybrid in: planned with 576" in n
               for n in p.notes)


def test_a_pool_block_is_a_page_of_each_slot_of_one_group_not_of_every_layer(clean_env, tmp_path):
    """gpt-oss-20b at TP 2 (12 full + 12 sliding-window layers, K+V of 4 KV heads × 64 per rank, bf16): groups of 12, so one
    pool block is 16 tokens × 1,024 B × 12 layers = 196,608 B (not the 24 layers' 393,216 B); one sequence of
    131,072 tokens holds 8,192 full blocks and ⌈(128 − 1 + 2 × 8,192) ÷ 16⌉ + 1 = 1,033 window blocks; + 1 null."""
    config = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "configs" / "gpt-oss-20b.json").read_text())
    model = write_model(tmp_path / "gpt-oss-20b", 13_800_000_000, 3, config=config)
    env = {"NODES": "spark1 spark2", "MODEL": str(model), "RECIPE": "gpt-oss-20b-tp2"}
    p = make_plan(load_settings(cli={}, environ=env), read_checkpoint(model), compute_capability="12.1")
    assert p.kv_block_bytes == 16 * 2 * 4 * 64 * 2 * 12 == 196_608
    assert p.kv_group_layers == 12
    assert p.kv_blocks_per_rank == 8192 + 1033 + 1
    assert p.kv_cache_memory_bytes == p.kv_blocks_per_rank * p.kv_block_bytes


def test_only_a_model_with_attention_and_state_layers_is_aligned(clean_env, tmp_path):
    """A config of linear-attention layers only (written here, not a real model) has no attention page to align:
    the plan keeps the recipe's block instead of failing."""
    config = dict(CONFIG, layer_types=["linear_attention"] * 48)
    assert not aligns_to_state(kv_terms(config, "auto", 2, Path("/m")))
    assert aligns_to_state(kv_terms(CONFIG, "auto", 2, Path("/m")))
    model = write_model(tmp_path / "linear-only", 1_000_000_000, 1, config=config)
    env = {"NODES": "spark1 spark2", "MODEL": str(model), "RECIPE": "qwen3-next-80b-a3b-thinking-tp2"}
    p = make_plan(load_settings(cli={}, environ=env), read_checkpoint(model), compute_capability="12.1")
    assert p.kv_block_tokens == 576 and not any("is not the block" in n for n in p.notes)
