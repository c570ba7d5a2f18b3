"""A dead rank in `status` (and `wait`'s RankDied) comes with its node's kernel lines about OOM/Xid: "exited
137" becomes "the kernel's OOM killer ended it". Local nodes: the node's real `dmesg` is a stand-in on its
PATH that prints an OOM killer line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli as run
from tests.unit.localnodes import served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]
OOM = "[Fri Dec  4 03:01:02 2026] Out of memory: Killed process 4242 (python3) total-vm:120000000kB, anon-rss:1kB"


def _kill(root: Path, node: str, code: int) -> None:
    state_file = root / f"docker-{node}.json"
    state = json.loads(state_file.read_text())
    for c in state["containers"].values():
        c["State"].update(Status="exited", Running=False, ExitCode=code)
    state_file.write_text(json.dumps(state))


@pytest.mark.parametrize("oom", [True, False])
def test_status_says_the_oom_killer_ended_a_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any,
                                                 oom: bool) -> None:
    with served_scene(monkeypatch, tmp_path, NODES, {"SERVED_MODEL_NAME": "lab-model"}) as nodes:
        assert run(["up"], capsys)[0] == 0
        _kill(nodes.root, "spark3", 137)
        dmesg = nodes.root / "hw" / "spark3" / "bin" / "dmesg"
        dmesg.write_text("#!/bin/sh\necho 'usb 1-1: new device'\n" + (f"echo '{OOM}'\n" if oom else ""))
        dmesg.chmod(0o755)
        code, out, err = run(["--json", "status"], capsys)
    doc = json.loads(out)
    assert code == 1
    row = next(r for r in doc["ranks"] if r["rank"] == 2)
    said = next(p for p in doc["problems"] if p.startswith("rank 2 (spark3): exited (exit 137)"))
    if oom:
        assert row["why"].startswith("the kernel's OOM killer ended it") and row["kernel_lines"] == [OOM]
        assert "OOM killer" in said and OOM in said
    else:
        assert "SIGKILL" in row["why"] and row["kernel_lines"] == [] and "OOM killer ended" not in said


def test_rank_died_shows_the_kernel_lines_with_the_log() -> None:
    from sparkctl.facts.docker_parse import ContainerState
    from sparkctl.remote.readiness import rank_died

    st = ContainerState("c", "sparkctl-t-rank2", 2, None, "i", "exited", False, 137, "", 0, "")
    err = rank_died(2, "spark3", st, ["INFO loading"], 12.0,
                    kernel=("the kernel's OOM killer ended it (the node's memory ran out)", [OOM]))
    assert "exited, exit code 137: the kernel's OOM killer ended it" in err.message
    assert "INFO loading" in err.message and f"the kernel's lines on spark3:\n    {OOM}" in err.message


def test_wait_says_the_oom_killer_ended_a_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any) -> None:
    with served_scene(monkeypatch, tmp_path, NODES, {"SERVED_MODEL_NAME": "lab-model"}) as nodes:
        assert run(["up"], capsys)[0] == 0
        _kill(nodes.root, "spark2", 137)
        dmesg = nodes.root / "hw" / "spark2" / "bin" / "dmesg"
        dmesg.write_text(f"#!/bin/sh\necho '{OOM}'\n")
        dmesg.chmod(0o755)
        code, out, err = run(["wait", "--timeout", "20"], capsys)
    assert code == 1
    assert "rank 1 on spark2 died (exited, exit code 137: the kernel's OOM killer ended it" in out + err, out + err
    assert f"the kernel's lines on spark2:\n    {OOM}" in out + err
