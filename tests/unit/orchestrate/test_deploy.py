"""deploy's step engine on fake steps over a dict that stands for the cluster: only the steps whose probe finds
something to do run, a failure names its step, node and fix and marks the later steps `not run`, a signal in
a step ends the run with that step failed (its own rollback ran), a re-run completes from where it stopped,
a plan changes nothing, and the registry is the documented order (a `setup` step is one entry)."""

from __future__ import annotations

import io
import json
import os
import signal
from typing import Any, cast

import pytest

from sparkctl import signals
from sparkctl.errors import CheckFailed, UsageError
from sparkctl.orchestrate import deploy as flow
from sparkctl.progress import Feed
from sparkctl.spec import deploy_plan as dp


class World:
    """The 'cluster': which steps' work is in place; every apply is recorded."""

    def __init__(self, done: set[str] | None = None) -> None:
        self.done = set(done or ())
        self.applied: list[str] = []
        self.rolled_back: list[str] = []
        self.probed: list[str] = []


def step(w: World, name: str, *, fail: Exception | None = None, signum: int | None = None,
         off: str | None = None) -> flow.Step:
    def probe(ctx: flow.Context) -> dp.StepPlan:
        w.probed.append(name)
        if name in w.done:
            return dp.StepPlan(False, f"{name} is in place")
        return dp.StepPlan(True, f"{name} is missing", [f"make {name}"])

    def apply(ctx: flow.Context, plan: dp.StepPlan) -> dict[str, Any]:
        w.applied.append(name)
        try:
            if signum is not None:
                os.kill(os.getpid(), signum)  # the handler raises Interrupted right here
            if fail is not None:
                raise fail
        except BaseException:
            w.rolled_back.append(name)  # the flow's own rollback: nothing of this step is left
            raise
        w.done.add(name)
        return {"made": name}

    return flow.Step(name, name, probe, apply, (lambda ctx: off))


def context(buf: io.StringIO | None = None) -> flow.Context:
    return flow.Context(cast(Any, None), None, Feed("deploy", buf))


@pytest.fixture
def handlers() -> Any:
    saved = {s: signal.getsignal(s) for s in signals.HANDLED}
    signals.reset()
    signals.install()
    yield
    signals.reset()
    for s, h in saved.items():
        signal.signal(s, h)


def test_only_the_steps_with_something_to_do_run_and_the_rest_are_skipped() -> None:
    w = World(done={"sync", "build"})
    steps = [step(w, n) for n in ("pull", "sync", "check", "build", "up")]
    results = flow.apply_steps(context(), steps)
    assert [(r.step, r.status) for r in results] == [("pull", dp.DONE), ("sync", dp.SKIPPED), ("check", dp.DONE),
                                                    ("build", dp.SKIPPED), ("up", dp.DONE)]
    assert w.applied == ["pull", "check", "up"]
    assert results[1].why == "nothing to do: sync is in place"
    assert results[0].changed == {"made": "pull"}
    again = World(done=w.done)
    assert all(r.status == dp.SKIPPED for r in flow.apply_steps(context(), [step(again, n) for n in
                                                                            ("pull", "sync", "check", "build", "up")]))
    assert again.applied == []


def test_a_failure_names_the_step_its_node_and_fix_and_the_later_steps_are_not_run() -> None:
    w = World()
    boom = CheckFailed("the image is not on spark3", fix="run `sparkctl build`", node="spark3")
    steps = [step(w, "sync"), step(w, "build", fail=boom), step(w, "up"), step(w, "wait"),
             step(w, "supervise", off="--supervise not given")]
    with pytest.raises(flow.DeployFailed) as exc:
        flow.apply_steps(context(), steps)
    e = exc.value
    assert e.node == "spark3" and e.fix == "run `sparkctl build`" and e.exit_code == 1
    assert "deploy failed at step build on spark3: the image is not on spark3" in e.message
    assert e.message.endswith("not run: up, wait")
    assert [(r.step, r.status) for r in e.results] == [("sync", dp.DONE), ("build", dp.FAILED), ("up", dp.NOT_RUN),
                                                      ("wait", dp.NOT_RUN), ("supervise", dp.SKIPPED)]
    failed = e.results[1].as_dict()
    assert failed["node"] == "spark3" and failed["fix"] == "run `sparkctl build`"
    assert w.applied == ["sync", "build"]


