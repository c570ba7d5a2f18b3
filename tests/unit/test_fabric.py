"""`check --fabric`: the container each rank runs, the findings from what ranks print, the cleanup."""

from __future__ import annotations

import _thread
import concurrent.futures
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster import NodeError, RunResult
from sparkctl.orchestrate import fabric_test as fabric
from sparkctl.probes import fabric_allreduce
from sparkctl.rules.check_rules import CLUSTER_ROW, FAIL, OK
from sparkctl.spec.builders import rank_env
from sparkctl.spec.recipes import FabricTest
from sparkctl.spec.settings import load_settings

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "nccl"
NODES = ["spark1", "spark2", "spark3", "spark4"]
PINS = {
    "RANK0_FABRIC_IP": "192.168.100.1", "RANK0_CX7_IF": "enp1s0f0np0", "RANK0_CX7_IB": "rocep1s0f0",
    "RANK0_GID_INDEX": "3",
    "RANK1_FABRIC_IP": "192.168.100.2", "RANK1_CX7_IF": "enp1s0f0np0", "RANK1_CX7_IB": "rocep1s0f0",
    "RANK1_GID_INDEX": "3",
    "RANK2_FABRIC_IP": "192.168.100.3", "RANK2_CX7_IF": "enP2p1s0f1np1", "RANK2_CX7_IB": "roceP2p1s0f1",
    "RANK2_GID_INDEX": "4",
    "RANK3_FABRIC_IP": "192.168.100.4", "RANK3_CX7_IF": "enp1s0f0np0", "RANK3_CX7_IB": "rocep1s0f0",
    "RANK3_GID_INDEX": "3",
}  # fmt: skip


def _settings(recipe: str = "glm53-exl3-tp4", **extra: str) -> Any:
    return load_settings(cli={}, environ={"NODES": " ".join(NODES), "MODEL": "/models/GLM-5.3-EXL3", "RECIPE": recipe,
                                          **PINS, "HF_TOKEN": "hf_secret_never_shown", **extra})


def _pins(s: Any) -> list[Any]:
    return [s.rank_pins(r) for r in range(len(s.nodes))]


def _env_of(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, w in enumerate(argv) if w == "--env")


def test_run_argv_has_the_pins_up_would_set_and_no_secret(clean_env: dict[str, str]) -> None:
    s = _settings()
    pins = _pins(s)
    argv = fabric.fabric_run_argv(s, 2, pins)
    env = _env_of(argv)
    want = {k: v for k, v in rank_env(s, 2, pins[2]).items() if k != "HF_TOKEN"}
    assert {k: v for k, v in env.items() if k not in ("NCCL_DEBUG", "PYTHONUNBUFFERED")} == want
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "enP2p1s0f1np1"
    assert env["NCCL_IB_HCA"] == "roceP2p1s0f1" and env["NCCL_IB_GID_INDEX"] == "4"
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_NVLS_ENABLE"] == "0"
    assert not any("hf_secret_never_shown" in w for w in argv)
    assert argv[:6] == ["docker", "run", "--rm", "--interactive", "--pull", "never"]
    assert "--mount" not in argv  # no model needed; a missing one must not read as a fabric failure
    for label in ("sparkctl.cluster=sparkctl", "sparkctl.rank=2", "sparkctl.purpose=fabric-test"):
        assert argv[argv.index(label) - 1] == "--label"
    assert argv[argv.index("--name") + 1] == "sparkctl-sparkctl-fabric-rank2"
    assert "--gpus" in argv and "--ulimit" in argv  # the service's own container options
    tail = argv[argv.index("--entrypoint"):]
    assert tail[:4] == ["--entrypoint", "python3", str(s.get("IMAGE")), "-"]
    assert tail[tail.index("--master-addr") + 1] == "192.168.100.1"
    assert tail[tail.index("--master-port") + 1] == str(s.getint("MASTER_PORT") + 1)  # never the service's own
    assert tail[tail.index("--world") + 1] == "4" and tail[tail.index("--backend") + 1] == "nccl"
    assert tail[tail.index("--sizes") + 1] == "1048576,16777216,67108864,268435456"


