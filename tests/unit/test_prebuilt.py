"""`build` for a recipe that runs a published image (no chain), offline: the whole command over local
nodes (tests/unit/localnodes.py) whose `docker` keeps images as Docker does (a pull by digest keeps
its RepoDigests and gives one image ID everywhere; a tag is another name for the same ID). The lab
covers the path without a registry (tests/lab/test_prebuilt_lab.py); the registry path is here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkctl.orchestrate.build import transport
from tests.conftest import prebuilt_recipe, write_model
from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, local_nodes

NODES = ["spark1", "spark2", "spark3", "spark4"]
DIGEST = "registry.example/serve@sha256:" + "d" * 64
TAG = "registry.example/serve:2026-10-12"


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    monkeypatch.chdir(tmp_path)
    model = write_model(tmp_path / "model", 1_000_000, 2)
    for k in ("SPARKCTL_ENV_FILE", "IMAGE", "BASE_IMAGE"):
        monkeypatch.delenv(k, raising=False)
    env = {"NODES": " ".join(NODES), "MODEL": str(model), "RECIPE": str(prebuilt_recipe(tmp_path)),
           "CLUSTER_NAME": "t", "FABRIC_SUBNET": "10.232.0.0/24"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with local_nodes(monkeypatch, tmp_path / "lab", NODES) as ln:
        yield ln


def image_ids(ln: LocalNodes, ref: str) -> dict[str, str | None]:
    out = {}
    for n in NODES:
        r = ln.docker(n, "image", "inspect", ref)
        out[n] = json.loads(r.stdout)[0]["Id"] if r.returncode == 0 else None
    return out


def verbs(ln: LocalNodes) -> list[tuple[str, str]]:
    return [(c["node"], c["argv"][0]) for c in ln.docker_calls() if c["argv"][:1] in (["pull"], ["load"], ["tag"])]


def test_transport_says_which_and_why() -> None:
    how, why = transport(DIGEST, None, ship=False)
    assert how == "pull" and "verifies the digest" in why and "no byte passes through the head" in why
    how, why = transport(TAG, DIGEST, ship=False)
    assert how == "pull" and DIGEST in why and "tag may have moved" in why
    how, why = transport(TAG, DIGEST, ship=True)
    assert how == "ship" and why.startswith("--ship")
    how, why = transport(TAG, None, ship=False)
    assert how == "ship" and "no registry digest" in why and "only the layers it lacks" in why


def test_a_digest_pinned_image_is_pulled_by_every_rank_and_is_one_image(nodes: LocalNodes, capsys: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMAGE", DIGEST)
    code, out, err = run(["--json", "build"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["mode"] == "prebuilt" and doc["transport"]["how"] == "pull"
    assert doc["image"]["digest"] == DIGEST and doc["image"]["fixed_by"] == {n: "pull" for n in NODES[1:]}
    ids = image_ids(nodes, DIGEST)
    assert len(set(ids.values())) == 1 and None not in ids.values(), ids
    assert all(r["ok"] and r["image_id"] == ids["spark1"] for r in doc["ranks"]), doc["ranks"]
    # every rank pulled the digest itself; nothing was shipped and nothing re-tagged (a digest has no tag)
    assert sorted(verbs(nodes)) == sorted((n, "pull") for n in NODES)
    assert doc["versions"]["vllm"] == "0.33.0"
    code, out, _ = run(["--json", "build"], capsys)  # and again: nothing to do
    assert code == 0 and json.loads(out)["image"]["stale"] == {}
    assert sorted(verbs(nodes)) == sorted((n, "pull") for n in NODES)


def test_a_tag_the_head_pulled_by_digest_reaches_the_ranks_as_that_digest(nodes: LocalNodes, capsys: Any,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert nodes.docker("spark1", "pull", DIGEST).returncode == 0
    assert nodes.docker("spark1", "tag", DIGEST, TAG).returncode == 0
    monkeypatch.setenv("IMAGE", TAG)
    code, out, err = run(["--json", "build"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["image"]["digest"] == DIGEST and doc["transport"]["how"] == "pull"
    assert doc["image"]["fixed_by"] == {n: "pull" for n in NODES[1:]}
    assert len(set(image_ids(nodes, TAG).values())) == 1
    # each rank: pull the head's digest (not the tag, which may have moved), then name it IMAGE
    mine = [(n, v) for n, v in verbs(nodes) if n != "spark1"]
    assert sorted(mine) == sorted([(n, "pull") for n in NODES[1:]] + [(n, "tag") for n in NODES[1:]])
    pulls = [c["argv"] for c in nodes.docker_calls() if c["argv"][:1] == ["pull"] and c["node"] != "spark1"]
    assert all(argv[-1] == DIGEST for argv in pulls), pulls


def test_ship_cannot_give_a_rank_a_digest_and_says_so(nodes: LocalNodes, capsys: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMAGE", DIGEST)
    code, out, err = run(["--json", "build", "--ship"], capsys)
    assert code == 1
    ranks = {r["node"]: r for r in json.loads(out)["ranks"]}
    assert ranks["spark1"]["ok"]  # the head pulled it
    for n in NODES[1:]:
        assert not ranks[n]["ok"] and "shipped copy carries no digest" in ranks[n]["error"], ranks[n]
        assert "without --ship" in ranks[n]["fix"]
    assert not any(v == "load" for _, v in verbs(nodes))


def test_a_rank_the_registry_refuses_fails_by_name(nodes: LocalNodes, capsys: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMAGE", DIGEST)
    (nodes.root / "registry-refuses-spark3").touch()
    code, out, _ = run(["--json", "build"], capsys)
    assert code == 1
    ranks = {r["node"]: r for r in json.loads(out)["ranks"]}
    assert [n for n in NODES if not ranks[n]["ok"]] == ["spark3"]
    assert "prebuilt image" in ranks["spark3"]["error"] and "not on the node" in ranks["spark3"]["error"]


def test_dry_run_says_what_each_rank_would_get_and_changes_nothing(nodes: LocalNodes, capsys: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert nodes.docker("spark1", "pull", DIGEST).returncode == 0
    assert nodes.docker("spark2", "pull", DIGEST).returncode == 0
    (nodes.root / "docker-calls.jsonl").unlink()
    monkeypatch.setenv("IMAGE", DIGEST)
    code, out, err = run(["build", "--dry-run"], capsys)
    assert code == 0, err
    assert "spark2 image  nothing: it has the head's image" in out
    assert "spark3 image  pull: prebuilt image" in out and "how: pull: IMAGE is pinned by digest" in out
    assert verbs(nodes) == []


def test_without_image_every_image_command_says_what_to_set(nodes: LocalNodes, capsys: Any) -> None:
    for argv in (["build"], ["check"], ["build", "--dry-run"]):
        code, _, err = run(argv, capsys)
        assert code == 2, (argv, err)
        assert "IMAGE is not set: recipe lab-prebuilt runs a prebuilt image (the lab's test image)" in err
        assert "IMAGE=<registry>/<repo>@sha256:<digest>" in err and "Traceback" not in err
    assert verbs(nodes) == [] and not any(c["argv"][:1] == ["run"] for c in nodes.docker_calls())


def test_check_warns_when_a_published_image_is_named_by_a_tag() -> None:
    from sparkctl.rules.check_rules import rule_prebuilt_pin

    [tag] = rule_prebuilt_pin(TAG, "the serve recipe")
    assert tag.status == "warn" and "is a tag" in tag.reason and "the serve recipe" in tag.reason
    assert "@sha256:" in tag.fix
    [pinned] = rule_prebuilt_pin(DIGEST, "the serve recipe")
    assert pinned.status == "ok"
