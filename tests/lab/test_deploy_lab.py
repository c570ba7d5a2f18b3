"""`sparkctl deploy` on a fresh lab (fabric ports without addresses: setup is its first step), the checkpoint only
on the head (its own folder, /models/lab/deploytest, on spark1 only): --plan lists every step and changes
nothing; --yes sets the nodes up and reaches a real completion; a second --yes
is a no-op; a knob change re-deploys only what changed (up, wait) with a rollback point; SIGTERM at three
different steps (sync, up, wait), then --yes again, serves with nothing left behind.

Its own cluster name and ports, so it never touches another test's service.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
FOLDER = "deploytest"
CLUSTER = {"CLUSTER_NAME": "deploy", "PORT": "18895", "MASTER_PORT": "39521", "SERVED_MODEL_NAME": "lab-deploy"}
LABEL = "label=sparkctl.cluster=deploy"


def _env(lab: Lab, state: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**lab.env(), "NODES": " ".join(NODES), "MODEL": f"/models/lab/{FOLDER}", "XDG_STATE_HOME": str(state),
            **CLUSTER, **(extra or {})}


def sk(lab: Lab, state: Path, *args: str, env: dict[str, str] | None = None,
       timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=_env(lab, state, env), capture_output=True,
                          text=True, timeout=timeout)


def doc(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    d: dict[str, Any] = json.loads(r.stdout)
    return d


def statuses(d: dict[str, Any]) -> dict[str, str]:
    return {s["step"]: s["status"] for s in d["steps"]}


@pytest.fixture
def scene(lab: Lab, tmp_path: Path) -> Iterator[Path]:
    """A fresh lab (fabric ports without addresses, nothing of setup's) with the head's checkpoint copied into
    its own folder on spark1 only; everything removed after, the lab's fabric as it was."""
    from tests.lab.faults import fresh_fabric

    with fresh_fabric(lab):
        yield from _checkpoint_on_the_head(lab, tmp_path)


def _checkpoint_on_the_head(lab: Lab, tmp_path: Path) -> Iterator[Path]:
    src = lab.host("spark1").model_dir
    for h in lab.hosts:
        shutil.rmtree(h.model_dir / FOLDER, ignore_errors=True)
    dest = src / FOLDER
    dest.mkdir()
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    shutil.copytree(src / "serving", dest / "serving", symlinks=True)  # the checkpoint's own image chain
    state = tmp_path / "state"
    try:
        yield state
    finally:
        sk(lab, state, "down", timeout=300)
        for h in lab.hosts:
            shutil.rmtree(h.model_dir / FOLDER, ignore_errors=True)


def nothing_left(lab: Lab, state: Path) -> None:
    """No orphan container, the lock free, the service healthy and current."""
    r = sk(lab, state, "--json", "status", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert doc(r)["problems"] == []
    assert json.loads(sk(lab, state, "--json", "lock", "status", timeout=60).stdout)["locked"] is False


def test_plan_lists_every_step_and_changes_nothing(lab: Lab, scene: Path) -> None:
    r = sk(lab, scene, "deploy", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    d = doc(r)
    assert [s["step"] for s in d["steps"]] == ["setup", "pull", "sync", "check", "build", "up", "wait", "report",
                                               "supervise"]
    by = {s["step"]: s for s in d["steps"]}
    assert by["setup"]["todo"] and "no fabric document" in by["setup"]["why"]
    assert any("/etc/netplan/60-sparkctl-fabric.yaml" in w for w in by["setup"]["would"])
    assert by["sync"]["todo"] and len(by["sync"]["would"]) == 4  # a line per rank, then the chain
    assert by["sync"]["would"][-1].startswith("along the chain spark1 -> spark2 -> spark3 -> spark4")
    assert by["up"]["todo"] and by["wait"]["todo"]
    for n in NODES[1:]:
        assert not (lab.host(n).model_dir / FOLDER).exists()
    assert all(not lab.docker(n, "ps", "-aq", "--filter", LABEL).stdout.strip() for n in NODES)
    assert not any((lab.root / "hosts" / n / "setup-root/etc/netplan").exists() for n in NODES)  # setup wrote nothing


def test_yes_serves_then_a_rerun_is_a_noop_then_a_knob_change_redeploys_only_up_and_wait(
        lab: Lab, scene: Path) -> None:
    r = sk(lab, scene, "deploy", "--yes", "--json")
    assert r.returncode == 0, r.stderr
    d = doc(r)
    assert statuses(d)["setup"] == "done" and statuses(d)["sync"] == "done" and statuses(d)["up"] == "done"
    assert statuses(d)["wait"] == "done" and d["api"]["completion"] and d["api"]["model"] == "lab-deploy" and d["api"]["bench"]
    nothing_left(lab, scene)
    t0 = time.monotonic()
    r = sk(lab, scene, "deploy", "--yes", "--json", "--no-bench")
    assert r.returncode == 0, r.stderr
    d = doc(r)
    assert d["noop"] and not d["changed"], d  # the <= 3 s target: bench/deploy_time.py
    print(f"no-op re-run: {time.monotonic() - t0:.1f}s")
    first = json.loads(sk(lab, scene, "--json", "history").stdout)["history"][0]["config_hash"]
    r = sk(lab, scene, "deploy", "--yes", "--json", "--no-bench", env={"GPU_MEMORY_UTILIZATION": "0.75"})
    assert r.returncode == 0, r.stderr
    d = doc(r)
    assert d["plan_differs"] == [] or any("GPU_MEMORY_UTILIZATION" in x for x in d["plan_differs"])
    st = statuses(d)
    assert (st["setup"], st["sync"], st["build"], st["up"], st["wait"]) == ("skipped", "skipped", "skipped", "done",
                                                                          "done"), st
    up = next(s for s in d["steps"] if s["step"] == "up")
    assert up["changed"]["rollback_point"]["config_hash"] == first
    r = sk(lab, scene, "--json", "rollback", env={"GPU_MEMORY_UTILIZATION": "0.75"})
    assert r.returncode == 0, r.stderr


def _sigterm_at(lab: Lab, state: Path, step: str, phase: str) -> subprocess.CompletedProcess[str]:
    events = state.parent / f"events-{step}.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "sparkctl", "deploy", "--yes", "--no-bench", "--json",
                             "--events", str(events)], env=_env(lab, state), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        seen = [json.loads(x) for x in events.read_text().splitlines()] if events.exists() else []
        if any(e["step"] == step and e["phase"] == phase for e in seen):
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize(("step", "phase"), [("sync", "start"), ("up", "start"), ("wait", "start")])
def test_sigterm_at_a_step_then_yes_again_serves_with_nothing_left(lab: Lab, scene: Path, step: str,
                                                                   phase: str) -> None:
    if step != "sync":  # the fabric and the checkpoint in place first, so the signal lands in the step named
        assert sk(lab, scene, "setup", "--yes").returncode == 0
        assert sk(lab, scene, "model", "sync").returncode == 0
    r = _sigterm_at(lab, scene, step, phase)
    assert r.returncode == 143, r.stdout + r.stderr
    d = doc(r)
    assert statuses(d)[step] == "failed" and next(s for s in d["steps"] if s["step"] == step)["interrupted"]
    assert json.loads(sk(lab, scene, "--json", "lock", "status", timeout=60).stdout)["locked"] is False
    r = sk(lab, scene, "deploy", "--yes", "--json", "--no-bench")
    assert r.returncode == 0, r.stdout + r.stderr
    assert doc(r)["api"]["completion"]
    nothing_left(lab, scene)
