"""`recipe new`: a recipe for a checkpoint sparkctl has never seen, from its config.json alone, every choice
explained in a comment of the TOML it writes.

    TP           = the nodes (one GB10 GPU each); attention heads, KV heads (and linear-attention heads)
                   must split evenly: KV heads divisible by TP, or TP divisible by them (vLLM replicates
                   each KV head over TP ÷ KV heads ranks)
    weights/rank = the shards' bytes (on disk: whatever the quantization) ÷ TP
    KV budget    = node memory − OS reserve − overhead − weights/rank (the planner's GB10 figures)
    max_model_len= the largest length whose KV cache (planned as `sparkctl plan` plans it) fits the budget,
                   capped at max_position_embeddings, rounded down to a multiple of 1024
A model that cannot split over the nodes, or whose weights alone do not fit, is refused with the numbers.
Pure: the caller reads config.json and the shard sizes (orchestrate/recipe.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .planner import (
    GIB,
    IN_FLIGHT_BATCHES,
    STATE_BLOCKS_PER_SEQUENCE,
    KvTerm,
    aligns_to_state,
    attention_head_dim,
    gb,
    hybrid_block_tokens,
    hybrid_kv_bytes,
    hybrid_paging,
    kv_heads,
    kv_terms,
    layer_kinds,
)
from .recipes import MemoryProfile

GB10_NODE_MEMORY_BYTES = 128_000_000_000  # the shipped recipes' NODE_MEMORY_BYTES: 128 GB unified
GB10 = MemoryProfile()  # overhead 14 GiB, OS reserve 4 GiB, cap 0.82: the planner's GB10 profile
DENSE_BLOCK_TOKENS = 16  # vLLM's KV page for the dense attention backends on CUDA
MLA_BLOCK_TOKENS = 64
#: The quantization methods vLLM reads from quantization_config (no flag needed), in the words of a comment.
QUANT_METHODS = {
    "fp8": "FP8 weights (block or per-tensor scales)",
    "mxfp4": "MXFP4 (4-bit, shared 8-bit exponent per 32 values)",
    "nvfp4": "NVFP4 (4-bit, FP8 scale per 16 values)",
    "modelopt": "NVIDIA ModelOpt (FP8 or NVFP4)",
    "modelopt_fp4": "NVIDIA ModelOpt NVFP4",
    "compressed-tensors": "compressed-tensors (FP8, NVFP4 or INT4/INT8 as its config_groups say)",
    "awq": "AWQ (4-bit integer, group scales)",
    "gptq": "GPTQ (integer, group scales)",
    "exl3": "EXL3 (needs the EXL3 overlay image: --quantization exl3)",
}
#: Family flags: model_type -> (extra vLLM args, why).
FAMILY_FLAGS: dict[str, tuple[list[str], str]] = {
    "glm_moe_dsa": (["--trust-remote-code"], "GLM-5's remote code (as the flagship recipes pass it)"),
}
#: Every sparkctl recipe's executor (one process per rank); a draft's extra_args start with it.
EXECUTOR_ARGS = ("--distributed-executor-backend", "mp")
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ModelSource:
    """What `recipe new` read: config.json (with its quantization_config), the shard bytes, where from."""

    config: dict[str, Any]
    weight_bytes: int
    where: str  # a folder, or hf://REPO
    repo: str | None = None  # the Hub repo id (MODEL_REPO), when known
    quant_file: dict[str, Any] | None = None  # quantization_config.json (EXL3 packs), when present


@dataclass
class Draft:
    name: str
    tp: int
    max_model_len: int
    kv_cache_dtype: str
    kv_block_tokens: int
    weights_per_rank: int
    kv_bytes: int
    quant: str
    weights_kind: str  # what the description names: the quantization, else the stored dtype (bf16)
    extra_args: list[str]
    served_name: str
    why: dict[str, str] = field(default_factory=dict)


def quant_method(src: ModelSource) -> str:
    """The checkpoint's quantization method: config.json's quantization_config, else quantization_config.json."""
    for q in (src.config.get("quantization_config"), src.quant_file):
        if isinstance(q, dict) and isinstance(q.get("quant_method"), str):
            return q["quant_method"].lower()
    return "none"


DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def weights_kind(config: dict[str, Any], method: str) -> str:
    """How the recipe's description names the weights: the quantization method, or for an unquantized checkpoint
    its stored dtype (config.json's torch_dtype, or dtype in newer transformers), never "none"."""
    if method != "none":
        return method
    dtype = _text_config(config).get("torch_dtype") or _text_config(config).get("dtype")
    return DTYPE_NAMES.get(str(dtype), str(dtype)) if dtype else "unquantized"


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return {**config, **inner} if isinstance(inner, dict) else config


def split_problem(config: dict[str, Any], tp: int, where: Path) -> str | None:
    """Why the model cannot be split over `tp` ranks, in numbers; None when it can."""
    heads = int(config.get("num_attention_heads") or 0)
    if heads % tp:
        return f"num_attention_heads={heads} is not divisible by TP={tp}"
    if "kv_lora_rank" not in config:
        kv = kv_heads(config, where)
        if kv % tp and tp % kv:
            return (f"num_key_value_heads={kv} and TP={tp}: neither divides the other (each rank holds KV heads ÷ TP, "
                    f"or one KV head replicated over TP ÷ KV heads ranks)")
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        if key in config and int(config[key]) % tp:
            return f"{key}={config[key]} is not divisible by TP={tp}"
    return None


def _kv_bytes(terms: list[KvTerm], max_len: int, block: int, seqs: int, batched: int) -> int:
    """The planner's KV bytes per rank (make_plan's arithmetic, DCP 1)."""
    per_token = sum(t.bytes_per_token for t in terms)
    if not any(t.window is not None or t.state_bytes for t in terms):
        return (math.ceil(max_len / block) * seqs + 1) * block * per_token
    return hybrid_kv_bytes(terms, max_len, IN_FLIGHT_BATCHES * batched, block, seqs)


def draft(src: ModelSource, nodes: int, *, node_memory: int = GB10_NODE_MEMORY_BYTES, name: str | None = None,
          max_full_seqs: int = 1, batched_tokens: int = 8192, profile: MemoryProfile = GB10,
          dense_block: int = DENSE_BLOCK_TOKENS) -> Draft:
    """Every choice of the recipe for `nodes` nodes (GB10's memory model unless `profile` and `dense_block`, the
    KV page of plain attention, say another platform's: `--like`), or a UsageError with the numbers."""
    config = _text_config(src.config)
    where = Path(src.where)
    tp = nodes
    if tp < 1:
        raise UsageError(f"--nodes {nodes}: at least 1")
    for key in ("num_hidden_layers", "num_attention_heads"):
        if not isinstance(config.get(key), int):
            raise UsageError(f"{src.where}: config.json has no {key}: not a decoder model sparkctl can plan")
    problem = split_problem(config, tp, where)
    if problem:
        raise UsageError(f"{src.where} cannot be split over {nodes} node(s): {problem}",
                         fix="choose --nodes so that the heads divide evenly (e.g. 1, 2 or 4)")
    mla = "kv_lora_rank" in config
    sparse_mla = mla and ("index_topk" in config or "index_head_dim" in config)
    kv_dtype = "fp8" if sparse_mla else "auto"
    block = MLA_BLOCK_TOKENS if mla else dense_block
    stored = "fp8_ds_mla" if sparse_mla else kv_dtype
    terms = kv_terms(config, stored, tp, where, mtp_layers=False)
    if aligns_to_state(terms):  # vLLM pages a hybrid's attention to hold a state page (planner.py)
        block = hybrid_block_tokens(terms)
    weights = math.ceil(src.weight_bytes / tp)
    overhead = int(profile.overhead_gib * GIB)
    reserve = int(profile.os_reserve_gib * GIB)
    budget = node_memory - reserve - overhead - weights
    numbers = (f"per rank {gb(weights)} weights ({gb(src.weight_bytes)} ÷ TP={tp}) + {gb(overhead)} overhead, "
               f"a node has {gb(node_memory)} − {gb(reserve)} OS reserve")
    cap = int(config.get("max_position_embeddings") or 0) or 131072
    if _kv_bytes(terms, min(1024, cap), block, max_full_seqs, batched_tokens) > budget:
        raise UsageError(f"{src.where} does not fit on {nodes} node(s): {numbers}, leaving {gb(max(budget, 0))} "
                         f"for the KV cache, less than 1,024 tokens need",
                         fix=f"use more nodes (--nodes {nodes * 2}) or a smaller quantization of the model")
    lo, hi = min(1024, cap), cap
    while lo < hi:  # the largest length whose KV fits
        mid = (lo + hi + 1) // 2
        if _kv_bytes(terms, mid, block, max_full_seqs, batched_tokens) <= budget:
            lo = mid
        else:
            hi = mid - 1
    max_len = lo if lo == cap or lo < 1024 else lo // 1024 * 1024
    kv = _kv_bytes(terms, max_len, block, max_full_seqs, batched_tokens)
    method = quant_method(src)
    model_type = str(config.get("model_type", "?"))
    flags, flags_why = FAMILY_FLAGS.get(model_type, ([], f"none for model_type {model_type}"))
    extra = list(EXECUTOR_ARGS)
    if method == "exl3":
        extra += ["--quantization", "exl3"]
    extra += flags
    if any(t.window is not None for t in terms):
        extra += ["--max-num-batched-tokens", str(batched_tokens)]
    base = name or _NAME_RE.sub("-", (src.repo or Path(src.where).name).split("/")[-1]).strip("-").lower()
    d = Draft(name=f"{base}-tp{tp}", tp=tp, max_model_len=max_len, kv_cache_dtype=kv_dtype, kv_block_tokens=block,
              weights_per_rank=weights, kv_bytes=kv, quant=method, weights_kind=weights_kind(config, method),
              extra_args=extra,
              served_name=(src.repo or base).split("/")[-1], why={})
    heads, kvh = int(config["num_attention_heads"]), (None if mla else kv_heads(config, where))
    if mla:
        d.why["TP"] = f"{heads} attention heads ÷ {tp} = {heads // tp} per rank; MLA: one latent KV per token, no KV heads to split"
    elif kvh is not None and kvh >= tp:
        d.why["TP"] = f"{heads} attention heads ÷ {tp} = {heads // tp} per rank; {kvh} KV heads ÷ {tp} = {kvh // tp} per rank"
    else:
        d.why["TP"] = (f"{heads} attention heads ÷ {tp} = {heads // tp} per rank; {kvh} KV heads < TP: each KV head is "
                       f"replicated on {tp // max(kvh or 1, 1)} ranks (1 per rank)")
    kinds = layer_kinds(config, where)
    mix = ", ".join(f"{kinds.count(k)} {k}" for k in ("full", "sliding", "state") if kinds.count(k))
    d.why["KV"] = (f"{' + '.join(f'{t.name} × {t.layers}' for t in terms)}; layers: {mix}; head_dim "
                   f"{'-' if mla else attention_head_dim(config, where)}")
    d.why["fit"] = (f"{numbers}: {gb(budget)} left for the KV cache; {max_len:,} tokens need {gb(kv)} "
                    f"(blocks of {block} tokens, {max_full_seqs} full sequence(s) + vLLM's null block)")
    if aligns_to_state(terms):
        paging = hybrid_paging(terms, max_len, IN_FLIGHT_BATCHES * batched_tokens, block)
        state = max(t.state_bytes_per_layer for t in terms)
        d.why["block"] = (f"vLLM 0.33 pages a hybrid's attention in blocks of a multiple of 64 tokens whose page of "
                          f"one attention layer ({block} × {paging.page_bytes // block:,} B = {paging.page_bytes:,} B) "
                          f"holds one linear-attention layer's state ({state:,} B, padded to the page); "
                          f"{paging.group_layers} layers per KV cache group, {STATE_BLOCKS_PER_SEQUENCE} state blocks "
                          f"per sequence per state group (prefix caching's align mode: the running state, the last "
                          f"block-aligned one and a prefill checkpoint)")
    d.why["max_model_len"] = (f"the largest length whose KV fits, capped at max_position_embeddings={cap:,}"
                              + (", rounded down to a multiple of 1024" if max_len != lo else ""))
    d.why["kv_dtype"] = ("fp8: GB10's only sparse-MLA backend stores fp8_ds_mla (656 B per token per layer)" if sparse_mla
                         else "auto: the model's dtype (KV_CACHE_DTYPE=fp8 halves the KV bytes, about doubling the context)")
    d.why["quant"] = (f"{method}: {QUANT_METHODS.get(method, 'read by vLLM from quantization_config')}; weights per rank "
                      "are the shards' bytes on disk ÷ TP" if method != "none" else
                      "none: the weights in their dtype; weights per rank are the shards' bytes ÷ TP")
    d.why["flags"] = (f"--distributed-executor-backend mp (one process per rank, as every sparkctl recipe); family: "
                      f"{flags_why}" + ("; --max-num-batched-tokens pinned: a sliding window holds the window plus the "
                                        "tokens of two scheduled batches (async scheduling)" if "--max-num-batched-tokens" in extra else ""))
    return d


def _q(value: Any) -> str:
    return json.dumps(value)


def recipe_text(d: Draft, src: ModelSource, nodes: int, image: str | None = None,
                node_memory: int = GB10_NODE_MEMORY_BYTES) -> str:
    """The recipe file (TOML), each choice explained in a comment."""
    model_repo = f"MODEL_REPO = {_q(src.repo)}  # `model pull`; pin MODEL_REVISION to a commit id in your env file\n" \
        if src.repo and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}", src.repo) else ""
    image_line = (f"IMAGE = {_q(image)}  # the stock vLLM image, pinned by digest\n" if image else
                  "# IMAGE: set IMAGE=vllm/vllm-openai@sha256:<digest> (a stock vLLM >= 0.33 arm64 image for GB10, pinned\n"
                  "# by its digest) in your env file: prebuilt mode, `build` gives every rank the head's copy\n")
    lines = [
        f"# {d.name} — written by `sparkctl recipe new` for {nodes} DGX Spark (GB10) node(s) from {src.where}.",
        f"# TP={d.tp}: {d.why['TP']}.",
        f"# KV per token per layer: {d.why['KV']}.",
        f"# Memory per rank: {d.why['fit']}.",
        f"# MAX_MODEL_LEN: {d.why['max_model_len']}.",
        f"# KV_CACHE_DTYPE: {d.why['kv_dtype']}.",
        f"# Quantization: {d.why['quant']}.",
        f"# Flags: {d.why['flags']}.",
        *([f"# KV block: {d.why['block']}."] if "block" in d.why else []),
        "# Check it: `sparkctl recipe validate FILE`, then `sparkctl --recipe FILE plan` against the real checkpoint.",
        f"name = {_q(d.name)}",
        f"description = {_q(f'{d.served_name} ({d.weights_kind}), {nodes}x DGX Spark, TP{d.tp}, {d.max_model_len:,} tokens')}",
        "",
        "[defaults]",
        *([model_repo.rstrip("\n")] if model_repo else []),
        f"TP = {d.tp}",
        "DCP = 1",
        "GPUS_PER_NODE = 1",
        'DCP_COMM_BACKEND = "ag_rs"',
        f"MAX_MODEL_LEN = {d.max_model_len}",
        f"KV_CACHE_DTYPE = {_q(d.kv_cache_dtype)}",
        'GPU_COMPUTE_CAPABILITY = "12.1"      # GB10; `check` and `up` use what the nodes\' nvidia-smi reports',
        "MAX_FULL_SEQS = 1",
        "GPU_MEMORY_UTILIZATION = 0.80        # vLLM's startup guard refuses above ~0.82 on GB10",
        f"NODE_MEMORY_BYTES = {node_memory}     # GB10: 128 GB unified; `check` uses each node's real MemTotal",
        "PORT = 8888",
        "MASTER_PORT = 29501",
        f"SERVED_MODEL_NAME = {_q(d.served_name)}",
        'SPEC_METHOD = "off"',
        image_line.rstrip("\n"),
        "ULIMIT_NOFILE = 1048576",
        "ULIMIT_MEMLOCK = -1",
        'SHM_SIZE = "64g"',
        "",
        "[memory]",
        f"overhead_gib = {GB10.overhead_gib:g}                    # CUDA/NCCL state a worker holds before vLLM measures memory",
        f"os_reserve_gib = {GB10.os_reserve_gib:g}",
        f"gpu_memory_utilization_cap = {GB10.gpu_memory_utilization_cap:g}",
        f"kv_block_tokens = {d.kv_block_tokens}",
        "",
        "[vllm]",
        f"extra_args = {_q(d.extra_args)}",
        "",
        "[container]",
        'network = "host"',
        'ipc = "host"',
        'gpus = "all"',
        'devices = ["/dev/infiniband"]',
        'cap_add = ["IPC_LOCK"]',
        "",
        "[container.env]",
        'NCCL_IB_DISABLE = "0"',
        'NCCL_NET = "IB"                      # RDMA or fail: never a silent fall-back to TCP sockets',
        'NCCL_IGNORE_CPU_AFFINITY = "1"',
        'VLLM_NO_USAGE_STATS = "1"',
        'HF_HUB_OFFLINE = "1"',
        'TRANSFORMERS_OFFLINE = "1"',
        'PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True"',
        "",
        "[images.prebuilt]",
        'source = "a stock vLLM image (vllm/vllm-openai), pinned by digest in IMAGE"',
        "",
        "[checkpoint]",
        'layout = "hf-safetensors"           # recipes/layouts/hf-safetensors.json: shards and headers, no model-specific rules',
    ]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ --like