def test_a_usage_error_in_a_step_keeps_its_exit_code() -> None:
    w = World()
    with pytest.raises(flow.DeployFailed) as exc:
        flow.apply_steps(context(), [step(w, "pull", fail=UsageError("MODEL_REVISION is unset"))])
    assert exc.value.exit_code == 2


def test_sigterm_in_a_step_rolls_it_back_and_a_rerun_completes_from_there(handlers: Any) -> None:
    w = World()
    names = ("sync", "check", "build", "up", "wait")
    steps = [step(w, n, signum=signal.SIGTERM if n == "build" else None) for n in names]
    with pytest.raises(signals.Interrupted) as exc:
        flow.apply_steps(context(), steps)
    results = exc.value.deploy_results  # type: ignore[attr-defined]
    assert [(r.step, r.status) for r in results] == [("sync", dp.DONE), ("check", dp.DONE), ("build", dp.FAILED),
                                                    ("up", dp.NOT_RUN), ("wait", dp.NOT_RUN)]
    assert results[2].interrupted and "SIGTERM" in (results[2].error or "")
    assert w.rolled_back == ["build"] and "build" not in w.done
    signals.reset()
    w.applied.clear()
    results = flow.apply_steps(context(), [step(w, n) for n in names])
    assert [(r.step, r.status) for r in results] == [("sync", dp.SKIPPED), ("check", dp.SKIPPED), ("build", dp.DONE),
                                                    ("up", dp.DONE), ("wait", dp.DONE)]
    assert w.applied == ["build", "up", "wait"]


def test_a_plan_applies_nothing_and_a_probe_that_cannot_tell_says_the_step_runs() -> None:
    w = World(done={"sync"})

    def blind(ctx: flow.Context) -> dp.StepPlan:
        raise CheckFailed("spark1 is unreachable", fix="check ssh", node="spark1")

    steps = [step(w, "sync"), flow.Step("up", "up", blind, lambda c, p: {}), step(w, "x", off="not asked")]
    plan = flow.plan_steps(context(), steps)
    assert w.applied == []
    assert [(p["step"], p["todo"]) for p in plan] == [("sync", False), ("up", True), ("x", False)]
    assert plan[1]["why"].startswith("cannot tell yet (spark1 is unreachable)")
    assert plan[1]["detail"] == {"node": "spark1", "fix": "check ssh"}
    assert plan[2]["why"] == "not asked" and w.probed == ["sync"]


def test_every_step_writes_its_events() -> None:
    buf = io.StringIO()
    w = World(done={"sync"})
    with pytest.raises(flow.DeployFailed):
        flow.apply_steps(context(buf), [step(w, "sync"), step(w, "up", fail=CheckFailed("no", node="spark2")),
                                        step(w, "wait")])
    events = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [(e["step"], e["phase"]) for e in events] == [
        ("sync", "probe"), ("sync", "skip"), ("up", "probe"), ("up", "start"), ("up", "failed"), ("wait", "not-run")]
    assert events[4]["node"] == "spark2" and events[4]["level"] == "error"


def test_the_registry_is_the_documented_order_and_a_first_step_is_one_entry() -> None:
    assert [s.name for s in flow.STEPS] == ["setup", "pull", "sync", "check", "build", "up", "wait", "report",
                                           "supervise"]
    w = World()
    steps = [step(w, n) for n in ("sync", "up")]
    steps.insert(0, step(w, "setup"))
    flow.apply_steps(context(), steps)
    assert w.applied == ["setup", "sync", "up"]


