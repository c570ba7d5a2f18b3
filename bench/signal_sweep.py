#!/usr/bin/env python3
"""The signal sweep on the lab: SIGINT and SIGTERM sent to `up` and `down` at N evenly spaced
moments across their run (N=20 by default). After each run:

  - containers: the complete service (every rank running, nothing else) or none at all;
  - the cluster lock is free;
  - the audit is consistent: every container that is there has a successful-`up` audit line with its
    ID on its node (no orphan), and a run that left nothing wrote no `up` line it did not undo.

Prints one line per run and the totals (runs, leftovers, locks left held, orphans, exit codes), and
exits 1 on any violation. Needs root and a lab (`sparkctl lab up`); builds the lab chain first.
Run it in chunks to keep each lab hold short, e.g. `--runs up:INT`.
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.kit: the lab client and the loopback stand-in
from tests.kit.lab import Lab  # noqa: E402

NODES = ["spark1", "spark2", "spark3", "spark4"]
KNOBS = {"CLUSTER_NAME": "sweep", "PORT": "18892", "MASTER_PORT": "39512"}
LABEL = "label=sparkctl.cluster=sweep"
SERVICE = {n: [f"sparkctl-sweep-rank{i}"] for i, n in enumerate(NODES)}
NONE: dict[str, list[str]] = {n: [] for n in NODES}


def env(lab: Lab) -> dict[str, str]:
    return {**lab.env(), "NODES": " ".join(NODES), **KNOBS}


def sk(lab: Lab, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env(lab), capture_output=True, text=True,
                          timeout=timeout)


def containers(lab: Lab, *, running_only: bool = False) -> dict[str, list[str]]:
    extra = [] if running_only else ["-a"]
    return {n: sorted(lab.docker(n, "ps", *extra, "--filter", LABEL, "--format", "{{.Names}}").stdout.split())
            for n in NODES}


def ids(lab: Lab) -> dict[str, list[str]]:
    return {n: lab.docker(n, "ps", "-aq", "--no-trunc", "--filter", LABEL).stdout.split() for n in NODES}


def lock_free(lab: Lab) -> bool:
    r = sk(lab, "--json", "lock", "status", timeout=60)
    return bool(r.returncode == 0 and json.loads(r.stdout)["locked"] is False)


def orphans(lab: Lab) -> list[str]:
    """Containers that no successful-`up` audit line on their node names."""
    r = sk(lab, "--json", "audit", "--tail", "5000", timeout=60)
    entries = json.loads(r.stdout)["entries"]
    recorded = {(e["node"], e.get("container")) for e in entries if e.get("action") == "up"}
    return [f"{n}:{cid[:12]}" for n, cs in ids(lab).items() for cid in cs if (n, cid) not in recorded]


def state_to(lab: Lab, want: str) -> None:
    r = sk(lab, "up" if want == "up" else "down")  # the lock is free after every run (checked)
    if r.returncode != 0:
        raise SystemExit(f"cannot bring the sweep cluster {want}: {r.stdout}{r.stderr}")


def timed(lab: Lab, command: str) -> float:
    t0 = time.monotonic()
    r = sk(lab, command)
    if r.returncode != 0:
        raise SystemExit(f"`sparkctl {command}` failed: {r.stdout}{r.stderr}")
    return time.monotonic() - t0


def one_run(lab: Lab, command: str, sig: signal.Signals, delay: float) -> dict[str, object]:
    state_to(lab, "down" if command == "up" else "up")
    proc = subprocess.Popen([sys.executable, "-m", "sparkctl", command], env=env(lab), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    sent = proc.poll() is None
    if sent:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    after = containers(lab)
    live = containers(lab, running_only=True)
    complete = after == SERVICE and live == SERVICE
    outcome = "service" if complete else "none" if after == NONE else "LEFTOVER"
    # The exit status says what happened: 0 = the command did its job (`up`: the service runs; `down`:
    # nothing is left); 128+signum = interrupted, everything as it was before.
    done = "service" if command == "up" else "none"
    before = "none" if command == "up" else "service"
    exit_ok = (proc.returncode, outcome) in ((0, done), (128 + sig, before))
    return {"command": command, "signal": sig.name, "delay_s": round(delay, 3), "sent": sent,
            "exit": proc.returncode, "exit_ok": exit_ok, "outcome": outcome, "lock_free": lock_free(lab), "orphans": orphans(lab),
            "tail": (out + err).strip().splitlines()[-1:] if outcome == "LEFTOVER" else []}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="up:INT,up:TERM,down:INT,down:TERM", help="COMMAND:SIGNAL,...")
    ap.add_argument("--moments", type=int, default=20)
    ap.add_argument("--first", type=int, default=1, help="first moment (1..N), to run the sweep in chunks")
    ap.add_argument("--last", type=int, default=0, help="last moment (default N)")
    args = ap.parse_args()
    lab = Lab.load()
    last = args.last or args.moments
    built = sk(lab, "build", timeout=900)  # the lab chain (a no-op when it is there; not timed)
    if built.returncode != 0:
        raise SystemExit(f"`sparkctl build` failed: {built.stdout}{built.stderr}")
    state_to(lab, "down")
    # Each command's run length, warm (the first run of a session pays for cold caches): best of 2.
    durations = {"up": 1e9, "down": 1e9}
    for _ in range(2):
        for command in ("up", "down"):
            durations[command] = min(durations[command], timed(lab, command))
    print(f"run lengths: up {durations['up']:.2f}s, down {durations['down']:.2f}s", flush=True)
    results = []
    for pair in args.runs.split(","):
        command, name = pair.split(":")
        sig = signal.Signals[f"SIG{name}"]
        for k in range(args.first, last + 1):
            delay = durations[command] * k / (args.moments + 1)
            r = one_run(lab, command, sig, delay)
            results.append(r)
            print(json.dumps(r), flush=True)
    state_to(lab, "down")
    bad = [r for r in results if r["outcome"] == "LEFTOVER" or not r["lock_free"] or r["orphans"] or not r["exit_ok"]]
    codes = collections.Counter(f"{r['command']}/{r['signal']}→{r['exit']}" for r in results)
    print(f"runs {len(results)} (signal sent while running: {sum(bool(r['sent']) for r in results)}); leftovers {sum(r['outcome'] == 'LEFTOVER' for r in results)}; "
          f"locks left held {sum(not r['lock_free'] for r in results)}; "
          f"runs with orphans {sum(bool(r['orphans']) for r in results)}; "
          f"exit status not matching the outcome {sum(not r['exit_ok'] for r in results)}; "
          f"outcomes {dict(collections.Counter(r['outcome'] for r in results))}; exit codes {dict(codes)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
