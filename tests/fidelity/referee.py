"""The referee: vLLM 0.33.0's own code, run on CPU, judging what sparkctl renders.

Imported only inside the fidelity venv (tests/fidelity/setup_venv.sh); nothing here is sparkctl's own
arithmetic. Where vLLM needs a GPU to decide something, the function says what it asks vLLM instead:

- `parse_serve`: the parser `vllm serve` builds (vllm/entrypoints/cli/main.py: a FlexibleArgumentParser
  with subparsers, then `ServeSubcommand.subparser_init`), `ServeSubcommand.validate`,
  `AsyncEngineArgs.from_cli_args` and `create_engine_config` -- which builds ModelConfig (from the
  checkpoint's config.json), ParallelConfig, CacheConfig and SpeculativeConfig. It runs on vLLM's CPU
  platform (VLLM_TARGET_DEVICE=cpu): the platform-specific choices it makes there (block size 16, the
  CPU worker, no attention backend) are not the GPU's, so the KV check below redoes exactly those
  choices with vLLM's CUDA platform code for the target compute capability. Nothing after
  create_engine_config runs: the next step, the executor, starts workers on GPUs.
- `kv_specs`: the attention backend CudaPlatform.get_valid_backends picks for the compute capability,
  the block size `Platform._preferred_block_size_for_backends` picks for it, the KV dtype
  `_canonicalize_sparse_mla_kv_cache_dtype` turns the requested one into, and each layer's spec from
  `MLAAttention.get_kv_cache_spec` / `DeepseekV32IndexerCache.get_kv_cache_spec`, collected by the
  worker's own `get_kv_cache_spec` (vllm/v1/worker/gpu/attn_utils.py).
- `kv_verdict`: `get_global_kv_cache_groups` + `get_kv_cache_configs` (vllm/v1/core/kv_cache_planning.py),
  the check that refuses to start with "To serve at least one request with the model's max seq len".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402


@functools.cache
def serve_parser() -> tuple[FlexibleArgumentParser, FlexibleArgumentParser]:
    """(root parser, serve subparser), built the way `vllm serve` builds them (cli/main.py)."""
    root = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = root.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand().subparser_init(subparsers)
    serve.set_defaults(dispatch_function=ServeSubcommand.cmd)
    return root, serve


def abbreviated_flags(argv: list[str]) -> list[str]:
    """Options in a `vllm serve ...` argv that are not one of the serve parser's own option strings.

    argparse's prefix matching would take `--kv-cache-memory-byte` for `--kv-cache-memory-bytes`
    without a word; a flag only counts when it is spelled exactly as vLLM declares it."""
    _, serve = serve_parser()
    known = set(serve._option_string_actions)
    bad = []
    for word in argv[2:]:
        if word.startswith("-") and not _is_number(word):
            if word.split("=", 1)[0] not in known:
                bad.append(word)
    return bad


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


@dataclass
class Parsed:
    args: argparse.Namespace
    engine_args: AsyncEngineArgs
    vllm_config: Any  # vllm.config.VllmConfig


def register_exl3_overlay() -> None:
    """The fourth seam: `--quantization exl3` is not a method stock vLLM 0.33 knows ("Unknown
    quantization method: exl3"). In production the image's EXL3 overlay (the checkpoint's serving/exl3.py,
    installed by the chain's `mul1` layer) registers it through vLLM's public
    `register_quantization_config`; the referee registers a placeholder the same way, so the rest of the
    argv is still judged by vLLM's own config classes. It quantizes nothing: the KV cache does not depend
    on it (the planner's figures come from the attention layers)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    if "exl3" in QUANTIZATION_METHODS:
        return

    @register_quantization_config("exl3")
    class Exl3OverlayPlaceholder(QuantizationConfig):  # noqa: F841 - registered by the decorator
        @classmethod
        def get_name(cls) -> str:
            return "exl3"

        @classmethod
        def get_supported_act_dtypes(cls) -> list[Any]:
            import torch

            return [torch.bfloat16, torch.float16]

        @classmethod
        def get_min_capability(cls) -> int:
            return 80

        @staticmethod
        def get_config_filenames() -> list[str]:
            return ["quantization_config.json"]

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> Exl3OverlayPlaceholder:
            return cls()

        def get_quant_method(self, layer: Any, prefix: str) -> None:
            return None


def parse_serve(argv: list[str]) -> Parsed:
    """Parse one rank's `vllm serve MODEL ...` argv and build vLLM's engine config from it."""
    assert argv[:2] == ["vllm", "serve"], argv[:3]
    if "exl3" in argv:
        register_exl3_overlay()
    root, _ = serve_parser()
    args = root.parse_args(argv[1:])
    ServeSubcommand().validate(args)
    if getattr(args, "model_tag", None) is not None:  # what ServeSubcommand.cmd does first
        args.model = args.model_tag
    engine_args = AsyncEngineArgs.from_cli_args(args)
    # A GPU image has Triton; this venv does not (CUDA-only). Without it vLLM falls back to Model Runner
    # V1 (config/vllm.py:751), which refuses DSpark; with it, vLLM's own feature check picks the runner.
    with mock.patch("vllm.config.vllm.HAS_TRITON", True):
        vllm_config = engine_args.create_engine_config()
    # CpuPlatform.check_and_update_config (vllm/platforms/cpu.py:318-337), on a CPU with AVX-512 BF16, sets the
    # Mamba SSM state dtype to float32 for its own GDN kernel; CudaPlatform leaves the command line's value. Put
    # that back, so a hybrid's state is judged as on the GPU whatever CPU runs the suite (a model's own config
    # hook that sets it, e.g. Qwen3.5's, runs again in hybrid_kv_specs).
    vllm_config.cache_config.mamba_ssm_cache_dtype = engine_args.mamba_ssm_cache_dtype
    return Parsed(args, engine_args, vllm_config)


# ---------------------------------------------------------------- the KV cache, as a GPU would plan it

@dataclass
class KvChoice:
    backend: str             # e.g. FLASHINFER_MLA_SPARSE_SM120
    cache_dtype: str         # what vLLM stores, e.g. fp8_ds_mla
    block_size: int          # tokens per block
    specs: dict[str, Any]    # layer name -> KVCacheSpec, as the worker reports them
    backends: list[Any]      # the attention backend classes of those layers


@contextlib.contextmanager
def _flashinfer_present() -> Iterator[None]:
    """The CPU venv has no FlashInfer (CUDA-only); the serving image has it. Tell vLLM's backend
    selector so, and nothing else: every other rule of the backends still applies."""
    with mock.patch("vllm.utils.flashinfer.has_flashinfer_sparse_mla_sm120", return_value=True):
        yield


def _cuda_platform() -> Any:
    """vLLM's CudaPlatform class, imported on a machine without a GPU driver.

    vllm/platforms/cuda.py:23 imports `vllm._C_stable_libtorch` only to register the compiled CUDA ops
    (it needs libcuda.so.1 to load); the backend-selection and block-size code used here calls none
    of them, so an empty module stands in for it."""
    import sys
    import types

    try:
        import vllm._C_stable_libtorch  # noqa: F401
    except ImportError:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    from vllm.platforms.cuda import CudaPlatform

    return CudaPlatform


@contextlib.contextmanager
def _cuda_only_modules_unavailable() -> Iterator[None]:
    """Some backend modules touch the GPU while being imported (cutlass_mla.py:71 asks torch.cuda), which
    on this machine raises something other than the ImportError vLLM's selector expects for an
    unavailable backend (platforms/cuda.py:400). Report those as ImportError, i.e. "unavailable"; none
    of them is a sparse-MLA backend, so none could have been chosen for GLM-5."""
    _cuda_platform()
    import vllm.platforms.cuda as cuda

    real = cuda._get_attn_backend_class

    def load(backend: Any) -> Any:
        try:
            return real(backend)
        except (ImportError, OSError):
            raise
        except Exception as e:  # noqa: BLE001 - any import-time failure of a CUDA-only module
            raise ImportError(f"{backend.name} cannot load without a GPU: {e}") from e

    with mock.patch.object(cuda, "_get_attn_backend_class", load):
        yield


@contextlib.contextmanager
def _as_gpu(capability: tuple[int, int]) -> Iterator[None]:
    """vLLM's current platform is, for the duration, its CudaPlatform on a GPU of this compute
    capability (vllm/platforms/__init__.py keeps it in `_current_platform`)."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import DeviceCapability

    cuda = _cuda_platform()

    class TargetGpu(cuda):  # type: ignore[misc, valid-type]
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*capability)

    with mock.patch.object(platforms, "_current_platform", TargetGpu()):
        yield


def select_mla_backend(vllm_config: Any, capability: tuple[int, int], *, stock_dcp: bool = False) -> Any:
    """The sparse-MLA backend vLLM picks for this model on a GPU of this compute capability.

    Stock vLLM 0.33.0 has no sparse-MLA backend with DCP on SM12x: FlashInferMLASparseSM120Impl
    (v1/attention/backends/mla/flashinfer_mla_sparse_sm120.py:33) does not declare supports_dcp, so
    AttentionBackend.validate_configuration (v1/attention/backend.py:346) rejects it with "DCP not
    supported". The recipes' image chain patches DCP in (its `dcp` layer); the KV layout is the
    backend's either way. So, unless `stock_dcp`, the backend is chosen as for DCP 1 -- the sizes
    below still divide tokens by the configured DCP (FullAttentionSpec.max_memory_usage_bytes)."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    hf = vllm_config.model_config.hf_text_config
    parallel = vllm_config.parallel_config
    selector = AttentionSelectorConfig(
        head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,  # MLAAttention.head_size (mla_attention.py:480)
        dtype=torch.bfloat16,
        kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        block_size=None,
        use_mla=True,
        use_sparse=True,
        use_dcp=stock_dcp and parallel.decode_context_parallel_size > 1,
    )
    num_heads = hf.num_attention_heads // parallel.tensor_parallel_size
    with set_current_vllm_config(vllm_config), _flashinfer_present(), _cuda_only_modules_unavailable():
        valid, invalid = _cuda_platform().get_valid_backends(
            DeviceCapability(*capability), selector, num_heads=num_heads)
    if not valid:
        raise AssertionError(f"vLLM finds no MLA backend for SM{capability[0]}{capability[1]}: {invalid}")
    return min(valid, key=lambda c: c.priority).backend_class


def kv_specs(vllm_config: Any, capability: tuple[int, int]) -> KvChoice:
    """Every KV cache layer's spec as the worker of a GPU with this compute capability reports it.

    GLM-5 (glm_moe_dsa) builds, per decoder layer, one sparse MLAAttention and one indexer cache
    (DeepseekV32IndexerCache); the MTP draft model adds its own decoder layer(s) with the same two
    caches. The layer objects are vLLM's own classes; only what their constructors compute from the
    checkpoint is set here (head sizes, with the file:line they come from)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import (
        MLAAttention,
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    # The model's own config hook (VllmConfig.try_verify_and_update_config, config/vllm.py:2754), run by
    # create_engine_config on this CPU platform, decides again as on the GPU: for GLM-5 on SM10x it
    # turns KV dtype `auto` into fp8 (model_executor/models/config.py:93-101).
    hook = MODELS_CONFIG_MAP.get(vllm_config.model_config.architecture)
    if hook is not None:
        with _as_gpu(capability):
            hook.verify_and_update_config(vllm_config)
    backend = select_mla_backend(vllm_config, capability)
    cache = vllm_config.cache_config
    # mla_attention.py:523-529: the layer rewrites the dtype its backend stores, and CacheConfig with it.
    cache.cache_dtype = _canonicalize_sparse_mla_kv_cache_dtype(backend, cache.cache_dtype)
    cache.block_size = _cuda_platform()._preferred_block_size_for_backends(
        [backend], type(cache).DEFAULT_BLOCK_SIZE, vllm_config)

    hf = vllm_config.model_config.hf_text_config
    n_target = hf.num_hidden_layers
    # MTP loads the checkpoint's num_nextn_predict_layers as draft layers (SpeculativeConfig.hf_config_override,
    # config/speculative.py:751-760); DSpark and no speculation load none of them.
    spec = vllm_config.speculative_config
    mtp_layers = hf.num_nextn_predict_layers if spec is not None and spec.method == "mtp" else 0
    # deepseek_v2.py:724,732: the indexer's cache holds index_head_dim fp8 values plus one fp32 scale
    # per quant block of 128.
    quant_block = 128
    indexer_head = hf.index_head_dim + hf.index_head_dim // quant_block * 4
    ctx = vllm_config.compilation_config.static_forward_context
    ctx.clear()
    with set_current_vllm_config(vllm_config):
        for i in range(n_target + mtp_layers):
            prefix = f"model.layers.{i}.self_attn"
            idx = DeepseekV32IndexerCache(indexer_head, torch.uint8, f"{prefix}.indexer.k_cache", cache)
            idx.is_draft_layer = i >= n_target
            attn = MLAAttention.__new__(MLAAttention)
            torch.nn.Module.__init__(attn)
            attn.layer_name = f"{prefix}.attn"
            attn.kv_cache_dtype = cache.cache_dtype
            attn.head_size = hf.kv_lora_rank + hf.qk_rope_head_dim   # mla_attention.py:480
            attn.sliding_window = None
            attn.topk_buffer_width = hf.index_topk
            attn.indexer = idx
            attn.non_causal_multi_token_decode = False
            attn.attn_backend = backend
            attn.kv_sharing_target_layer_name = None
            attn.is_draft_layer = i >= n_target
            ctx[attn.layer_name] = attn
        specs = get_kv_cache_spec(vllm_config)
    ctx.clear()
    backends = [backend, DeepseekV32IndexerCache.get_attn_backend(idx)]
    return KvChoice(backend.get_name(), cache.cache_dtype, cache.block_size, specs, backends)


@dataclass
class KvVerdict:
    accepted: bool
    error: str
    num_blocks: int          # blocks vLLM allocates (the null block included); 0 when refused
    bytes_per_block: int     # one block across every layer and cache


def kv_verdict(vllm_config: Any, choice: KvChoice, available: int) -> KvVerdict:
    """What vLLM's KV-cache planner says to `--kv-cache-memory-bytes available` on one rank."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import (
        _pool_bytes_per_block,
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )

    specs = choice.specs

    # What EngineCore._initialize_kv_caches does (v1/engine/core.py:286-322), for one rank; with
    # --kv-cache-memory-bytes the worker reports exactly that many bytes as available.
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(choice.backends)]
    resolve_kv_cache_layout(vllm_config, [layouts], list(specs.values()))
    groups = get_global_kv_cache_groups(vllm_config, [dict(specs)])
    vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    per_block = _pool_bytes_per_block(vllm_config, groups)
    try:
        (config,) = get_kv_cache_configs(vllm_config, [dict(specs)], [available], groups)
    except ValueError as e:
        return KvVerdict(False, str(e), 0, per_block)
    return KvVerdict(True, "", config.num_blocks, per_block)