#: The model's own keys of [defaults]: `--like` plans them; every other key is the base recipe's platform.
MODEL_KEYS = ("MODEL_REPO", "TP", "DCP", "MAX_MODEL_LEN", "KV_CACHE_DTYPE", "SERVED_MODEL_NAME", "SPEC_METHOD",
              "MAX_FULL_SEQS")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {type(value).__name__}")


def _toml_table(name: str, table: dict[str, Any], comments: dict[str, str] | None = None) -> list[str]:
    """`[name]` with its scalars and arrays, then its sub-tables (arrays of tables as `[[name.key]]`)."""
    comments = comments or {}
    lines = [f"[{name}]"]
    subs: list[tuple[str, Any]] = []
    for key, value in table.items():
        if isinstance(value, dict):
            subs.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            subs.append((key, value))
        else:
            note = f"  # {comments[key]}" if key in comments else ""
            lines.append(f"{key} = {_toml_value(value)}{note}")
    for key, value in subs:
        if isinstance(value, dict):
            lines += ["", *_toml_table(f"{name}.{key}", value)]
        else:
            for item in value:
                lines += ["", f"[[{name}.{key}]]", *(f"{k} = {_toml_value(v)}" for k, v in item.items())]
    return lines


def base_plan_inputs(base: dict[str, Any]) -> tuple[int, MemoryProfile, int]:
    """What `--like` takes from the base recipe to plan the model: node memory, memory profile (its
    kv_block_tokens the KV page of plain attention), the full-length sequences."""
    defaults, mem = base.get("defaults") or {}, base.get("memory") or {}
    profile = MemoryProfile(overhead_gib=float(mem.get("overhead_gib", GB10.overhead_gib)),
                            os_reserve_gib=float(mem.get("os_reserve_gib", GB10.os_reserve_gib)),
                            gpu_memory_utilization_cap=float(mem.get("gpu_memory_utilization_cap",
                                                                     GB10.gpu_memory_utilization_cap)),
                            kv_block_tokens=int(mem.get("kv_block_tokens", DENSE_BLOCK_TOKENS)))
    return int(defaults.get("NODE_MEMORY_BYTES", GB10_NODE_MEMORY_BYTES)), profile, int(defaults.get("MAX_FULL_SEQS", 1))


