"""`sparkctl deploy` on the lab: sparkctl's own share of a deploy and the no-op re-run, printed, exit 1 on a miss.

    flock /run/lock/sparkctl-labtests.lock .venv/bin/python bench/deploy_time.py

  1. sparkctl's own share of a first `deploy --yes` on 4 nodes <= 5 s: the whole run's wall time less the
     work that is not sparkctl's (the done steps' time in pull, sync and build: downloads, copies, builds;
     the wait step: the engine's load; the report: the completion), read from its --json document
  2. the no-op re-run (`deploy --yes` with nothing changed) <= 3 s wall, every step skipped
Needs the lab up (`sparkctl lab up --nodes 4`) and root. Its own cluster (CLUSTER_NAME=deploybench, its own
ports and MODEL folder, the checkpoint on the head only); it brings the service down and removes the folder
at the end. --no-bench: the short bench is the engine's time, not sparkctl's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.kit: the lab client
from tests.kit.lab import Lab  # noqa: E402

NODES = "spark1 spark2 spark3 spark4"
FOLDER = "deploybench"
OWN_TARGET_S = 5.0
NOOP_TARGET_S = 3.0
NOT_OURS = ("pull", "sync", "build", "wait", "report")  # their time is downloads, copies, builds, the engine


def run(env: dict[str, str], *args: str) -> tuple[float, dict[str, Any], subprocess.CompletedProcess[str]]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env, capture_output=True, text=True,
                       timeout=3600)
    took = time.monotonic() - t0
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = {}
    return took, doc, r


def own_share(wall: float, doc: dict[str, Any]) -> float:
    """The wall time less the done steps' work that is not sparkctl's."""
    theirs = sum(float(s.get("seconds") or 0) for s in doc.get("steps", [])
                 if s.get("step") in NOT_OURS and s.get("status") == "done")
    return wall - theirs


def main() -> int:
    lab = Lab.load()
    head_dir = lab.host("spark1").model_dir
    for h in lab.hosts:
        shutil.rmtree(h.model_dir / FOLDER, ignore_errors=True)
    (head_dir / FOLDER).mkdir()
    for f in head_dir.iterdir():
        if f.is_file():
            shutil.copy2(f, head_dir / FOLDER / f.name)
    shutil.copytree(head_dir / "serving", head_dir / FOLDER / "serving", symlinks=True)  # the image chain
    state = Path(tempfile.mkdtemp(prefix="deploybench-"))
    env = {**lab.env(), "NODES": NODES, "MODEL": f"/models/lab/{FOLDER}", "CLUSTER_NAME": "deploybench",
           "PORT": "18897", "MASTER_PORT": "39531", "XDG_STATE_HOME": str(state)}
    misses = []
    try:
        wall, doc, r = run(env, "deploy", "--yes", "--json", "--no-bench")
        if r.returncode != 0:
            print(f"deploy --yes failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
            return 1
        own = own_share(wall, doc)
        steps = ", ".join(f"{s['step']} {s['status']} {s['seconds']:.2f}s" for s in doc["steps"])
        print(f"first deploy: {wall:.2f}s wall, sparkctl's own share {own:.2f}s (target <= {OWN_TARGET_S}s); {steps}")
        if own > OWN_TARGET_S:
            misses.append(f"own share {own:.2f}s > {OWN_TARGET_S}s")
        wall, doc, r = run(env, "deploy", "--yes", "--json", "--no-bench")
        skipped = all(s["status"] == "skipped" for s in doc.get("steps", []) if s["step"] != "report")
        steps = ", ".join(f"{s['step']} {s['seconds']:.2f}s" for s in doc.get("steps", []))
        print(f"no-op re-run: {wall:.2f}s wall (target <= {NOOP_TARGET_S}s), every step skipped: {skipped}, "
              f"noop: {doc.get('noop')}; {steps}")
        if r.returncode != 0 or not doc.get("noop"):
            misses.append(f"the re-run was not a no-op (exit {r.returncode}): {r.stderr[-500:]}")
        if wall > NOOP_TARGET_S:
            misses.append(f"no-op re-run {wall:.2f}s > {NOOP_TARGET_S}s")
    finally:
        run(env, "down")
        for h in lab.hosts:
            shutil.rmtree(h.model_dir / FOLDER, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)
    for m in misses:
        print(f"MISS: {m}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