def select_dense_backend(vllm_config: Any, capability: tuple[int, int], *, sliding: bool = False) -> Any:
    """The attention backend vLLM picks for a dense (MHA/GQA) model on a GPU of this compute capability:
    CudaPlatform.get_valid_backends with the model's head size, KV dtype and query heads per rank, the
    best priority first (FlashInfer is not in this CPU venv: vLLM lists it as unavailable, and on SM12x its
    priority is below FLASH_ATTN's anyway)."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    model = vllm_config.model_config
    selector = AttentionSelectorConfig(
        head_size=model.get_head_size(), dtype=torch.bfloat16, kv_cache_dtype=vllm_config.cache_config.cache_dtype,
        block_size=None, use_mla=False, use_sparse=False, use_dcp=False, has_sliding_window=sliding)
    with set_current_vllm_config(vllm_config), _cuda_only_modules_unavailable():
        valid, invalid = _cuda_platform().get_valid_backends(
            DeviceCapability(*capability), selector, num_heads=model.get_num_attention_heads(vllm_config.parallel_config))
    if not valid:
        raise AssertionError(f"vLLM finds no attention backend for SM{capability[0]}{capability[1]}: {invalid}")
    return min(valid, key=lambda c: c.priority).backend_class


def gpu_async_scheduling(vllm_config: Any) -> None:
    """What VllmConfig decides about async scheduling on the GPU (config/vllm.py:1685-1719): on with the mp
    executor (MultiprocExecutor.supports_async_scheduling) unless an option forbids it; this CPU platform's
    executor does not support it, so create_engine_config turned it off here. It sets how many batches are in
    flight (VllmConfig.max_in_flight_tokens), which a sliding-window cache holds."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    assert vllm_config.parallel_config.distributed_executor_backend == "mp"
    if MultiprocExecutor.supports_async_scheduling() and vllm_config.speculative_config is None \
            and vllm_config.parallel_config.pipeline_parallel_size == 1:
        vllm_config.scheduler_config.async_scheduling = True


