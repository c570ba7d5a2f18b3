#!/usr/bin/env python3
"""Benchmark `sparkctl setup` against its targets; prints the figures, exits 1 if one is missed (2 when the
nodes are not there to measure).

| figure | target |
|---|---|
| `setup` plan on the env file's nodes (4 lab nodes) | <= 2 s (best of --repeat) |
| `setup --yes` when there is nothing to change | <= 2 s, 0 changes |
| SSH logins per node per plan | exactly 1 |

Logins are counted in-process: every connection sparkctl's cluster layer opens goes through
`sparkctl.cluster.fanout.connect`, wrapped here with a counter per node.

    python bench/setup_speed.py --env-file ENV [--repeat 3]

Needs nodes that `setup` already set up (run `sparkctl setup --yes` once first) for the second figure:
on the lab, a lab made by `sparkctl lab up --fresh`.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launcher"))

PLAN_TARGET_S = 2.0
APPLY_TARGET_S = 2.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env-file", required=True)
    ap.add_argument("--ssh-config", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    from sparkctl.cluster import Cluster, fanout
    from sparkctl.errors import SparkctlError
    from sparkctl.orchestrate import setup as flow
    from sparkctl.spec.settings import load_settings

    logins: collections.Counter[str] = collections.Counter()
    plain = fanout.connect

    def counted(target: Any, **kw: Any) -> Any:
        logins[target.alias] += 1
        return plain(target, **kw)

    fanout.connect = counted  # type: ignore[assignment]
    s = load_settings(env_file=a.env_file)
    plans, applies, changes = [], [], -1
    try:
        for _ in range(a.repeat):
            logins.clear()
            t0 = time.perf_counter()
            with Cluster(s.nodes, a.ssh_config) as c:
                report = flow.plan(c, s)
            plans.append(time.perf_counter() - t0)
            per_node = dict(logins)
            t0 = time.perf_counter()
            with Cluster(s.nodes, a.ssh_config) as c:
                report = flow.apply(c, s, flow.plan(c, s), a.ssh_config)
            applies.append(time.perf_counter() - t0)
            changes = len(report.changes)
    except SparkctlError as exc:
        print(f"cannot measure: {exc}")
        return 2
    ok = True
    plan_s, apply_s = min(plans), min(applies)
    print(f"setup plan on {len(s.nodes)} nodes: {plan_s:.2f} s (target <= {PLAN_TARGET_S} s)")
    ok &= plan_s <= PLAN_TARGET_S
    print(f"setup --yes with nothing to change: {apply_s:.2f} s, {changes} change(s) (target <= {APPLY_TARGET_S} s, 0)")
    ok &= apply_s <= APPLY_TARGET_S and changes == 0
    print(f"SSH logins per node in one plan: {per_node} (target: 1 each)")
    ok &= all(per_node.get(n) == 1 for n in s.nodes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