def test_lab_recipe_uses_gloo_in_its_torch_image(clean_env: dict[str, str]) -> None:
    s = _settings("lab")
    argv = fabric.fabric_run_argv(s, 0, _pins(s), timeout_s=12)
    tail = argv[argv.index("--entrypoint"):]
    assert tail[2] == "sparkctl-lab/torch:latest"
    assert tail[tail.index("--backend") + 1] == "gloo" and tail[tail.index("--deadline") + 1] == "12"


def test_busbw_factor_is_nccl_tests() -> None:
    assert fabric_allreduce.busbw_factor(2) == 1.0
    assert fabric_allreduce.busbw_factor(4) == 1.5
    assert fabric_allreduce.busbw_factor(8) == 1.75
    assert fabric_allreduce.busbw_factor(1) == 0.0


def _split_ranks(name: str) -> list[str]:
    """A capture holds rank 0's output, then rank 1's: split at rank 1's start event."""
    text = (FIX / name).read_text()
    at = text.index('@@sparkctl-fabric {"event":"start","rank":1')
    return [text[:at], text[at:]]


def _ok_run(text: str) -> RunResult:
    return RunResult(stdout=text, stderr="", exit_code=0, elapsed=1.0)


GLOO = FabricTest(backend="gloo", expect_rdma=False, timeout_s=30)


def test_real_gloo_run_passes_with_busbw_per_rank() -> None:
    parts = _split_ranks("h200x1-gloo-2rank.log")
    outcomes = [fabric.outcome_from_run(r, f"n{r}", _ok_run(t)) for r, t in enumerate(parts)]
    findings = fabric.evaluate(outcomes, GLOO, timeout_s=30)
    assert [f.status for f in findings] == [OK, OK]
    assert findings[0].short.endswith("GB/s") and "4194304" in findings[0].text
    report = fabric.FabricReport("gloo", "img", outcomes, findings, 2.0, 0.9, {}, {})
    assert set(report.busbw_by_size()) == {"65536", "1048576", "4194304"}
    assert report.ok and report.to_dict()["ranks"][1]["joined"]


def test_lost_node_and_rank_that_never_joined_are_named() -> None:
    parts = _split_ranks("h200x1-gloo-2rank.log")
    lost = NodeError("n1", "lost", "SSH connection lost: EOF")
    outcomes = [fabric.outcome_from_run(0, "n0", _ok_run(parts[0])), fabric.outcome_from_run(1, "n1", lost)]
    findings = fabric.evaluate(outcomes, GLOO, timeout_s=30)
    bad = [f for f in findings if f.status == FAIL]
    assert any(f.node == "n1" and "SSH connection lost" in f.text for f in bad)
    cluster = [f for f in bad if f.node == CLUSTER_ROW]
    assert len(cluster) == 1 and "rank(s) 1 never joined" in cluster[0].text


def _events(*docs: str) -> RunResult:
    return RunResult(stdout="\n".join(fabric_allreduce.MARK + d for d in docs), stderr="", exit_code=1, elapsed=1)


def test_wrong_interface_and_timeouts_are_findings_with_fixes() -> None:
    start = '{"event":"start","rank":%d,"world":3,"backend":"gloo"}'
    outcomes = [
        fabric.outcome_from_run(0, "n0", _events(start % 0, '{"event":"timeout","rank":0,"stage":"init"}')),
        fabric.outcome_from_run(1, "n1", _events(start % 1, '{"event":"error","rank":1,"stage":"init",'
                                                 '"error":"RuntimeError: Unable to find address for: eth9"}')),
        fabric.outcome_from_run(2, "n2", _events(start % 2)),  # killed: no timeout line, no done
    ]
    findings = {f.node: f for f in fabric.evaluate(outcomes, GLOO, timeout_s=30)}
    assert findings["n0"].status == FAIL and "did not finish within 30 s" in findings["n0"].text
    assert findings["n1"].status == FAIL and "eth9" in findings["n1"].text and "RANK1_CX7_IF" in findings["n1"].fix
    assert findings["n2"].status == FAIL and "without a result" in findings["n2"].text
    assert "rank(s) 0, 1, 2 never joined" in findings[CLUSTER_ROW].text


