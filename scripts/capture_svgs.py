#!/usr/bin/env python3
"""Capture what a person sees from `sparkctl check` and `sparkctl status` on the lab as SVG pictures
(docs/img/check.svg, docs/img/status.svg), drawn by sparkctl's own rich console: the README shows them.

    python scripts/capture_svgs.py [--out docs/img] [--width 120]

Needs root and a running lab (`sparkctl lab up --nodes 4`). When the lab's service is not running it is
started first (`up`, `wait`) and taken down again after, so the lab is left as it was found. Exits 1 when a
command could not be captured, 2 when there is no lab.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launcher"))
sys.path.insert(0, str(ROOT))  # tests.kit: the lab client

from rich.console import Console  # noqa: E402

from sparkctl import cli, output  # noqa: E402
from tests.kit.lab import running_lab  # noqa: E402

NODES = ["spark1", "spark2", "spark3", "spark4"]


def _sparkctl(env: dict[str, str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _capture(args: list[str], title: str, width: int) -> tuple[int, str]:
    """Run `sparkctl ARGS` in this process with its human text recorded; the exit code and the SVG."""
    recording = Console(record=True, width=width, force_terminal=True, color_system="truecolor",
                        highlight=False, soft_wrap=False, file=io.StringIO())
    output.record_into(recording)
    code = 0
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            cli.main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    finally:
        output.record_into(None)
    return code, recording.export_svg(title=title)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--width", type=int, default=120)
    args = ap.parse_args()
    lab = running_lab()
    if lab is None:
        return 2
    env = {**os.environ, **lab.env(), "NODES": " ".join(NODES), **lab.pin_knobs(NODES)}
    os.environ.clear()
    os.environ.update(env)
    if _sparkctl(env, "status").returncode == 0:
        print("the lab's service is running: `check` is captured before `up` (run `sparkctl down` first)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0

    def capture(name: str, argv: list[str]) -> None:
        nonlocal failed
        code, svg = _capture(argv, f"sparkctl {' '.join(argv)}", args.width)
        if "<svg" not in svg or code != 0:
            print(f"sparkctl {name}: exit {code}, not captured", file=sys.stderr)
            failed += 1
            return
        (args.out / f"{name}.svg").write_text(svg)
        print(f"{args.out / (name + '.svg')}: sparkctl {' '.join(argv)}, {len(svg):,} bytes")

    capture("check", ["check"])  # the preflight, as a user sees it before the first `up`
    try:
        for step in (["up"], ["wait", "--timeout", "300"]):
            r = _sparkctl(env, *step)
            if r.returncode != 0:
                print(f"sparkctl {' '.join(step)} failed (exit {r.returncode}):\n{r.stderr[-2000:]}",
                      file=sys.stderr)
                return 1
        capture("status", ["status"])
    finally:
        _sparkctl(env, "down")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
