"""README's Safety claims, offline, on local nodes that really run every command (localnodes.py).

The lab proves the same on real SSH and Docker (test_secrets_lab.py, test_foreign_lab.py,
test_lifecycle_lab.py::test_model_is_read_only_in_every_container); these run in every unit run and
see every command string that crossed to a node.
"""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]
HF = "hf_SECRETzq81vX"
KEY = "sk-SECRETm2Pq9w"
EVERY_COMMAND = [["config"], ["--json", "config"], ["verify-model"], ["check"], ["build", "--dry-run"], ["build"],
                 ["up"], ["--json", "up"], ["status"], ["--json", "status"], ["logs", "--tail", "5"], ["audit"],
                 ["--json", "audit"], ["wait", "--timeout", "1"], ["lock", "status"], ["down"],
                 ["--json", "down"]]


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    # Secrets come from an env file, as a user keeps them.
    (tmp_path / "cluster.env").write_text(f"HF_TOKEN={HF}\nVLLM_API_KEY={KEY}\n")
    with served_scene(monkeypatch, tmp_path, NODES, {"SPARKCTL_ENV_FILE": str(tmp_path / "cluster.env")},
                      unset=("SPARKCTL_ENV_FILE", "TP", "DCP")) as ln:
        yield ln


def test_secrets_travel_only_on_stdin_into_a_0600_file_that_down_removes(nodes: LocalNodes, capsys: Any,
                                                                         tmp_path: Path) -> None:
    seen_env_file = False
    for argv in EVERY_COMMAND:
        code, out, err = run(argv, capsys)
        assert code in (0, 1), (argv, err)
        assert HF not in out + err and KEY not in out + err, f"{argv} showed a secret"
        if argv[-1] == "up":
            for rank, n in enumerate(NODES):
                f = nodes.home(n) / ".sparkctl" / "t" / f"rank{rank}.env"
                assert stat.S_IMODE(f.stat().st_mode) == 0o600
                assert stat.S_IMODE(f.parent.stat().st_mode) == 0o700
                assert f"HF_TOKEN={HF}" in f.read_text() and f"VLLM_API_KEY={KEY}" in f.read_text()
                seen_env_file = True
    assert seen_env_file
    for sent in nodes.sent:  # every command string that crossed to a node
        assert HF not in sent.command and KEY not in sent.command, sent.command[:200]
        if HF in sent.stdin.decode("utf-8", "replace"):
            assert "sparkctl-start" in sent.command  # the env file's writer reads it from stdin
    for call in nodes.docker_calls():
        assert not any(HF in a or KEY in a for a in call["argv"]), call["argv"]
    for n in NODES:  # down removed the env files; the audit holds no secret
        state = nodes.home(n) / ".sparkctl" / "t"
        assert not list(state.glob("rank*.env"))
        assert HF not in (state / "audit.log").read_text() and KEY not in (state / "audit.log").read_text()
    tp4 = (tmp_path / "env" / "env.tp4").read_text()  # written by check and up
    assert HF not in tp4 and KEY not in tp4 and "\nHF_TOKEN=" not in tp4


def test_the_model_is_mounted_read_only_on_every_rank(nodes: LocalNodes, capsys: Any) -> None:
    assert run(["up"], capsys)[0] == 0
    runs = [c["argv"] for c in nodes.docker_calls() if c["argv"][:1] == ["run"]]
    assert len(runs) == len(NODES) + 1  # every rank, and the argv judge on the head (argvjudge): each mounts it
    model = str(Path.cwd() / "model")
    for argv in runs:
        mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"]
        mine = [m for m in mounts if f"source={model}," in m]
        assert len(mine) == 1 and mine[0].split(",")[-1] == "readonly", mounts
        assert not any(a in ("-v", "--volume") or a.startswith("--volume=") for a in argv)


def test_up_down_and_rollback_touch_only_this_clusters_containers(nodes: LocalNodes, capsys: Any) -> None:
    foreign = {"other": ["--label", "sparkctl.cluster=othercluster"], "plain": [],
               "prefix": ["--label", "sparkctl.cluster=t2"], "rank-only": ["--label", "sparkctl.rank=0"]}
    for n in NODES:
        for name, labels in foreign.items():
            assert nodes.docker(n, "run", "--detach", "--name", f"{name}-{n}", *labels, "busybox").returncode == 0

    def survivors() -> dict[str, list[str]]:
        out = {}
        for n in NODES:
            state = json.loads((nodes.root / f"docker-{n}.json").read_text())["containers"]
            out[n] = sorted(c["Name"].lstrip("/") for c in state.values())
        return out

    planted = {n: sorted(f"{k}-{n}" for k in foreign) for n in NODES}
    assert run(["up"], capsys)[0] == 0
    assert run(["up", "--recreate"], capsys)[0] == 0
    assert run(["down"], capsys)[0] == 0
    assert survivors() == planted
    (nodes.root / "docker-fail-spark4").touch()  # a failed up: its rollback sweeps too
    assert run(["up"], capsys)[0] == 1
    assert survivors() == planted


