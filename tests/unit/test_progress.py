"""The events of long work: every event `Feed` writes is one JSON line valid against the shipped JSON Schema
(data/events.schema.json), `--events -` and `--json` cannot share stdout, and the display prints one plain
line per change of phase when it is not a terminal (never one per byte)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from rich.console import Console

from sparkctl.errors import UsageError
from sparkctl.progress import Display, Feed, make_event, open_feed, schema
from tests.conftest import run_cli
from tests.unit.localnodes import served_scene


def validator() -> jsonschema.Draft202012Validator:
    doc = schema()
    jsonschema.Draft202012Validator.check_schema(doc)
    return jsonschema.Draft202012Validator(doc)


def test_every_event_feed_writes_is_one_line_valid_against_the_schema() -> None:
    buf = io.StringIO()
    feed = Feed("deploy", buf)
    feed.event("sync", "copying", "", node="spark2", rank=1, bytes_done=10, bytes_total=100)
    feed.event("wait", "loading weights", "rank 3", node="spark4", rank=3)
    feed.event("build", "failed", "no space", node="spark1", level="error")
    feed.event("pull", "downloading", node="spark1", bytes_done="12abc", bytes_total=float("nan"))  # a node's odd answer
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4
    v = validator()
    for line in lines:
        ev = json.loads(line)
        v.validate(ev)
        assert set(ev) == set(schema()["required"])
    assert json.loads(lines[3])["bytes_done"] is None


def test_the_schema_refuses_an_event_without_its_keys_or_with_a_bad_level() -> None:
    v = validator()
    ev = make_event("deploy", "up", "start")
    v.validate(ev)
    for broken in ({k: x for k, x in ev.items() if k != "phase"}, {**ev, "level": "loud"}, {**ev, "rank": -1},
                   {**ev, "extra": 1}):
        with pytest.raises(jsonschema.ValidationError):
            v.validate(broken)
    with pytest.raises(ValueError):
        make_event("deploy", "up", "start", level="loud")


def test_events_dash_and_json_both_wanting_stdout_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        open_feed("-", "deploy", as_json=True)
    with pytest.raises(UsageError):
        open_feed(str(tmp_path / "no" / "such" / "dir" / "e.jsonl"), "deploy", as_json=False)
    f = open_feed(str(tmp_path / "e.jsonl"), "deploy", as_json=True)
    f.event("up", "start")
    f.close()
    assert json.loads((tmp_path / "e.jsonl").read_text())["step"] == "up"


def test_plain_display_prints_a_line_per_change_of_phase_not_per_byte() -> None:
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=False, width=200)
    with Display(con) as d:
        feed = Feed("deploy", None, display=d)
        for done in range(0, 100, 10):
            feed.event("sync", "copying", node="spark2", bytes_done=done, bytes_total=100)
        feed.event("sync", "complete", node="spark2", bytes_done=100, bytes_total=100)
    lines = buf.getvalue().splitlines()
    assert lines == ["sync spark2: copying", "sync spark2: complete"]


def test_quiet_display_prints_nothing(capsys: Any) -> None:
    buf = io.StringIO()
    with Display(Console(file=buf), quiet=True) as d:
        Feed("deploy", None, display=d).event("up", "start", "x")
    assert buf.getvalue() == ""


def test_up_and_build_write_valid_events_with_the_global_option(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                capsys: Any) -> None:
    nodes = ["spark1", "spark2", "spark3", "spark4"]
    with served_scene(monkeypatch, tmp_path, nodes, {"SERVED_MODEL_NAME": "m", "VLLM_API_KEY": "k"}):
        events = tmp_path / "events.jsonl"
        code, out, err = run_cli(["--events", str(events), "up"], capsys)
        assert code == 0, err
        code, out, err = run_cli(["build", "--dry-run", "--events", str(events)], capsys)
        assert code == 0, err
        got = [json.loads(line) for line in events.read_text().splitlines()]
    v = validator()
    for ev in got:
        v.validate(ev)
    assert {e["command"] for e in got} == {"up"}  # a dry run has no progress to report
    assert got[-1]["phase"] == "changed" and any("started rank 0 on spark1" in e["message"] for e in got)