def test_nccl_on_sockets_and_differing_versions_fail() -> None:
    sock = (FIX / "h200x1-nccl-1rank-socket.log").read_text()
    other = sock.replace("NCCL version 2.28.9+cuda13.0", "NCCL version 2.26.2+cuda12.8")
    nccl_fab = FabricTest(backend="nccl", expect_rdma=True)
    outcomes = [fabric.outcome_from_run(0, "n0", _ok_run(sock)), fabric.outcome_from_run(1, "n1", _ok_run(other))]
    findings = fabric.evaluate(outcomes, nccl_fab, timeout_s=60)
    assert sum(f.status == FAIL and "fell back to NET/Socket" in f.text for f in findings) == 2
    assert any(f.node == CLUSTER_ROW and "NCCL versions differ" in f.text for f in findings)
    # the same logs with a floor: the largest size's busbw is compared
    floor = FabricTest(backend="nccl", expect_rdma=False, busbw_floor_gbps=1e6)
    assert any("below the recipe's floor" in f.text for f in fabric.evaluate(outcomes, floor, timeout_s=60))


class FakeNode:
    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log

    def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None) -> RunResult:
        kind = "sweep" if argv[:2] == ["sh", "-c"] else "run"
        self.log.append((self.name, kind))
        return RunResult(stdout="0\n" if kind == "sweep" else "", stderr="", exit_code=0, elapsed=0)


class FakeCluster:
    def __init__(self, nodes: list[str], run_all: Any) -> None:
        self.log: list[tuple[str, str]] = []
        self.nodes = {n: FakeNode(n, self.log) for n in nodes}
        self._run_all = run_all

    def node(self, name: str) -> FakeNode:
        return self.nodes[name]

    def run_all(self, fn: Any, nodes: list[str]) -> dict[str, Any]:
        return self._run_all(self, fn, nodes)


def test_containers_are_swept_on_every_node_after_a_run(clean_env: dict[str, str]) -> None:
    s = _settings("lab")

    def run_all(c: FakeCluster, fn: Any, nodes: list[str]) -> dict[str, Any]:
        return {n: fn(c.node(n)) for n in nodes}

    c = FakeCluster(NODES, run_all)
    report = fabric.run_fabric_test(c, s, _pins(s))  # type: ignore[arg-type]
    assert sorted(n for n, k in c.log if k == "sweep") == NODES
    assert not report.ok  # the fake printed nothing: no rank joined


def test_ctrl_c_sweeps_every_node_and_reraises(clean_env: dict[str, str]) -> None:
    s = _settings("lab")
    released = threading.Event()
    returned = threading.Event()
    woken: list[bool] = []

    def run_all(c: FakeCluster, fn: Any, nodes: list[str]) -> dict[str, Any]:
        _thread.interrupt_main()  # Ctrl-C while every rank's docker run is in flight
        woken.append(released.wait(30))  # "docker run" ends once the sweep removed its container
        returned.set()
        return {n: RunResult("", "", 137, 0) for n in nodes}

    c = FakeCluster(NODES, run_all)
    orig = fabric.sweep

    def sweep(node: Any, cluster: str) -> int:
        released.set()
        return orig(node, cluster)

    fabric_sweep = pytest.MonkeyPatch()
    fabric_sweep.setattr(fabric, "sweep", sweep)
    try:
        with pytest.raises(KeyboardInterrupt):
            fabric.run_fabric_test(c, s, _pins(s))  # type: ignore[arg-type]
        # the in-flight runs ended because the Ctrl-C's sweep removed their containers, not by waiting
        # out a bound (how fast: a wall-clock figure, not asserted here on a loaded machine). The run's
        # thread may still be between its wait and its return when the interrupt reaches us (seen once
        # in a random-order run on a busy machine): wait for it to say how it woke, not for a time.
        assert returned.wait(60)
        assert woken == [True]
    finally:
        fabric_sweep.undo()
    sweeps = [n for n, k in c.log if k == "sweep"]
    assert sorted(set(sweeps)) == NODES and len(sweeps) == 2 * len(NODES)  # before and after the in-flight runs


