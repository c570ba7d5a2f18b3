#!/usr/bin/env python3
"""Benchmark the fidelity suite; prints the figures, exits 1 if a target is missed.

1. Cold install of the fidelity venv (tests/fidelity/setup_venv.sh into an empty folder): torch CPU,
   vLLM 0.33.0 and the pinned requirements. Target: <= 600 s (it must fit in CI on a new machine).
   Skipped with --warm-only.
2. The suite itself with a ready venv (`python -m pytest -q -m fidelity tests/fidelity`).
   Target: <= 180 s on this 2-CPU machine.
3. The cache: a second setup_venv.sh with nothing changed. Target: <= 5 s.

    python bench/fidelity_speed.py [--venv DIR] [--warm-only]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "tests" / "fidelity" / "setup_venv.sh"
TARGETS = {"cold install": 600.0, "suite": 180.0, "cached setup": 5.0}


def timed(argv: list[str], env: dict[str, str], timeout: float) -> tuple[float, subprocess.CompletedProcess[str]]:
    start = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout, check=False)
    return time.monotonic() - start, done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", help="the venv to use for the suite (default: a fresh one, installed cold)")
    ap.add_argument("--warm-only", action="store_true", help="skip the cold install; needs --venv")
    args = ap.parse_args()
    if args.warm_only and not args.venv:
        ap.error("--warm-only needs --venv")

    figures: dict[str, float] = {}
    scratch = None
    venv = Path(args.venv) if args.venv else None
    env = dict(os.environ)
    try:
        if not args.warm_only:
            scratch = Path(tempfile.mkdtemp(prefix="fidelity-venv-"))
            venv = venv or scratch / "venv"
            if venv.exists() and args.venv:
                print(f"--venv {venv} exists; the cold install uses a fresh folder instead", file=sys.stderr)
                venv = scratch / "venv"
            env["SPARKCTL_FIDELITY_VENV"] = str(venv)
            secs, done = timed([str(SETUP)], env, TARGETS["cold install"] * 2)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            figures["cold install"] = secs
        assert venv is not None
        env["SPARKCTL_FIDELITY_VENV"] = str(venv)
        secs, done = timed([str(SETUP)], env, 300)
        figures["cached setup"] = secs
        env["SPARKCTL_FIDELITY"] = "1"
        secs, done = timed([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:warnings", "-m",
                            "fidelity", "tests/fidelity"], env, TARGETS["suite"] * 3)
        figures["suite"] = secs
        summary = done.stdout.strip().splitlines()[-1:] or ["(no output)"]
        print(f"suite result: {summary[0]}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    missed = 0
    for name, secs in figures.items():
        ok = secs <= TARGETS[name]
        missed += not ok
        print(f"{name:13s} {secs:7.1f} s   target <= {TARGETS[name]:g} s   {'ok' if ok else 'MISSED'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
