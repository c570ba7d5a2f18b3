"""`audit` is incomplete when a node did not answer: exit 1, naming the nodes; with no answer at all it says
there is nothing to show. Offline: loopback ports nothing listens on, and the flow's answer stood in for the
partial case."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster import NodeError
from tests.unit.test_json_failure_shape import _argv, _run, check_shape, place

__all__ = ["place"]  # the fixture, used by name


def test_audit_with_no_node_answering_exits_1_naming_them(place: dict[str, str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(_argv(["{R}", "audit"], place, "nodeA nodeB"), capsys)
    assert code == 1 and out == ""
    assert "no node answered, so there is no audit to show (nodeA, nodeB)" in err
    code, out, _ = _run(_argv(["{R}", "audit", "--json"], place, "nodeA nodeB"), capsys)
    doc = json.loads(out)
    check_shape(doc, 1)
    assert doc["unreachable"] == ["nodeA", "nodeB"] and [f["node"] for f in doc["failures"]] == ["nodeA", "nodeB"]


def test_audit_with_some_answers_shows_them_and_exits_1_naming_the_missing(
        place: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from sparkctl.commands import lifecycle

    entry = {"node": "nodeA", "when": "2026-12-07T10:00:00Z", "who": "mia", "action": "up"}

    def partial(*a: Any, **k: Any) -> tuple[list[dict[str, Any]], dict[str, NodeError]]:
        return [entry], {"nodeB": NodeError("nodeB", "timeout", "timed out", "check nodeB's network")}

    monkeypatch.setattr(lifecycle, "read_audit", partial)
    code, out, err = _run(_argv(["{R}", "audit"], place, "nodeA nodeB"), capsys)
    assert code == 1 and "2026-12-07T10:00:00Z nodeA mia up" in out
    assert "the audit is incomplete: no answer from nodeB" in err
    code, out, _ = _run(_argv(["{R}", "audit", "--json"], place, "nodeA nodeB"), capsys)
    doc = json.loads(out)
    check_shape(doc, 1)
    assert doc["entries"] == [entry] and doc["node"] == "nodeB" and doc["fix"] == "check nodeB's network"


def test_audit_reads_a_node_whose_command_failed_as_missing(place: dict[str, str], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The flow: a node that connected but could not run the read is missing too, never silently empty."""
    from sparkctl.orchestrate import audit
    from sparkctl.spec.settings import load_settings

    class Answered:
        def __init__(self, *a: Any, **k: Any) -> None:
            self.errors = {"nodeA": NodeError("nodeA", "refused", "refused")}
            self.connected = ["nodeB"]

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def run_all(self, *a: Any, **k: Any) -> Any:
            from sparkctl.cluster import Results

            return Results({"nodeB": NodeError("nodeB", "command-timeout", "timed out")})

    monkeypatch.setattr(audit, "Cluster", Answered)
    s = load_settings(cli={"NODES": "nodeA nodeB"})
    entries, missing = audit.read_audit(s, None, 10)
    assert entries == [] and list(missing) == ["nodeA", "nodeB"] and missing["nodeB"].kind == "command-timeout"
