"""Everything sparkctl reads from the engine, in one place, each with where vLLM 0.33 writes it.

`wait` reads each rank's phase from its log lines, `status` and `bench` read /metrics. Every pattern
and name here comes from vLLM 0.33.0's source (or uvicorn's, the HTTP server vLLM runs), given as
the file that has it; tests/fidelity/test_standin_vs_vllm.py checks each against that file in the
installed vLLM, and the lab's stand-in engine prints exactly these lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Marker:
    phase: str
    pattern: str  # a regex, searched in one log line
    source: str  # the file (inside site-packages) whose format string it matches
    who: str  # which ranks print it in vLLM


PHASE_MARKERS: tuple[Marker, ...] = (
    Marker("rendezvous", r"world_size=\d+ rank=\d+ local_rank=\d+ distributed_init_method=",
           "vllm/distributed/parallel_state.py", "every rank's worker, as torch.distributed starts"),
    Marker("rendezvous", r"Launching vLLM \(v[^)]*\) headless multiproc executor",
           "vllm/entrypoints/cli/serve.py", "every headless rank, first"),
    Marker("rendezvous", r"Initializing a V1 LLM engine \(v[^)]*\) with config",
           "vllm/v1/engine/core.py", "the head's engine core"),
    Marker("loading weights", r"Starting to load model ", "vllm/v1/worker/gpu_model_runner.py",
           "global rank 0 only (info_once scope=global)"),
    Marker("loading weights", r"Filesystem type for checkpoints: ", "vllm/model_executor/model_loader/weight_utils.py",
           "every node's first rank, as loading starts"),
    Marker("loading weights", r"Loading weights took [\d.]+ seconds", "vllm/model_executor/model_loader/default_loader.py",
           "every node's first rank"),
    Marker("loading weights", r"Model loading took \S+ GiB memory and", "vllm/v1/worker/gpu_model_runner.py",
           "every node's first rank"),
    Marker("graph capture", r"Capturing CUDA graphs", "vllm/v1/worker/gpu_model_runner.py",
           "global rank 0's progress bar"),
    Marker("graph capture", r"Graph capturing finished in \d+ secs", "vllm/v1/worker/gpu_model_runner.py",
           "every node's first rank"),
    Marker("ready", r"Application startup complete", "uvicorn/lifespan/on.py", "the head's API server"),
)
PHASE_ORDER = ("rendezvous", "loading weights", "graph capture", "ready")

# /metrics names (vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py). Counters are exposed by
# prometheus_client with "_total" appended to the name vLLM declares.
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
GENERATION_TOKENS = "vllm:generation_tokens_total"
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
METRIC_SOURCES: dict[str, str] = {
    NUM_REQUESTS_RUNNING: "vllm/v1/metrics/loggers.py", NUM_REQUESTS_WAITING: "vllm/v1/metrics/loggers.py",
    KV_CACHE_USAGE: "vllm/v1/metrics/loggers.py", GENERATION_TOKENS: "vllm/v1/metrics/loggers.py",
    SPEC_DRAFTS: "vllm/v1/spec_decode/metrics.py", SPEC_DRAFT_TOKENS: "vllm/v1/spec_decode/metrics.py",
    SPEC_ACCEPTED: "vllm/v1/spec_decode/metrics.py",
}


def phase_patterns() -> list[tuple[str, re.Pattern[str]]]:
    """(phase, one regex of all its markers), in the order a rank goes through them."""
    return [(phase, re.compile("|".join(f"(?:{m.pattern})" for m in PHASE_MARKERS if m.phase == phase)))
            for phase in PHASE_ORDER]