def recipe_like_text(d: Draft, src: ModelSource, nodes: int, base: dict[str, Any], base_name: str) -> str:
    """The recipe on another recipe's platform (`--like BASE`): BASE's image, memory model, container, env,
    ports and fabric test; the model's own keys planned here. A base that builds a chain (its layers belong to
    its own checkpoint's serving/ folder) gives its BASE_IMAGE, run prebuilt."""
    defaults = {k: v for k, v in (base.get("defaults") or {}).items() if k not in MODEL_KEYS}
    images = dict(base.get("images") or {})
    image_note = f"{base_name}'s image"
    if images.get("layers"):
        if not defaults.get("BASE_IMAGE"):
            raise UsageError(f"--like {base_name}: it builds a chain on no BASE_IMAGE; nothing to run prebuilt",
                             fix="--like a recipe with a prebuilt IMAGE or a BASE_IMAGE")
        defaults["IMAGE"] = defaults.pop("BASE_IMAGE")
        image_note = (f"{base_name}'s BASE_IMAGE, run prebuilt: its chain's layers belong to its own checkpoint's "
                      "serving/ folder")
        images = {k: v for k, v in images.items() if k not in ("layers", "tag_prefix")}  # its tags: the chain's
        images["prebuilt"] = {"source": f"the base image of recipe {base_name} (`recipe new --like {base_name}`)"}
    planned: dict[str, Any] = {}
    if src.repo:
        planned["MODEL_REPO"] = src.repo
    planned.update(TP=d.tp, DCP=1, MAX_MODEL_LEN=d.max_model_len, KV_CACHE_DTYPE=d.kv_cache_dtype,
                   MAX_FULL_SEQS=int((base.get("defaults") or {}).get("MAX_FULL_SEQS", 1)),
                   SERVED_MODEL_NAME=d.served_name, SPEC_METHOD="off")
    base_args = list((base.get("vllm") or {}).get("extra_args") or [])
    family = [a for a in d.extra_args[len(EXECUTOR_ARGS):] if a not in base_args]  # the base has its executor
    vllm = {**(base.get("vllm") or {}), "extra_args": base_args + family}
    vllm.pop("dspark_speculative_config", None)  # the base model's draft model, not this one's
    memory = {**(base.get("memory") or {}), "kv_block_tokens": d.kv_block_tokens}
    comments = {"TP": d.why["TP"], "MAX_MODEL_LEN": d.why["max_model_len"], "KV_CACHE_DTYPE": d.why["kv_dtype"],
                "IMAGE": image_note}
    lines = [
        f"# {d.name} — written by `sparkctl recipe new --like {base_name}` for {nodes} node(s) from {src.where}:",
        f"# the platform (image, memory model, container, env, ports, fabric test) is {base_name}'s; the model's own",
        "# values are planned from its config.json.",
        f"# KV per token per layer: {d.why['KV']}.",
        f"# Memory per rank: {d.why['fit']}.",
        f"# Quantization: {d.why['quant']}.",
        f"# Flags: {base_name}'s [vllm] extra_args" + (f", and {' '.join(family)}" if family else "") + ".",
        *([f"# KV block: {d.why['block']}."] if "block" in d.why else []),
        f"name = {_q(d.name)}",
        f"description = {_q(f'{d.served_name} ({d.weights_kind}) on the {base_name} platform, TP{d.tp}, {d.max_model_len:,} tokens')}",
        "",
        *_toml_table("defaults", {**planned, **defaults}, comments),
        "",
        *_toml_table("memory", memory),
        "",
        *_toml_table("vllm", vllm),
    ]
    for section in ("container", "fabric"):
        if base.get(section):
            lines += ["", *_toml_table(section, base[section])]
    if images:
        lines += ["", *_toml_table("images", images)]
    lines += ["", *_toml_table("checkpoint", {"layout": "hf-safetensors"})]
    return "\n".join(lines) + "\n"
