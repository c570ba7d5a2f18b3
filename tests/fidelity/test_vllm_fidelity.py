"""vLLM 0.33.0's own code judges every `vllm serve` argv sparkctl renders (see referee.py for what runs).

(a) each rank's argv parses with `vllm serve`'s parser, uses full flag names only, and builds vLLM's
    engine config (ModelConfig, ParallelConfig, CacheConfig, SpeculativeConfig) with our values;
(b) vLLM's KV-cache planner, with the per-layer specs vLLM builds for GLM-5 on the target GPU, accepts
    the planned --kv-cache-memory-bytes and refuses one block less.
Run in the fidelity venv: tests/fidelity/setup_venv.sh, then `$VENV/bin/python -m pytest -q -m fidelity
tests/fidelity`. The matrix is listed in COMBOS and KV_COMBOS below.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.fidelity

RECIPES = ("glm53-exl3-tp4", "glm53-exl3-2.75bpw")
PACK = {"glm53-exl3-tp4": ("3.00bpw", 308_000_000_000, 41), "glm53-exl3-2.75bpw": ("2.75bpw", 258_000_000_000, 81)}
NODES = "spark1 spark2 spark3 spark4"
PINS = {f"RANK{r}_{k}": v for r in range(4) for k, v in (
    ("FABRIC_IP", f"192.168.100.{r + 1}"), ("CX7_IF", "enp1s0f0np0" if r != 2 else "enP2p1s0f1np1"),
    ("CX7_IB", "rocep1s0f0" if r != 2 else "roceP2p1s0f1"), ("GID_INDEX", "3" if r != 2 else "4"))}
GB10 = (12, 1)
B200 = (10, 0)
GB10_1M_DCP4_MIN = 15_569_972_224  # docs/sources.md: 3,908 blocks × 3,984,128 B

# (a) knob sets, each on top of the recipe's defaults, rendered for every rank.
EXTRA_ARGS_SAMPLES = (
    "--enable-prefix-caching",
    "--max-num-seqs 8 --host 127.0.0.1",
    "--enforce-eager --max-num-batched-tokens 16384",
)
COMBOS: list[tuple[str, dict[str, str]]] = []
for _recipe in RECIPES:
    _sets: list[dict[str, str]] = [
        {},
        {"MAX_MODEL_LEN": "8192"},
        {"MAX_MODEL_LEN": "131072", "DCP": "2"},
        {"DCP": "1", "MAX_MODEL_LEN": "65536"},
        {"MAX_FULL_SEQS": "4", "MAX_MODEL_LEN": "262144"},
        {"KV_CACHE_DTYPE": "auto"},
        {"SPEC_METHOD": "off"},
        *({"VLLM_EXTRA_ARGS": sample} for sample in EXTRA_ARGS_SAMPLES),
    ]
    if _recipe == "glm53-exl3-2.75bpw":
        _sets += [{"SPEC_METHOD": "dspark", "DSPARK": "@drafter"}, {"HEAD_Q": "off"},
                  {"SPEC_METHOD": "dspark", "DSPARK": "@drafter", "MAX_MODEL_LEN": "32768", "HEAD_Q": "on"}]
    COMBOS += [(_recipe, s) for s in _sets]

# (b) knob sets for the KV check, on a GPU of the given compute capability.
KV_COMBOS: list[tuple[str, tuple[int, int], dict[str, str]]] = []
for _recipe in RECIPES:
    for _len in ("8192", "65536", "262144", "1000000"):
        for _dcp in ("1", "2", "4"):
            for _dtype in ("fp8", "auto"):
                KV_COMBOS.append((_recipe, GB10, {"MAX_MODEL_LEN": _len, "DCP": _dcp, "KV_CACHE_DTYPE": _dtype}))
    for _seqs in ("2", "3", "4"):
        KV_COMBOS.append((_recipe, GB10, {"MAX_FULL_SEQS": _seqs}))
        KV_COMBOS.append((_recipe, GB10, {"MAX_FULL_SEQS": _seqs, "MAX_MODEL_LEN": "8192", "DCP": "1"}))
    # lengths DCP does not divide: each rank holds ceil(MAX_MODEL_LEN / DCP) tokens of a sequence; 256,001
    # at DCP 4 is 64,001 tokens, one past 1,000 blocks of 64 (rounding down plans one block short)
    for _len, _dcp in (("256001", "4"), ("256001", "2"), ("131073", "4")):
        KV_COMBOS.append((_recipe, GB10, {"MAX_MODEL_LEN": _len, "DCP": _dcp, "KV_CACHE_DTYPE": "fp8"}))
    KV_COMBOS.append((_recipe, GB10, {"MAX_FULL_SEQS": "3", "MAX_MODEL_LEN": "256001", "DCP": "4"}))
    KV_COMBOS.append((_recipe, GB10, {"VLLM_EXTRA_ARGS": EXTRA_ARGS_SAMPLES[0]}))
    KV_COMBOS.append((_recipe, GB10, {"SPEC_METHOD": "off"}))  # no MTP layer: 78 layers
for _len, _dcp in (("8192", "1"), ("1000000", "4")):
    for _dtype in ("fp8", "auto"):
        KV_COMBOS.append(("glm53-exl3-tp4", B200, {"MAX_MODEL_LEN": _len, "DCP": _dcp, "KV_CACHE_DTYPE": _dtype}))


def _id(recipe: str, knobs: dict[str, str], cc: tuple[int, int] | None = None) -> str:
    parts = [recipe.replace("glm53-exl3-", "")] + ([f"sm{cc[0]}{cc[1]}"] if cc else [])
    parts += [f"{k}={v}" for k, v in knobs.items()]
    return ",".join(parts).replace(" ", "_")


@pytest.fixture(scope="session")
def referee() -> Any:
    from tests.fidelity import referee as ref

    return ref


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A GLM-5.3-shaped checkpoint folder per recipe (config.json from sparkctl.lab.ckptgen, sparse shards),
    and a DSpark drafter folder."""
    from sparkctl.lab.ckptgen import config_json
    from tests.conftest import write_model

    root = tmp_path_factory.mktemp("fidelity-models")
    out = {}
    for recipe, (pack, size, shards) in PACK.items():
        out[recipe] = write_model(root / pack, size, shards, config=config_json(pack))
        # The checkpoint ships its quantization_config.json (the 3.00 bpw card, docs/sources.md); vLLM reads it for --quantization.
        (out[recipe] / "quantization_config.json").write_text(json.dumps(
            {"quant_method": "exl3", "bits": 3 if pack == "3.00bpw" else 2.75}))
    drafter = root / "dspark-drafter"
    drafter.mkdir()
    cfg = dict(config_json("3.00bpw"), num_hidden_layers=1, num_nextn_predict_layers=0)
    (drafter / "config.json").write_text(json.dumps(cfg))
    out["@drafter"] = drafter
    return out


