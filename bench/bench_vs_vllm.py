#!/usr/bin/env python3
"""The referee figures: `sparkctl bench` against vLLM's own `vllm bench serve`, on the same load, on the
lab's real engine (`sparkctl lab up --engine vllm`, recipe lab-vllm, TP 2 on spark1 + spark3).

It runs what a user runs, `sparkctl --json bench --tool vllm --workload prose --concurrency C... --num-prompts N
--input-len I --output-len O` (sparkctl's levels first, then `vllm bench serve` per level in the head's
container), and prints per level the differences that matter, sparkctl's figure against vLLM's:

  median TTFT          within 30 % or 15 ms  (the tolerance of tests/realengine/test_bench_agreement.py)
  mean TPOT            within 50 % or 1.5 ms
  output throughput    within 35 %

Exits 1 when a level misses one of them. The two tools run one after the other (vLLM's inside the container it
measures), so a machine whose load changes between them moves the figures: the load average before and after
is printed with them. `--from-json FILE` judges a saved `bench --tool vllm --save FILE` run instead of
measuring. Needs root, the lab up with `--engine vllm`, and the lab lock (`flock /run/sparkctl-lab-agents.lock`);
it brings the service up (`up`, `wait`) and takes it down again unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LAB = Path(os.environ.get("SPARKCTL_LAB_DIR", "/var/lib/sparkctl-lab"))
# The real-engine lab tests' cluster (tests/lab/realengine.py): its own name and ports.
CLUSTER = {"CLUSTER_NAME": "vllmlab", "NODES": "spark1 spark3", "PORT": "18931", "MASTER_PORT": "39531", "TP": "2"}
# (metric key, what it is called here, relative tolerance, absolute tolerance in the metric's unit)
TOLERANCES = [("median_ttft_ms", "median TTFT (ms)", 0.30, 15.0),
              ("mean_tpot_ms", "mean TPOT (ms)", 0.50, 1.5),
              ("output_throughput", "output throughput (tok/s)", 0.35, 0.0)]


def sparkctl(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPARKCTL_SSH_CONFIG": str(LAB / "ssh_config"),
           "SPARKCTL_ENV_FILE": str(LAB / "lab-vllm.env"), **CLUSTER}
    return subprocess.run([str(ROOT / ".venv/bin/sparkctl"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def judge(doc: dict[str, Any]) -> list[str]:
    """Print the table; the misses, one line each."""
    task = doc["vllm_bench_serve"]["workload_compared"]
    mine = {int(lv["concurrency"]): lv for lv in doc["workloads"][task]}
    misses = []
    print(f"workload {task}; sparkctl vs vllm bench serve (vLLM's definitions and names)")
    print("| C | metric | sparkctl | vllm bench serve | diff | tolerance | |")
    print("|---:|---|---:|---:|---:|---|---|")
    for level in doc["vllm_bench_serve"]["levels"]:
        c = int(level["concurrency"])
        for key, name, rel, absolute in TOLERANCES:
            a, b = mine[c].get(key), level["result"].get(key)
            if not isinstance(a, int | float) or not isinstance(b, int | float) or b == 0:
                misses.append(f"C={c} {name}: not measured (sparkctl {a}, vLLM {b})")
                continue
            diff = a - b
            ok = abs(diff) <= rel * abs(b) or abs(diff) <= absolute
            limit = f"{rel:.0%}" + (f" or {absolute:g}" if absolute else "")
            print(f"| {c} | {name} | {a:,.2f} | {b:,.2f} | {diff / b:+.1%} | {limit} | {'ok' if ok else 'MISS'} |")
            if not ok:
                misses.append(f"C={c} {name}: sparkctl {a:,.2f} vs vLLM {b:,.2f} ({diff / b:+.1%}, allowed {limit})")
    return misses


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-prompts", default="20")
    ap.add_argument("--input-len", default="32")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--from-json", type=Path, help="judge a saved `bench --tool vllm --save` run")
    ap.add_argument("--keep", action="store_true", help="leave the service up")
    a = ap.parse_args()
    if a.from_json:
        doc = json.loads(a.from_json.read_text())
    else:
        for step, args, limit in (("up", ("up",), 600), ("wait", ("wait", "--timeout", "600"), 660)):
            r = sparkctl(*args, timeout=limit)
            if r.returncode:
                print(f"{step} failed ({r.returncode}): {r.stderr.strip()[-800:]}", file=sys.stderr)
                return 1
        before = load()
        try:
            r = sparkctl("--json", "bench", "--tool", "vllm", "--workload", "prose", "--concurrency", a.concurrency,
                         "--num-prompts", a.num_prompts, "--input-len", a.input_len, "--output-len", a.output_len,
                         timeout=3600)
        finally:
            if not a.keep:
                sparkctl("down", timeout=300)
        print(f"load average {before} before, {load()} after")
        if r.returncode:
            print(f"bench failed ({r.returncode}): {r.stderr.strip()[-800:]}", file=sys.stderr)
            return 1
        doc = json.loads(r.stdout)
    misses = judge(doc)
    for m in misses:
        print(f"MISS {m}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
