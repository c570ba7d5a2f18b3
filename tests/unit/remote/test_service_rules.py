"""service.py's rules (what its mutation run, bench/mutation.py, showed untested): what `up` says and
reports, the memory wait's words and its switch, the page cache's freed figure, and what a node says
when the rank's env file cannot be written. Fakes from test_memory_wait.py (the wait) and the local
nodes of test_lifecycle_paths.py (`up` as a user runs it)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster import NodeError, Results, RunResult
from sparkctl.errors import CheckFailed
from sparkctl.facts import node_facts as F
from sparkctl.remote import service
from sparkctl.rules import memory
from sparkctl.spec.builders import RankSpec
from sparkctl.spec.planner import GB
from sparkctl.spec.settings import RankPins, load_settings
from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene
from tests.unit.test_lifecycle_paths import NODES, SERVED, calls
from tests.unit.test_memory_wait import LOOK, Clock, FakeCluster, meminfo, node_facts

SETTINGS = {"NODES": "spark1 spark2", "TP": "2", "DCP": "1", "MODEL": "/models/x"}


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    with served_scene(monkeypatch, tmp_path, NODES, {"SERVED_MODEL_NAME": SERVED, "VLLM_API_KEY": "k-local"}) as ln:
        yield ln


# ------------------------------------------------------------------------------ up as a user runs it


def test_an_up_that_starts_the_service_says_so_and_reports_changed(nodes: LocalNodes, capsys: Any) -> None:
    """A fresh `up` started every rank: `--json` says changed with the four ranks, the text says how
    many started (never "already running; nothing changed"); the same `up` again changes nothing."""
    code, out, err = run(["--json", "up"], capsys)
    assert code == 0, err
    doc = json.loads(out[out.index("{"):])
    assert doc["changed"] is True and len(doc["started"]) == len(NODES) and doc["reasons"], doc
    code, out, err = run(["up", "--recreate"], capsys)
    assert code == 0, err
    assert f"up: {len(NODES)} ranks started" in out and "nothing changed" not in out, out
    code, out, err = run(["--json", "up"], capsys)
    assert code == 0 and json.loads(out[out.index("{"):])["changed"] is False


def test_any_positive_memory_wait_waits_only_zero_turns_it_off(nodes: LocalNodes, capsys: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every look at a node shows an ended engine still holding GPU memory. MEMORY_WAIT_S=0.3 (under a
    second, still a wait) refuses after it and starts nothing; MEMORY_WAIT_S=0 starts without looking."""
    from sparkctl.orchestrate import up as orchestrate_up

    real = orchestrate_up.probe_node

    def ghost(node: Any, s: Any) -> F.NodeFacts:
        return dataclasses.replace(real(node, s), gpu_apps=F.parse_compute_apps("77, VLLM::Worker_TP, 60000\n"
                                                                              "@@ended 77\n"))

    monkeypatch.setattr(orchestrate_up, "probe_node", ghost)
    monkeypatch.setenv("MEMORY_WAIT_S", "0.3")
    code, out, err = run(["up"], capsys)
    assert code == 1 and "the memory did not come back within 0.3 s (MEMORY_WAIT_S)" in err, out + err
    assert calls(nodes, "run") == [], "a rank started before its memory was back"
    monkeypatch.setenv("MEMORY_WAIT_S", "0")
    code, out, err = run(["up"], capsys)
    assert code == 0 and len(calls(nodes, "run")) == len(NODES), out + err


# ------------------------------------------------------------------------------ the memory wait


def test_the_wait_says_seconds_waited_whatever_the_clocks_origin() -> None:
    """time.monotonic() starts anywhere: the wait's words and audit line give the seconds since it
    began. spark1, back at the first look, costs no word and no audit line; spark2 is waited for
    (said once, with why), then back after 4 s."""
    m = meminfo()
    need = (m.free_bytes or 0) + (m.cache_bytes or 0) - GB
    ghost = node_facts("77, VLLM::Worker_TP, 60000\n@@ended 77\n")
    cluster = FakeCluster({"spark1": [node_facts()], "spark2": [ghost, ghost, node_facts()]})
    clock, said = Clock(), list[str]()
    clock.t = 86_400.0  # a host up for a day
    service.wait_for_memory(cluster, load_settings(environ=SETTINGS),  # type: ignore[arg-type]
                            {n: memory.NodeMemory(need, True, True) for n in ("spark1", "spark2")},
                            LOOK, said.append, clock=clock, sleep=clock.sleep)
    assert len(said) == 2 and said[0].startswith("waiting up to 120 s (MEMORY_WAIT_S) for the memory on spark2")
    assert said[1] == "memory back on spark2 after 4.0 s"
    (line,) = cluster.audit["spark2"]
    assert json.loads(line)["detail"].startswith("back after 4.0 s: ended process(es)")
    assert "spark1" not in cluster.audit


# ------------------------------------------------------------------------------ the page cache


class _Node:
    def __init__(self, name: str, stdout: str, stderr: str = "", code: int = 0) -> None:
        self.name, self.answer, self.audit = name, RunResult(stdout, stderr, code, 0.0), list[str]()

    def run(self, argv: list[str], *, timeout: float | None = None, stdin: bytes | None = None) -> RunResult:
        if argv[3] == "sparkctl-audit":
            self.audit += argv[5:]
            return RunResult("", "", 0, 0.0)
        return self.answer


class _Cluster:
    def __init__(self, *nodes: _Node) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.connected = list(self.nodes)

    def run_all(self, fn: Any, nodes: list[str]) -> Results[Any]:
        out: dict[str, Any] = {}
        for n in nodes:
            try:
                out[n] = fn(self.nodes[n])
            except NodeError as exc:
                out[n] = exc
        return Results(out)


def test_drop_caches_says_and_audits_what_memfree_grew_by() -> None:
    """The script prints MemFree before and after in kB: freed = after − before, in bytes."""
    node = _Node("spark1", "dropped sudo 1000000 6000000\n")
    said = list[str]()
    service.drop_caches(_Cluster(node), load_settings(environ={**SETTINGS, "DROP_CACHES": "1"}),  # type: ignore[arg-type]
                        ["spark1"], said.append)
    assert said == ["dropped the page cache on spark1 (sudo): 5.1 GB freed"]
    (line,) = node.audit
    assert json.loads(line)["detail"] == "sudo, 5120000000 B freed"


# ------------------------------------------------------------------------------ the env file


def test_what_a_node_says_when_the_env_file_cannot_be_written_is_capped_at_200_characters() -> None:
    """The start script exits 97 when the rank's env file cannot be written: the refusal names the file
    and how to fix it, and carries the node's words cut to 200 characters (a node's text is capped)."""
    words = "mkdir: cannot create directory '/home/u/.sparkctl': Permission denied " * 5
    node = _Node("spark2", "", words, 97)
    spec = RankSpec(1, "spark2", RankPins(), {"HF_TOKEN": "hf_x"}, ["vllm", "serve", "/m"])
    started = list[str]()
    with pytest.raises(CheckFailed) as exc:
        service._start(_Cluster(node), load_settings(environ=SETTINGS), [spec], "h1", started,  # type: ignore[arg-type]
                       lambda m: None, {})
    msg = exc.value.message
    cut = words.strip()[:200]
    assert f"cannot write .sparkctl/sparkctl/rank1.env: {cut} (fix: check that the SSH user can write" in msg, msg
    assert words.strip()[:201] not in msg and started == []
