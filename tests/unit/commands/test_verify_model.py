"""verify-model's words and statuses: unreachable nodes are named once each and what was checked is said
plainly (never "(+-1 nodes)"); a --local folder that is not there is bad input, exit 2, as `plan` says of a
MODEL that is not a folder."""

from __future__ import annotations

import json

import pytest

from tests.unit.test_json_failure_shape import _argv, _run, check_shape, place

__all__ = ["place"]  # the fixture, used by name


def test_unreachable_nodes_are_named_once_and_what_was_checked_is_plain(place: dict[str, str],
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(_argv(["{R}", "verify-model"], place, "nodeA nodeB"), capsys)
    model = f"{place['tmp']}/m"
    assert code == 1 and f"nodeA:{model} and 1 other node" in out and "+-" not in out, out
    assert "nodeA: connection refused" in out and "nodeA: nodeA" not in out and "nodeB: nodeB" not in out
    code, out, _ = _run(_argv(["{R}", "verify-model", "--json"], place, "nodeA nodeB"), capsys)
    doc = json.loads(out)
    check_shape(doc, 1)
    assert doc["checkpoint"] == f"nodeA:{model} and 1 other node"
    assert [(f["node"], f["kind"]) for f in doc["failures"]] == [("nodeA", "node-unreachable"),
                                                                 ("nodeB", "node-unreachable")]
    assert [f["message"] for f in doc["findings"]][0].startswith("nodeA: connection refused")


def test_a_missing_local_folder_is_bad_input_as_in_plan(place: dict[str, str],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    gone = f"{place['tmp']}/gone"
    code, out, err = _run(["verify-model", "--local", gone, "--json"], capsys)
    doc = json.loads(out)
    assert code == 2 and doc["error"] == f"--local {gone}: no such folder", (out, err)
    check_shape(doc, 2)
    code, out, _ = _run(["--model", gone, "--nodes", "nodeA nodeB", "plan", "--local", "--json"], capsys)
    assert code == 2 and json.loads(out)["exit_code"] == 2
