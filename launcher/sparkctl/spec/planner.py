"""The memory planner: will the model, its KV cache and the runtime's overhead fit on every rank?

    per rank = weights (shards ÷ TP) + KV cache + overhead (~14 GiB of CUDA/NCCL state)
    must fit in node memory − OS reserve (unified memory on GB10: GPU and CPU share it)

The KV cache is planned as vLLM 0.33 will allocate and check it (docs/sources.md, "Memory and the KV cache"; the fidelity
suite in tests/fidelity/ runs vLLM's own planner against these figures):
  - the backend follows the GPU: on GB10 (SM12x) the only sparse-MLA backend stores `fp8`/`auto` as
    `fp8_ds_mla`, 656 B per token per layer; on SM10x plain fp8 is 576 B (kv_lora_rank + rope);
  - the sparse-attention indexer adds index_head_dim + index_head_dim // 128 × 4 B (132 B);
  - every attention layer counts, the MTP layer too when it speculates (78 + 1 = 79 for GLM-5);
  - pages are blocks of 64 tokens; DCP=d gives each rank ceil(max_model_len / d) tokens of a sequence;
  - vLLM reserves one null block, then refuses to start unless the longest request fits.
So bytes = (MAX_FULL_SEQS × ceil(ceil(len / DCP) / 64) + 1) × 64 × bytes per token: the minimum vLLM
accepts, in whole blocks. 1,000,000 tokens at DCP 4 on GB10: 3,908 × 3,984,128 = 15,569,972,224 B.
A model mixing kinds of cache (sliding windows, linear-attention state) is paged in KV cache groups of one page
size, a hybrid's attention block raised to hold a state page (the comment above `hybrid_block_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import CheckFailed, UsageError
from ..facts.parsing import parse_json
from .settings import Settings

GIB = 1 << 30
GB = 1000**3
MAX_CONFIG_INT = 1 << 24  # layers, heads, widths: far above any real model, far below float overflow
MAX_SHARD_BYTES = 1 << 50  # 1 PiB: a size above it in a node's listing is not a file size
MAX_CHECKPOINT_BYTES = 1 << 56
INDEX_NAME = "model.safetensors.index.json"

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1}
_MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FP8_DS_MLA_BYTES = 656


@dataclass(frozen=True)
class Shard:
    name: str
    size: int | None  # None: named by the index but missing from the folder


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    config: dict[str, Any]
    shards: tuple[Shard, ...]
    index_total_size: int | None
    drafter_config: dict[str, Any] | None = None  # DSPARK/config.json, read with the checkpoint (dspark)

    @property
    def missing(self) -> list[str]:
        return [s.name for s in self.shards if s.size is None]

    @property
    def shard_bytes(self) -> int:
        return sum(s.size or 0 for s in self.shards)


def read_checkpoint(model: Path, drafter: Path | None = None) -> CheckpointInfo:
    """config.json + the shard list (from the index, else *.safetensors) with their sizes on disk; with
    `drafter`, the DSpark drafter's config.json too (None when it cannot be read: make_plan says so)."""
    from ..probes.ckpt_scan import scan

    info = checkpoint_from_scan(scan(str(model), headers="summary", shards=False), model, "this machine")
    if drafter is None:
        return info
    return replace(info, drafter_config=config_or_none(scan(str(drafter), headers="summary", shards=False)))