def test_the_setup_step_runs_setup_when_it_plans_changes_and_names_a_node_that_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy's setup step is `sparkctl setup`'s own plan and apply: nothing to do when setup plans no change; its
    changes listed per node otherwise; a node whose apply failed fails the step naming it and its fix."""
    from sparkctl.orchestrate import setup as setup_flow

    class Report:
        def __init__(self, changes: list[dict[str, str]]) -> None:
            self.changes = changes
            self.cabling = type("C", (), {"layout": "switch"})()
            self.applied: dict[str, setup_flow.NodeOutcome] | None = None
            self.failed: list[str] = []

    planned = [Report([])]
    monkeypatch.setattr(setup_flow, "plan", lambda cluster, s: planned[0])
    stale: list[str | None] = [None]
    monkeypatch.setattr(setup_flow, "document_disagrees", lambda cluster, s: stale[0])
    ctx = context()
    ctx.cluster = cast(Any, object())  # the probes' connections: never used by the fakes
    planned[0] = Report([{"node": "spark2", "what": "limits"}])
    assert not flow.probe_setup(ctx).todo  # the fabric document matches: setup's full plan is not read
    stale[0] = "spark2 has no fabric document of cluster 't'"
    planned[0] = Report([])
    assert not flow.probe_setup(ctx).todo
    planned[0] = Report([{"node": "spark2", "what": "the fabric document", "path": "/etc/sparkctl/t/fabric.json"}])
    p = flow.probe_setup(ctx)
    assert p.todo and p.would == ["spark2: the fabric document (/etc/sparkctl/t/fabric.json)"]
    assert p.why.startswith("spark2 has no fabric document")

    def failed_apply(cluster: Any, s: Any, report: Report, ssh_config: Any) -> Report:
        report.applied = {"spark2": setup_flow.NodeOutcome("failed", error="visudo refused it", fix="see the file")}
        report.failed = ["spark2"]
        return report

    monkeypatch.setattr(setup_flow, "apply", failed_apply)
    with pytest.raises(CheckFailed) as exc:
        flow.apply_setup(ctx, p)
    assert exc.value.node == "spark2" and "visudo refused it" in exc.value.message and exc.value.fix == "see the file"


def test_check_is_skipped_only_for_the_inputs_it_passed_with(monkeypatch: pytest.MonkeyPatch) -> None:
    a = dp.inputs({"TP": "4"}, b"recipe", "fp1")
    b = dp.inputs({"TP": "4"}, b"recipe", "fp2")
    now = [a]
    monkeypatch.setattr(flow, "current_inputs", lambda ctx: now[0])
    ctx = context()
    assert flow.probe_check(ctx).todo
    ctx.state["check_passed"] = dp.inputs_key(a)
    assert not flow.probe_check(ctx).todo
    now[0] = b  # another checkpoint on the head: checked again
    assert flow.probe_check(ctx).todo


def test_a_running_service_of_this_cluster_does_not_stop_a_redeploy_but_anything_else_does() -> None:
    """check fails on this cluster's running containers and the head's ports they hold; a deploy that
    replaces that service goes on. A taken port without a service of ours, or any other failure, stops it."""
    from sparkctl.rules.findings import FAIL, Finding

    containers = Finding("spark1", "containers", FAIL, "1 running")
    ports = Finding("spark1", "ports", FAIL, "18895 taken")
    disk = Finding("spark2", "disk", FAIL, "full")
    assert flow.blocking_findings([containers, ports]) == ([], True)
    assert flow.blocking_findings([containers, ports, disk]) == ([disk], True)
    assert flow.blocking_findings([ports]) == ([ports], False)


def test_the_report_of_a_service_already_serving_asks_for_a_short_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """When `wait` did not run (nothing changed), the report's completion is a proof of life: ANSWER_TOKENS at
    most, not the length of a measure. After a `wait` its answer is reused and no second request is made."""
    from sparkctl.remote import readiness, service

    asked: list[int] = []

    class Api:
        base_url = "http://head:8000"

        def __init__(self, url: str, key: object) -> None:
            pass

        def models(self) -> list[str]:
            return ["m"]

        def chat(self, model: str, prompt: str, max_tokens: int = 32, timeout: float = 120.0) -> tuple[str, float]:
            asked.append(max_tokens)
            return "hello there", 0.1

    monkeypatch.setattr(readiness, "HeadApi", Api)
    monkeypatch.setattr(service, "head_base_url", lambda cluster, s: Api.base_url)

    class Settings:
        nodes = ["spark1"]

        def get(self, key: str) -> str | None:
            return None

    ctx = flow.Context(cast(Any, Settings()), None, Feed("deploy", io.StringIO()), bench=False)
    ctx.cluster = cast(Any, object())
    out = flow.apply_report(ctx, dp.StepPlan(True, "x"))
    assert asked == [flow.ANSWER_TOKENS] and flow.ANSWER_TOKENS <= 16 and out["completion"] == "hello there"
    ctx.memo.clear()
    ctx.answer = {"url": Api.base_url, "models": ["m"], "completion": "after wait", "latency_s": 0.2}
    ctx.forget()  # a step changed the cluster after wait: the probes' reads go, wait's answer stays
    assert flow.apply_report(ctx, dp.StepPlan(True, "x"))["completion"] == "after wait" and asked == [flow.ANSWER_TOKENS]
