"""`exec`'s status is its command's: with --json, a command that exits non-zero makes the one failure document
(its reason the command's last stderr line, `exit_code` the process's status), and its own report (stdout,
stderr, `command_exit_code`) rides beside it; a command that exits 0 keeps exec's document as it was."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sparkctl.cluster import RunResult
from tests.unit.test_json_failure_shape import _run, check_shape, place

__all__ = ["place"]  # the fixture, used by name


@pytest.mark.parametrize("status", [0, 3])
def test_exec_json_is_the_commands_status(status: int, place: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from sparkctl.commands import rank_exec

    def ran(ssh_config: Any, node: str, cluster: str, rank: int, argv: list[str], timeout: float) -> RunResult:
        return RunResult("out\n", "first\nno such file: /x\n" if status else "", status, 0.1)

    monkeypatch.setattr(rank_exec, "run_in_rank", ran)
    code, out, _ = _run(["--nodes", "nodeA nodeB", "exec", "--rank", "1", "--json", "--", "ls", "/x"], capsys)
    doc = json.loads(out)
    assert code == status
    if not status:
        assert doc == {"rank": 1, "node": "nodeB", "exit_code": 0, "stdout": "out\n", "stderr": ""}
        return
    check_shape(doc, status)
    assert doc["error"] == "`ls /x` exited 3 in rank 1's container on nodeB: no such file: /x"
    assert doc["node"] == "nodeB" and doc["command_exit_code"] == 3 and doc["stdout"] == "out\n"