def test_size_label() -> None:
    assert [fabric.size_label(n) for n in (65536, 1 << 20, 256 << 20, 1 << 30, 1000)] == [
        "64 KiB", "1 MiB", "256 MiB", "1 GiB", "1000 B"]


def test_up_fabric_gate_refuses_on_failure_and_skips_while_serving(clean_env: dict[str, str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from sparkctl.errors import CheckFailed
    from sparkctl.orchestrate.up import fabric_gate

    s = _settings("lab")
    calls: list[int] = []
    bad = fabric.FabricReport("gloo", "img", [], [fabric.Finding("spark3", "collective", FAIL, "failed",
                                                                  "rank 2 (spark3): failed at init", "the fix")],
                              1.0, 0.5, {}, {})
    monkeypatch.setattr(fabric, "run_fabric_test", lambda *a, **k: calls.append(1) or bad)
    printed: list[str] = []
    with pytest.raises(CheckFailed, match="rank 2 \\(spark3\\): failed at init"):
        fabric_gate(None, s, _pins(s), {n: [] for n in NODES}, printed.append)  # type: ignore[arg-type]
    assert calls == [1]
    running = {n: [SimpleNamespace(running=True)] for n in NODES}
    fabric_gate(None, s, _pins(s), running, printed.append)  # type: ignore[arg-type]
    assert calls == [1] and "skipped" in printed[-1]


def test_one_rank_failing_stops_the_others_at_once(clean_env: dict[str, str]) -> None:
    s = _settings("lab")
    swept = threading.Event()
    err = fabric_allreduce.MARK + ('{"event":"error","rank":2,"stage":"init",'
                                   '"error":"RuntimeError: Unable to find address for: eth9"}')

    class Node(FakeNode):
        def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None) -> RunResult:
            if argv[:2] == ["sh", "-c"]:
                swept.set()
                return super().run(argv, stdin=stdin, timeout=timeout)
            if self.name == "spark3":
                return RunResult(err, "", 1, 0.1)
            woken.append(swept.wait(30))  # the other ranks wait at the rendezvous until their container is removed
            return RunResult("", "", 137, 5)

    def run_all(c: FakeCluster, fn: Any, nodes: list[str]) -> dict[str, Any]:
        with __import__("concurrent.futures").futures.ThreadPoolExecutor(4) as pool:
            return dict(zip(nodes, pool.map(lambda n: fn(c.node(n)), nodes), strict=True))

    woken: list[bool] = []
    c = FakeCluster(NODES, run_all)
    c.nodes = {n: Node(n, c.log) for n in NODES}
    report = fabric.run_fabric_test(c, s, _pins(s))  # type: ignore[arg-type]
    assert woken == [True, True, True]  # the failed rank's sweep released the waiting ones (no bound ran out)
    by_node = {f.node: f for f in report.findings if f.status == FAIL}
    assert "eth9" in by_node["spark3"].text
    for n in ("spark1", "spark2", "spark4"):
        assert by_node[n].short == "stopped" and "after rank 2 failed" in by_node[n].text


# What docker 28 prints for `docker run --pull never` of an image its engine lacks (exit 125).
NO_IMAGE = ("docker: Error response from daemon: No such image: {image}\n\n"
            "Run 'docker run --help' for more information\n")


def _side_by_side(c: FakeCluster, fn: Any, nodes: list[str]) -> dict[str, Any]:
    """Cluster.run_all: every node at once, a NodeError as that node's result."""

    def guarded(n: str) -> Any:
        try:
            return fn(c.node(n))
        except NodeError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(len(nodes)) as pool:
        return dict(zip(nodes, pool.map(guarded, nodes), strict=True))


def _run_nodes(s: Any, act: Any) -> fabric.FabricReport:
    """run_fabric_test on s's nodes side by side, each `docker run` being act(node, swept): `swept` is set
    once a sweep has begun (the first failure's, which removes the others' containers)."""
    swept = threading.Event()

    class Node(FakeNode):
        def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None) -> RunResult:
            if argv[:2] == ["sh", "-c"]:
                swept.set()
                return super().run(argv, stdin=stdin, timeout=timeout)
            result: RunResult = act(self.name, swept)
            return result

    c = FakeCluster([], _side_by_side)
    c.nodes = {n: Node(n, c.log) for n in s.nodes}
    return fabric.run_fabric_test(c, s, _pins(s))  # type: ignore[arg-type]


