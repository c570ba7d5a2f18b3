#!/usr/bin/env python3
"""Benchmark `sparkctl build` on the lab (4 hosts, the lab recipe's chain over the >= 100 MB lab base).

Targets:
  1. no-change `build` on 4 ranks: nothing rebuilt, <= 3 s wall
  2. no-change `build --ship`: 0 bytes sent
  3. one top-layer change with `--ship`: bytes sent <= 1.1 x (compressed size of the changed layers x 3)
  4. shipping the full chain to 3 ranks takes <= 1.4 x shipping it to 1

Bytes sent are everything written to the ranks' `docker load` streams (layers, configs, manifest,
tar headers), as sparkctl counts them. The compressed size of the change is measured independently:
the new layers' tars from the head's `docker save`, compressed with the codec the ship used.
Prints the figures; exits 1 when a target is missed. Needs root (it brings the lab up if it is not).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.kit: the lab client and the loopback stand-in
from sparkctl.lab import manage  # noqa: E402
from sparkctl.spec.recipes import load_recipe  # noqa: E402
from tests.kit.lab import Lab  # noqa: E402

# SPARKCTL_BENCH_RANKS="spark1 spark2 spark5 spark6" picks other lab hosts (head first); default spark1..4.
RANKS = os.environ.get("SPARKCTL_BENCH_RANKS", "spark1 spark2 spark3 spark4").split()
RECIPE = load_recipe("lab")
TAGS = [f"{RECIPE.tag_prefix}:{name}" for name in RECIPE.layer_names()]
TOP = TAGS[-1]
BASE = str(RECIPE.defaults["BASE_IMAGE"])  # the lab base plus the stand-in engine
REPEAT = 3

# One top-layer change, shaped like a real patch release: keys3 rewrites a ~200 KB Python module.
CHANGE = (
    "\n# bench: a new revision of the keys3 patch (regenerates a ~200 KB source file)\n"
    "RUN python3 -c 'import random; r = random.Random(7); words = [\"tensor\", \"rank\", \"layer\", \"expert\", "
    "\"codebook\", \"shard\", \"kv\", \"scale\"]; open(\"/opt/serving/keys3/patched_module.py\", \"w\")"
    ".write(\"\".join(\"def f%d(%s):\\n    return %s * %d\\n\" % (i, r.choice(words), r.choice(words), r.randrange(10**6)) "
    "for i in range(6000)))'\n"
)


def sparkctl(lab: Lab, nodes: list[str], *args: str) -> tuple[float, dict[str, Any]]:
    env = {**lab.env(), "NODES": " ".join(nodes), "TP": str(len(nodes)), "DCP": str(len(nodes))}
    start = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "sparkctl", "--env-file", str(lab.env_file), "--json", "build", *args],
                         capture_output=True, text=True, env=env, timeout=900, check=False)
    wall = time.monotonic() - start
    if res.returncode != 0:
        raise SystemExit(f"sparkctl build {' '.join(args)} failed (exit {res.returncode}):\n{res.stderr[-2000:]}")
    return wall, json.loads(res.stdout)


def image(lab: Lab, node: str, ref: str) -> dict[str, Any] | None:
    res = lab.docker(node, "image", "inspect", ref)
    return json.loads(res.stdout)[0] if res.returncode == 0 else None


def compressed_layers(lab: Lab, node: str, ref: str, diff_ids: list[str], codec: str) -> int:
    """Compressed bytes of the given layers of `ref` on `node`, from its own `docker save`."""
    with tempfile.TemporaryDirectory() as tmp:
        save = subprocess.Popen(["docker", "-H", lab.host(node).docker_host, "save", ref], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tmp, "-f", "-"], stdin=save.stdout, check=True, timeout=300)
        save.wait(timeout=60)
        by_digest = {}
        for path in Path(tmp).rglob("*"):
            if path.is_file() and not path.is_symlink() and (path.name == "layer.tar" or "blobs" in path.parts):
                by_digest["sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()] = path
        z = {"zstd": ["zstd", "-q", "-3", "-c"], "pigz": ["pigz", "-c", "-3"]}.get(codec, ["gzip", "-c", "-3"])
        total = 0
        for diff in diff_ids:
            data = by_digest[diff].read_bytes()
            total += len(subprocess.run(z, input=data, capture_output=True, check=True, timeout=300).stdout)
        return total


def main() -> int:
    if os.geteuid() != 0:
        print("bench/build_speed.py needs root (the lab)", file=sys.stderr)
        return 2
    _, hosts, _ = manage.status(deep=False)
    started = False
    healthy = {h.name for h in hosts if h.ok}
    if not set(RANKS) <= healthy:
        manage.up(nodes=max(len(RANKS), len(hosts)))
        started = True
    lab = Lab.load()
    misses: list[str] = []
    try:
        base = image(lab, "spark1", BASE)
        assert base is not None, f"{BASE} missing on spark1"
        print(f"base {BASE}: {base['Size'] / 1e6:.0f} MB, {len(base['RootFS']['Layers'])} layer(s)")
        if base["Size"] < 100e6:
            misses.append(f"lab base is {base['Size'] / 1e6:.0f} MB, not >= 100 MB")

        sparkctl(lab, RANKS)  # the chain exists everywhere before measuring
        walls = []
        for _ in range(REPEAT):
            wall, doc = sparkctl(lab, RANKS)
            rebuilt = [(r["node"], x["layer"]) for r in doc["ranks"] for x in r["layers"] if x["action"] != "skip"]
            if rebuilt:
                misses.append(f"no-change build rebuilt {rebuilt}")
            walls.append(wall)
        wall = statistics.median(walls)
        print(f"1. no-change build, {len(RANKS)} ranks: {wall:.2f} s wall (median of {REPEAT}; target <= 3 s)")
        if wall > 3.0:
            misses.append(f"no-change build took {wall:.2f} s > 3 s")

        _, doc = sparkctl(lab, RANKS, "--ship")
        _, doc = sparkctl(lab, RANKS, "--ship")
        sent = doc["ship"]["bytes_sent"]
        print(f"2. no-change build --ship: {sent} bytes sent (target 0)")
        if sent != 0:
            misses.append(f"no-change --ship sent {sent} bytes")

        before = image(lab, "spark1", TOP)
        assert before is not None
        head_dockerfile = lab.host("spark1").model_dir / "serving" / "Dockerfile.keys3"
        original = head_dockerfile.read_bytes()
        try:
            head_dockerfile.write_bytes(original + CHANGE.encode())
            _, doc = sparkctl(lab, RANKS, "--ship")
            after = image(lab, "spark1", TOP)
            assert after is not None
            new = [d for d in after["RootFS"]["Layers"] if d not in set(before["RootFS"]["Layers"])]
            codec = doc["ship"]["codec"]
            layer_bytes = compressed_layers(lab, "spark1", TOP, new, codec)
            sent = doc["ship"]["bytes_sent"]
            targets = len(RANKS) - 1
            limit = 1.1 * layer_bytes * targets
            print(f"3. one top-layer change, --ship: {sent} bytes sent to {targets} ranks; the change is {len(new)} new "
                  f"layer(s), {layer_bytes} bytes {codec}-compressed; target <= {limit:.0f} "
                  f"(1.1 x {targets} x {layer_bytes}) -> {sent / (targets * layer_bytes):.3f} x per rank")
            if sent > limit:
                misses.append(f"top-layer ship sent {sent} > {limit:.0f}")
            ids = {n: (image(lab, n, TOP) or {}).get("Id") for n in RANKS}
            if len(set(ids.values())) != 1:
                misses.append(f"image IDs differ after --ship: {ids}")
        finally:
            head_dockerfile.write_bytes(original)
        sparkctl(lab, ["spark1"])  # back to the checkpoint's Dockerfiles on the head

        def ship_full(targets: list[str]) -> float:
            times = []
            for _ in range(REPEAT):
                for n in targets:  # the chain goes, the base stays
                    lab.docker(n, "rmi", "-f", *TAGS, timeout=120)
                wall, doc = sparkctl(lab, ["spark1", *targets], "--ship")
                if not all(r["ok"] for r in doc["ranks"]):
                    misses.append(f"full ship to {targets} failed")
                times.append(wall)
            return statistics.median(times)

        one = ship_full(RANKS[1:2])
        three = ship_full(RANKS[1:])
        print(f"4. full chain --ship: 1 rank {one:.2f} s, {len(RANKS) - 1} ranks {three:.2f} s -> {three / one:.2f} x "
              "(target <= 1.4 x)")
        if three > 1.4 * one:
            misses.append(f"3-rank ship {three:.2f} s > 1.4 x 1-rank {one:.2f} s")
    finally:
        if started and os.environ.get("SPARKCTL_LAB_KEEP") != "1":
            manage.down()
    for m in misses:
        print(f"MISSED: {m}", file=sys.stderr)
    print("build_speed: " + ("all targets met" if not misses else f"{len(misses)} target(s) missed"))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