@dataclass
class Rendered:
    settings: Any
    plan: Any
    argv: list[list[str]]


def render(recipe: str, knobs: dict[str, str], models: dict[str, Path],
           compute_capability: tuple[int, int] = GB10) -> Rendered:
    """sparkctl's own settings → plan → every rank's `vllm serve` argv, offline."""
    from sparkctl.spec import planner as planmod
    from sparkctl.spec.builders import vllm_serve_argv
    from sparkctl.spec.renderer import resolve_pins
    from sparkctl.spec.settings import load_settings

    env = {"NODES": NODES, "MODEL": str(models[recipe]), "RECIPE": recipe, **PINS}
    env.update({k: str(models[v]) if v in models else v for k, v in knobs.items()})
    settings = load_settings(cli={}, environ=env)
    ckpt = planmod.read_checkpoint(settings.model, planmod.drafter_dir(settings))
    kwargs: dict[str, Any] = {}
    if "compute_capability" in inspect.signature(planmod.make_plan).parameters:
        kwargs["compute_capability"] = f"{compute_capability[0]}.{compute_capability[1]}"
    plan = planmod.make_plan(settings, ckpt, **kwargs)
    pins = resolve_pins(settings)
    return Rendered(settings, plan, [vllm_serve_argv(settings, plan, r, pins) for r in range(len(settings.nodes))])


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ------------------------------------------------------------------------------------------------ (a)

@pytest.mark.parametrize(("recipe", "knobs"), COMBOS, ids=[_id(r, k) for r, k in COMBOS])
def test_every_rank_argv_parses_and_builds_vllms_config(referee, models, recipe, knobs):
    r = render(recipe, knobs, models)
    s = r.settings
    for rank, argv in enumerate(r.argv):
        assert referee.abbreviated_flags(argv) == [], f"rank {rank}: flags that are not vLLM's own option strings (an abbreviation argparse would take as a prefix, or a removed flag)"
        parsed = referee.parse_serve(argv)
        cfg, args = parsed.vllm_config, parsed.args
        par, cache, model = cfg.parallel_config, cfg.cache_config, cfg.model_config
        assert args.model_tag == str(s.model) and model.model == str(s.model)
        assert args.headless is (rank > 0)
        assert args.port == s.getint("PORT") and args.served_model_name == [s.get("SERVED_MODEL_NAME")]
        assert par.tensor_parallel_size == s.getint("TP")
        assert par.decode_context_parallel_size == s.getint("DCP")
        assert par.dcp_comm_backend == s.get("DCP_COMM_BACKEND")
        assert (par.nnodes, par.node_rank) == (4, rank)
        assert par.master_addr == PINS["RANK0_FABRIC_IP"] and par.master_port == s.getint("MASTER_PORT")
        assert model.max_model_len == s.getint("MAX_MODEL_LEN")
        assert cache.cache_dtype == s.get("KV_CACHE_DTYPE")
        assert cache.kv_cache_memory_bytes == r.plan.kv_cache_memory_bytes
        assert cache.gpu_memory_utilization == pytest.approx(float(s.get("GPU_MEMORY_UTILIZATION")))
        spec = cfg.speculative_config
        if s.get("SPEC_METHOD") == "off":
            assert spec is None
        else:
            assert spec is not None and spec.method == s.get("SPEC_METHOD")
            assert spec.num_speculative_tokens == s.getint("SPEC_K")
        if "--max-num-seqs" in argv:
            assert cfg.scheduler_config.max_num_seqs == int(_flag(argv, "--max-num-seqs"))
        if "--enable-prefix-caching" in argv:  # vLLM's CPU platform then turns it off for MLA (cpu.py:543)
            assert parsed.engine_args.enable_prefix_caching is True