def _register_attention(vllm_config: Any, i: int, backend: Any, window: int | None) -> None:
    """Decoder layer i's vLLM Attention (model_executor/layers/attention/attention.py), with what its
    constructor computes: KV heads per rank (ModelConfig.get_num_kv_heads: the replication rule), head size,
    KV dtype, sliding window; registered in the forward context where the worker's get_kv_cache_spec reads it."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backend import AttentionType

    model, cache = vllm_config.model_config, vllm_config.cache_config
    layer = Attention.__new__(Attention)
    torch.nn.Module.__init__(layer)
    layer.layer_name = f"model.layers.{i}.self_attn.attn"
    layer.attn_type = AttentionType.DECODER
    layer.kv_cache_dtype = cache.cache_dtype
    layer.sliding_window = window
    layer.num_kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
    layer.head_size = layer.head_size_v = model.get_head_size()
    layer.kv_cache_torch_dtype = model.dtype if cache.cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    layer.attn_backend = backend
    layer.kv_sharing_target_layer_name = None
    layer.is_draft_layer = False
    vllm_config.compilation_config.static_forward_context[layer.layer_name] = layer


def dense_kv_specs(vllm_config: Any, capability: tuple[int, int]) -> KvChoice:
    """Every layer's KV spec for a dense-attention model, as the worker reports them: vLLM's own Attention
    layer (model_executor/layers/attention/attention.py) per decoder layer, with the KV heads per rank from
    ModelConfig.get_num_kv_heads (the replication rule), the head size from get_head_size, the sliding window
    of each `sliding_attention` layer of config.json's layer_types (as the model's attention layers take it),
    the block size CudaPlatform._preferred_block_size_for_backends picks, collected by the worker's
    get_kv_cache_spec."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    model, cache = vllm_config.model_config, vllm_config.cache_config
    hf = model.hf_text_config
    types = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    backend = select_dense_backend(vllm_config, capability, sliding="sliding_attention" in types)
    cache.block_size = _cuda_platform()._preferred_block_size_for_backends(
        [backend], type(cache).DEFAULT_BLOCK_SIZE, vllm_config)
    ctx = vllm_config.compilation_config.static_forward_context
    ctx.clear()
    with set_current_vllm_config(vllm_config):
        for i in range(hf.num_hidden_layers):
            window = hf.sliding_window if types[i] == "sliding_attention" else None
            _register_attention(vllm_config, i, backend, window)
        specs = get_kv_cache_spec(vllm_config)
    ctx.clear()
    return KvChoice(backend.get_name(), cache.cache_dtype, cache.block_size, specs, [backend])


