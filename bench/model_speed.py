"""model pull / model sync on the lab: the issue's four targets, printed, exit 1 on a miss.

    flock /run/lock/sparkctl-labtests.lock .venv/bin/python bench/model_speed.py [--shards 41 --shard-mb 50]

  1. sync of a generated checkpoint (>= 2 GB, >= 40 shards) head -> 3 ranks <= 1.3 x head -> 1 rank
  2. re-sync with nothing changed: <= 2 s on 4 nodes, 0 bytes of shard data sent
  3. one changed shard: bytes sent per rank <= 1.05 x that shard's size
  4. pull re-run with nothing new: 0 bytes downloaded (counted by the stand-in Hub), in under 2 s
Needs the lab up (`sparkctl lab up --nodes 4`), root, and ~5 x the checkpoint's size free on /var;
everything it writes is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.kit: the lab client and the loopback stand-in
from sparkctl.lab import ckptgen  # noqa: E402
from sparkctl.lab.hfhub import StandinHub  # noqa: E402
from sparkctl.lab.state import MGMT_NET  # noqa: E402
from tests.kit.lab import Lab  # noqa: E402

REPO = "lab/bulk"
SUB = "benchmodel"
HF_PYTHON = Path("/var/cache/sparkctl-lab/hf-python/bin/python")


def run(env: dict[str, str], *args: str) -> tuple[float, dict[str, object], subprocess.CompletedProcess[str]]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "sparkctl", *args, "--json"], env=env, capture_output=True, text=True,
                       timeout=1800)
    took = time.monotonic() - t0
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        doc = {}
    return took, doc, r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=41)
    ap.add_argument("--shard-mb", type=int, default=50)
    args = ap.parse_args()
    lab = Lab.load()
    if not HF_PYTHON.exists():
        subprocess.run(["/usr/bin/python3", "-m", "venv", str(HF_PYTHON.parent.parent)], check=True)
        subprocess.run([str(HF_PYTHON.parent / "pip"), "install", "-q", "huggingface_hub>=0.24"], check=True)
    work = Path(tempfile.mkdtemp(prefix="sparkctl-bench-model-", dir="/var/tmp"))
    dirs = [h.model_dir / SUB for h in lab.hosts]
    misses: list[str] = []
    try:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        t0 = time.monotonic()
        src = ckptgen.make_bulk(work / "src", shards=args.shards, shard_bytes=args.shard_mb * 1_000_000)
        total = sum(p.stat().st_size for p in src.iterdir())
        print(f"generated {args.shards} shards, {total / 1e9:.2f} GB in {time.monotonic() - t0:.1f}s", flush=True)
        hub = StandinHub(work / "hub")
        rev = hub.publish(REPO, src)
        env = {**lab.env(), "NODES": " ".join(lab.names[:4]), "MODEL": f"{lab.model_path}/{SUB}",
               "MODEL_REPO": REPO, "MODEL_REVISION": rev, "HF_PYTHON": str(HF_PYTHON), "CLUSTER_NAME": "benchmodel"}
        with hub.serve(str(MGMT_NET.network_address + 1)) as url:
            env["HF_ENDPOINT"] = url
            took, doc, r = run(env, "model", "pull")
            if doc.get("status") != "downloaded":
                print(f"pull failed: {r.stderr[-800:]}")
                return 1
            print(f"pull: {total / 1e9:.2f} GB in {took:.1f}s ({total / took / 1e6:.0f} MB/s)")
            served = hub.bytes_served
            took, doc, r = run(env, "model", "pull")
            again = hub.bytes_served - served
            print(f"[4] pull re-run: {again} bytes downloaded, {took:.2f}s, status {doc.get('status')}")
            if again != 0 or doc.get("status") != "up-to-date":
                misses.append("pull re-run downloaded bytes")
            if took > 2.0:  # a re-run with nothing new says so in under 2 s
                misses.append(f"pull re-run took {took:.2f}s (target < 2 s)")
        one_t, doc, r = run(env, "model", "sync", "--to", "spark2")
        if not doc.get("ok"):
            print(f"sync to 1 rank failed: {r.stderr[-800:]}")
            return 1
        shutil.rmtree(dirs[1])
        three_t, doc, r = run(env, "model", "sync")
        if not doc.get("ok"):
            print(f"sync to 3 ranks failed: {r.stderr[-800:]}")
            return 1
        ratio = three_t / one_t
        print(f"[1] sync head->1 rank {one_t:.1f}s ({total / one_t / 1e6:.0f} MB/s), head->3 ranks {three_t:.1f}s "
              f"({3 * total / three_t / 1e6:.0f} MB/s aggregate): ratio {ratio:.2f} (target <= 1.3)")
        if ratio > 1.3:
            misses.append(f"sync to 3 ranks took {ratio:.2f}x the time to 1")
        took, doc, r = run(env, "model", "sync")
        sent = sum(int(x.get("bytes_sent") or 0) for x in doc.get("ranks", []))  # type: ignore[union-attr]
        print(f"[2] re-sync, nothing changed: {took:.2f}s, {sent} bytes sent, ok={doc.get('ok')} (target <= 2 s, 0 B)")
        if took > 2.0 or sent != 0 or not doc.get("ok"):
            misses.append(f"no-change re-sync {took:.2f}s / {sent} B")
        changed = ckptgen.new_revision_of_shard(dirs[0], 5)
        size = changed.stat().st_size
        took, doc, r = run(env, "model", "sync")
        per = [int(x.get("bytes_sent") or 0) for x in doc.get("ranks", [])]  # type: ignore[union-attr]
        worst = max(per) / size if per else float("inf")
        print(f"[3] one changed shard ({size / 1e6:.1f} MB): bytes sent per rank {per}, worst {worst:.3f}x "
              f"in {took:.1f}s (target <= 1.05x)")
        if worst > 1.05 or not doc.get("ok"):
            misses.append(f"changed shard sent {worst:.3f}x its size")
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    print("MISSED: " + "; ".join(misses) if misses else "all targets met")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
