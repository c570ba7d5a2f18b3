"""The topology (replicas → ranks → nodes), every shape it refuses, the replica view of the settings, and
`render` of two replicas on eight nodes."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import UsageError
from sparkctl.spec.builders import LABEL_REPLICA, docker_run_argv, rank_specs
from sparkctl.spec.settings import load_settings
from sparkctl.spec.topology import TopologyError, build_topology
from tests.conftest import run_cli as run
from tests.conftest import write_model

EIGHT = [f"spark{i}" for i in range(1, 9)]


def pins(n: int) -> dict[str, str]:
    return {f"RANK{r}_{k}": v for r in range(n) for k, v in (
        ("FABRIC_IP", f"10.0.0.{r + 11}"), ("CX7_IF", f"enp{r}s0"), ("CX7_IB", f"roce{r}"), ("GID_INDEX", str(r)))}


def load(**environ: str) -> Any:
    base = {"NODES": " ".join(EIGHT), "MODEL": "/models/m", "RECIPE": "lab"}
    return load_settings(cli={}, environ={**base, **environ})


# ------------------------------------------------------------------------------------ the shape


def test_one_replica_is_todays_mapping() -> None:
    topo = build_topology(["a", "b", "c", "d"], 4, 1, None, 29501)
    (rep,) = topo.replicas
    assert rep.head == "a" == topo.head and rep.nodes == ("a", "b", "c", "d")
    assert [(r.rank, r.position, r.node) for r in rep.ranks] == [(0, 0, "a"), (1, 1, "b"), (2, 2, "c"), (3, 3, "d")]
    assert rep.master_port == 29501


def test_eight_nodes_at_tp4_hold_two_replicas_in_order() -> None:
    topo = build_topology(EIGHT, 4, 1, None, 29501)
    assert [r.nodes for r in topo.replicas] == [tuple(EIGHT[:4]), tuple(EIGHT[4:])]
    assert topo.heads == ("spark1", "spark5") and topo.head == "spark1"
    assert [r.offset for r in topo.replicas] == [0, 4]
    rep, rank = topo.locate("spark7")
    assert (rep.index, rank.rank, rank.position) == (1, 2, 6)
    assert build_topology(EIGHT, 4, 1, 2, 29501) == topo  # REPLICAS given and right


def test_gpus_per_node_groups_nodes_by_tp_over_gpn() -> None:
    topo = build_topology(EIGHT, 8, 2, None, 1)  # TP8 at 2 GPUs per node: 4 nodes per replica
    assert [r.nodes for r in topo.replicas] == [tuple(EIGHT[:4]), tuple(EIGHT[4:])]
    (rep,) = build_topology(["a", "b"], 4, 2, None, 1).replicas  # today's shape: TP = nodes × gpn
    assert rep.nodes == ("a", "b")


@pytest.mark.parametrize(("nodes", "tp", "gpn", "replicas", "says", "keys"), [
    (EIGHT, 6, 4, None, "TP=6 must be a multiple of GPUS_PER_NODE=4", ("TP", "GPUS_PER_NODE")),
    (EIGHT[:6], 4, 1, None, "leftover nodes: spark5 spark6", ("NODES", "TP", "GPUS_PER_NODE")),
    (EIGHT[:2], 4, 1, None, "leftover nodes: spark1 spark2", ("NODES", "TP", "GPUS_PER_NODE")),
    (EIGHT, 4, 1, 3, "REPLICAS=3 but NODES (8 nodes) hold 2 replica(s)", ("REPLICAS", "NODES", "TP")),
    (EIGHT, 4, 1, 1, "REPLICAS=1 but NODES (8 nodes) hold 2", ("REPLICAS", "NODES", "TP")),
])
def test_shapes_that_do_not_split_are_refused(nodes: list[str], tp: int, gpn: int, replicas: int | None,
                                              says: str, keys: tuple[str, ...]) -> None:
    with pytest.raises(TopologyError) as exc:
        build_topology(nodes, tp, gpn, replicas, 29501)
    assert says in exc.value.problem and exc.value.keys == keys


@pytest.mark.parametrize(("environ", "says"), [
    ({"TP": "6", "DCP": "2", "GPUS_PER_NODE": "4"},
     "TP=6 must be a multiple of GPUS_PER_NODE=4 (a rank is a whole node) (from environment)"),
    ({"NODES": " ".join(EIGHT[:6])}, "leftover nodes: spark5 spark6; list a multiple of 4 nodes or change TP "
                                     "(NODES from environment, TP from recipe lab, GPUS_PER_NODE from recipe lab)"),
    ({"REPLICAS": "3"}, "REPLICAS=3 but NODES (8 nodes) hold 2 replica(s) of TP=4 (4 node(s) each at "
                        "GPUS_PER_NODE=1); list 12 nodes or leave REPLICAS unset (REPLICAS from environment, "
                        "NODES from environment, TP from recipe lab)"),
    ({"REPLICAS": "0"}, "REPLICAS=0 (from environment) must be at least 1"),
    ({"MASTER_ADDR": "10.0.0.1"}, "MASTER_ADDR=10.0.0.1 (from environment) applies to one service"),
])
def test_settings_refuse_a_bad_shape_naming_the_knobs_and_sources(clean_env: Any, environ: dict[str, str],
                                                                  says: str) -> None:
    with pytest.raises(UsageError) as exc:
        load(**environ)
    assert says in exc.value.message and exc.value.exit_code == 2


def test_replicas_default_to_what_the_nodes_hold(clean_env: Any) -> None:
    assert len(load().topology.replicas) == 2
    assert len(load(REPLICAS="2").topology.replicas) == 2
    assert len(load(NODES="a b c d").topology.replicas) == 1


def test_rank_pins_are_accepted_up_to_the_last_position_in_nodes(clean_env: Any) -> None:
    s = load(**pins(8))
    assert s.rank_pins(7).fabric_ip == "10.0.0.18"
    with pytest.raises(UsageError, match="no rank 8 with 8 nodes"):
        load(RANK8_CX7_IF="eth0")


# ------------------------------------------------------------------------------------ the replica view


def test_the_replica_view_has_its_nodes_its_pins_and_knows_where_it_is(clean_env: Any) -> None:
    s = load(**pins(8))
    r1 = s.replica(1)
    assert r1.nodes == EIGHT[4:] and r1.head == "spark5"
    assert (r1.replica_index, r1.replica_count, r1.rank_offset) == (1, 2, 4)
    assert r1.rank_pins(0).fabric_ip == "10.0.0.15" and r1.rank_pins(3).netdev == "enp7s0"  # RANK4, RANK7
    assert r1.getint("MASTER_PORT") == s.getint("MASTER_PORT")
    assert [(r.rank, r.position) for r in r1.service.ranks] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert r1.service.index == 1
    r0 = s.replica(0)
    assert r0.nodes == EIGHT[:4] and r0.rank_pins(3).netdev == "enp3s0"
    assert [v.replica_index for v in s.replicas()] == [0, 1]
    assert s.nodes == EIGHT and s.head == "spark1"  # the settings themselves are unchanged
    with pytest.raises(UsageError, match="replica 2 does not exist: there are 2"):
        s.replica(2)


def test_one_replica_view_is_the_settings_themselves(clean_env: Any) -> None:
    s = load(NODES="a b c d", **pins(4))
    assert s.replica(0) is s and s.replicas() == [s]
    assert s.replica_count == 1


def _argv(s: Any, rank: int = 0) -> list[str]:
    from sparkctl.spec.planner import Plan

    plan = Plan.__new__(Plan)
    object.__setattr__(plan, "kv_cache_memory_bytes", 1)
    spec = rank_specs(s, plan, [s.rank_pins(r) for r in range(len(s.nodes))])[rank]
    return docker_run_argv(s, spec, "h" * 16)


def test_the_replica_label_only_when_there_are_replicas(clean_env: Any) -> None:
    two = load(**pins(8), KV_CACHE_MEMORY_BYTES="1000")
    one = load(NODES=" ".join(EIGHT[:4]), **pins(4), KV_CACHE_MEMORY_BYTES="1000")
    a1 = _argv(two.replica(1), 2)
    assert f"{LABEL_REPLICA}=1" in a1 and a1[a1.index(f"{LABEL_REPLICA}=1") - 2] == "sparkctl.rank=2"
    assert f"{LABEL_REPLICA}=0" in _argv(two.replica(0))
    assert not any(LABEL_REPLICA in w for w in _argv(one))
    # Replica 0 of two is today's service on its nodes but for the label: nothing else differs.
    a0 = _argv(two.replica(0))
    i = a0.index(f"{LABEL_REPLICA}=0")
    assert a0[:i - 1] + a0[i + 1:] == _argv(one)
    assert "--master-addr" in a1 and a1[a1.index("--master-addr") + 1] == "10.0.0.15"  # replica 1's head: RANK4


# ------------------------------------------------------------------------------------ render


@pytest.fixture
def eight(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.chdir(tmp_path)
    model = write_model(tmp_path / "model", 1_000_000, 2)
    for k in ("SPARKCTL_ENV_FILE", "IMAGE", "VLLM_API_KEY", "HF_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"NODES": " ".join(EIGHT), "MODEL": str(model), "RECIPE": "lab", **pins(8)}.items():
        monkeypatch.setenv(k, v)
    return model


def test_render_two_replicas_on_eight_nodes(eight: Path, capsys: Any) -> None:
    from dotenv import dotenv_values

    code, out, err = run(["--json", "render"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    reps = doc["replicas"]
    assert [(r["replica"], r["head"], r["env_tp4"]) for r in reps] == [
        (0, "spark1", "env/env.tp4"), (1, "spark5", "env/env.tp4.replica1")]
    assert (doc["env_tp4"], doc["config_hash"], doc["ranks"]) == (reps[0]["env_tp4"], reps[0]["config_hash"],
                                                                  reps[0]["ranks"])
    assert reps[0]["config_hash"] != reps[1]["config_hash"]  # one hash per replica
    for rep in reps:
        assert [r["node"] for r in rep["ranks"]] == EIGHT[rep["replica"] * 4:][:4]
        for r in rep["ranks"]:
            argv = r["docker_argv"]
            assert f"sparkctl.replica={rep['replica']}" in argv and f"sparkctl.rank={r['rank']}" in argv
            assert argv[argv.index("--name") + 1] == f"sparkctl-rank{r['rank']}"
            assert argv[argv.index("--master-addr") + 1] == f"10.0.0.{11 + 4 * rep['replica']}"
            pos = rep["replica"] * 4 + r["rank"]  # the pins of position pos in NODES: RANK4..7 for replica 1
            assert r["env"]["VLLM_HOST_IP"] == f"10.0.0.{pos + 11}" and r["env"]["NCCL_IB_HCA"] == f"roce{pos}"
            assert r["env"]["NCCL_IB_GID_INDEX"] == str(pos)
    second = dotenv_values(Path("env/env.tp4.replica1"))
    assert second["NODES"] == " ".join(EIGHT[4:]) and second["MASTER_ADDR"] == "10.0.0.15"
    assert [second[f"RANK{k}_CX7_IF"] for k in range(4)] == ["enp4s0", "enp5s0", "enp6s0", "enp7s0"]
    assert "Replica 1 of 2" in Path("env/env.tp4.replica1").read_text()
    first = dotenv_values(Path("env/env.tp4"))
    assert first["NODES"] == " ".join(EIGHT[:4]) and first["MASTER_ADDR"] == "10.0.0.11"

    code, out, err = run(["render"], capsys)
    assert code == 0, err
    assert "## replica 1 (head spark5)" in out and "wrote env/env.tp4.replica1" in out
    assert len([ln for ln in out.splitlines() if ln.startswith("docker run")]) == 8
    assert all(shlex.split(ln)[0] == "docker" for ln in out.splitlines() if ln.startswith("docker run"))


def test_render_of_one_replica_has_no_replica_file_and_no_label(eight: Path, capsys: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODES", " ".join(EIGHT[:4]))
    for r in range(4, 8):
        for k in ("FABRIC_IP", "CX7_IF", "CX7_IB", "GID_INDEX"):
            monkeypatch.delenv(f"RANK{r}_{k}")
    code, out, err = run(["--json", "render"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert len(doc["replicas"]) == 1 and not Path("env/env.tp4.replica1").exists()
    assert not any("sparkctl.replica" in w for r in doc["ranks"] for w in r["docker_argv"])
    assert "Replica" not in Path("env/env.tp4").read_text()
