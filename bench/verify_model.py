#!/usr/bin/env python3
"""Benchmark `verify-model` against its targets; prints the figures, exits 1 if one is missed.

1. Header-level verification of the full-size sparse packs (ckptgen): 3.00 bpw (41 shards, 58k+
   tensors) in <= 1.0 s and 2.75 bpw (81 shards) in <= 1.5 s, each reading < 64 MB
   (bytes read = /proc/self/io rchar delta over one scan+verify). Best of --repeat runs (the
   median is printed too): on a shared machine the best run is the one least disturbed by others.
2. --deep throughput vs `cat shards > /dev/null` on --data-gb of real (non-sparse) data, >= 80%.
   Two comparisons, both printed:
   - cold: each file's pages are evicted with posix_fadvise(DONTNEED) before each run, so both
     read from the disk. This is the target ("close to the disk's read speed").
   - warm: both read from the page cache. Then sha256 (CPU-bound: ~1.7 GB/s per core with SHA-NI)
     is compared with a memory copy, so the ratio is roughly cores x 1.7 / memcpy speed: printed
     for information, not held to the target.

    python bench/verify_model.py [--data-gb 2] [--repeat 5] [--workers N] [--dir TMPDIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launcher"))

from sparkctl.checkpoint.verify import verify_dir  # noqa: E402
from sparkctl.lab.ckptgen import make_checkpoint  # noqa: E402
from sparkctl.probes.ckpt_scan import deep_hashes  # noqa: E402
from sparkctl.spec.recipes import load_layout  # noqa: E402

MB = 1_000_000


def rchar() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def bench_headers(root: Path, pack: str, layout: str, limit_s: float, repeat: int) -> bool:
    d = root / pack
    t0 = time.perf_counter()
    make_checkpoint(d, pack, serving=False)
    gen = time.perf_counter() - t0
    rules = load_layout(layout)
    times, cpu = [], []
    read = 0
    for i in range(repeat):
        r0, c0, w0 = rchar(), time.process_time(), time.perf_counter()
        report = verify_dir(d, rules)
        times.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
        if i == 0:
            read = rchar() - r0
    best = min(times)
    ok = best <= limit_s and 0 <= read < 64 * MB and report.ok
    s = report.summary
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{pack:8s} {s.shards} shards, {s.tensors:,} tensors, {s.bytes / 2**30:.1f} GiB (generated in {gen:.1f} s); "
          f"{os.cpu_count()} CPUs, load average {load}")
    print(f"         verify: best {best:.3f} s, median {statistics.median(times):.3f} s, cpu best {min(cpu):.3f} s "
          f"(target <= {limit_s} s); read {read / MB:.1f} MB (target < 64 MB); "
          f"verdict {'OK' if report.ok else 'FAILED'} -> {'PASS' if ok else 'MISS'}")
    shutil.rmtree(d)
    return ok


def evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_cat(paths: list[Path]) -> float:
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def timed_deep(paths: list[Path], workers: int | None, cache: Path) -> float:
    cache.unlink(missing_ok=True)  # measure hashing, not the cache
    t0 = time.perf_counter()
    got = deep_hashes([str(p) for p in paths], workers=workers, cache_file=str(cache))
    dt = time.perf_counter() - t0
    assert all("sha256" in v for v in got.values()), got
    return dt


def bench_deep(root: Path, data_gb: float, repeat: int, workers: int | None) -> bool:
    nfiles = 4
    per = int(data_gb * 1e9 / nfiles)
    block = os.urandom(64 * 1024 * 1024)
    paths = []
    for i in range(nfiles):
        p = root / f"shard-{i}.bin"
        with open(p, "wb") as f:
            left = per
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
        paths.append(p)
    total = per * nfiles
    cache = root / "deep-cache.json"
    deep_hashes([str(p) for p in paths], workers=workers, cache_file=str(cache))  # fills the cache
    t0 = time.perf_counter()
    again = deep_hashes([str(p) for p in paths], workers=workers, cache_file=str(cache))
    cached = time.perf_counter() - t0
    assert all(v["cached"] for v in again.values())

    results = {}
    for mode in ("cold", "warm"):
        cats, deeps = [], []
        for _ in range(repeat):
            if mode == "cold":
                evict(paths)
            else:
                timed_cat(paths)  # make sure everything is cached
            cats.append(timed_cat(paths))
            if mode == "cold":
                evict(paths)
            deeps.append(timed_deep(paths, workers, cache))
        cat_s, deep_s = min(cats), min(deeps)
        results[mode] = (total / cat_s, total / deep_s)
    print(f"deep     {total / 1e9:.1f} GB real data in {nfiles} files, {workers or 'default'} workers, "
          f"{os.cpu_count()} CPUs; cached re-run {cached * 1000:.0f} ms")
    for mode, (cat_bps, deep_bps) in results.items():
        ratio = deep_bps / cat_bps
        note = "target >= 80%" if mode == "cold" else "information only (sha256 vs memcpy)"
        print(f"         {mode}: cat {cat_bps / 1e9:.2f} GB/s, --deep {deep_bps / 1e9:.2f} GB/s = {ratio:.0%} ({note})")
    cold_ratio = results["cold"][1] / results["cold"][0]
    evicted = results["cold"][0] < 0.8 * results["warm"][0]
    if not evicted:
        print("         note: eviction did not slow cat down (the disk is as fast as the cache, or the data "
              "stayed cached); the cold figure is then a warm one")
    ok = cold_ratio >= 0.8
    print(f"         -> {'PASS' if ok else 'MISS'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-gb", type=float, default=2.0, help="real data for the --deep comparison")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", type=int, default=None, help="--deep threads (default: the probe's)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    ap.add_argument("--skip-deep", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sparkctl-bench-", dir=args.dir))
    try:
        ok = bench_headers(root, "3.00bpw", "glm53-3.00bpw", 1.0, args.repeat)
        ok &= bench_headers(root, "2.75bpw", "glm53-2.75bpw", 1.5, args.repeat)
        if not args.skip_deep:
            ok &= bench_deep(root, args.data_gb, max(2, args.repeat // 2), args.workers)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("all targets met" if ok else "a target was missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
