"""`status` names orphan containers and exits 1: a container labelled for this cluster that no
successful `up` recorded (what a `kill -9` of `up` leaves), found with the same audit `up` and `down` use.

Local nodes (tests/unit/localnodes.py): every remote command really runs, `docker` is the stand-in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]
SERVED = "lab-model"


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    with served_scene(monkeypatch, tmp_path, NODES, {"SERVED_MODEL_NAME": SERVED, "VLLM_API_KEY": "k-local"}) as ln:
        yield ln


def _forget_up(ln: LocalNodes, node: str) -> None:
    """As if `up` had been killed before it audited what it started on `node`."""
    audit = ln.home(node) / ".sparkctl" / "t" / "audit.log"
    kept = [ln_ for ln_ in audit.read_text().splitlines() if json.loads(ln_).get("action") != "up"]
    audit.write_text("".join(x + "\n" for x in kept))


def test_status_names_orphans_and_exits_1(nodes: LocalNodes, capsys: Any) -> None:
    from tests.kit.local import local_standin
    from tests.unit.test_standin import write_checkpoint

    assert run(["up"], capsys)[0] == 0
    with local_standin(write_checkpoint(nodes.root / "served"), env={}, served_name=SERVED,
                       extra_args=["--api-key", "k-local"]) as url:
        code, out, err = run(["--json", "status", "--url", url], capsys)
        assert code == 0, out + err  # the control: every container recorded by the `up` that started it
        assert json.loads(out)["orphans"] == []
        _forget_up(nodes, "spark3")
        code, out, err = run(["--json", "status", "--url", url], capsys)
        assert code == 1, out + err
        doc = json.loads(out)
        assert doc["ok"] is False
        assert [(o["node"], o["name"], o["rank"]) for o in doc["orphans"]] == [("spark3", "sparkctl-t-rank2", 2)]
        assert any(p.startswith("spark3: orphan container sparkctl-t-rank2 (rank 2")
                   and "no successful `up` recorded it" in p for p in doc["problems"]), doc["problems"]
        code, out, err = run(["status", "--url", url], capsys)  # the human view names it too
        assert code == 1 and "orphan container sparkctl-t-rank2" in out + err
