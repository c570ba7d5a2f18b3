"""The checkpoint's own image chain on the lab, the production code path end to end.

The lab's generated checkpoint ships serving/Dockerfile.{dcp,mul1,v145,keys,keys3}; `sparkctl build`
builds them on four hosts over the lab's engine image, whose ENTRYPOINT is `vllm serve` as in vLLM's
OpenAI image; each layer's change is really in the image; the service comes up through that
entrypoint; a Dockerfile that cannot take its parent is refused before anything is built.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkctl.lab.state import ENGINE_IMAGE
from sparkctl.spec.recipes import load_recipe
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
RECIPE = load_recipe("lab")
TAGS = [f"{RECIPE.tag_prefix}:{name}" for name in RECIPE.layer_names()]
CLUSTER = {"CLUSTER_NAME": "chaintest", "PORT": "18890", "MASTER_PORT": "39503"}


def sk(lab: Lab, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**lab.env(), "NODES": " ".join(NODES), **CLUSTER}
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def inspect(lab: Lab, node: str, ref: str) -> dict[str, Any] | None:
    res = lab.docker(node, "image", "inspect", ref)
    return json.loads(res.stdout)[0] if res.returncode == 0 else None


@pytest.fixture
def four(lab: Lab) -> Iterator[Lab]:
    missing = [n for n in NODES if n not in lab.names]
    if missing:
        pytest.skip(f"the lab has no {', '.join(missing)}")
    sk(lab, "down", timeout=60)
    try:
        yield lab
    finally:
        sk(lab, "lock", "--force-unlock", timeout=30)
        sk(lab, "down", timeout=60)


def test_the_checkpoints_chain_builds_on_four_hosts_and_serves_through_the_entrypoint(four: Lab) -> None:
    lab = four
    for node in NODES:
        engine = inspect(lab, node, ENGINE_IMAGE)
        assert engine is not None and engine["Config"]["Entrypoint"] == ["vllm", "serve"], node
        lab.docker(node, "rmi", "-f", *TAGS, timeout=120)
    res = sk(lab, "--json", "build")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    for rank in doc["ranks"]:
        assert [x["action"] for x in rank["layers"]] == ["built"] * 5, rank
        # the version probe ran in every layer: the base's exllamav3 until v145, 1.4.5 from v145 on
        versions = {x["layer"]: x["versions"] for x in rank["layers"]}
        assert [versions[n]["exllamav3"] for n in RECIPE.layer_names()] == ["0.0.43", "0.0.43", "1.4.5", "1.4.5", "1.4.5"]
        assert versions["keys3"] == {"exllamav3": "1.4.5", "nccl": "absent", "torch": "absent", "vllm": "0.33.0",
                                     "cuda": "absent", "nccl.conf": "absent"}
        top = inspect(lab, rank["node"], TAGS[-1])
        assert top is not None and json.loads(top["Config"]["Labels"]["sparkctl.versions"]) == versions["keys3"]
    # Every layer's change is in the top image (the checkpoint's self-tests ran at build time; this
    # reads the result back through the same `--entrypoint` override sparkctl renders).
    probe = ("import sys, importlib.metadata as m, exllamav3, exl3, ablit_runtime;"
             "print(m.version('exllamav3'), exllamav3.USE_AVX, 'vllm_dcp_patch' in sys.modules,"
             " exl3.SCALAR_MARKERS, ablit_runtime.enabled())")
    for node in NODES:
        out = lab.docker(node, "run", "--rm", "--entrypoint", "python3", TAGS[-1], "-c", probe)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1.4.5", "False", "True", "True", "False"], (node, out.stdout)
        # the base underneath still has the old exllamav3: the change is the chain's
        base = lab.docker(node, "run", "--rm", "--entrypoint", "python3", ENGINE_IMAGE, "-c",
                          "import importlib.metadata as m; print(m.version('exllamav3'))")
        assert base.stdout.strip() == "0.0.43"
    up = sk(lab, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    wait = sk(lab, "wait", "--timeout", "60")
    assert wait.returncode == 0 and "ready after" in wait.stdout, wait.stdout + wait.stderr
    for i, node in enumerate(NODES):
        info = lab.docker(node, "inspect", f"sparkctl-chaintest-rank{i}")
        c = json.loads(info.stdout)[0]
        assert c["Config"]["Image"] == TAGS[-1]
        assert c["Path"] == "vllm" and c["Args"][:2] == ["serve", "/models/lab"], (c["Path"], c["Args"][:3])


def test_the_old_command_line_does_not_start_on_a_base_with_an_entrypoint(four: Lab) -> None:
    """What `docker run IMAGE vllm serve ...` (sparkctl before --entrypoint) does on vLLM's image:
    the entrypoint runs `vllm serve vllm serve /models/lab ...`, and vllm refuses it."""
    lab = four
    res = lab.docker("spark1", "run", "--rm", ENGINE_IMAGE, "vllm", "serve", "/models/lab", "--port", "18891")
    assert res.returncode != 0
    assert "unrecognized arguments" in res.stderr or "error" in res.stderr.lower(), res.stderr


def test_a_dockerfile_that_cannot_take_its_parent_is_refused_before_anything_builds(four: Lab) -> None:
    lab = four
    sk(lab, "build")
    before = {n: [(inspect(lab, n, t) or {}).get("Id") for t in TAGS] for n in NODES}
    target: Path = lab.host("spark3").model_dir / "serving" / "Dockerfile.v145"
    original = target.read_bytes()
    target.write_bytes(original.replace(b"ARG BASE\nFROM ${BASE}\n", b"FROM sparkctl-lab/base:bookworm\n"))
    try:
        res = sk(lab, "build", "--no-cache")
    finally:
        target.write_bytes(original)
    assert res.returncode == 2, res.stderr
    assert "spark3: /models/lab/serving/Dockerfile.v145 (layer v145) builds FROM sparkctl-lab/base:bookworm" in res.stderr
    assert "Traceback" not in res.stderr
    after = {n: [(inspect(lab, n, t) or {}).get("Id") for t in TAGS] for n in NODES}
    assert after == before


def base_findings(lab: Lab) -> dict[str, dict[str, Any]]:
    res = sk(lab, "--json", "check", timeout=300)
    doc = json.loads(res.stdout)
    return {f["node"]: f for f in doc["findings"] if f["check"] == "base"}


def test_a_stale_base_on_one_host_is_found_by_check_and_fixed_by_one_build(four: Lab) -> None:
    lab = four
    assert sk(lab, "build").returncode == 0
    head_id = inspect(lab, "spark1", ENGINE_IMAGE)["Id"]  # type: ignore[index]
    # spark2's tag now names another image, as a mutable tag pulled at another time leaves it
    victim = "spark2"
    lab.docker(victim, "rmi", "-f", *TAGS, timeout=120)  # so its chain must be built again, on whatever base it has
    made = lab.docker(victim, "run", "--name", "stale-base", "--entrypoint", "sh", ENGINE_IMAGE, "-c",
                      "echo older > /etc/sparkctl-stale")
    assert made.returncode == 0, made.stderr
    try:
        assert lab.docker(victim, "commit", "stale-base", ENGINE_IMAGE).returncode == 0
    finally:
        lab.docker(victim, "rm", "-f", "stale-base")
    assert inspect(lab, victim, ENGINE_IMAGE)["Id"] != head_id  # type: ignore[index]

    found = base_findings(lab)
    assert found[victim]["status"] == "fail" and "stale" in json.dumps(found[victim]), found[victim]
    assert all(found[n]["status"] == "ok" for n in NODES if n != victim), found

    res = sk(lab, "--json", "build")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["base"]["id"] == head_id and list(doc["base"]["stale"]) == [victim]
    assert doc["base"]["fixed_by"] == {victim: "ship"}  # no registry digest in the lab: sent from the head
    assert inspect(lab, victim, ENGINE_IMAGE)["Id"] == head_id  # type: ignore[index]
    ranks = {r["node"]: r for r in doc["ranks"]}
    assert [x["action"] for x in ranks[victim]["layers"]] == ["built"] * 5
    assert all(x["action"] == "skip" for n in NODES if n != victim for x in ranks[n]["layers"])
    # built on the head's base, so the same content hash as every other rank (a stale base gave another: the loop)
    hashes = {n: inspect(lab, n, TAGS[-1])["Config"]["Labels"]["sparkctl.content-hash"] for n in NODES}  # type: ignore[index]
    assert len(set(hashes.values())) == 1, hashes

    res = sk(lab, "--json", "check", timeout=300)
    findings = json.loads(res.stdout)["findings"]
    found = {f["node"]: f for f in findings if f["check"] == "base"}
    assert all(f["status"] == "ok" for f in found.values()), found
    versions = [f for f in findings if f["check"] == "versions"]
    assert len(versions) == 4 and all(f["status"] == "ok" for f in versions), versions
    again = json.loads(sk(lab, "--json", "build").stdout)  # and no loop: the next build changes nothing
    assert again["base"]["stale"] == {}
    assert all(x["action"] == "skip" for r in again["ranks"] for x in r["layers"])