def test_referee_catches_an_abbreviated_flag(referee, models):
    """The full-name check itself: vLLM's parser takes the abbreviation silently; the referee does not."""
    argv = render("glm53-exl3-tp4", {}, models).argv[0]
    bad = [("--kv-cache-memory-byte" if w == "--kv-cache-memory-bytes" else w) for w in argv]
    parsed = referee.parse_serve(bad)  # vLLM accepts it ...
    assert parsed.vllm_config.cache_config.kv_cache_memory_bytes == int(_flag(argv, "--kv-cache-memory-bytes"))
    assert referee.abbreviated_flags(bad) == ["--kv-cache-memory-byte"]  # ... the referee does not


def test_vllm_refuses_a_kv_dtype_typo_before_loading(referee, models):
    argv = render("glm53-exl3-tp4", {}, models).argv[0]
    bad = [("fp9" if w == "fp8" else w) for w in argv]
    with pytest.raises(Exception, match="fp9"):
        referee.parse_serve(bad)


# ------------------------------------------------------------------------------------------------ (b)

def _kv_check(referee: Any, rendered: Rendered, cc: tuple[int, int]) -> dict[str, Any]:
    argv = rendered.argv[0]
    planned = int(_flag(argv, "--kv-cache-memory-bytes"))
    cfg = referee.parse_serve(argv).vllm_config
    choice = referee.kv_specs(cfg, cc)
    ok = referee.kv_verdict(cfg, choice, planned)
    less = referee.kv_verdict(cfg, choice, planned - ok.bytes_per_block)
    from vllm.v1.core.kv_cache_planning import max_memory_usage_bytes

    per_request = max_memory_usage_bytes(cfg, choice.specs.values())
    assert per_request % ok.bytes_per_block == 0
    return dict(planned=planned, choice=choice, ok=ok, less=less,
                blocks_per_request=per_request // ok.bytes_per_block)


@pytest.mark.parametrize(("recipe", "cc", "knobs"), KV_COMBOS, ids=[_id(r, k, c) for r, c, k in KV_COMBOS])
def test_planned_kv_bytes_are_the_minimum_vllm_accepts(referee, models, recipe, cc, knobs):
    rendered = render(recipe, knobs, models, compute_capability=cc)
    seqs = rendered.settings.getint("MAX_FULL_SEQS")
    k = _kv_check(referee, rendered, cc)
    ok, less, per_req = k["ok"], k["less"], k["blocks_per_request"]
    where = (f"{recipe} {knobs} on SM{cc[0]}{cc[1]} ({k['choice'].backend}, {k['choice'].cache_dtype}): "
             f"sparkctl plans {k['planned']:,} B")
    assert ok.accepted, f"{where}; vLLM refuses it: {ok.error}"
    # vLLM keeps one null block; MAX_FULL_SEQS full-length requests must fit in the rest, and one block
    # less must not hold them: the plan is the minimum, rounded up to whole blocks.
    assert ok.num_blocks - 1 >= seqs * per_req, f"{where}: holds {ok.num_blocks - 1} blocks, {seqs} × {per_req} needed"
    if seqs == 1:
        assert not less.accepted, f"{where}: vLLM would also accept one block ({ok.bytes_per_block:,} B) less"
        assert "To serve at least one request" in less.error
    else:
        assert less.num_blocks - 1 < seqs * per_req, f"{where}: one block less still holds {seqs} requests"


def test_default_recipe_on_gb10_needs_exactly_the_known_minimum(referee, models):
    """Known answer for the referee itself: 1,000,000 tokens, DCP 4, fp8, GB10 (docs/sources.md)."""
    rendered = render("glm53-exl3-tp4", {}, models)
    k = _kv_check(referee, rendered, GB10)
    choice, ok = k["choice"], k["ok"]
    assert (choice.backend, choice.cache_dtype, choice.block_size) == ("FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla", 64)
    assert len(choice.specs) == 2 * 79
    assert ok.bytes_per_block == 79 * 64 * (656 + 132) == 3_984_128
    minimum = (k["blocks_per_request"] + 1) * ok.bytes_per_block
    assert minimum == GB10_1M_DCP4_MIN
    assert k["planned"] == GB10_1M_DCP4_MIN, f"sparkctl plans {k['planned']:,} B, vLLM needs {minimum:,} B"


@pytest.mark.parametrize(("dtype", "stored"), [("fp8", "fp8"), ("auto", "fp8_e4m3")])
def test_sm10x_keeps_plain_fp8(referee, models, dtype, stored):
    """SM10x: FLASHINFER_MLA_SPARSE stores plain fp8 (576 B), in blocks of 32; `auto` becomes fp8 there."""
    rendered = render("glm53-exl3-tp4", {"KV_CACHE_DTYPE": dtype}, models, compute_capability=B200)
    cfg = referee.parse_serve(rendered.argv[0]).vllm_config
    choice = referee.kv_specs(cfg, B200)
    assert (choice.backend, choice.cache_dtype, choice.block_size) == ("FLASHINFER_MLA_SPARSE", stored, 32)
    mla = choice.specs["model.layers.0.self_attn.attn"]
    assert mla.page_size_bytes == 576 * choice.block_size


def test_stock_vllm_033_has_no_sparse_mla_backend_with_dcp_on_gb10(referee, models):
    """A fact of stock vLLM 0.33.0 the recipes rely on their `dcp` image layer to change (see
    referee.select_mla_backend). If a vLLM release lifts it, this test says so."""
    cfg = referee.parse_serve(render("glm53-exl3-tp4", {}, models).argv[0]).vllm_config
    with pytest.raises(AssertionError, match="DCP not supported"):
        referee.select_mla_backend(cfg, GB10, stock_dcp=True)
    cfg1 = referee.parse_serve(render("glm53-exl3-tp4", {"DCP": "1"}, models).argv[0]).vllm_config
    assert referee.select_mla_backend(cfg1, GB10, stock_dcp=True).get_name() == "FLASHINFER_MLA_SPARSE_SM120"


def test_bfloat16_kv_has_no_backend_on_gb10(referee, models):
    """Why sparkctl must refuse KV_CACHE_DTYPE=bfloat16 on GB10: vLLM finds no backend for it (the
    argv is edited here, since sparkctl's planner refuses to render it)."""
    argv = render("glm53-exl3-tp4", {"DCP": "1"}, models).argv[0]
    cfg = referee.parse_serve([("bfloat16" if w == "fp8" else w) for w in argv]).vllm_config
    with pytest.raises(AssertionError, match="no MLA backend"):
        referee.select_mla_backend(cfg, GB10, stock_dcp=True)


@pytest.mark.parametrize("knobs", [{}, {"MAX_MODEL_LEN": "32768", "DCP": "2"}], ids=["1M-dcp4", "32k-dcp2"])
def test_dspark_target_caches_fit(referee, models, knobs):
    """DSpark: the MTP layer is not loaded. vLLM 0.33 has no GLM DSpark drafter (the image supplies it),
    so only the 78 target layers are judged here; the drafter's own cache is sparkctl's to add on top."""
    rendered = render("glm53-exl3-2.75bpw", {"SPEC_METHOD": "dspark", "DSPARK": "@drafter", **knobs}, models)
    k = _kv_check(referee, rendered, GB10)
    assert len(k["choice"].specs) == 2 * 78
    assert k["ok"].accepted, k["ok"].error
    assert k["ok"].num_blocks - 1 >= k["blocks_per_request"]


PLAN_CONTRACT = ("kv_cache_dtype_effective", "kv_backend", "compute_capability", "kv_block_tokens",
                 "kv_block_bytes", "kv_blocks_per_rank")


@pytest.mark.parametrize("cc", [GB10, B200], ids=["gb10", "sm100"])
def test_plan_states_what_vllm_will_use(referee, models, cc):
    rendered = render("glm53-exl3-tp4", {}, models, compute_capability=cc)
    missing = [a for a in PLAN_CONTRACT if not hasattr(rendered.plan, a)]
    if missing:
        pytest.skip(f"the planner does not report {', '.join(missing)} yet")
    k = _kv_check(referee, rendered, cc)
    p, choice, ok = rendered.plan, k["choice"], k["ok"]
    assert p.compute_capability == f"{cc[0]}.{cc[1]}"
    assert (p.kv_backend, p.kv_cache_dtype_effective, p.kv_block_tokens) == (
        choice.backend, choice.cache_dtype, choice.block_size)
    assert p.kv_block_bytes == ok.bytes_per_block
    assert p.kv_blocks_per_rank == ok.num_blocks