def _run_without_image(s: Any, lacking: set[str]) -> fabric.FabricReport:
    """run_fabric_test where the nodes in `lacking` have no such image and the others wait at the
    rendezvous until the first failure's sweep removes their container."""

    def act(name: str, swept: threading.Event) -> RunResult:
        if name in lacking:
            return RunResult("", NO_IMAGE.format(image=fabric.fabric_image(s)), 125, 0.1)
        swept.wait(30)
        return RunResult("", "", 137, 5)

    return _run_nodes(s, act)


def test_a_lab_without_the_torch_image_is_told_to_run_lab_torch(clean_env: dict[str, str]) -> None:
    """Every lab host lacking sparkctl-lab/torch:latest said "check spark2 and its Docker engine"."""
    report = _run_without_image(_settings("lab"), set(NODES))
    by_node = {f.node: f for f in report.findings if f.status == FAIL and f.node != CLUSTER_ROW}
    assert sorted(by_node) == NODES  # each rank names its own missing image (none reads as "stopped")
    for f in by_node.values():
        assert f.short == "no image" and "No such image: sparkctl-lab/torch:latest" in f.text, f
        assert "`sparkctl lab torch`" in f.fix and "Docker engine" not in f.fix, f


def test_the_lab_image_the_hint_names_is_the_one_lab_torch_loads() -> None:
    """The fabric test names the lab's torch image itself (production code does not import the lab); it must
    stay the image `sparkctl lab torch` loads and the lab recipe's [fabric] image."""
    from sparkctl.lab.state import TORCH_IMAGE
    from sparkctl.spec.recipes import load_recipe

    assert fabric.LAB_TORCH_IMAGE == TORCH_IMAGE == load_recipe("lab").fabric.image


def test_one_host_without_the_image_is_named_and_the_others_were_stopped(clean_env: dict[str, str]) -> None:
    report = _run_without_image(_settings("lab"), {"spark2"})
    by_node = {f.node: f for f in report.findings if f.status == FAIL}
    assert by_node["spark2"].short == "no image" and "`sparkctl lab torch`" in by_node["spark2"].fix
    for n in ("spark1", "spark3", "spark4"):
        assert by_node[n].short == "stopped" and "after rank 1 failed" in by_node[n].text


def test_production_without_the_serving_image_is_told_to_build(clean_env: dict[str, str]) -> None:
    s = _settings()
    assert not s.recipe.fabric.image  # the test runs in IMAGE, the chain's top
    report = _run_without_image(s, set(NODES))
    fails = [f for f in report.findings if f.status == FAIL and f.node != CLUSTER_ROW]
    assert len(fails) == 4
    for f in fails:
        assert f.short == "no image" and f"No such image: {s.get('IMAGE')}" in f.text, f
        assert "`sparkctl build`" in f.fix and "lab torch" not in f.fix, f


def test_a_recipes_own_fabric_image_missing_is_named_with_how_to_load_it() -> None:
    fab = FabricTest(backend="nccl", image="registry.example/nccl-tests:1", expect_rdma=False)
    res = RunResult("", NO_IMAGE.format(image=fab.image), 125, 0.1)
    (f, _cluster) = fabric.evaluate([fabric.outcome_from_run(0, "n0", res)], fab, timeout_s=30)
    assert f.short == "no image" and "registry.example/nccl-tests:1 on n0" in f.fix and "docker pull" in f.fix
    # any other docker failure keeps the generic fix
    other = RunResult("", "docker: Cannot connect to the Docker daemon at unix:///var/run/docker.sock.", 125, 0.1)
    (g, _cluster) = fabric.evaluate([fabric.outcome_from_run(0, "n0", other)], fab, timeout_s=30)
    assert g.short == "no result" and "check n0 and its Docker engine" in g.fix


