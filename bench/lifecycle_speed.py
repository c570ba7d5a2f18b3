#!/usr/bin/env python3
"""The lifecycle's figures on the lab (4 hosts, stand-in engine with zero load delay), best of N runs:

  up (nothing running → all ranks started)   ≤ 2.0 s   wall time of the real CLI
  wait notices readiness                     ≤ 1.0 s   after the head's /health first answers 200
  down                                       ≤ 2.0 s
  up on an identical running cluster         ≤ 1.5 s
  SSH connections per node per command       exactly 1 (sshd "Accepted publickey" lines)

Prints the figures and exits 1 when a target is missed. Needs root and a lab (`sparkctl lab up`);
builds the lab chain first if it is missing (not timed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.kit: the lab client and the loopback stand-in
from tests.kit.lab import Lab  # noqa: E402

NODES = ["spark1", "spark2", "spark3", "spark4"]
KNOBS = {"CLUSTER_NAME": "bench", "PORT": "18890", "MASTER_PORT": "39503", "STANDIN_LOAD_DELAY_S": "0"}
TARGETS = {"up": 2.0, "wait_notice": 1.0, "down": 2.0, "noop_up": 1.5}


def env(lab: Lab, **extra: str) -> dict[str, str]:
    return {**lab.env(), "NODES": " ".join(NODES), **KNOBS, **extra}


def sparkctl(lab: Lab, *args: str, extra: dict[str, str] | None = None) -> tuple[float, dict[str, Any], int]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "sparkctl", "--json", *args], env=env(lab, **(extra or {})),
                       capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - start
    try:
        doc = json.loads(r.stdout) if r.stdout.strip() else {}
    except json.JSONDecodeError:
        doc = {}
    if r.returncode != 0:
        raise SystemExit(f"sparkctl {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-1500:]}")
    return wall, doc, r.returncode


def accepted(lab: Lab) -> dict[str, int]:
    return {n: lab.host(n).sshd_log.read_text(errors="replace").count("Accepted publickey") for n in NODES}


def connections(lab: Lab, before: dict[str, int]) -> dict[str, int]:
    after = accepted(lab)
    return {n: after[n] - before[n] for n in NODES}


def health_watch(url: str, stop: threading.Event, seen: dict[str, float]) -> None:
    """Poll /health every 10 ms from this machine: the moment the head turns ready."""
    deadline = time.monotonic() + 120
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:  # noqa: S310 - the lab's own head
                if r.status == 200:
                    seen["ready_at"] = time.time()
                    return
        except OSError:
            pass
        time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    lab = Lab.load()
    missing = [n for n in NODES if n not in lab.names]
    if missing:
        raise SystemExit(f"the lab lacks {missing}: sparkctl lab up --nodes 4")
    subprocess.run([sys.executable, "-m", "sparkctl", "build"], env=env(lab), check=True, capture_output=True,
                   timeout=900)
    sparkctl(lab, "down")
    best: dict[str, float] = {}
    conns: dict[str, dict[str, int]] = {}
    url = f"http://{lab.host(NODES[0]).mgmt_ip}:{KNOBS['PORT']}/health"

    def keep(name: str, value: float) -> None:
        best[name] = min(best.get(name, float("inf")), value)

    for _ in range(args.repeat):
        before = accepted(lab)
        wall, doc, _ = sparkctl(lab, "up")
        conns["up"] = connections(lab, before)
        keep("up", wall)
        assert doc.get("changed"), doc

        stop, seen = threading.Event(), {}
        watcher = threading.Thread(target=health_watch, args=(url, stop, seen), daemon=True)
        watcher.start()
        before = accepted(lab)
        _, wdoc, _ = sparkctl(lab, "wait", "--timeout", "60")
        conns["wait"] = connections(lab, before)
        stop.set()
        watcher.join(2)
        if "ready_at" in seen:
            keep("wait_notice", max(0.0, wdoc["health_ok_at"] - seen["ready_at"]))

        before = accepted(lab)
        wall, doc, _ = sparkctl(lab, "up")
        conns["noop_up"] = connections(lab, before)
        assert not doc.get("changed"), doc
        keep("noop_up", wall)

        before = accepted(lab)
        wall, _, _ = sparkctl(lab, "down")
        conns["down"] = connections(lab, before)
        keep("down", wall)

    failed = []
    print(f"{'figure':<34}{'best of ' + str(args.repeat):>14}{'target':>10}")
    for name, target in TARGETS.items():
        value = best.get(name)
        ok = value is not None and value <= target
        failed += [] if ok else [name]
        shown = "n/a" if value is None else f"{value:.3f} s"
        print(f"{name:<34}{shown:>14}{target:>9.1f}s  {'ok' if ok else 'MISSED'}")
    for cmd, per_node in conns.items():
        ok = all(v == 1 for v in per_node.values())
        failed += [] if ok else [f"connections/{cmd}"]
        print(f"ssh connections per node, {cmd:<8}{json.dumps(per_node):>40}  {'ok' if ok else 'MISSED'}")
    if failed:
        print("missed: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