def hybrid_kv_specs(vllm_config: Any, capability: tuple[int, int]) -> KvChoice:
    """Every layer's KV spec for a Qwen3-Next style hybrid (gated attention + Gated DeltaNet), as the worker
    reports them: each `full_attention` layer of the text config's layer_types is vLLM's own Attention (as in
    dense_kv_specs), each `linear_attention` layer vLLM's own QwenGatedDeltaNetAttention with what its
    constructor reads from config.json (mamba/gdn/qwen_gdn_linear_attn.py: linear heads, head dims, conv
    kernel; base.py: TP size, speculative tokens). Then, as the worker does once its layers exist
    (MultiprocExecutor's worker: `current_platform.update_block_size_for_backend`), CudaPlatform picks the
    attention block and, for a hybrid, raises it until one attention page holds a whole state page and pads
    the state page to it (platforms/interface.py `_align_hybrid_block_size`)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
        _resolve_gdn_prefill_backend,
    )
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    model, cache = vllm_config.model_config, vllm_config.cache_config
    hook = MODELS_CONFIG_MAP.get(model.architecture)
    if hook is not None:  # HybridAttentionMambaModelConfig: the Mamba cache mode and block, as on the GPU
        with _as_gpu(capability):
            hook.verify_and_update_config(vllm_config)
    hf = model.hf_text_config
    types = list(hf.layer_types)
    backend = select_dense_backend(vllm_config, capability)
    # qwen_gdn_linear_attn.py ChunkGatedDeltaRule: the GDN prefill kernel for this GPU; FlashInfer's needs CUDA
    # runtime >= 13, which the GB10 serving images have (this CPU venv has no CUDA runtime to ask).
    # The module bound vLLM's current platform (the CPU one here) when it was imported: give it the GPU's.
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn_module
    import vllm.platforms as platforms

    with _as_gpu(capability), mock.patch.object(_cuda_platform(), "get_cuda_runtime_major", return_value=13), \
            mock.patch.object(gdn_module, "current_platform", platforms._current_platform):
        _, gdn_prefill = _resolve_gdn_prefill_backend(vllm_config)
    assert gdn_prefill == "flashinfer", gdn_prefill
    # qwen_gdn_linear_attn.py:691-696: FlashInfer's prefill exports align-mode checkpoints every 64 tokens
    alignment = FLASHINFER_GDN_CHECKPOINT_ALIGNMENT \
        if cache.mamba_cache_mode == "align" and gdn_prefill == "flashinfer" else None
    spec = vllm_config.speculative_config
    ctx = vllm_config.compilation_config.static_forward_context
    ctx.clear()
    with set_current_vllm_config(vllm_config):
        for i, kind in enumerate(types):
            if kind == "linear_attention":
                gdn = QwenGatedDeltaNetAttention.__new__(QwenGatedDeltaNetAttention)
                torch.nn.Module.__init__(gdn)
                gdn.prefix = f"model.layers.{i}.linear_attn"
                gdn.tp_size = vllm_config.parallel_config.tensor_parallel_size
                gdn.model_config, gdn.cache_config = model, cache
                gdn.num_spec = spec.num_speculative_tokens if spec is not None else 0
                gdn.num_k_heads, gdn.num_v_heads = hf.linear_num_key_heads, hf.linear_num_value_heads
                gdn.head_k_dim, gdn.head_v_dim = hf.linear_key_head_dim, hf.linear_value_head_dim
                gdn.conv_kernel_size = hf.linear_conv_kernel_dim
                gdn.vllm_config, gdn._checkpoint_alignment = vllm_config, alignment
                ctx[gdn.prefix] = gdn
                continue
            _register_attention(vllm_config, i, backend, None)
        with _as_gpu(capability), _cuda_only_modules_unavailable():
            _cuda_platform().update_block_size_for_backend(vllm_config)
        specs = get_kv_cache_spec(vllm_config)
    backends = [backend, *{type(s): ctx[n].get_attn_backend() for n, s in specs.items()
                           if n.endswith("linear_attn")}.values()]
    ctx.clear()
    return KvChoice(backend.get_name(), cache.cache_dtype, cache.block_size, specs, backends)
