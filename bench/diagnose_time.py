#!/usr/bin/env python3
"""Benchmark `sparkctl diagnose` on the lab: the whole bundle (check included) of 4 hosts in at most
TARGET_S seconds. Prints the figure (best of --repeat, and every run), the bundle's size and the
manifest's own timing; exits 1 on a miss, 2 when the lab is not there to measure.

    python bench/diagnose_time.py [--repeat 3] [--no-check]

Runs the real CLI as a subprocess (`sparkctl --json diagnose --out ...`) with the lab's env file and
ssh_config, NODES spark1..4. Needs root and a running lab (`sparkctl lab up --nodes 4`).
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.kit: the lab client

from tests.kit.lab import running_lab  # noqa: E402

TARGET_S = 10.0
NODES = ["spark1", "spark2", "spark3", "spark4"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-check", action="store_true", help="leave check out of the bundle")
    args = ap.parse_args()
    lab = running_lab()
    if lab is None:
        return 2
    env = {**lab.env(), "NODES": " ".join(NODES), **lab.pin_knobs(NODES)}
    times: list[float] = []
    manifest: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bundle.tar.gz"
        for _ in range(max(1, args.repeat)):
            start = time.monotonic()
            r = subprocess.run([sys.executable, "-m", "sparkctl", "--json", "diagnose", "--out", str(out),
                                *(["--no-check"] if args.no_check else [])],
                               env=env, cwd=tmp, capture_output=True, text=True, timeout=300)
            times.append(time.monotonic() - start)
            if r.returncode != 0:
                print(f"diagnose failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}", file=sys.stderr)
                return 1
            manifest = json.loads(r.stdout)
        size = out.stat().st_size
    best = min(times)
    missing = [f["path"] for f in manifest.get("files", []) if f.get("missing")]  # type: ignore[union-attr]
    print(f"diagnose on {len(NODES)} lab hosts: best {best:.2f}s (runs: {', '.join(f'{t:.2f}' for t in times)}), "
          f"target ≤ {TARGET_S:.0f}s; bundle {size} bytes; manifest timing {manifest.get('timing_s')}; "
          f"{len(missing)} file(s) missing: {', '.join(missing[:10])}")
    if best > TARGET_S:
        print(f"MISS: {best:.2f}s > {TARGET_S:.0f}s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