def test_the_fabric_sweep_leaves_the_service_and_other_clusters_alone(nodes: LocalNodes, capsys: Any) -> None:
    """`check --fabric` while this cluster serves: its sweep removes this cluster's fabric-test containers
    (its own and a leftover) and nothing else -- not the serving ranks (they carry the cluster label too),
    not another cluster's fabric test (it carries the purpose label too), not another cluster's service."""
    assert run(["up"], capsys)[0] == 0
    planted = {"leftover": ["sparkctl.cluster=t", "sparkctl.purpose=fabric-test"],
               "other-fabric": ["sparkctl.cluster=othercluster", "sparkctl.purpose=fabric-test"],
               "other-serving": ["sparkctl.cluster=othercluster", "sparkctl.rank=0"]}
    for n in NODES:
        for name, labels in planted.items():
            words = [w for lab in labels for w in ("--label", lab)]
            assert nodes.docker(n, "run", "--detach", "--name", f"{name}-{n}", *words, "busybox").returncode == 0

    def containers(n: str) -> dict[str, dict[str, str]]:
        state = json.loads((nodes.root / f"docker-{n}.json").read_text())["containers"]
        return {c["Name"].lstrip("/"): c["Config"]["Labels"] for c in state.values()}

    serving = {n: sorted(k for k, lab in containers(n).items() if lab.get("sparkctl.cluster") == "t"
                         and "sparkctl.purpose" not in lab) for n in NODES}
    assert all(len(v) == 1 for v in serving.values()), serving  # the service's rank container on each node
    run(["check", "--fabric", "--fabric-timeout", "5"], capsys)  # the stub's ranks report nothing: it fails
    ran = [c["node"] for c in nodes.docker_calls()
           if c["argv"][:1] == ["run"] and any(a.startswith("sparkctl-t-fabric-rank") for a in c["argv"])]
    assert sorted(ran) == NODES  # the fabric test did run on every node, and so did its sweep
    for n in NODES:
        left = containers(n)
        assert sorted(left) == sorted([*serving[n], f"other-fabric-{n}", f"other-serving-{n}"]), (n, sorted(left))


def test_check_fabric_beside_the_service_never_meets_on_a_port_the_head_uses(
        nodes: LocalNodes, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`check --fabric` while this cluster serves: the all-reduce's rendezvous is neither MASTER_PORT (the
    serving ranks' rendezvous holds it on the head), nor PORT, nor a port the head was seen listening on;
    every rank is told the same port."""
    import socket

    with socket.socket() as held:  # something on the head (this machine) listens on MASTER_PORT + 1
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        master, api = taken - 1, taken + 1
        monkeypatch.setenv("MASTER_PORT", str(master))
        monkeypatch.setenv("PORT", str(api))
        assert run(["up"], capsys)[0] == 0
        code, out, err = run(["check", "--fabric", "--fabric-timeout", "5"], capsys)
    assert "Traceback" not in err, err
    runs = [c["argv"] for c in nodes.docker_calls()
            if c["argv"][:1] == ["run"] and any(a.startswith("sparkctl-t-fabric-rank") for a in c["argv"])]
    ports = {a[a.index("--master-port") + 1] for a in runs}
    assert len(runs) == len(NODES) and len(ports) == 1, ports
    (port,) = ports
    assert int(port) not in (master, api, taken), (port, master, api, taken)
    assert f"port {port}" in out, out  # the run says where it meets (a firewall question names it)


def test_model_pull_carries_the_token_on_stdin_never_on_a_command_line(nodes: LocalNodes, capsys: Any,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """`model pull` over the stand-in Hub (which refuses a wrong token): the download works, so the token
    reached the head -- on the pull's stdin, not on its command line, nor on any other."""
    pytest.importorskip("huggingface_hub")
    from sparkctl.lab import ckptgen
    from sparkctl.lab.hfhub import StandinHub

    hub = StandinHub(tmp_path / "hub", token=HF)
    rev = hub.publish("lab/tiny", ckptgen.make_checkpoint(tmp_path / "pack", "tiny"))
    monkeypatch.setenv("MODEL", str(tmp_path / "pulled"))
    monkeypatch.setenv("MODEL_REPO", "lab/tiny")
    monkeypatch.setenv("MODEL_REVISION", rev)
    monkeypatch.setenv("HF_PYTHON", sys.executable)  # a python with huggingface_hub, as the head has
    with hub.serve() as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        code, out, err = run(["--json", "model", "pull"], capsys)
    doc = json.loads(out)
    assert doc["status"] == "downloaded" and doc["commit"] == rev, (code, out, err)
    assert HF not in out + err
    pulls = [s for s in nodes.sent if "lab/tiny" in s.command and rev in s.command]
    assert [s.node for s in pulls] == NODES[:1] and HF in pulls[0].stdin.decode()  # on the head, on stdin
    for sent in nodes.sent:  # every command string that crossed to a node
        assert HF not in sent.command, sent.command[:300]
