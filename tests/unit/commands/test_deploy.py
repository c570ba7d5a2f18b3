"""`sparkctl deploy` as a user runs it, on local nodes (tests/unit/localnodes.py): --plan (the default) is one
JSON document listing every step and changes nothing; --yes reports every step's status in one document, a
re-run with nothing changed is a no-op that says so, a later --yes names what differs from the saved plan, a
failure's document names the step, node, fix and the steps not run (exit 1), SIGTERM in a step exits 143 and a
re-run completes; and the real `up` step: started once, then found running with this exact config, then
replaced after a knob change with a rollback point."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import CheckFailed
from sparkctl.orchestrate import deploy as flow
from sparkctl.progress import schema
from sparkctl.spec import deploy_plan as dp
from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with served_scene(monkeypatch, tmp_path, NODES, {"SERVED_MODEL_NAME": "lab-model", "VLLM_API_KEY": "k"}) as ln:
        yield ln


class World:
    def __init__(self) -> None:
        self.done: set[str] = set()
        self.applied: list[str] = []
        self.fail: dict[str, Exception] = {}
        self.signal: dict[str, int] = {}


def fake(w: World, name: str) -> flow.Step:
    def probe(ctx: flow.Context) -> dp.StepPlan:
        return dp.StepPlan(name not in w.done, f"{name} {'in place' if name in w.done else 'missing'}",
                           [] if name in w.done else [f"make {name}"])

    def apply(ctx: flow.Context, plan: dp.StepPlan) -> dict[str, Any]:
        w.applied.append(name)
        if name in w.signal:
            os.kill(os.getpid(), w.signal.pop(name))
        if name in w.fail:
            raise w.fail.pop(name)
        w.done.add(name)
        return {"made": name}

    return flow.Step(name, name, probe, apply)


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch, nodes: LocalNodes) -> World:
    w = World()
    monkeypatch.setattr(flow, "STEPS", [fake(w, n) for n in ("sync", "check", "build", "up", "wait")])
    return w


def doc_of(out: str) -> dict[str, Any]:
    lines = out.splitlines()
    assert len(lines) == 1, out  # exactly one document
    d: dict[str, Any] = json.loads(lines[0])
    return d


def test_plan_is_the_default_one_document_every_step_and_nothing_changed(world: World, capsys: Any,
                                                                          tmp_path: Path) -> None:
    code, out, err = run(["deploy", "--json"], capsys)
    assert code == 0, err
    d = doc_of(out)
    assert d["mode"] == "plan" and d["changed"] is False
    assert [(s["step"], s["todo"], s["would"]) for s in d["steps"]] == [
        (n, True, [f"make {n}"]) for n in ("sync", "check", "build", "up", "wait")]
    assert world.applied == []
    saved = dp.read_doc(Path(d["plan_file"]))
    assert saved is not None and saved["inputs"]["checkpoint"] and saved["inputs"]["settings"]["VLLM_API_KEY"] == "(set)"
    assert Path(d["plan_file"]).is_relative_to(tmp_path / "state" / "sparkctl" / "t")


def test_yes_reports_each_step_then_a_rerun_is_a_noop_that_says_so(world: World, capsys: Any) -> None:
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    assert code == 0, err
    d = doc_of(out)
    assert d["ok"] and not d["noop"] and d["changed"]
    assert [(s["step"], s["status"], s["changed"]) for s in d["steps"]] == [
        (n, "done", {"made": n}) for n in ("sync", "check", "build", "up", "wait")]
    code, out, err = run(["deploy", "--yes"], capsys)
    assert code == 0, err
    assert "nothing to do: the service already runs this exact config" in out
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    d = doc_of(out)
    assert d["noop"] and not d["changed"] and {s["status"] for s in d["steps"]} == {"skipped"}
    assert world.applied == ["sync", "check", "build", "up", "wait"]


def test_yes_says_what_differs_from_the_saved_plan_before_it_proceeds(world: World, capsys: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run(["deploy"], capsys)
    assert code == 0, err
    said = " ".join(out.split())  # as read, whatever the width the console wrapped it at (the path's length)
    assert "nothing was changed. `sparkctl deploy --yes` runs: sync, check, build, up, wait" in said
    assert "- make build" in out
    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "0.75")
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    assert code == 0, err
    d = doc_of(out)
    assert d["plan_differs"] == ["setting GPU_MEMORY_UTILIZATION: 0.8 -> 0.75"]
    assert "the inputs differ from the saved plan's" in err and "GPU_MEMORY_UTILIZATION: 0.8 -> 0.75" in err
    monkeypatch.delenv("GPU_MEMORY_UTILIZATION")
    assert run(["deploy"], capsys)[0] == 0
    d = doc_of(run(["deploy", "--yes", "--json"], capsys)[1])
    assert d["plan_differs"] == []


def test_a_failure_is_one_document_naming_step_node_fix_and_what_was_not_run(world: World, capsys: Any) -> None:
    world.fail["build"] = CheckFailed("docker build failed: no space left", fix="free space on spark3", node="spark3")
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    assert code == 1
    d = doc_of(out)
    assert d["ok"] is False and d["exit_code"] == 1 and d["node"] == "spark3" and d["fix"] == "free space on spark3"
    assert d["error"].startswith("deploy failed at step build on spark3: docker build failed")
    assert d["error"].endswith("not run: up, wait")
    assert [(s["step"], s["status"]) for s in d["steps"]] == [("sync", "done"), ("check", "done"), ("build", "failed"),
                                                            ("up", "not run"), ("wait", "not run")]
    code, out, err = run(["deploy", "--yes"], capsys)
    assert code == 0, err
    assert world.applied == ["sync", "check", "build", "build", "up", "wait"]


def test_sigterm_in_a_step_exits_143_with_its_document_and_a_rerun_completes(world: World, capsys: Any) -> None:
    world.signal["up"] = signal.SIGTERM
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    assert code == 143
    d = doc_of(out)
    assert d["ok"] is False and d["exit_code"] == 143 and "SIGTERM" in d["error"]
    assert [(s["step"], s["status"]) for s in d["steps"]][-2:] == [("up", "failed"), ("wait", "not run")]
    assert d["steps"][3]["interrupted"] is True
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    assert code == 0, err
    assert [(s["step"], s["status"]) for s in doc_of(out)["steps"]] == [
        ("sync", "skipped"), ("check", "skipped"), ("build", "skipped"), ("up", "done"), ("wait", "done")]


def test_events_file_has_one_valid_line_per_event(world: World, capsys: Any, tmp_path: Path) -> None:
    import jsonschema

    events = tmp_path / "events.jsonl"
    code, out, err = run(["deploy", "--yes", "--events", str(events)], capsys)
    assert code == 0, err
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    for ev in lines:
        jsonschema.validate(ev, schema())
    assert {(e["step"], e["phase"]) for e in lines} >= {("up", "start"), ("up", "done"), ("wait", "done")}
    assert {e["command"] for e in lines} == {"deploy"}


@pytest.mark.parametrize("argv", [["deploy", "--json", "--plan", "--yes"], ["deploy", "--json", "--events", "-"]])
def test_bad_flags_exit_2_with_one_document(world: World, capsys: Any, argv: list[str]) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert doc_of(out)["ok"] is False and world.applied == []


def test_the_real_up_step_starts_once_is_a_noop_after_and_replaces_only_on_a_knob_change(
        nodes: LocalNodes, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow, "STEPS", [s for s in flow.STEPS if s.name == "up"])
    code, out, err = run(["deploy", "--json"], capsys)
    assert code == 0, err
    (up,) = doc_of(out)["steps"]
    assert up["todo"] and any(w.startswith("start 4 rank(s), config ") for w in up["would"])
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    assert code == 0, err
    (up,) = doc_of(out)["steps"]
    assert up["status"] == "done" and len(up["changed"]["started"]) == 4
    first = up["changed"]["config_hash"]
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    assert code == 0, err
    d = doc_of(out)
    assert d["noop"] and d["steps"][0]["status"] == "skipped" and first in d["steps"][0]["why"]
    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "0.75")
    code, out, err = run(["deploy", "--yes", "--json"], capsys)
    assert code == 0, err
    (up,) = doc_of(out)["steps"]
    assert up["status"] == "done" and up["changed"]["config_hash"] != first
    assert up["changed"]["rollback_point"]["config_hash"] == first
    code, out, err = run(["history", "--json"], capsys)
    assert code == 0, err
    assert first in out and up["changed"]["config_hash"] in out


def test_the_real_sync_step_leaves_out_ranks_that_share_the_heads_folder(nodes: LocalNodes, capsys: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow, "STEPS", [s for s in flow.STEPS if s.name in ("pull", "sync")])
    code, out, err = run(["deploy", "--json"], capsys)
    assert code == 0, err
    pull, sync = doc_of(out)["steps"]
    assert not pull["todo"] and "no MODEL_REVISION pin" in pull["why"]  # the lab recipe names a repo, no pin
    assert not sync["todo"] and sync["detail"]["shared"] == ["spark2", "spark3", "spark4"]