@pytest.mark.parametrize("body, key", [('backend = "mpi"', "backend"), ("sizes = [0]", "sizes"),
                                       ("iters = 0", "fabric"), ("speed = 1", "speed")])
def test_recipe_fabric_section_is_validated(tmp_path: Path, body: str, key: str) -> None:
    from sparkctl.errors import UsageError
    from sparkctl.spec.recipes import load_recipe

    text = (Path(fabric.__file__).parent.parent / "recipes" / "lab.toml").read_text().partition("\n[fabric]")[0]
    bad = tmp_path / "bad.toml"
    bad.write_text(text + "\n[fabric]\n" + body + "\n")
    with pytest.raises(UsageError, match=f"bad.toml/fabric.*{key}" if key != "fabric" else "bad.toml/fabric"):
        load_recipe(str(bad))
    assert load_recipe("glm53-exl3-tp4").fabric.busbw_floor_gbps == 5.0


def test_the_remove_by_hand_hints_remove_only_this_clusters_fabric_tests(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clean_env: dict[str, str]) -> None:
    """When a sweep fails, both hints (the sweep's error and the run's `not cleaned` finding) name a command
    that, pasted into a node's shell, removes this cluster's fabric-test containers and nothing else: not
    another cluster's fabric test, not this cluster's service. The cluster's name is one quoted word."""
    import shlex
    import subprocess

    from tests.unit.localnodes import local_nodes

    class Unswept(FakeNode):
        def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None) -> RunResult:
            if argv[:2] == ["sh", "-c"]:
                return RunResult("", "Cannot connect to the Docker daemon", 1, 0)
            return super().run(argv, stdin=stdin, timeout=timeout)

    def run_all(c: FakeCluster, fn: Any, nodes: list[str]) -> dict[str, Any]:
        return {n: fn(c.node(n)) for n in nodes}

    c = FakeCluster(NODES, run_all)
    c.nodes = {n: Unswept(n, c.log) for n in NODES}
    report = fabric.run_fabric_test(c, _settings("lab", CLUSTER_NAME="t"), _pins(_settings("lab")))  # type: ignore[arg-type]
    (finding,) = [f for f in report.findings if f.node == "spark1" and f.short == "not cleaned"]
    hints = {"finding": finding.fix.split("remove them by hand on spark1: ", 1)[1]}
    with pytest.raises(NodeError) as err:
        fabric.sweep(Unswept("spark1", []), "t")  # type: ignore[arg-type]
    hints["sweep"] = err.value.fix.split("on spark1: ", 1)[1]
    with pytest.raises(NodeError) as odd:
        fabric.sweep(Unswept("spark1", []), "t x;touch canary")  # type: ignore[arg-type]
    hints["quoted"] = odd.value.fix.split("on spark1: ", 1)[1]

    planted = {"mine": ["sparkctl.cluster=t", "sparkctl.purpose=fabric-test"],
               "odd": ["sparkctl.cluster=t x;touch canary", "sparkctl.purpose=fabric-test"],
               "other-fabric": ["sparkctl.cluster=othercluster", "sparkctl.purpose=fabric-test"],
               "serving": ["sparkctl.cluster=t", "sparkctl.rank=0"]}
    with local_nodes(monkeypatch, tmp_path / "nodes", ["spark1"]) as ln:
        for which, hint in hints.items():
            state = ln.root / "docker-spark1.json"
            state.write_text(json.dumps({**json.loads(state.read_text()), "containers": {}}))
            for name, labels in planted.items():
                words = [w for lab in labels for w in ("--label", lab)]
                assert ln.docker("spark1", "run", "--detach", "--name", name, *words, "busybox").returncode == 0
            subprocess.run(["sh", "-c", hint], env=ln.env_for("spark1"), cwd=tmp_path, capture_output=True,
                           timeout=30, check=False)
            left = sorted(c["Name"].lstrip("/") for c in json.loads(state.read_text())["containers"].values())
            gone = {"finding": "mine", "sweep": "mine", "quoted": "odd"}[which]
            assert left == sorted(set(planted) - {gone}), (which, hint, left)
            assert not (tmp_path / "canary").exists(), hint
            assert shlex.split(hint)[:2] == ["docker", "rm"], hint