def config_or_none(scan: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return checkpoint_from_scan(scan, Path(str(scan.get("dir", "?"))), "", config_only=True).config or None
    except (UsageError, CheckFailed):
        return None


def checkpoint_from_scan(scan: Any, model: Path, where: str, *, config_only: bool = False) -> CheckpointInfo:
    """What the planner needs (config.json, the shard names and their sizes, the index's total size)
    from a checkpoint scan (probes/ckpt_scan.py: this machine's, or what a node printed). Anything
    malformed is a UsageError or CheckFailed naming `where`, never another exception."""
    from ..probes.ckpt_scan import decode_blob

    at = f" on {where}" if where else ""
    if not isinstance(scan, dict):
        raise CheckFailed(f"unexpected answer reading the checkpoint{at}")
    err = scan.get("error")
    if err:
        if isinstance(err, dict) and err.get("code") == "dir-missing":
            raise UsageError(f"MODEL={model} is not a folder{at}",
                             fix="point MODEL at the checkpoint folder, at the same path on every node")
        raise CheckFailed(f"cannot read the checkpoint{at}: {str(err.get('message') if isinstance(err, dict) else err)[:300]}")
    blobs, files = scan.get("json"), scan.get("files")
    if not isinstance(blobs, dict) or not isinstance(files, dict):
        raise CheckFailed(f"unexpected answer reading the checkpoint{at}: json/files are not objects")

    def load(name: str) -> Any:
        entry = blobs.get(name)
        if entry is None or (isinstance(entry, dict) and entry.get("missing")):
            return None
        if not isinstance(entry, dict):
            raise CheckFailed(f"unexpected answer reading the checkpoint{at}: its {name} entry is malformed")
        if entry.get("error"):
            raise UsageError(f"{model / name}{at}: {str(entry['error'])[:200]}")
        try:
            raw = decode_blob(entry.get("data"))
            return parse_json(raw) if raw else None
        except (ValueError, TypeError) as exc:  # a blob that does not decode; ParseError: not JSON, too deep
            raise UsageError(f"{model / name}{at}: not valid JSON ({str(exc)[:200]})") from None

    def size_of(name: str) -> int | None:
        entry = files.get(name)
        size = entry.get("size") if isinstance(entry, dict) else None
        if size is None:
            return None
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SHARD_BYTES:
            raise CheckFailed(f"unexpected answer reading the checkpoint{at}: size of {name[:80]!r} is "
                              f"{str(size)[:40]!r}, not a byte count")
        return size

    config = load("config.json")
    if config is None:
        raise UsageError(f"config.json not found in {model}{at}", fix="MODEL must be the checkpoint folder itself")
    if not isinstance(config, dict):
        raise UsageError(f"{model / 'config.json'}{at}: expected a JSON object")
    if config_only:
        return CheckpointInfo(model, config, (), None)
    index_entry = blobs.get(INDEX_NAME)
    total: int | None = None
    if isinstance(index_entry, dict) and isinstance(index_entry.get("summary"), dict):
        summ = index_entry["summary"]
        shards = summ.get("shards")
        if summ.get("error") or not summ.get("weight_map") or not isinstance(shards, dict):
            raise UsageError(f"{model / INDEX_NAME}{at}: has no weight_map object of tensor → shard names")
        names = sorted(map(str, shards))
        total = _byte_count(summ.get("total_size"))
    elif (index := load(INDEX_NAME)) is not None:
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise UsageError(f"{model / INDEX_NAME}{at}: has no weight_map object")
        names = sorted({str(v) for v in weight_map.values()})
        meta = index.get("metadata") if isinstance(index, dict) else None
        total = _byte_count(meta.get("total_size") if isinstance(meta, dict) else None)
    else:
        names = sorted(n for n in files if isinstance(n, str) and "/" not in n and n.endswith(".safetensors"))
        if not names:
            raise UsageError(f"{model}{at}: no {INDEX_NAME} and no *.safetensors files")
    for name in names:
        if "/" in name or name.startswith("."):
            raise UsageError(f"{model / INDEX_NAME}{at}: shard name {name[:80]!r} must be a plain file name")
    return CheckpointInfo(model, config, tuple(Shard(n, size_of(n)) for n in names), total)


def _byte_count(total: Any) -> int | None:
    """The index's metadata.total_size when it is a plausible byte count, else None."""
    if isinstance(total, bool) or not isinstance(total, int) or not 0 <= total <= MAX_CHECKPOINT_BYTES:
        return None
    return total


@dataclass(frozen=True)
class KvTerm:
    """One kind of cache on one rank. A token term (the default) holds bytes_per_token_per_layer for every
    token of a sequence; a sliding-window term (`window`) only the last `window` tokens plus the tokens
    of one scheduled batch; a state term (`state_bytes_per_layer`: linear attention, Mamba) a fixed state
    per sequence, whatever its length."""

    name: str
    bytes_per_token_per_layer: int
    layers: int
    window: int | None = None  # sliding-window attention: tokens it looks back
    state_bytes_per_layer: int = 0  # recurrent state per sequence (then bytes_per_token_per_layer is 0)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_per_layer * self.layers

    @property
    def state_bytes(self) -> int:
        return self.state_bytes_per_layer * self.layers

    def blocks_held(self, seq_tokens: int, in_flight_tokens: int, block: int) -> int:
        """Blocks of one sequence of `seq_tokens` this term keeps in each of its KV cache groups: all its tokens'
        blocks; for a window, the last window − 1 tokens plus every token scheduled but not yet settled, and one
        more block because the window need not start at a block's edge (vLLM's
        SlidingWindowSpec.max_admission_blocks_per_request); for a state, STATE_BLOCKS_PER_SEQUENCE."""
        if self.state_bytes_per_layer:
            return STATE_BLOCKS_PER_SEQUENCE
        if self.window is None:
            return math.ceil(seq_tokens / block)
        return math.ceil(min(seq_tokens, self.window - 1 + in_flight_tokens) / block) + 1


@dataclass
class Plan:
    tp: int
    dcp: int
    max_model_len: int
    max_full_seqs: int
    kv_cache_dtype: str
    weights_total: int
    weights_per_rank: int
    kv_terms: list[KvTerm]
    kv_bytes_per_token: int
    tokens_per_rank: int
    kv_cache_memory_bytes: int
    overhead_bytes: int
    os_reserve_bytes: int
    node_memory_bytes: int
    gpu_memory_utilization: float
    gpu_memory_utilization_cap: float
    compute_capability: str = "12.1"
    compute_capability_source: str = ""
    kv_backend: str = ""
    kv_cache_dtype_effective: str = ""  # what vLLM stores, e.g. fp8_ds_mla for fp8 on GB10
    kv_backend_why: str = ""
    kv_block_tokens: int = 64
    kv_block_bytes: int = 0  # one block of the pool: kv_block_tokens × kv_bytes_per_token (layers of mixed kinds:
    #                           a page of each layer of one KV cache group)
    kv_blocks_per_rank: int = 0  # MAX_FULL_SEQS × blocks of one full sequence + vLLM's null block
    kv_group_layers: int = 0  # layers per KV cache group when the layers mix kinds of cache (0: one group of all)
    notes: list[str] = field(default_factory=list)

    @property
    def per_rank_total(self) -> int:
        return self.weights_per_rank + self.kv_cache_memory_bytes + self.overhead_bytes

    @property
    def available(self) -> int:
        return self.node_memory_bytes - self.os_reserve_bytes

    @property
    def headroom(self) -> int:
        return self.available - self.per_rank_total

    def problems(self) -> list[str]:
        out = []
        if self.headroom < 0:
            out.append(
                f"does not fit: per rank {gb(self.weights_per_rank)} weights + {gb(self.kv_cache_memory_bytes)} KV "
                f"+ {gb(self.overhead_bytes)} overhead = {gb(self.per_rank_total)}, but a node has "
                f"{gb(self.node_memory_bytes)} − {gb(self.os_reserve_bytes)} OS reserve = {gb(self.available)} "
                f"({gb(-self.headroom)} short)"
            )
        if self.gpu_memory_utilization > self.gpu_memory_utilization_cap:
            out.append(
                f"GPU_MEMORY_UTILIZATION={self.gpu_memory_utilization:g} is above the recipe's cap "
                f"{self.gpu_memory_utilization_cap:g}: vLLM's startup guard refuses it, because the worker already "
                f"holds ~{self.overhead_bytes / GIB:g} GiB of CUDA/NCCL state when it measures free memory; size "
                f"the KV cache with --kv-cache-memory-bytes instead"
            )
        return out

    @property
    def fits(self) -> bool:
        return not self.problems()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_terms"] = [dict(asdict(t), bytes_per_token=t.bytes_per_token) for t in self.kv_terms]
        d.update(per_rank_total=self.per_rank_total, available=self.available, headroom=self.headroom,
                 fits=self.fits, problems=self.problems())
        return d


def gb(n: int) -> str:
    return f"{n / GB:.1f} GB"


def _cfg_int(config: dict[str, Any], key: str, where: Path, default: int | None = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_CONFIG_INT:
        raise UsageError(f"{where / 'config.json'}: {key} should be a non-negative integer "
                         f"(at most {MAX_CONFIG_INT}), got {str(value)[:40]!r}")
    return value


@dataclass(frozen=True)
class KvLayout:
    """The attention backend vLLM picks for this model on this GPU, and the cache dtype it really stores
    (vLLM canonicalises the requested dtype per backend: on GB10 `fp8` and `auto` become `fp8_ds_mla`)."""

    backend: str
    dtype: str  # what vLLM stores, e.g. "fp8_ds_mla"
    why: str
    block_tokens: int | None = None  # the backend's KV page in tokens; None: the recipe's kv_block_tokens


# vLLM 0.33 (vllm/v1/attention/backends/mla/*, platforms/cuda.py, model_executor/layers/attention/
# mla_attention.py `_canonicalize_sparse_mla_kv_cache_dtype`): the sparse-MLA backends by GPU generation.
SM120_SPARSE = "FLASHINFER_MLA_SPARSE_SM120"
SM120_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")  # all stored as fp8_ds_mla
_QUANTIZED = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")
INDEXER_QUANT_BLOCK = 128  # the indexer's K cache: head_dim fp8 bytes + one fp32 scale per 128 (deepseek_v2.py)


def _major(compute_capability: str) -> int:
    return int(compute_capability.split(".", 1)[0])


def kv_layout(config: dict[str, Any], compute_capability: str, kv_dtype: str) -> KvLayout:
    """Which backend and stored dtype vLLM 0.33 uses for this model's KV cache on this GPU generation.

    Raises UsageError for a dtype that no backend on that GPU can serve (bfloat16 on GB10)."""
    sparse_mla = "kv_lora_rank" in config and ("index_topk" in config or "index_head_dim" in config)
    cc = compute_capability
    if not sparse_mla:
        return KvLayout("(dense attention)", kv_dtype, "not a sparse-MLA model: the dtype is stored as given")
    major = _major(cc)
    if major == 12:
        if kv_dtype not in SM120_DTYPES:
            raise UsageError(
                f"KV_CACHE_DTYPE={kv_dtype} cannot be served on compute capability {cc} (GB10 / SM12x): vLLM 0.33's "
                f"only sparse-MLA backend there, {SM120_SPARSE}, stores the packed fp8_ds_mla layout only "
                f"(accepts {', '.join(SM120_DTYPES)}) and vLLM would refuse the model after loading its weights",
                fix="set KV_CACHE_DTYPE=fp8 (stored as fp8_ds_mla, 656 B per token per layer)")
        stored = "fp8_ds_mla"
        why = (f"SM{cc.replace('.', '')}: vLLM's only sparse-MLA backend is {SM120_SPARSE}, which stores "
               f"{kv_dtype} as fp8_ds_mla (656 B per token per layer)")
        return KvLayout(SM120_SPARSE, stored, why if kv_dtype != "fp8_ds_mla" else why.split(", which")[0], 64)
    if major == 10:
        if kv_dtype == "fp8_ds_mla":
            return KvLayout("FLASHMLA_SPARSE", "fp8_ds_mla",
                            "SM10x: fp8_ds_mla asked for explicitly; FLASHINFER_MLA_SPARSE refuses it, FLASHMLA_SPARSE "
                            "serves it", 64)
        # GLM-5's own config hook (vllm/model_executor/models/config.py) turns `auto` into fp8_e4m3 on SM10x.
        stored = "fp8_e4m3" if kv_dtype == "auto" else kv_dtype
        if stored in _QUANTIZED:
            return KvLayout("FLASHINFER_MLA_SPARSE", stored,
                            f"SM10x: FLASHINFER_MLA_SPARSE is preferred for a quantized cache and keeps plain "
                            f"{stored} (kv_lora_rank + rope bytes) in blocks of 32 tokens"
                            + (" (the model's config hook turns auto into fp8_e4m3)" if kv_dtype == "auto" else ""),
                            32)
        return KvLayout("(SM10x unquantized sparse-MLA backend)", stored,
                        "SM10x: an unquantized cache in the model's dtype (backend not verified against vLLM)")
    return KvLayout(f"(not modelled for SM{cc.replace('.', '')})", kv_dtype,
                    f"compute capability {cc}: sparkctl models vLLM's sparse-MLA backends for SM10x and SM12x "
                    f"only; the bytes follow the dtype's width and are not verified against vLLM")


def kv_terms(config: dict[str, Any], kv_dtype: str, tp: int, where: Path, *, mtp_layers: bool = True) -> list[KvTerm]:
    """Bytes per token of KV cache on one rank, term by term, for the dtype vLLM stores (see kv_layout).

    mtp_layers: the MTP block (num_nextn_predict_layers) is a full decoder layer with its own caches,
    loaded only when it speculates (SPEC_METHOD=mtp)."""
    layers = _cfg_int(config, "num_hidden_layers", where)
    if mtp_layers:
        layers += _cfg_int(config, "num_nextn_predict_layers", where, 0)
    if kv_dtype == "auto":
        dtype_bytes = _MODEL_DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
    else:
        dtype_bytes = _DTYPE_BYTES.get(kv_dtype, 2)
    terms: list[KvTerm] = []
    if "kv_lora_rank" in config:  # MLA: one latent vector + the rope key per token per layer
        width = _cfg_int(config, "kv_lora_rank", where) + _cfg_int(config, "qk_rope_head_dim", where)
        if kv_dtype == "fp8_ds_mla":
            terms.append(KvTerm("MLA latent (fp8_ds_mla: 512 fp8 + 16 B scales + 64 bf16 rope = 656 B)",
                                FP8_DS_MLA_BYTES, layers))
        else:
            terms.append(KvTerm(f"MLA latent ({width} × {dtype_bytes} B, {kv_dtype})", width * dtype_bytes, layers))
    else:  # ordinary attention: K and V per KV head, heads split across TP ranks
        heads = kv_heads(config, where)
        head_dim = attention_head_dim(config, where)
        # vLLM: each rank holds max(1, KV heads ÷ TP); with more ranks than KV heads each head is replicated.
        per_rank_heads = max(1, heads // tp) if heads >= tp or tp % max(heads, 1) == 0 else math.ceil(heads / tp)
        per_layer = 2 * per_rank_heads * int(head_dim) * dtype_bytes
        label = f"{per_rank_heads} heads × {head_dim} × 2 × {dtype_bytes} B"
        kinds = layer_kinds(config, where)
        full = sum(1 for k in kinds if k == "full")
        sliding = sum(1 for k in kinds if k == "sliding")
        state = sum(1 for k in kinds if k == "state")
        extra = layers - len(kinds)  # MTP layers: full attention
        if full + extra:
            terms.append(KvTerm(f"K+V ({label})", per_layer, full + extra))
        if sliding:
            window = _cfg_int(config, "sliding_window", where)
            terms.append(KvTerm(f"K+V sliding window {window} ({label})", per_layer, sliding, window=window))
        if state:
            per_seq, why = linear_state_bytes(config, tp, where)
            terms.append(KvTerm(f"linear-attention state per sequence ({why})", 0, state,
                                state_bytes_per_layer=per_seq))
    if "index_head_dim" in config:
        dim = _cfg_int(config, "index_head_dim", where)
        scales = dim // INDEXER_QUANT_BLOCK * 4
        terms.append(KvTerm(f"indexer ({dim} fp8 + {scales} B scales)", dim + scales, layers))
    return terms


def kv_heads(config: dict[str, Any], where: Path) -> int:
    """The KV heads of an attention layer (all query heads when the config names no KV heads: MHA)."""
    if "num_key_value_heads" in config and config["num_key_value_heads"] is not None:
        return _cfg_int(config, "num_key_value_heads", where)
    return _cfg_int(config, "num_attention_heads", where)


def attention_head_dim(config: dict[str, Any], where: Path) -> int:
    return _cfg_int(config, "head_dim", where, 0) or _cfg_int(config, "hidden_size", where) // max(
        _cfg_int(config, "num_attention_heads", where), 1)


_FULL_TYPES = ("full_attention", "attention", "global_attention")
_SLIDING_TYPES = ("sliding_attention", "local_attention", "chunked_attention")
_STATE_TYPES = ("linear_attention", "mamba", "mamba2", "gated_delta_net", "linear")


def layer_kinds(config: dict[str, Any], where: Path) -> list[str]:
    """Each decoder layer's cache kind, in order: "full", "sliding" (a window of `sliding_window` tokens)
    or "state" (linear attention / Mamba: a fixed state per sequence). From `layer_types` (gpt-oss,
    Qwen3-Next), else `full_attention_interval` (every N-th layer full, the rest linear attention), else a
    `sliding_window` with `use_sliding_window` (every layer sliding), else every layer full."""
    n = _cfg_int(config, "num_hidden_layers", where)
    types = config.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n or not all(isinstance(t, str) for t in types):
            raise UsageError(f"{where / 'config.json'}: layer_types should be a list of {n} layer type names")
        out = []
        for i, t in enumerate(types):
            if t in _FULL_TYPES:
                out.append("full")
            elif t in _SLIDING_TYPES:
                out.append("sliding")
            elif t in _STATE_TYPES:
                out.append("state")
            else:
                raise UsageError(f"{where / 'config.json'}: layer_types[{i}] is {t[:40]!r}, which sparkctl's planner "
                                 f"does not know (known: {', '.join(_FULL_TYPES + _SLIDING_TYPES + _STATE_TYPES)})")
        return out
    interval = config.get("full_attention_interval")
    if interval is not None:
        step = _cfg_int(config, "full_attention_interval", where)
        if step < 1:
            raise UsageError(f"{where / 'config.json'}: full_attention_interval should be at least 1")
        return ["full" if (i + 1) % step == 0 else "state" for i in range(n)]
    if config.get("use_sliding_window") and config.get("sliding_window"):
        return ["sliding"] * n
    return ["full"] * n


def linear_state_bytes(config: dict[str, Any], tp: int, where: Path) -> tuple[int, str]:
    """One linear-attention (Gated DeltaNet) layer's state per sequence on one rank, in the model's dtype:
    the causal-conv state (conv_dim ÷ TP × (kernel − 1)) and the recurrent state (value heads ÷ TP × key
    head dim × value head dim), as vLLM's MambaStateShapeCalculator.gated_delta_net_state_shape sizes them."""
    nk = _cfg_int(config, "linear_num_key_heads", where)
    nv = _cfg_int(config, "linear_num_value_heads", where)
    dk = _cfg_int(config, "linear_key_head_dim", where)
    dv = _cfg_int(config, "linear_value_head_dim", where)
    kernel = _cfg_int(config, "linear_conv_kernel_dim", where)
    dtype_bytes = _MODEL_DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)
    conv = (2 * nk * dk + nv * dv) // tp * (kernel - 1)
    temporal = nv // tp * dk * dv
    return (conv + temporal) * dtype_bytes, (f"conv {conv:,} + recurrent {temporal:,} values × {dtype_bytes} B")


def drafter_terms(drafter_config: dict[str, Any] | None, kv_dtype: str, tp: int, where: Path) -> list[KvTerm]:
    """SPEC_METHOD=dspark: the drafter brings its own caches (planned from its config.json)."""
    if drafter_config is None:
        raise UsageError(f"SPEC_METHOD=dspark: cannot read the drafter's config.json in DSPARK={where}, so its "
                         "KV cache cannot be planned",
                         fix="point DSPARK at the drafter folder (it must hold config.json), at the same path on "
                             "every node")
    terms = kv_terms(drafter_config, kv_dtype, tp, where, mtp_layers=False)
    return [KvTerm(f"drafter {t.name}", t.bytes_per_token_per_layer, t.layers) for t in terms]


def make_plan(settings: Settings, ckpt: CheckpointInfo, node_memory_bytes: int | None = None,
              compute_capability: str | None = None, drafter_config: dict[str, Any] | None = None) -> Plan:
    """The memory plan per rank. compute_capability: what the nodes' nvidia-smi reports (check, up);
    None plans for the recipe's GPU_COMPUTE_CAPABILITY. drafter_config: DSPARK/config.json (default: the
    one read with the checkpoint)."""
    mem = settings.recipe.memory
    tp, dcp = settings.getint("TP"), settings.getint("DCP")
    max_len, seqs = settings.getint("MAX_MODEL_LEN"), settings.getint("MAX_FULL_SEQS")
    kv_dtype = str(settings.get("KV_CACHE_DTYPE"))
    cc = compute_capability or str(settings.get("GPU_COMPUTE_CAPABILITY"))
    cc_source = "the nodes' nvidia-smi" if compute_capability else settings.describe("GPU_COMPUTE_CAPABILITY")
    notes: list[str] = []
    total = ckpt.shard_bytes
    if ckpt.missing:
        notes.append(f"{len(ckpt.missing)} shard(s) named by the index are missing ({', '.join(ckpt.missing[:3])}"
                     f"{'…' if len(ckpt.missing) > 3 else ''}); run `sparkctl verify-model`")
        if ckpt.index_total_size:
            total = max(total, ckpt.index_total_size)
    layout = kv_layout(ckpt.config, cc, kv_dtype)
    if layout.backend == SM120_SPARSE and dcp > 1:
        notes.append(f"DCP={dcp} on SM{cc}: stock vLLM 0.33's {SM120_SPARSE} does not support decode context "
                     "parallelism (it refuses the model); the image chain's `dcp` layer is what enables it")
    method = settings.get("SPEC_METHOD")
    terms = kv_terms(ckpt.config, layout.dtype, tp, ckpt.path, mtp_layers=method == "mtp")
    if method == "dspark":
        dspark = Path(str(settings.get("DSPARK")))
        drafter_config = drafter_config if drafter_config is not None else ckpt.drafter_config
        drafter_dtype = kv_layout(drafter_config, cc, kv_dtype).dtype if drafter_config else layout.dtype
        terms += drafter_terms(drafter_config, drafter_dtype, tp, dspark)
    per_token = sum(t.bytes_per_token for t in terms)
    block = layout.block_tokens or mem.kv_block_tokens
    if aligns_to_state(terms):
        aligned = hybrid_block_tokens(terms)
        if aligned != block:
            notes.append(f"the recipe's kv_block_tokens={block} is not the block vLLM 0.33 pages this hybrid in: "
                         f"planned with {aligned} (set kv_block_tokens = {aligned} in the recipe)")
        block = aligned
    seq_tokens = math.ceil(max_len / dcp)
    blocks_per_seq = math.ceil(seq_tokens / block)
    # vLLM reserves one null block before it checks that the longest request fits.
    blocks = blocks_per_seq * seqs + 1
    kv_bytes = blocks * block * per_token
    block_bytes = block * per_token
    group_layers = 0
    if any(t.window is not None or t.state_bytes for t in terms):
        in_flight = IN_FLIGHT_BATCHES * max_num_batched_tokens(settings)
        paging = hybrid_paging(terms, seq_tokens, in_flight, block)
        kv_bytes, blocks, block_bytes = paging.kv_bytes(seqs), paging.blocks(seqs), paging.block_bytes
        group_layers = paging.group_layers
        if any(t.window is not None for t in terms):
            notes.append(f"sliding-window layers keep sliding_window − 1 + {in_flight} in-flight tokens (two batches: "
                         "vLLM's async scheduling on a GPU) + 1 block, as vLLM 0.33 sizes them (the fidelity suite "
                         "judges it for gpt-oss)")
        if any(t.state_bytes for t in terms):
            notes.append(f"hybrid paging as vLLM 0.33 does it: {block}-token attention blocks, so that one attention "
                         f"page ({paging.page_bytes:,} B per layer) holds a layer's linear-attention state, padded to "
                         f"it; {paging.group_layers} layers per KV cache group; each state group keeps "
                         f"{STATE_BLOCKS_PER_SEQUENCE} blocks per sequence (prefix caching's align mode: the running "
                         "state, the last block-aligned one and a prefill checkpoint); "
                         f"{paging.blocks_per_seq:,} blocks per sequence in all (judged by the fidelity suite for "
                         "Qwen3-Next)")
    return Plan(
        tp=tp, dcp=dcp, max_model_len=max_len, max_full_seqs=seqs, kv_cache_dtype=kv_dtype,
        weights_total=total,
        weights_per_rank=math.ceil(total / tp),
        kv_terms=terms,
        kv_bytes_per_token=per_token,
        tokens_per_rank=blocks_per_seq * block * seqs,
        kv_cache_memory_bytes=kv_bytes,
        overhead_bytes=int(mem.overhead_gib * GIB),
        os_reserve_bytes=int(mem.os_reserve_gib * GIB),
        node_memory_bytes=node_memory_bytes or settings.getint("NODE_MEMORY_BYTES"),
        gpu_memory_utilization=float(settings.get("GPU_MEMORY_UTILIZATION")),
        gpu_memory_utilization_cap=mem.gpu_memory_utilization_cap,
        compute_capability=cc,
        compute_capability_source=cc_source,
        kv_backend=layout.backend,
        kv_cache_dtype_effective=layout.dtype,
        kv_backend_why=layout.why,
        kv_block_tokens=block,
        kv_block_bytes=block_bytes,
        kv_blocks_per_rank=blocks,
        kv_group_layers=group_layers,
        notes=notes,
    )


# A model whose layers keep different kinds of cache (full attention with sliding windows, or with linear-
# attention / Mamba state) is paged by vLLM 0.33 in KV cache groups of one page size, in one shared pool:
#   - the attention block: vllm/platforms/interface.py `Platform.update_block_size_for_backend` (the worker runs
#     it once its layers exist) → `_align_hybrid_block_size`: the block is the least multiple of the alignment
#     whose attention page (block × one attention layer's bytes per token) holds one state layer's page:
#     alignment = lcm(max(the backend's smallest kernel block, the block it prefers: 16 on GB10), the state
#     layers' prefill checkpoint alignment) -- in mamba_cache_mode "align" (prefix caching on, vLLM's default)
#     with FlashInfer's Gated DeltaNet prefill (GB10), FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64
#     (vllm/v1/attention/backends/gdn_attn.py) -- and the state page is padded to the attention page
#     (CacheConfig.mamba_page_size_padded);
#   - the state page: vllm/model_executor/layers/mamba/mamba_utils.py `MambaStateShapeCalculator
#     .gated_delta_net_state_shape` (conv state + recurrent state, see linear_state_bytes), in the model's dtype
#     (`MambaStateDtypeCalculator._mamba_state_dtype`: mamba_cache_dtype and mamba_ssm_cache_dtype "auto");
#   - the groups: vllm/v1/core/kv_cache_planning.py `_get_kv_cache_groups_uniform_page_size`: the layers of one
#     spec form ⌈layers ÷ group size⌉ groups; the group size is the fewest layers of any spec, or the most when
#     that is below 1.5 × the fewest; one block of the pool is a page of every slot of a group
#     (`_get_kv_cache_bytes_per_block`: page × group size);
#   - a state group keeps `MambaSpec.max_memory_usage_bytes` ÷ page blocks per sequence: in "align" mode 2 (the
#     running state and the last block-aligned one) + 1 prefill checkpoint block (FlashInfer's GDN prefill
#     exports mid-prefill states: qwen_gdn_linear_attn.py `get_kv_cache_spec`, num_prefill_checkpoint_blocks=1)
#     + the speculative tokens (none here); a token group its blocks (KvTerm.blocks_held);
#   - `get_kv_cache_configs` allocates available ÷ pool block blocks and, one null block held back, refuses to
#     start unless one request's blocks of every group fit (`_max_memory_usage_bytes_from_groups`: "To serve at
#     least one request ...").
ATTENTION_KERNEL_ALIGNMENT = 16  # the CUDA attention backend's block on GB10 (FlashAttention, as dense models)
GDN_CHECKPOINT_ALIGNMENT = 64  # gdn_attn.py FLASHINFER_GDN_CHECKPOINT_ALIGNMENT: align-mode state checkpoints
# MambaSpec.max_memory_usage_bytes in "align" mode: 2 + num_prefill_checkpoint_blocks (1) + speculative blocks (0)
STATE_BLOCKS_PER_SEQUENCE = 3


def aligns_to_state(terms: list[KvTerm]) -> bool:
    """Whether vLLM aligns the attention block to a state page: attention layers and state layers both (a hybrid)."""
    return any(t.state_bytes_per_layer for t in terms) and any(t.bytes_per_token_per_layer for t in terms)


def hybrid_block_tokens(terms: list[KvTerm]) -> int:
    """The attention block vLLM 0.33 picks for a model with state layers (update_block_size_for_backend): the least
    multiple of lcm(16, 64) tokens whose page of one attention layer holds one state layer's page."""
    attention = max((t.bytes_per_token_per_layer for t in terms if not t.state_bytes_per_layer), default=0)
    state = max((t.state_bytes_per_layer for t in terms), default=0)
    if not attention or not state:
        raise ValueError("hybrid_block_tokens needs both attention and state layers (see aligns_to_state)")
    unit = math.lcm(ATTENTION_KERNEL_ALIGNMENT, GDN_CHECKPOINT_ALIGNMENT)
    return unit * -(-state // (unit * attention))  # cdiv, in integers


def kv_group_layers(layer_counts: list[int]) -> int:
    """Layers per KV cache group (_get_kv_cache_groups_uniform_page_size): the fewest layers of one kind, or the
    most when the most are fewer than 1.5 × the fewest (fewer padded slots)."""
    fewest, most = min(layer_counts), max(layer_counts)
    return most if 2 * most < 3 * fewest else fewest


@dataclass(frozen=True)
class HybridPaging:
    """One rank's KV pool for a model whose layers keep different kinds of cache, as vLLM 0.33 pages it."""

    block_tokens: int
    page_bytes: int  # one layer's page: block × the attention layer's bytes per token; state pages padded to it
    group_layers: int  # layers (tensor slots) per KV cache group
    blocks_per_seq: int  # one sequence's blocks in every group together

    @property
    def block_bytes(self) -> int:
        """One block of the shared pool: a page of every slot of a group."""
        return self.page_bytes * self.group_layers

    def blocks(self, seqs: int) -> int:
        return seqs * self.blocks_per_seq + 1  # + vLLM's null block

    def kv_bytes(self, seqs: int) -> int:
        return self.blocks(seqs) * self.block_bytes


def hybrid_paging(terms: list[KvTerm], seq_tokens: int, in_flight_tokens: int, block: int) -> HybridPaging:
    """The pool of a model mixing full, sliding-window and state layers (the comment above: vLLM's functions)."""
    page = block * max((t.bytes_per_token_per_layer for t in terms if not t.state_bytes_per_layer), default=0)
    page = max([page, *(t.state_bytes_per_layer for t in terms)])  # a state page never exceeds it (the block)
    group = kv_group_layers([t.layers for t in terms])
    per_seq = sum(math.ceil(t.layers / group) * t.blocks_held(seq_tokens, in_flight_tokens, block) for t in terms)
    return HybridPaging(block, page, group, per_seq)


def hybrid_kv_bytes(terms: list[KvTerm], seq_tokens: int, in_flight_tokens: int, block: int, seqs: int) -> int:
    """KV bytes per rank when the layers mix full, sliding-window and state caches: `seqs` sequences' blocks of
    every group, plus vLLM's one null block of the shared pool."""
    return hybrid_paging(terms, seq_tokens, in_flight_tokens, block).kv_bytes(seqs)


IN_FLIGHT_BATCHES = 2  # vLLM's async scheduling (its default) keeps two batches in flight
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM's default for an OpenAI server on a GPU (chunked prefill)


def max_num_batched_tokens(settings: Settings) -> int:
    """--max-num-batched-tokens as the ranks will run (the recipe's extra args, then VLLM_EXTRA_ARGS), else
    vLLM's default: a sliding-window cache holds the window plus one scheduled batch."""
    words = list(settings.recipe.vllm_extra_args) + settings.vllm_extra_args()
    value = DEFAULT_MAX_NUM_BATCHED_TOKENS
    for i, word in enumerate(words):
        if word == "--max-num-batched-tokens" and i + 1 < len(words) and words[i + 1].isdigit():
            value = int(words[i + 1])
        elif word.startswith("--max-num-batched-tokens=") and word.split("=", 1)[1].isdigit():
            value = int(word.split("=", 1)[1])
    return value


def nodes_compute_capability(caps: dict[str, str | None]) -> tuple[str | None, str | None]:
    """The one compute capability the nodes report (None when none is known), and a problem when they
    disagree: every rank gets the same KV bytes, planned for one backend."""
    known = {n: c for n, c in caps.items() if c}
    values = sorted(set(known.values()))
    if len(values) > 1:
        listing = ", ".join(f"{n} {c}" for n, c in known.items())
        return None, (f"the ranks report different GPU compute capabilities ({listing}): vLLM would pick a "
                      "different KV-cache backend per rank; serve one model on one GPU generation")
    return (values[0] if values else None), None


def drafter_dir(settings: Settings) -> Path | None:
    """The DSpark drafter folder whose config.json the plan needs (SPEC_METHOD=dspark), else None."""
    return Path(str(settings.get("DSPARK"))) if settings.get("SPEC_METHOD") == "dspark" else None


def plan_for(settings: Settings, node_memory_bytes: int | None = None) -> Plan:
    return make_plan(settings, read_checkpoint(settings.model, drafter_dir(settings)), node_memory_bytes)


def require_fit(plan: Plan) -> None:
    problems = plan.problems()
    if problems:
        raise CheckFailed("plan refused: " + "\n  ".join(problems))
