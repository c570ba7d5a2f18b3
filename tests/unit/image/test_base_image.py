"""The base image pinned on the head: identity by image ID, RepoDigests honoured for lookup and pulls,
and `check`'s rule that names a stale base on a rank."""

from __future__ import annotations

import json
from pathlib import Path

from sparkctl.facts import node_facts as F
from sparkctl.image import base_image as base_identity
from sparkctl.rules import check_rules as C
from sparkctl.rules.check_rules import FAIL, OK, WARN

REF = "ghcr.io/miaai-lab/glm-5.3-flash-2x-dgx-sparks:exl3"
DIGEST = "ghcr.io/miaai-lab/glm-5.3-flash-2x-dgx-sparks@sha256:" + "d" * 64
NEW = "sha256:" + "1" * 64
OLD = "sha256:" + "2" * 64


def img(id_: str, *, tags: tuple[str, ...] = (REF,), digests: tuple[str, ...] = ()) -> F.Image:
    return F.Image(id=id_, repo_tags=tags, labels={}, layers=("sha256:" + "0" * 64,), repo_digests=digests)


def test_repo_digests_are_parsed_and_name_the_image() -> None:
    doc = json.loads(Path("tests/fixtures/docker/image-inspect.json").read_text())
    doc[0]["RepoDigests"] = [DIGEST]
    images = F.parse_image_inspect(json.dumps(doc))
    assert images[0].repo_digests == (DIGEST,) and images[1].repo_digests == ()
    # BASE_IMAGE pinned by digest finds the image it was pulled as (no pull every time)
    assert F.find_image(images, DIGEST) is images[0]


def test_pin_prefers_the_digest_of_the_same_repository() -> None:
    other = "docker.io/library/python@sha256:" + "e" * 64
    p = base_identity.identify(REF, img(NEW, digests=(other, DIGEST)))
    assert p == base_identity.BaseIdentity(REF, NEW, DIGEST) and p.describe() == DIGEST
    assert base_identity.repo_of("python:3.11") == "python" and base_identity.repo_of(DIGEST) == DIGEST.split("@")[0]
    # a base built or loaded locally (the lab's; or after save | load) has no digest: the ID is the pin
    local = base_identity.identify("sparkctl-lab/engine:latest", img(NEW, tags=("sparkctl-lab/engine:latest",)))
    assert local.digest is None and local.describe() == "image ID " + "1" * 12


def test_identity_is_the_image_id_not_the_digest() -> None:
    p = base_identity.identify(REF, img(NEW, digests=(DIGEST,)))
    assert base_identity.stale(p, img(NEW)) is None  # loaded by save | load: no RepoDigests, same image
    assert base_identity.stale(p, img(OLD, digests=(DIGEST.replace("d", "c"),))) == (
        f"base image {REF} is {'2' * 12}, the head's is {'1' * 12} ({DIGEST})")
    assert base_identity.stale(p, None) == f"base image {REF} is not on the node"


def test_check_names_the_stale_rank_and_sends_it_to_one_build() -> None:
    images = {"spark1": [img(NEW, digests=(DIGEST,))], "spark2": [img(NEW)], "spark3": [img(OLD)], "spark4": [],
              "spark5": None}
    out = C.rule_base_image(images, "spark1", REF)
    assert {n: f.status for n, f in out.items()} == {"spark1": OK, "spark2": OK, "spark3": FAIL, "spark4": WARN}
    assert out["spark3"].short == "stale" and "the head's is " + "1" * 12 in out["spark3"].reason
    assert out["spark3"].fix == f"run `sparkctl build`: it gives spark3 the head's base ({DIGEST}), once"
    missing_on_head = C.rule_base_image({"spark1": [], "spark2": [img(OLD)]}, "spark1", REF)
    assert {f.status for f in missing_on_head.values()} == {WARN}


def test_check_compares_the_recorded_versions_across_ranks_and_with_the_recipe() -> None:
    from sparkctl.image import chain as im

    good = {"exllamav3": "1.4.5", "nccl": "2.27.7", "torch": "2.9.0", "vllm": "0.33.0"}

    def top(versions: dict[str, str] | None) -> list[F.Image]:
        labels = {"sparkctl.versions": json.dumps(versions)} if versions is not None else {}
        return [F.Image(id=NEW, repo_tags=("sparkctl/glm53-exl3:keys3",), labels=labels, layers=())]

    argv = im.label_versions_argv("sparkctl/glm53-exl3:keys3", good)
    label = argv[argv.index("--label") + 1]
    assert label == 'sparkctl.versions={"exllamav3":"1.4.5","nccl":"2.27.7","torch":"2.9.0","vllm":"0.33.0"}'
    assert im.read_versions(top(good)[0]) == good
    images = {"spark1": top(good), "spark2": top(good), "spark3": top({**good, "torch": "2.8.0"}),
              "spark4": top({**good, "exllamav3": "0.0.43"}), "spark5": top(None)}
    out = C.rule_versions(images, "spark1", "sparkctl/glm53-exl3:keys3", {"exllamav3": "1.4.5"})
    assert {n: f.status for n, f in out.items()} == {"spark1": OK, "spark2": OK, "spark3": FAIL, "spark4": FAIL}
    assert "torch 2.8.0 (head: 2.9.0)" in out["spark3"].reason
    assert "exllamav3 is 0.0.43, the recipe expects 1.4.5" in out["spark4"].reason
