"""`status` checks, from each rank's node, that the head's master port can be reached, and names the
path that is cut: a partition after the rendezvous, which `wait` does not watch.

Local nodes (tests/unit/localnodes.py): the reach test (probes/reach.sh) really runs on each node. The
master address is set with MASTER_ADDR: 127.0.0.1 (its closed port refuses: a refusal proves the path)
and 255.255.255.255, to which every Linux kernel refuses a TCP connect ("Network is unreachable"): a
cut path, without a firewall. The lab test drops real packets between two hosts
(tests/lab/test_lock_scope_lab.py::test_status_names_the_path_to_the_master_that_is_cut).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli as run
from tests.unit.localnodes import served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]


@pytest.mark.parametrize("addr, cut", [("127.0.0.1", False), ("255.255.255.255", True)])
def test_status_names_each_rank_whose_path_to_the_master_is_cut(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                 capsys: Any, addr: str, cut: bool) -> None:
    from tests.kit.local import local_standin
    from tests.unit.test_standin import write_checkpoint

    env = {"SERVED_MODEL_NAME": "lab-model", "MASTER_ADDR": addr, "MASTER_PORT": "39599"}
    with served_scene(monkeypatch, tmp_path, NODES, env) as nodes:
        assert run(["up"], capsys)[0] == 0
        with local_standin(write_checkpoint(nodes.root / "served"), env={}, served_name="lab-model") as url:
            code, out, err = run(["--json", "status", "--url", url], capsys)
            doc = json.loads(out)
            assert [(p["rank"], p["node"], p["head"], p["ok"]) for p in doc["master_paths"]] == \
                [(1, "spark2", "spark1", not cut), (2, "spark3", "spark1", not cut), (3, "spark4", "spark1", not cut)]
            assert code == (1 if cut else 0), out + err
            if cut:
                want = f"rank 2 (spark3) cannot reach the head's master {addr}:39599 on spark1: "
                assert any(p.startswith(want) and "the path spark3 → spark1 is cut" in p for p in doc["problems"]), \
                    doc["problems"]
                code, out, err = run(["status", "--url", url], capsys)
                assert code == 1 and "the path spark2 → spark1 is cut" in out + err
