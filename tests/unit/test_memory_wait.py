"""Memory, `up`'s side: who holds GPU memory (the probe's real shell on real /proc), the wait until a
node's memory is back after a stop, DROP_CACHES=auto, and the refusal next to a foreign process.
The numbers come from real captures: /proc/meminfo of a host with ~5 GB of page cache
(tests/fixtures/host/proc-meminfo-cache.txt) and nvidia-smi's answers on an H200 with a process
holding 10.5 GiB (tests/fixtures/nvidia-smi-h200-process, from ../shared/captures)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sparkctl.cluster import NodeError, Results, RunResult
from sparkctl.errors import CheckFailed
from sparkctl.facts import node_facts as F
from sparkctl.orchestrate import up as orchestrate_up
from sparkctl.remote import service
from sparkctl.rules import memory
from sparkctl.spec.planner import GB
from sparkctl.spec.resources import probe_script
from sparkctl.spec.settings import load_settings

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CID = "c0" * 32
OURS = "0a" * 32
GB10_QUERY = "NVIDIA GB10, 580.95.05, [N/A], 12.1, 1\n"


def fixture(rel: str) -> str:
    return (FIXTURES / rel).read_text()


def meminfo() -> F.MemInfo:
    return F.parse_meminfo(fixture("host/proc-meminfo-cache.txt"))


def node_facts(apps: str = "", gpus: str = GB10_QUERY) -> F.NodeFacts:
    return F.NodeFacts(meminfo=meminfo(), gpus=F.parse_nvidia_smi_query(gpus), gpu_apps=F.parse_compute_apps(apps))


# ------------------------------------------------------------------------------ the probe's lines


def _gpu_apps_function() -> str:
    text = probe_script("node_facts.sh").decode()
    m = re.search(r"^gpu_apps\(\) \{\n.*?^\}\n", text, re.S | re.M)
    assert m, "gpu_apps() not found in node_facts.sh"
    return m.group(0)


def test_the_probe_says_which_listed_process_has_ended_on_real_proc(tmp_path: Path) -> None:
    """node_facts.sh's own gpu_apps, run here: nvidia-smi's real H200 line for a live pid (this test's)
    and for a pid no process has. The dead one is '@@ended' (memory on its way back), the live one not."""
    dead = 4194303
    assert not os.path.exists(f"/proc/{dead}")
    line = fixture("nvidia-smi-h200-process/compute-apps-noheader-nounits.csv").splitlines()[0]
    rows = [line.replace("446", str(os.getpid()), 1), line.replace("446", str(dead), 1)]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(f"'{r.rsplit(',', 1)[0]}'" for r in rows) + "\n")
    smi.chmod(0o755)
    r = subprocess.run(["sh", "-c", _gpu_apps_function() + "T=\ngpu_apps\n"], capture_output=True, text=True,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, timeout=30)
    assert r.returncode == 0, r.stderr
    assert f"@@ended {dead}" in r.stdout.splitlines()
    assert f"@@ended {os.getpid()}" not in r.stdout
    apps = F.parse_compute_apps(r.stdout)
    assert [(a.pid, a.ended) for a in apps] == [(os.getpid(), False), (dead, True)]


def test_parse_names_the_container_and_its_cluster() -> None:
    """The real capture, then the probe's lines: a container's name (docker inspect's '/name') and its
    sparkctl.cluster label ('' or '<no value>' when it has none); an ended pid."""
    text = (fixture("nvidia-smi-h200-process/compute-apps.csv") + "77, VLLM::Worker_TP, 60000 MiB\n"
            + f"@@cgroup 446 {CID}\n@@container {CID}\t/sparkctl-other-rank0\tother\n@@ended 77\n")
    a, b = F.parse_compute_apps(text)
    assert (a.pid, a.container_name, a.container_cluster, a.ended) == (446, "sparkctl-other-rank0", "other", False)
    assert (b.pid, b.container_id, b.ended) == (77, None, True)
    for label in ("", "<no value>"):
        (c,) = F.parse_compute_apps(f"446, python3, 10758\n@@cgroup 446 {CID}\n@@container {CID}\ttrainer\t{label}\n")
        assert (c.container_name, c.container_cluster) == ("trainer", None)


# ---------------------------------------------------------------------------------- who holds it


def test_foreign_is_a_live_process_outside_this_clusters_containers() -> None:
    apps = F.parse_compute_apps(
        f"1, a, 10\n2, b, 20\n3, c, 30\n4, d, 40\n@@cgroup 2 {OURS}\n@@cgroup 3 {CID}\n"
        f"@@container {CID}\t/x-rank0\tmine\n@@ended 4\n")
    assert [a.pid for a in memory.foreign(apps, "mine", {OURS})] == [1]  # 2 by ID, 3 by label, 4 ended
    assert [a.pid for a in memory.foreign(apps, "other", set())] == [1, 2, 3]


def test_up_refuses_next_to_a_foreign_process_naming_it_before_anything_changes() -> None:
    """A trainer container and another sparkctl cluster's engine hold GPU memory: refused (exit 1),
    each named, with how to free it; this cluster's own container is not a reason."""
    s = load_settings(environ={"NODES": "spark1 spark2", "TP": "2", "DCP": "1", "MODEL": "/models/x"})
    other = F.parse_compute_apps(f"446, python3, 10758\n@@cgroup 446 {CID}\n@@container {CID}\t/trainer\t\n")
    theirs = F.parse_compute_apps(f"9, VLLM::Worker_TP, 100\n@@cgroup 9 {CID}\n"
                                  f"@@container {CID}\t/sparkctl-prod-rank1\tprod\n")
    P = orchestrate_up.Preflight
    ok: dict[str, Any] = {"spark1": P(F.NodeFacts(gpu_apps=other), ([], "img"), None),
                          "spark2": P(F.NodeFacts(gpu_apps=theirs), ([], "img"), None)}
    with pytest.raises(CheckFailed) as exc:
        orchestrate_up.refuse_foreign_gpu_processes(s, ok)
    msg, fix = exc.value.message, exc.value.fix or ""
    assert exc.value.exit_code == 1 and "nothing was changed" in msg
    assert "spark1: GPU memory is held by pid 446 python3 (11.3 GB, container trainer)" in msg
    assert "container sparkctl-prod-rank1 of sparkctl cluster 'prod'" in msg
    assert "`docker stop trainer` on spark1" in fix and "CLUSTER_NAME=prod" in fix and "does not stop" in fix
    mine = F.parse_compute_apps(f"446, python3, 10758\n@@cgroup 446 {OURS}\n")
    state = [type("C", (), {"id": OURS})()]
    orchestrate_up.refuse_foreign_gpu_processes(
        s, {"spark1": P(F.NodeFacts(gpu_apps=mine), (state, "img"), None),
            "spark2": P(F.NodeFacts(gpu_apps=[]), ([], "img"), None)})


# ------------------------------------------------------------------------------ memory back?


def test_not_back_on_real_meminfo_names_the_numbers() -> None:
    m = meminfo()
    assert m.free_bytes is not None and m.cache_bytes is not None
    fits = memory.NodeMemory(m.free_bytes + m.cache_bytes - GB, unified=True, drop_caches=True)
    assert memory.not_back(node_facts(), fits) is None  # the cache counts: it is dropped next
    short = memory.NodeMemory(m.free_bytes + m.cache_bytes + GB, unified=True, drop_caches=True)
    why = memory.not_back(node_facts(), short) or ""
    assert "needs 25.3 GB, 18.6 GB is free and 5.7 GB is page cache (MemTotal 25.3 GB)" in why, why
    ended = node_facts("77, VLLM::Worker_TP, 60000\n@@ended 77\n")
    assert "pid 77 VLLM::Worker_TP (62.9 GB; it has exited)" in (memory.not_back(ended, fits) or "")
    # Discrete GPUs: host memory is not the GPU's; only a process still being torn down holds it.
    h200 = fixture("nvidia-smi-h200/query.csv")
    assert memory.not_back(node_facts(gpus=h200), memory.NodeMemory(10**15, False, False)) is None
    assert memory.not_back(node_facts("77, x, 1\n@@ended 77\n", h200), memory.NodeMemory(1, False, False))


def test_drop_caches_auto_is_on_for_unified_memory_only() -> None:
    gb10, h200 = node_facts(), node_facts(gpus=fixture("nvidia-smi-h200/query.csv"))
    assert memory.unified(gb10) and not memory.unified(h200)
    assert memory.drop_caches_on("auto", True) and not memory.drop_caches_on("auto", False)
    assert memory.drop_caches_on("1", False) and not memory.drop_caches_on("0", True)
    s = load_settings(environ={"NODES": "a b", "TP": "2", "DCP": "1", "MODEL": "/models/x"})
    assert s.get("DROP_CACHES", "auto") == "auto"
    plan = type("P", (), {"per_rank_total": 7})()
    P = orchestrate_up.Preflight
    got = orchestrate_up.node_memory(s, plan, {"a": P(gb10, None, None), "b": P(h200, None, None)})
    assert got == {"a": memory.NodeMemory(7, True, True), "b": memory.NodeMemory(7, False, False)}


# ------------------------------------------------------------------------------------ the wait


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        assert s > 0
        self.t += s


class FakeCluster:
    """Each look at a node returns its next facts; audit lines are kept."""

    def __init__(self, looks: dict[str, list[F.NodeFacts | NodeError]]) -> None:
        self.looks = looks
        self.audit: dict[str, list[str]] = {}
        self.connected = list(looks)
        self.nodes = {n: SimpleNamespace(name=n, run=self._audit(n)) for n in looks}

    def _audit(self, n: str) -> Any:
        def run(argv: list[str], *, timeout: float | None = None, stdin: bytes | None = None) -> RunResult:
            self.audit.setdefault(n, []).extend(argv[5:])
            return RunResult("", "", 0, 0.0)
        return run

    def run_all(self, fn: Any, nodes: list[str]) -> Results[Any]:
        out: dict[str, Any] = {}
        for n in nodes:
            if fn is LOOK:
                seq = self.looks[n]
                got = seq.pop(0) if len(seq) > 1 else seq[0]
                out[n] = got
            else:
                out[n] = fn(self.nodes[n])
        return Results(out)


def LOOK(node: Any) -> F.NodeFacts:  # noqa: N802 - a marker the fake recognises
    raise AssertionError("the fake cluster answers looks itself")


def _wait(looks: dict[str, list[Any]], need: int, wait_s: str = "120") -> tuple[FakeCluster, list[str], Clock]:
    s = load_settings(environ={"NODES": "spark1 spark2", "TP": "2", "DCP": "1", "MODEL": "/models/x",
                               "MEMORY_WAIT_S": wait_s})
    cluster, said, clock = FakeCluster(looks), list[str](), Clock()
    service.wait_for_memory(cluster, s, {n: memory.NodeMemory(need, True, True) for n in looks},  # type: ignore[arg-type]
                            LOOK, said.append, clock=clock, sleep=clock.sleep)
    return cluster, said, clock


def test_the_wait_says_what_it_waits_for_then_starts_when_it_is_back() -> None:
    """spark2's killed engine is still listed (ended) for two looks, then gone: up waits ~4 s and says
    so once, then that it is back (audited); spark1, already back, costs one look and no word."""
    m = meminfo()
    need = (m.free_bytes or 0) + (m.cache_bytes or 0) - GB
    ghost = node_facts("77, VLLM::Worker_TP, 60000\n@@ended 77\n")
    cluster, said, clock = _wait({"spark1": [node_facts()], "spark2": [ghost, ghost, node_facts()]}, need)
    assert said[0].startswith("waiting up to 120 s (MEMORY_WAIT_S) for the memory on spark2 to come back: "
                              "ended process(es) still hold GPU memory: pid 77 VLLM::Worker_TP"), said
    assert said[1:] == ["memory back on spark2 after 4.0 s"] and clock.t == 4.0
    (line,) = cluster.audit["spark2"]
    assert json.loads(line)["action"] == "memory-wait" and "spark1" not in cluster.audit


def test_memory_never_back_refuses_with_the_numbers_at_the_bound() -> None:
    m = meminfo()
    need = (m.free_bytes or 0) + (m.cache_bytes or 0) + 3 * GB
    with pytest.raises(CheckFailed) as exc:
        _wait({"spark1": [node_facts()], "spark2": [node_facts()]}, need, wait_s="9")
    msg = exc.value.message
    assert "did not come back within 9 s (MEMORY_WAIT_S)" in msg and "nothing of this release was started" in msg
    assert "spark1: the plan needs 27.3 GB, 18.6 GB is free and 5.7 GB is page cache" in msg
    assert "spark2:" in msg and "MEMORY_WAIT_S" in (exc.value.fix or "")


def test_the_wait_is_bounded_and_audits_the_refusal() -> None:
    m = meminfo()
    need = (m.free_bytes or 0) + (m.cache_bytes or 0) + GB
    s = load_settings(environ={"NODES": "spark1", "TP": "1", "DCP": "1", "MODEL": "/models/x", "MEMORY_WAIT_S": "5"})
    cluster, clock, looks = FakeCluster({"spark1": [node_facts()]}), Clock(), []
    orig = cluster.run_all

    def counting(fn: Any, nodes: list[str]) -> Results[Any]:
        if fn is LOOK:
            looks.append(clock.t)
        return orig(fn, nodes)

    cluster.run_all = counting  # type: ignore[method-assign]
    with pytest.raises(CheckFailed):
        service.wait_for_memory(cluster, s, {"spark1": memory.NodeMemory(need, True, True)},  # type: ignore[arg-type]
                                LOOK, lambda m: None, clock=clock, sleep=clock.sleep)
    assert looks == [0.0, 2.0, 4.0, 5.0] and clock.t == 5.0
    (line,) = cluster.audit["spark1"]
    assert json.loads(line)["action"] == "memory-wait-refused"
