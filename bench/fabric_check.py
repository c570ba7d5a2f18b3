#!/usr/bin/env python3
"""Benchmark `sparkctl check --fabric` on 4 lab hosts against its targets; prints the figures,
exits 1 if one is missed (2 when the lab is not there to measure).

Targets: the fabric test (every rank's container started, the gloo all-reduce at the lab recipe's
sizes, every container removed) finishes within 60 s, and leaves 0 fabric-test containers on any host.
Figures printed: the fabric test's wall time as sparkctl measured it (`fabric.seconds` in --json: from
the first `docker run` to the last sweep), the collective itself (the slowest rank's own time from
`init_process_group` to its last all-reduce, `collective_s`), and the overhead beyond the collective
(container start + interpreter and torch import + cleanup = seconds - collective_s); also the whole
`check --fabric` wall time and busbw per size. Best of --repeat.

    python bench/fabric_check.py [--repeat 3]

Needs root and a running lab (`sparkctl lab up --nodes 4`); loads the lab's torch image into the hosts
first if they lack it (`sparkctl lab torch`: ~1.5 min the first time on this machine, seconds after).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launcher"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.kit: the lab client and the loopback stand-in

from sparkctl.lab.state import HostPaths  # noqa: E402
from tests.kit.lab import Lab  # noqa: E402

NODES = ["spark1", "spark2", "spark3", "spark4"]
TARGET_S = 60.0
CLUSTER, MASTER_PORT = "benchfabric", "39541"  # our own label value and port on the shared lab


def left(lab: Lab) -> int:
    n = 0
    for h in NODES:
        r = lab.docker(h, "ps", "-aq", "--filter", "label=sparkctl.purpose=fabric-test")
        n += len(r.stdout.split())
    return n


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    try:
        lab = Lab.load()
    except Exception as exc:
        print(f"no lab to measure on: {exc} (sparkctl lab up --nodes 4)", file=sys.stderr)
        return 2
    if len(lab.names) < 4:
        print("the lab has fewer than 4 hosts (sparkctl lab up --nodes 4)", file=sys.stderr)
        return 2
    from sparkctl.lab.torch_image import ensure_torch

    t = time.monotonic()
    ensure_torch([HostPaths.of(n, lab.root) for n in NODES])
    print(f"torch image on 4 hosts: {time.monotonic() - t:.1f}s (once per lab)")
    env = {**lab.env(), "NODES": " ".join(NODES), "CLUSTER_NAME": CLUSTER, "MASTER_PORT": MASTER_PORT}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            t0 = time.monotonic()
            r = subprocess.run([sys.executable, "-m", "sparkctl", "--json", "check", "--fabric",
                                "--out", f"{tmp}/env.tp4"], env=env, capture_output=True, text=True, timeout=300)
            wall = time.monotonic() - t0
            try:
                fab = json.loads(r.stdout)["fabric"]
            except (ValueError, KeyError, TypeError):
                print(f"run {i + 1}: no fabric report (exit {r.returncode}): {r.stderr.strip()[-500:]}")
                return 1
            n_left = left(lab)
            over = fab["seconds"] - fab["collective_s"]
            print(f"run {i + 1}: fabric test {fab['seconds']:.2f}s (collective {fab['collective_s']:.2f}s, "
                  f"overhead start+cleanup {over:.2f}s), whole check --fabric {wall:.2f}s, ok={fab['ok']}, "
                  f"containers left {n_left}, busbw GB/s {fab['busbw_gbps']}")
            runs.append((fab["seconds"], fab["collective_s"], over, wall, fab["ok"], n_left))
    best = min(runs)
    missed = []
    if not all(r[4] for r in runs):
        missed.append("a run's fabric test did not pass")
    if best[0] > TARGET_S:
        missed.append(f"fabric test {best[0]:.1f}s > {TARGET_S:g}s")
    if any(r[5] for r in runs):
        missed.append("fabric-test containers were left behind")
    print(f"best: fabric test {best[0]:.2f}s (target <= {TARGET_S:g}s), collective {best[1]:.2f}s, "
          f"overhead beyond the collective {best[2]:.2f}s, check --fabric {best[3]:.2f}s, containers left "
          f"{max(r[5] for r in runs)} (target 0)")
    if missed:
        print("MISSED: " + "; ".join(missed))
        return 1
    print("all targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
