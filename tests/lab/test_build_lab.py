"""`sparkctl build` on the lab's real per-host Docker engines (classic builder, no registry).

The chain builds in order on all ranks with the right labels; a Dockerfile change rebuilds that layer
and the ones after it only; a missing payload fails before anything builds; a stopped engine is
reported while the other ranks finish; after --ship every rank has the head's image ID.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkctl import __version__
from sparkctl.spec.recipes import load_recipe
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

# SPARKCTL_TEST_RANKS="spark1 spark2 spark5 spark6" picks other lab hosts (head first); default spark1..4.
RANKS = os.environ.get("SPARKCTL_TEST_RANKS", "spark1 spark2 spark3 spark4").split()
RECIPE = load_recipe("lab")
LAYERS = RECIPE.layer_names()
TAGS = [f"{RECIPE.tag_prefix}:{name}" for name in LAYERS]


def build(lab: Lab, *args: str, nodes: list[str] = RANKS, timeout: float = 600) -> tuple[int, dict[str, Any], str]:
    """Run `sparkctl --json build ARGS` against the lab; (exit code, the JSON document, stderr)."""
    env = {**lab.env(), "NODES": " ".join(nodes), "TP": str(len(nodes)), "DCP": str(len(nodes))}
    res = subprocess.run([sys.executable, "-m", "sparkctl", "--env-file", str(lab.env_file), "--json", "build", *args],
                         capture_output=True, text=True, env=env, timeout=timeout, check=False)
    doc = json.loads(res.stdout) if res.stdout.strip() else {}
    return res.returncode, doc, res.stderr


def actions(doc: dict[str, Any], node: str) -> dict[str, str]:
    rank = next(r for r in doc["ranks"] if r["node"] == node)
    return {x["layer"]: x["action"] for x in rank["layers"]}


def inspect(lab: Lab, node: str, ref: str) -> dict[str, Any] | None:
    res = lab.docker(node, "image", "inspect", ref)
    return json.loads(res.stdout)[0] if res.returncode == 0 else None


def remove_chain(lab: Lab, nodes: list[str]) -> None:
    for node in nodes:
        lab.docker(node, "rmi", "-f", *TAGS, timeout=120)


@pytest.fixture(scope="module")
def chain_lab(lab: Lab) -> Lab:
    missing = [n for n in RANKS if n not in lab.names]
    if missing:
        pytest.skip(f"the lab has no {', '.join(missing)}")
    return lab


def test_chain_builds_in_order_on_every_rank_with_labels(chain_lab: Lab) -> None:
    lab = chain_lab
    remove_chain(lab, RANKS)
    code, doc, err = build(lab)
    assert code == 0, err
    for node in RANKS:
        assert actions(doc, node) == dict.fromkeys(LAYERS, "built"), node
        parent_layers: list[str] = []
        parent = inspect(lab, node, str(RECIPE.defaults["BASE_IMAGE"]))
        assert parent is not None
        parent_layers = parent["RootFS"]["Layers"]
        for name, tag in zip(LAYERS, TAGS, strict=True):
            img = inspect(lab, node, tag)
            assert img is not None, f"{node}: {tag} missing"
            labels = img["Config"]["Labels"]
            assert labels["sparkctl.recipe"] == "lab"
            assert labels["sparkctl.layer"] == name
            assert labels["sparkctl.version"] == __version__
            assert labels["sparkctl.content-hash"].startswith("sha256:")
            layers = img["RootFS"]["Layers"]
            # built FROM the previous layer: its layers extend the parent's
            assert layers[: len(parent_layers)] == parent_layers and len(layers) > len(parent_layers)
            parent_layers = layers
    # the same build again changes nothing
    code, doc, err = build(lab)
    assert code == 0, err
    for node in RANKS:
        assert actions(doc, node) == dict.fromkeys(LAYERS, "skip")


def test_a_changed_dockerfile_rebuilds_that_layer_and_later_ones_only(chain_lab: Lab, tmp_path: Path) -> None:
    lab = chain_lab
    code, _, err = build(lab)
    assert code == 0, err
    before = {n: {t: inspect(lab, n, t)["Id"] for t in TAGS} for n in RANKS}  # type: ignore[index]
    originals = {}
    for node in RANKS:  # each lab host has its own copy of the checkpoint, as a real node may
        path = lab.host(node).model_dir / "serving" / "Dockerfile.v145"
        originals[path] = path.read_bytes()
        path.write_bytes(originals[path] + b"# a change to the v145 layer\n")
    try:
        code, doc, err = build(lab)
    finally:
        for path, data in originals.items():
            path.write_bytes(data)
    assert code == 0, err
    for node in RANKS:
        assert actions(doc, node) == {"dcp": "skip", "mul1": "skip", "v145": "built", "keys": "built", "keys3": "built"}
        after = {t: inspect(lab, node, t)["Id"] for t in TAGS}  # type: ignore[index]
        assert after[TAGS[0]] == before[node][TAGS[0]] and after[TAGS[1]] == before[node][TAGS[1]]
        assert all(after[t] != before[node][t] for t in TAGS[2:])
    # back to the checkpoint's Dockerfiles (rebuilds v145 onwards again)
    code, _, err = build(lab)
    assert code == 0, err


def test_a_missing_payload_fails_before_anything_builds(chain_lab: Lab, tmp_path: Path) -> None:
    lab = chain_lab
    serving = lab.host("spark2").model_dir / "serving"
    moved = tmp_path / "patch_keys3.py"
    before = {n: [(inspect(lab, n, t) or {}).get("Id") for t in TAGS] for n in RANKS}
    shutil.move(serving / "patch_keys3.py", moved)
    try:
        code, doc, err = build(lab, "--no-cache")
    finally:
        shutil.move(moved, serving / "patch_keys3.py")
    assert code == 2, err
    assert "spark2: /models/lab/serving/Dockerfile.keys3 (layer keys3) copies patch_keys3.py, which is not in serving/" in err
    after = {n: [(inspect(lab, n, t) or {}).get("Id") for t in TAGS] for n in RANKS}
    assert after == before  # nothing was built anywhere, even with --no-cache


def test_a_rank_whose_engine_is_stopped_is_named_and_the_others_finish(chain_lab: Lab) -> None:
    from sparkctl.lab import hosts
    from sparkctl.lab.state import HostPaths, HostSpec

    lab = chain_lab
    victim = RANKS[-1]
    paths = HostPaths.of(victim, lab.root)
    hosts.stop_docker(paths)
    try:
        code, doc, err = build(lab, "--only", "keys3", "--no-cache")
    finally:
        hosts.start_docker(paths, HostSpec.of(int(victim.removeprefix("spark"))))
    assert code == 1, err
    ranks = {r["node"]: r for r in doc["ranks"]}
    assert not ranks[victim]["ok"]
    assert "engine" in ranks[victim]["error"].lower()
    for node in RANKS[:-1]:
        assert ranks[node]["ok"], ranks[node]
        assert actions(doc, node)["keys3"] == "built"


def test_ship_gives_every_rank_the_heads_image_id(chain_lab: Lab) -> None:
    lab = chain_lab
    code, _, err = build(lab, nodes=RANKS[:1])
    assert code == 0, err
    remove_chain(lab, RANKS[1:])
    code, doc, err = build(lab, "--ship")
    assert code == 0, err
    ids = {n: inspect(lab, n, TAGS[-1])["Id"] for n in RANKS}  # type: ignore[index]
    assert len(set(ids.values())) == 1, ids
    for n in RANKS:  # every chain tag, not only the top, arrives with the head's ID
        assert [inspect(lab, n, t)["Id"] for t in TAGS] == [inspect(lab, "spark1", t)["Id"] for t in TAGS]  # type: ignore[index]
    assert doc["ship"]["bytes_sent"] > 0
    # nothing changed: nothing is sent
    code, doc, err = build(lab, "--ship")
    assert code == 0, err
    assert doc["ship"]["bytes_sent"] == 0
