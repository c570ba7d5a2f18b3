"""A recipe that runs a published image instead of a chain (the 2.75 bpw card's way), on the lab.

The image exists only on the head, under a tag with no registry digest (loaded or built there), as a
published image looks after `docker load`. `build` resolves it on the head and ships each rank only
the layers it lacks; `check` then sees one image ID everywhere and warns that a tag is not a pin; a
rank whose tag names another image is found by `check` and fixed by the next `build`, never looped;
the service comes up from it through its ENTRYPOINT. Pull by digest needs a registry, which the lab
has not: that path is covered offline (tests/unit/test_prebuilt.py).
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
from tests.conftest import prebuilt_recipe
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
PREBUILT = "sparkctl-lab/prebuilt:serve"
CLUSTER = {"CLUSTER_NAME": "pbtest", "PORT": "18892", "MASTER_PORT": "39505"}


def sk(lab: Lab, recipe: Path, *args: str, timeout: float = 600,
       image: str | None = PREBUILT) -> subprocess.CompletedProcess[str]:
    env = {**lab.env(), "NODES": " ".join(NODES), "RECIPE": str(recipe), **CLUSTER}
    env.pop("IMAGE", None)
    if image is not None:
        env["IMAGE"] = image
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def image_id(lab: Lab, node: str, ref: str) -> str | None:
    res = lab.docker(node, "image", "inspect", ref)
    return json.loads(res.stdout)[0]["Id"] if res.returncode == 0 else None


def commit(lab: Lab, node: str, ref: str, marker: str) -> str:
    """A new image from the lab engine with one file changed, tagged `ref` on `node`, entrypoint kept."""
    name = f"pb-{node}"
    lab.docker(node, "rm", "-f", name)
    made = lab.docker(node, "run", "--name", name, "--entrypoint", "sh", ENGINE_IMAGE, "-c",
                      f"echo {marker} > /etc/sparkctl-prebuilt")
    assert made.returncode == 0, made.stderr
    try:
        done = lab.docker(node, "commit", "--change", 'ENTRYPOINT ["vllm", "serve"]', "--change", "CMD []",
                          name, ref)
        assert done.returncode == 0, done.stderr
    finally:
        lab.docker(node, "rm", "-f", name)
    iid = image_id(lab, node, ref)
    assert iid is not None
    return iid


def findings(lab: Lab, recipe: Path, check: str) -> dict[str, dict[str, Any]]:
    res = sk(lab, recipe, "--json", "check", timeout=300)
    doc = json.loads(res.stdout)
    return {f["node"]: f for f in doc["findings"] if f["check"] == check}


@pytest.fixture
def four(lab: Lab, tmp_path: Path) -> Iterator[tuple[Lab, Path]]:
    missing = [n for n in NODES if n not in lab.names]
    if missing:
        pytest.skip(f"the lab has no {', '.join(missing)}")
    recipe = prebuilt_recipe(tmp_path)
    sk(lab, recipe, "down", timeout=60)
    try:
        yield lab, recipe
    finally:
        sk(lab, recipe, "lock", "--force-unlock", timeout=30)
        sk(lab, recipe, "down", timeout=60)
        for n in NODES:
            lab.docker(n, "rmi", "-f", PREBUILT)


def test_a_prebuilt_image_on_the_head_reaches_every_rank_once_and_serves(four: tuple[Lab, Path]) -> None:
    lab, recipe = four
    for n in NODES[1:]:
        lab.docker(n, "rmi", "-f", PREBUILT)
    head_id = commit(lab, "spark1", PREBUILT, "published")

    # Without IMAGE the recipe names no image: every command that needs one says what to set (exit 2).
    for argv in (["up"], ["build"], ["check"]):
        res = sk(lab, recipe, *argv, image=None)
        assert res.returncode == 2, (argv, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr
        if argv != ["up"]:  # up may first stop at the fabric pins, which `check` discovers
            assert "IMAGE is not set: recipe lab-prebuilt runs a prebuilt image" in res.stderr, res.stderr
    assert all(not lab.docker(n, "ps", "-aq", "--filter", "label=sparkctl.cluster=pbtest").stdout.strip()
               for n in NODES)
    for argv in (["build", "--only", "dcp"], ["build", "--no-cache"], ["bake", "--out", "/tmp/pb-bake.hcl"]):
        res = sk(lab, recipe, *argv)
        assert res.returncode == 2 and "prebuilt image" in res.stderr and "Traceback" not in res.stderr, res.stderr

    image = findings(lab, recipe, "image")
    assert image["spark1"]["status"] == "ok"
    assert all(image[n]["status"] == "warn" and "not there" in image[n]["reason"] for n in NODES[1:]), image
    pin = findings(lab, recipe, "image-pin")
    assert pin["(cluster)"]["status"] == "warn" and "is a tag" in pin["(cluster)"]["reason"], pin
    assert findings(lab, recipe, "base") == {}  # no chain, no base rule

    plan = json.loads(sk(lab, recipe, "--json", "build", "--dry-run").stdout)
    assert plan["transport"]["how"] == "ship", plan  # no registry digest on the head
    assert all(plan["plan"][n]["image"].startswith("ship: prebuilt image") for n in NODES[1:]), plan["plan"]
    assert all(image_id(lab, n, PREBUILT) is None for n in NODES[1:])  # --dry-run changed nothing

    res = sk(lab, recipe, "--json", "build")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["mode"] == "prebuilt" and doc["image"]["id"] == head_id and doc["image"]["digest"] is None
    assert doc["image"]["fixed_by"] == {n: "ship" for n in NODES[1:]}, doc["image"]
    assert doc["versions"]["vllm"] == "0.33.0", doc["versions"]
    ranks = {r["node"]: r for r in doc["ranks"]}
    assert all(ranks[n]["image_id"] == head_id and ranks[n]["ok"] for n in NODES), ranks
    assert all(ranks[n]["shipped"]["bytes"] > 0 for n in NODES[1:]), ranks
    assert all(image_id(lab, n, PREBUILT) == head_id for n in NODES)

    again = json.loads(sk(lab, recipe, "--json", "build").stdout)  # nothing moves the second time
    assert again["ok"] and again["image"]["stale"] == {} and again["image"]["fixed_by"] == {}, again
    assert all(r["shipped"]["bytes"] == 0 for r in again["ranks"]), again["ranks"]

    image = findings(lab, recipe, "image")
    assert all(image[n]["status"] == "ok" for n in NODES), image

    up = sk(lab, recipe, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    wait = sk(lab, recipe, "wait", "--timeout", "60")
    assert wait.returncode == 0 and "ready after" in wait.stdout, wait.stdout + wait.stderr
    for i, node in enumerate(NODES):
        c = json.loads(lab.docker(node, "inspect", f"sparkctl-pbtest-rank{i}").stdout)[0]
        assert c["Image"] == head_id and c["Config"]["Image"] == PREBUILT
        assert c["Path"] == "vllm" and c["Args"][0] == "serve", (c["Path"], c["Args"][:2])
    assert sk(lab, recipe, "down").returncode == 0


def test_a_rank_whose_tag_names_another_image_is_found_and_fixed_by_one_build(four: tuple[Lab, Path]) -> None:
    lab, recipe = four
    head_id = commit(lab, "spark1", PREBUILT, "published")
    assert sk(lab, recipe, "build").returncode == 0
    victim = "spark3"
    other = commit(lab, victim, PREBUILT, "pulled-last-week")  # the tag moved between two pulls
    assert other != head_id

    image = findings(lab, recipe, "image")
    assert image[victim]["status"] == "fail" and "differs" in image[victim]["short"], image[victim]
    assert all(image[n]["status"] == "ok" for n in NODES if n != victim), image

    res = sk(lab, recipe, "--json", "build")
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert list(doc["image"]["stale"]) == [victim] and doc["image"]["fixed_by"] == {victim: "ship"}, doc["image"]
    assert image_id(lab, victim, PREBUILT) == head_id
    image = findings(lab, recipe, "image")
    assert all(image[n]["status"] == "ok" for n in NODES), image
