"""`sparkctl check` on the lab: the pins it renders match each host's real interfaces, and each real
fault is a failed check naming the right node. Every test leaves the lab as it found it.

The lab is shared (a colleague's service may run on it), so these checks use their own cluster
label, ports and image tag: CLUSTER_NAME, PORT/MASTER_PORT and IMAGE below are this file's alone.
IMAGE is a tiny image made on the head and copied to the other hosts with `docker save | docker
load`, which keeps its ID: the lab builds its engine image on each host separately, so the engine's
IDs differ between hosts and a check of the lab's own IMAGE fails the image rule (which is right).
"""

from __future__ import annotations

import io
import json
import re
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dotenv import dotenv_values

from tests.kit.lab import Lab
from tests.lab.faults import docker_stopped, link_down, sshd_stopped, tcp_dropped

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
IMAGE = "sparkctl-checktest/same:1"
PORT, MASTER_PORT = 18941, 39541
BASE_ENV = {"NODES": " ".join(NODES), "CLUSTER_NAME": "checktest", "PORT": str(PORT),
            "MASTER_PORT": str(MASTER_PORT), "IMAGE": IMAGE}  # fmt: skip

Findings = dict[tuple[str, str], dict[str, Any]]


def run_check(lab: Lab, out: Path, env: dict[str, str] | None = None, *args: str) -> tuple[int, dict[str, Any]]:
    """The real CLI, `--json check`, against the lab's first four hosts; (exit code, the JSON document)."""
    argv = [sys.executable, "-m", "sparkctl", "--env-file", str(lab.env_file), *args, "--json",
            "check", "--out", str(out / "env.tp4")]  # fmt: skip
    r = subprocess.run(argv, env={**lab.env(), **BASE_ENV, **(env or {})}, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    try:
        doc = json.loads(r.stdout) if r.stdout.strip() else {}
    except json.JSONDecodeError:
        pytest.fail(f"not one JSON document on stdout (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.returncode, doc


def by_cell(doc: dict[str, Any]) -> Findings:
    return {(f["node"], f["check"]): f for f in doc["findings"]}


def failed(doc: dict[str, Any]) -> Findings:
    return {k: f for k, f in by_cell(doc).items() if f["status"] == "fail"}


def assert_only_failures(doc: dict[str, Any], *cells: tuple[str, str]) -> Findings:
    """Exactly these (node, check) cells failed, each with a one-line fix."""
    bad = failed(doc)
    assert set(bad) == set(cells), json.dumps(list(bad.values()), indent=1, ensure_ascii=False)
    for f in bad.values():
        assert f["fix"] and "\n" not in f["fix"], f
    return bad


def wait_port(host: str, port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    pytest.fail(f"nothing listens on {host}:{port} after {timeout}s")


@pytest.fixture(scope="module")
def same_image(lab: Lab) -> Iterator[str]:
    """IMAGE with one and the same ID on the four hosts (made on the head, copied by save | load)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"sparkctl check lab test\n"
        info = tarfile.TarInfo("README")
        info.size, info.mtime = len(data), 0
        tar.addfile(info, io.BytesIO(data))
    head = lab.host(NODES[0]).docker_host
    subprocess.run(["docker", "-H", head, "import", "-", IMAGE], input=buf.getvalue(), check=True,
                   capture_output=True, timeout=60)  # fmt: skip
    saved = subprocess.run(["docker", "-H", head, "save", IMAGE], check=True, capture_output=True, timeout=60)
    for n in NODES[1:]:
        subprocess.run(["docker", "-H", lab.host(n).docker_host, "load"], input=saved.stdout, check=True,
                       capture_output=True, timeout=60)  # fmt: skip
    try:
        yield IMAGE
    finally:
        for n in NODES:
            lab.docker(n, "rmi", "-f", IMAGE, timeout=60)


@pytest.fixture
def healthy(lab: Lab, same_image: str, tmp_path: Path) -> Lab:
    """The lab, with every check passing for this file's settings (asserted, so a fault test's
    failure is the fault's and nothing else's)."""
    (tmp_path / "healthy").mkdir()
    code, doc = run_check(lab, tmp_path / "healthy")
    assert code == 0 and not failed(doc), json.dumps(list(failed(doc).values()), indent=1)
    return lab


# ------------------------------------------------------------------------------------- happy path


def test_happy_path_pins_match_each_hosts_real_interfaces(healthy: Lab, tmp_path: Path) -> None:
    lab = healthy
    code, doc = run_check(lab, tmp_path)
    assert code == 0 and doc["ok"] is True
    env = dotenv_values(tmp_path / "env.tp4")
    for rank, n in enumerate(NODES):
        h = lab.host(n)
        assert env[f"RANK{rank}_CX7_IF"] == h.fabric_if, n
        assert env[f"RANK{rank}_FABRIC_IP"] == h.fabric_ip, n
        assert env[f"RANK{rank}_CX7_IB"] == h.fabric_hca, n
        assert env[f"RANK{rank}_GID_INDEX"] == str(h.gid_index), n
        assert doc["pins"][str(rank)]["netdev"] == h.fabric_if
    # spark3 carries its fabric address on the second port; spark2's GID drifted to 5
    assert (env["RANK2_CX7_IF"], env["RANK2_CX7_IB"]) == ("enp1s0f1np1", "rocep1s0f1")
    assert env["RANK1_GID_INDEX"] == "5"
    assert env["MASTER_ADDR"] == lab.host(NODES[0]).fabric_ip and env["MASTER_PORT"] == str(MASTER_PORT)
    assert int(env["KV_CACHE_MEMORY_BYTES"] or 0) == doc["plan"]["kv_cache_memory_bytes"] > 0
    assert oct((tmp_path / "env.tp4").stat().st_mode & 0o777) == "0o600"
    cells = by_cell(doc)
    assert all(cells[(n, "reach")]["short"] == "3 peers" for n in NODES)


# ------------------------------------------------------------------------------------------ faults


def test_sshd_stopped(healthy: Lab, tmp_path: Path) -> None:
    with sshd_stopped(healthy, "spark3"):
        code, doc = run_check(healthy, tmp_path)
    assert code == 1
    bad = assert_only_failures(doc, ("spark3", "ssh"))
    assert "refused" in bad[("spark3", "ssh")]["reason"] and "sshd" in bad[("spark3", "ssh")]["fix"]
    cells = by_cell(doc)
    assert cells[("spark3", "docker")]["status"] == "skip"
    assert all(cells[(n, "docker")]["status"] == "ok" for n in ("spark1", "spark2", "spark4"))  # still checked


def test_docker_engine_stopped(healthy: Lab, tmp_path: Path) -> None:
    with docker_stopped(healthy, "spark2"):
        code, doc = run_check(healthy, tmp_path)
    assert code == 1
    bad = assert_only_failures(doc, ("spark2", "docker"))  # image and containers wait for the engine
    docker = bad[("spark2", "docker")]
    assert docker["short"] == "engine down" and "spark2" in docker["fix"]
    assert by_cell(doc)[("spark2", "image")]["status"] == "skip"


def test_fabric_interface_down(healthy: Lab, tmp_path: Path) -> None:
    with link_down(healthy, "spark3") as iface:
        code, doc = run_check(healthy, tmp_path)
    assert code == 1 and iface == "enp1s0f1np1"
    bad = assert_only_failures(doc, ("spark3", "fabric"))
    assert bad[("spark3", "fabric")]["short"] == "enp1s0f1np1 down"
    assert "ip link set enp1s0f1np1 up" in bad[("spark3", "fabric")]["fix"]


def test_firewall_dropping_the_master_port(healthy: Lab, tmp_path: Path) -> None:
    """spark3 drops TCP to MASTER_PORT: every other rank's reach test names it (the fast unforked pass
    cannot settle it, the parallel pass waits its 3 s), and the check still ends in seconds."""
    start = time.monotonic()
    with tcp_dropped(healthy, "spark3", MASTER_PORT):
        code, doc = run_check(healthy, tmp_path)
    took = time.monotonic() - start
    assert code == 1
    bad = assert_only_failures(doc, *[(n, "reach") for n in ("spark1", "spark2", "spark4")])
    for f in bad.values():
        assert "cannot reach spark3" in f["reason"] and f"port {MASTER_PORT}" in f["reason"], f
        assert "firewall" in f["fix"]
    assert by_cell(doc)[("spark3", "reach")]["status"] == "ok"  # its own connects out are answered
    assert took < 15, took


def test_shard_missing_from_one_model_folder(healthy: Lab, tmp_path: Path) -> None:
    folder = healthy.host("spark4").model_dir
    shard = sorted(folder.glob("*.safetensors"))[-1]
    aside = folder.parent / f".{shard.name}.checktest"  # outside the folder, on the same file system
    shard.rename(aside)
    try:
        code, doc = run_check(healthy, tmp_path)
    finally:
        aside.rename(shard)
    assert code == 1
    bad = assert_only_failures(doc, ("spark4", "model"))
    assert f"missing: {shard.name}" in bad[("spark4", "model")]["reason"]


def test_chain_image_differs_on_one_rank(healthy: Lab, tmp_path: Path) -> None:
    lab = healthy
    original = lab.docker("spark3", "image", "inspect", "--format", "{{.Id}}", IMAGE, check=True).stdout.strip()
    lab.docker("spark3", "tag", "sparkctl-lab/base:bookworm", IMAGE, check=True)
    try:
        code, doc = run_check(lab, tmp_path)
    finally:
        lab.docker("spark3", "tag", original, IMAGE, check=True)
    assert code == 1
    bad = assert_only_failures(doc, ("spark3", "image"))
    assert original.removeprefix("sha256:")[:12] in bad[("spark3", "image")]["reason"]


def test_api_port_taken_on_the_head(healthy: Lab, tmp_path: Path) -> None:
    head = healthy.host("spark1")
    listener = subprocess.Popen(
        ["ip", "netns", "exec", "spark1", sys.executable, "-m", "http.server", str(PORT), "--bind", "0.0.0.0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_port(head.mgmt_ip, PORT)
        code, doc = run_check(healthy, tmp_path)
    finally:
        listener.kill()
        listener.wait(timeout=10)
    assert code == 1
    bad = assert_only_failures(doc, ("spark1", "ports"))
    assert f"{PORT} PORT (the API)" in bad[("spark1", "ports")]["reason"]


def test_changed_host_key(healthy: Lab, tmp_path: Path) -> None:
    """A copy of known_hosts with another key for spark3, and an ssh_config pointing at it."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True,
                   timeout=30)  # fmt: skip
    other = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    known = tmp_path / "known_hosts"
    known.write_text("".join(
        f"{line.split()[0]} {other}\n" if line.startswith("spark3,") else line + "\n"
        for line in healthy.known_hosts.read_text().splitlines()
    ))  # fmt: skip
    config = tmp_path / "ssh_config"
    config.write_text(healthy.ssh_config.read_text().replace(str(healthy.known_hosts), str(known)))
    real = subprocess.run(["ssh-keygen", "-lf", str(healthy.known_hosts)], capture_output=True, text=True,
                          check=True, timeout=30).stdout  # fmt: skip
    spark3_fp = next(line.split()[1] for line in real.splitlines() if "spark3" in line)

    code, doc = run_check(healthy, tmp_path, {"SPARKCTL_SSH_CONFIG": str(config)})
    assert code == 1
    bad = assert_only_failures(doc, ("spark3", "ssh"))
    f = bad[("spark3", "ssh")]
    assert f["short"] == "HOST KEY CHANGED" and spark3_fp in f["reason"]
    assert f"sparkctl --ssh-config {config} trust spark3" in f["fix"]


