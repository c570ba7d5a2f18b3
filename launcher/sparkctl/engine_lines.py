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
    gpu_only: bool = False  # the GPU model runner prints it; vLLM's CPU runner never does (tests/realengine)


PHASE_MARKERS: tuple[Marker, ...] = (
    Marker("rendezvous", r"world_size=\d+ rank=\d+ local_rank=\d+ distributed_init_method=",
           "vllm/distributed/parallel_state.py", "every rank's worker, as torch.distributed starts"),
    Marker("rendezvous", r"Launching vLLM \(v[^)]*\) headless multiproc executor",
           "vllm/entrypoints/cli/serve.py", "every headless rank, first"),
    Marker("rendezvous", r"Initializing a V1 LLM engine \(v[^)]*\) with config",
           "vllm/v1/engine/core.py", "the head's engine core"),
    Marker("loading weights", r"Starting to load model ", "vllm/v1/worker/gpu_model_runner.py",
           "global rank 0 only (info_once scope=global); on CPU every rank (cpu_model_runner.py logs it plainly)"),
    Marker("loading weights", r"Filesystem type for checkpoints: ", "vllm/model_executor/model_loader/weight_utils.py",
           "every node's first rank, as loading starts"),
    Marker("loading weights", r"Loading weights took [\d.]+ seconds", "vllm/model_executor/model_loader/default_loader.py",
           "every node's first rank"),
    Marker("loading weights", r"Model loading took \S+ GiB memory and", "vllm/v1/worker/gpu_model_runner.py",
           "every node's first rank", gpu_only=True),
    Marker("graph capture", r"Capturing CUDA graphs", "vllm/v1/worker/gpu_model_runner.py",
           "global rank 0's progress bar", gpu_only=True),
    Marker("graph capture", r"Graph capturing finished in \d+ secs", "vllm/v1/worker/gpu_model_runner.py",
           "every node's first rank", gpu_only=True),
    Marker("ready", r"Application startup complete", "uvicorn/lifespan/on.py", "the head's API server"),
)
PHASE_ORDER = ("rendezvous", "loading weights", "graph capture", "ready")

# Lines of a rank whose start failed, in vLLM 0.33's own words. vLLM prints more after them (the
# engine core's and API server's shutdown), so `wait` looks for these in the whole log tail of a dead
# rank and names the first one it finds; `phase` here is what failed.
FAILURE_MARKERS: tuple[Marker, ...] = (
    Marker("a shard the index names is missing", r"Weight files referenced in index but missing: ",
           "vllm/model_executor/model_loader/weight_utils.py",
           "every rank whose node's folder lacks it (filter_duplicate_safetensors_files), before any weight is read"),
    Marker("no weight files", r"Cannot find any model weights with ",
           "vllm/model_executor/model_loader/default_loader.py",
           "every rank whose node's folder has no *.safetensors/*.bin/*.pt (DefaultModelLoader._prepare_weights)"),
    Marker("the worker failed to start", r"WorkerProc failed to start\.", "vllm/v1/executor/multiproc_executor.py",
           "a rank whose worker raised before READY (its traceback follows, each line with the same prefix)"),
)

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


_FAILURES = [(m, re.compile(m.pattern)) for m in FAILURE_MARKERS]
# vllm/logger.py _FORMAT's prefix: "(Worker_TP1 pid=7) ERROR 11-29 10:01:11 [file.py:123] "
_PREFIX = re.compile(r"^\((?P<proc>[^()\s]{1,64}) pid=(?P<pid>\d{1,10})\) [A-Z]{1,8} [\d-]{1,8} [\d:]{1,8} "
                     r"\[(?P<where>[^\]\s]{1,200})\] ")


def _message(line: str) -> str:
    m = _PREFIX.match(line)
    return (line[m.end():] if m else line).strip()[:500]


def failure_in(lines: list[str]) -> tuple[str, str] | None:
    """(what failed, vLLM's own words for it) for a dead rank's log, or None when no line says.

    The specific causes are looked for first, anywhere in the lines. For "WorkerProc failed to
    start." the words are the traceback's last line: vLLM's formatter prefixes every line of the
    record, so the traceback is the run of lines after it with the same process, pid and place."""
    for marker, rx in _FAILURES:
        for i, line in enumerate(lines):
            if not rx.search(line[:4096]):
                continue
            m = _PREFIX.match(line)
            last = line
            if m and marker.pattern.startswith("WorkerProc"):
                key = (m.group("proc"), m.group("pid"), m.group("where"))
                for nxt in lines[i + 1:]:
                    n = _PREFIX.match(nxt)
                    if not n or (n.group("proc"), n.group("pid"), n.group("where")) != key:
                        break
                    last = nxt
            return marker.phase, _message(last)
    return None
