#!/usr/bin/env python3
"""The load generator's own CPU per stream: it must never be what it measures.

The lab's stand-in engine serves on loopback (a subprocess: its CPU is not the client's) at
STANDIN_DECODE_TOK_S per stream, one token per chunk (no speculation: the client's worst case, one
wake-up per token). sparkctl's load generator (loadgen.level.run_level, in this process) runs C streams at
C = 1, 8, 32 and 64, one wave of C requests of OUTPUT_LEN tokens each, and measures its own CPU time
(time.process_time, all its threads) over the level's wall time. Printed per level: the client's CPU
in % of one core, per stream, per chunk (µs), the chunks per second it read, and the server's rate.

Target: client CPU ≤ 10% of one core at C = 64. Exit 1 on a miss, saying what limits it: the client
pays per chunk (one wake-up, one JSON parse; vLLM's own benchmark does the same per chunk), so its CPU
is chunks/s × µs per chunk, and the break-even rate (chunks/s at 10% of a core) is printed.

    python bench/loadgen_cpu.py [--tok-s 20] [--output-len 128]      # about 40 s
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launcher"))
sys.path.insert(0, str(ROOT))  # tests.kit: the lab client and the loopback stand-in
from sparkctl.lab.ckptgen import make_checkpoint  # noqa: E402
from sparkctl.loadgen import inputs, level, request  # noqa: E402
from sparkctl.remote import headapi  # noqa: E402
from tests.kit.local import local_standin  # noqa: E402

LEVELS = (1, 8, 32, 64)
TARGET_PCT = 10.0  # of one core, at C = 64


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tok-s", type=float, default=20.0, help="stand-in decode rate per stream (default 20)")
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        make_checkpoint(model, "tiny")
        env = {"STANDIN_DECODE_TOK_S": str(args.tok_s), "STANDIN_TTFT_S": "0.05"}
        with local_standin(model, env=env, served_name="m", extra_args=["--max-num-seqs", "256"]) as url:
            cfg = level.BenchConfig(endpoint=headapi.Endpoint.parse(url), model="m", warmup=0,
                                      max_tokens=args.output_len, timeout=120,
                                      workloads=[inputs.builtin_workload("prose")])
            sampling = level.Sampling(cfg, "cpu")
            print(f"stand-in at {args.tok_s:g} tok/s per stream, one token per chunk, {args.output_len}-token "
                  f"outputs, one wave of C requests per level")
            print(f"{'C':>4} {'client CPU % core':>18} {'per stream %':>13} {'µs/chunk':>9} {'chunks/s':>9} "
                  f"{'server tok/s':>13} {'failed':>7}")
            worst = None
            for c in LEVELS:
                lv = level.run_level(cfg, sampling, cfg.workloads[0], c, c, request.Canceller(),
                                       level.ProgressSink(), measure_spec=False)
                d = lv.to_dict()
                chunks = d["output_chunks"]
                pct = 100.0 * lv.cpu_s / lv.wall_s if lv.wall_s > 0 else float("nan")
                us = 1e6 * lv.cpu_s / chunks if chunks else float("nan")
                rate = chunks / lv.wall_s if lv.wall_s > 0 else 0.0
                print(f"{c:>4} {pct:>18.2f} {pct / c:>13.3f} {us:>9.1f} {rate:>9.0f} "
                      f"{(d['output_throughput'] or 0):>13.0f} {d['failed']:>7}")
                if c == LEVELS[-1]:
                    worst = (pct, us, rate, d["failed"])
                    asked = c * args.tok_s
                    if rate < 0.8 * asked:
                        print(f"note: at C={c} the stand-in delivered {rate:,.0f} of the {asked:,.0f} chunks/s asked "
                              f"({100 * rate / asked:.0f}%): the server, on this machine's CPUs, is the limit there; "
                              f"at the asked rate the client would pay ≈ {us * asked / 1e4:.1f}% of a core")
    assert worst is not None
    pct, us, rate, failed = worst
    break_even = TARGET_PCT / 100.0 * 1e6 / us if us == us and us > 0 else float("nan")
    print(f"at C={LEVELS[-1]}: client {pct:.2f}% of a core (target ≤ {TARGET_PCT:g}%); it pays ≈ {us:.0f} µs "
          f"per chunk, so {TARGET_PCT:g}% of a core reads ≈ {break_even:,.0f} chunks/s in all "
          f"({break_even / LEVELS[-1]:,.0f} per stream at C={LEVELS[-1]})")
    if failed:
        print(f"MISS: {failed} request(s) failed at C={LEVELS[-1]}")
        return 1
    if not pct <= TARGET_PCT:
        print(f"MISS: the client's CPU at C={LEVELS[-1]} is above {TARGET_PCT:g}% of a core: what limits it is "
              f"the chunk rate ({rate:,.0f}/s here) × its cost per chunk (wake-up + JSON parse)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