def test_nofile_below_the_recipes_need(healthy: Lab, tmp_path: Path) -> None:
    code, doc = run_check(healthy, tmp_path, {"ULIMIT_NOFILE": "1048576"})
    assert code == 1
    bad = assert_only_failures(doc, *((n, "limits") for n in NODES))
    for n in NODES:
        assert re.search(rf"^{n}: hard nofile limit 20000 < ULIMIT_NOFILE=1048576", bad[(n, "limits")]["reason"])
    assert not (tmp_path / "env.tp4").exists()


# ----------------------------------------------------------------------------- hostile input


# (A space cannot be inside a node name: NODES is split on spaces. The model path test has spaces.)
HOSTILE = ["x'y", 'x"y', "x;touch${IFS}{canary}", "$(touch${IFS}{canary})", "`touch${IFS}{canary}`"]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_node_name_is_refused_as_input(lab: Lab, tmp_path: Path, value: str) -> None:
    canary = tmp_path / "canary"
    name = value.replace("{canary}", str(canary))
    code, doc = run_check(lab, tmp_path, {"NODES": f"spark1 spark2 spark3 {name}"})
    # bad input: exit 2 and --json's one failure document (no report: nothing was checked)
    assert code == 2 and doc.get("ok") is False and "findings" not in doc, doc
    assert not canary.exists()


def test_hostile_model_path_is_data(lab: Lab, tmp_path: Path) -> None:
    """Spaces, quotes, `;`, `$(...)` and backticks in MODEL: a path that does not exist on any node."""
    canaries = [tmp_path / f"canary{i}" for i in range(4)]
    model = (f"/models/lab/it's x; touch {canaries[0]}; $(touch {canaries[1]}) `touch {canaries[2]}`"
             f" && touch {canaries[3]}")  # fmt: skip
    code, doc = run_check(lab, tmp_path, {"MODEL": model})
    assert code == 1
    for n in NODES:
        f = by_cell(doc)[(n, "model")]
        assert f["status"] == "fail" and f["short"] == "missing" and model in f["reason"], f
    assert not [c for c in canaries if c.exists()]
    assert not list(Path("/models").glob("lab/it*"))


def test_model_path_docker_cannot_mount_is_refused_as_input(lab: Lab, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    code, doc = run_check(lab, tmp_path, {"MODEL": f'/models/lab/"x",$(touch {canary})'})
    assert code == 2 and doc.get("ok") is False and "findings" not in doc and not canary.exists(), doc
