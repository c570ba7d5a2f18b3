#!/usr/bin/env python3
"""The timing figures of the unit-tested paths: printed here, exit 1 on a miss.

A unit test on a loaded 2-CPU machine cannot hold a wall-clock bound; a benchmark run on purpose can.
Each figure is the best of --repeat runs (the least disturbed by other work on the machine).

    python bench/suite_timings.py [--repeat 3]

| figure | target | was |
|---|---|---|
| ckptgen: a full-size sparse 3.00 bpw / 4-bit pack | < 10 s each | test_ckptgen.py:67 |
| readiness.phase_of on 3 huge lines (2.6 MB) | < 2 s (linear) | test_untrusted.py:122 |
| status's /metrics summary of a 2,000,000-line answer | < 5 s | test_untrusted.py:162 |
| promtext.parse on a pathological 60 kB line | < 2 s | test_untrusted.py:319 |
| stand-in: 80 tokens at 400 tok/s (+ 0.05 s TTFT) | 0.2 s <= t < 1.5 s | test_standin.py:245 |
| nccl.parse of 20 pathological 200 kB lines | < 2 s (lines cut to MAX_LINE) | test_nccl.py:194 |
| bench: a request's TTFT (role chunk at 0.02 s, 8 tokens 0.02 s apart) | TTFT < 1 s, > 8 tok/s | test_bench.py:313 |
| bench: a request with --timeout 0.5 against a stalled stream ends | < 2 s | test_bench.py:381 |
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launcher"))
sys.path.insert(0, str(ROOT))


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from sparkctl.facts import promtext
    from sparkctl.lab import ckptgen
    from sparkctl.orchestrate.status import metrics_summary
    from sparkctl.remote.readiness import phase_of
    from sparkctl.rules import nccl

    results: list[tuple[str, float, float, float]] = []  # name, seconds, low, high

    with tempfile.TemporaryDirectory() as tmp:
        for pack in ("3.00bpw", "4bit"):
            n = iter(range(1000))
            secs = best(lambda pack=pack, n=n: ckptgen.make_checkpoint(Path(tmp) / f"{pack}-{next(n)}", pack),
                        args.repeat)
            results.append((f"ckptgen {pack} full-size sparse pack", secs, 0, 10))
    lines = ["Loading " * 200_000, "\x00\xff" * 500_000, "Application startup complete" + "x" * 1_000_000]
    results.append(("phase_of on 3 huge lines", best(lambda: phase_of(lines), args.repeat), 0, 2))
    text = "vllm:num_requests_running 1\n" * 2_000_000
    results.append(("/metrics summary, 2M lines", best(lambda: metrics_summary(text), args.repeat), 0, 5))
    bad = "a{" + "}" * 20_000 + " x\n" + ("a{" + '"' * 20_000) + "\n" + "a " * 20_000
    results.append(("parse_prometheus, pathological", best(lambda: promtext.parse(bad), args.repeat), 0, 2))
    nccl_log = ("a:1:1 [0] " * 20000 + "NCCL INFO x\n") * 20
    results.append(("nccl.parse, 20 pathological lines", best(lambda: nccl.parse(nccl_log), args.repeat), 0, 2))

    from tests.unit import test_bench as tb  # its tiny loopback servers

    def ttft() -> float:
        with tb.tiny_server(tb.stream_app(tb.ok_stream(8), chunked=True, delay=0.02)) as url:
            r = tb.request(url)
        assert r.ok and r.ttft_s is not None and r.decode_tok_s is not None and r.decode_tok_s > 8
        return r.ttft_s

    results.append(("bench: TTFT of one streamed request", min(ttft() for _ in range(args.repeat)), 0.03, 1.0))

    def stalled() -> None:
        release = tb.threading.Event()

        def post(h: object) -> None:
            h.send_response(200)  # type: ignore[attr-defined]
            h.send_header("Content-Type", "text/event-stream")  # type: ignore[attr-defined]
            h.end_headers()  # type: ignore[attr-defined]
            h.wfile.write(tb.sse(tb.chunk(role=True), tb.chunk(" a")))  # type: ignore[attr-defined]
            h.wfile.flush()  # type: ignore[attr-defined]
            release.wait(10)

        with tb.tiny_server(lambda h: tb.models_or(h, post)) as url:
            r = tb.request(url, timeout=0.5)
            release.set()
        assert r.error_kind == "timeout"

    results.append(("bench: --timeout 0.5 on a stalled stream", best(stalled, args.repeat), 0.5, 2.0))

    from tests.kit.local import local_standin
    from tests.unit.test_standin import call, write_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = write_checkpoint(Path(tmp) / "m")
        env = {"STANDIN_DECODE_TOK_S": "400", "STANDIN_TTFT_S": "0.05", "STANDIN_ACCEPT_RATE": "0.5"}
        with local_standin(model, env=env, served_name="lab") as url:
            body = {"model": "lab", "prompt": "x", "max_tokens": 80}
            secs = best(lambda: call(f"{url}/v1/completions", body, key=None), args.repeat)
    results.append(("stand-in: 80 tokens at 400 tok/s", secs, 0.2, 1.5))

    missed = 0
    for name, secs, low, high in results:
        ok = low <= secs < high
        missed += not ok
        print(f"{'ok  ' if ok else 'MISS'} {name}: {secs:.3f} s (target {low:g} <= t < {high:g})")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
