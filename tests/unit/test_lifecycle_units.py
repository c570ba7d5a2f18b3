"""Pure parts of the lifecycle: lock scripts and owners, audit lines, diffing a running service."""

from __future__ import annotations

import json
import subprocess

from sparkctl.orchestrate.status import metrics_summary
from sparkctl.remote.lockdir import (
    LockOwner,
    acquire_argv,
    audit_append_argv,
    audit_line,
    new_owner,
    release_argv,
    show_argv,
)
from sparkctl.remote.readiness import phase_of
from sparkctl.remote.service import ContainerState, diff_running
from sparkctl.spec.builders import RankSpec
from sparkctl.spec.settings import RankPins


def sh(argv: list[str], cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=10)


def test_lock_is_atomic_and_only_the_holder_releases(tmp_path):
    a, b = new_owner("up"), new_owner("up")
    assert sh(acquire_argv("c1", a), tmp_path).returncode == 0
    second = sh(acquire_argv("c1", b), tmp_path)
    assert second.returncode == 1 and LockOwner.parse(second.stdout) == a
    assert sh(release_argv("c1", b.token), tmp_path).returncode == 1  # not b's lock
    shown = sh(show_argv("c1"), tmp_path)
    assert shown.returncode == 1 and LockOwner.parse(shown.stdout) == a
    assert sh(release_argv("c1", a.token), tmp_path).returncode == 0
    assert sh(show_argv("c1"), tmp_path).returncode == 0
    assert sh(acquire_argv("c1", b), tmp_path).returncode == 0


def test_hostile_values_in_lock_and_audit_stay_data(tmp_path):
    canary = tmp_path / "canary"
    owner = LockOwner(f"$(touch {canary})", 1, "`touch x`", "up; touch y", "tok")
    assert sh(acquire_argv("c2", owner), tmp_path).returncode == 0
    line = audit_line(action="up", detail=f"$(touch {canary}) ; rm -rf / `id`\nsecond line")
    assert sh(audit_append_argv("c2", [line]), tmp_path).returncode == 0
    assert not canary.exists() and not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    (log,) = (tmp_path / ".sparkctl" / "c2" / "audit.log").read_text().splitlines()
    assert json.loads(log)["detail"].startswith("$(touch")


def state(rank: int, cfg: str = "h1", image: str = "sha256:aa", running: bool = True) -> ContainerState:
    return ContainerState("id", f"sparkctl-c-rank{rank}", rank, cfg, image, "running" if running else "exited",
                          running, 0 if running else 137, "2026-11-29T11:30:00.123456789Z", 0, "")


def specs() -> list[RankSpec]:
    return [RankSpec(r, f"n{r}", RankPins(), {}, []) for r in range(3)]


def test_identical_service_has_no_diff():
    states = {f"n{r}": [state(r)] for r in range(3)}
    assert diff_running(specs(), "h1", states, dict.fromkeys(states, "sha256:aa")) == []


def test_diff_names_each_change():
    states = {"n0": [state(0, cfg="old")], "n1": [state(1, running=False)], "n2": []}
    reasons = diff_running(specs(), "h1", states, {"n0": "sha256:bb", "n1": "sha256:aa", "n2": "sha256:aa"})
    assert "rank 0 (n0): config changed (old → h1)" in reasons
    assert any(r.startswith("rank 0 (n0): image changed") for r in reasons)
    assert "rank 1 (n1): container exited (exit 137)" in reasons
    assert "rank 2 (n2): not running" in reasons


def test_container_state_from_inspect_and_uptime():
    doc = {"Id": "abc", "Name": "/sparkctl-c-rank1", "Image": "sha256:ff", "RestartCount": 2,
           "Config": {"Labels": {"sparkctl.rank": "1", "sparkctl.config-hash": "h"}},
           "State": {"Status": "running", "Running": True, "ExitCode": 0, "StartedAt": "2026-11-29T11:30:00.5Z"}}
    c = ContainerState.from_inspect(doc)
    assert (c.rank, c.config_hash, c.restarts, c.name) == (1, "h", 2, "sparkctl-c-rank1")
    import datetime as dt

    assert c.uptime_s(dt.datetime(2026, 11, 29, 11, 31, tzinfo=dt.UTC)) == 60
    assert ContainerState.from_inspect({"Config": {"Labels": {"sparkctl.rank": "x"}}}).rank is None


def test_phases_from_vllm_like_logs():
    assert phase_of([]) == "starting"
    # vLLM 0.33's own lines (engine_lines.PHASE_MARKERS; tests/unit/facts/test_engine_lines.py has more)
    rdv = "world_size=4 rank=1 local_rank=0 distributed_init_method=tcp://10.0.0.1:29501 backend=nccl"
    assert phase_of([rdv]) == "rendezvous"
    assert phase_of([rdv, "Loading weights took 3.20 seconds"]) == "loading weights"
    assert phase_of(["Graph capturing finished in 5 secs, took 0.10 GiB", "INFO:     Application startup complete."]) \
        == "ready"


def test_metrics_summary():
    text = "\n".join([
        "# HELP vllm:num_requests_running x", 'vllm:num_requests_running{model_name="m"} 2.0',
        'vllm:num_requests_waiting{model_name="m"} 1', 'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
        'vllm:generation_tokens_total{model_name="m"} 1234', "garbage line here", 'vllm:num_requests_running{x="y"} nan?',
    ])
    assert metrics_summary(text) == {"requests_running": 2.0, "requests_waiting": 1.0, "kv_cache_usage": 0.25,
                                      "generation_tokens": 1234.0}
