"""The image chain's pure parts: resolving the checkpoint's Dockerfiles, content hashes, the plan,
shipping selection, the bake file."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sparkctl.commands.bake import local_chain, render_bake, stage_contexts
from sparkctl.errors import UsageError
from sparkctl.facts.node_facts import Image
from sparkctl.image import chain as im
from sparkctl.lab import ckptgen
from sparkctl.spec.builders import LABEL_CONTENT_HASH
from sparkctl.spec.recipes import available_recipes, load_recipe

SERVING = ckptgen.serving_files()  # the lab checkpoint's serving/: relative path -> bytes
DIGESTS = {name: hashlib.sha256(data).hexdigest() for name, data in SERVING.items()}
DOCKERFILES: dict[str, bytes | None] = {n: d for n, d in SERVING.items() if n.startswith("Dockerfile.")}
BASE_ID = "sha256:" + "b" * 64
V145_FILES = ("v145/build.sh", "v145/exllamav3/__init__.py", "v145/patch_aarch64.py")


def lab_chain(dockerfiles: dict[str, bytes | None] | None = None) -> list[im.LayerSpec]:
    chain, problems = im.resolve_chain(im.load_chain(load_recipe("lab")), DIGESTS,
                                       DOCKERFILES if dockerfiles is None else dockerfiles)
    assert not problems
    return chain


def facts(images: list[Image], digests: dict[str, str] | None = None) -> im.RankFacts:
    return im.RankFacts(tools=frozenset({"gzip"}), digests=dict(DIGESTS if digests is None else digests),
                        dockerfiles=dict(DOCKERFILES), engine_ok=True, engine="20.10", images=tuple(images))


def img(ref: str, id_: str, labels: dict[str, str] | None = None, layers: tuple[str, ...] = ()) -> Image:
    return Image(id=id_, repo_tags=(ref,), labels=labels or {}, layers=layers)


def built_chain(chain: list[im.LayerSpec], digests: dict[str, str] = DIGESTS) -> list[Image]:
    """Images as a previous sparkctl build left them: each labelled with its content hash."""
    out = [img("sparkctl-lab/base:bookworm", BASE_ID, layers=("sha256:" + "0" * 64,))]
    parent = BASE_ID  # the base's key is its ID; a built layer's key is its own content hash
    for layer in chain:
        id_ = "sha256:" + hashlib_hex(layer.name)
        h = im.content_hash(layer, digests, parent)
        out.append(img(layer.tag, id_, {LABEL_CONTENT_HASH: h}))
        parent = h
    return out


def test_content_hash_is_the_same_on_every_rank_whatever_the_image_ids() -> None:
    """A build on each rank gives each image its own ID (creation times); the hashes still agree."""
    chain = lab_chain()
    rank_a = built_chain(chain)
    rank_b = [img(i.repo_tags[0], "sha256:" + hashlib_hex("other" + i.id), dict(i.labels), i.layers)
              if i.labels else i for i in rank_a]
    assert [i.id for i in rank_a[1:]] != [i.id for i in rank_b[1:]]
    for facts_ in (facts(rank_a), facts(rank_b)):
        steps = im.plan_build(chain, facts_, "sparkctl-lab/base:bookworm")
        assert [s.action for s in steps] == ["skip"] * 5
    assert im.parent_key(rank_b[0]) == BASE_ID and im.parent_key(rank_b[3]) == rank_a[3].labels[LABEL_CONTENT_HASH]


def hashlib_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------ the checkpoint's chain


CHAIN_RECIPES = [r for r in available_recipes() if load_recipe(r).prebuilt is None]
# The model card's chain (dcp -> mul1 -> v145 -> keys -> keys3); lab-vllm builds the real-engine checkpoint's own
# one-layer chain FROM the real base instead (test_the_real_engine_lab_builds_its_checkpoints_chain_from_the_real_base).
CARD_CHAIN_RECIPES = [r for r in CHAIN_RECIPES if r != "lab-vllm"]


@pytest.mark.parametrize("recipe", CARD_CHAIN_RECIPES)
def test_every_recipe_builds_the_checkpoints_own_dockerfiles(recipe: str) -> None:
    chain = im.load_chain(load_recipe(recipe))
    assert [x.name for x in chain] == ["dcp", "mul1", "v145", "keys", "keys3"]
    assert [x.dockerfile_name for x in chain] == [f"Dockerfile.{x.name}" for x in chain]


def test_the_275_recipe_runs_the_serve_recipes_prebuilt_image_not_a_chain() -> None:
    """The 2.75 bpw card (docs/sources.md): "Use the launcher (one-shot.sh) and prebuilt image of the serve recipe"."""
    recipe = load_recipe("glm53-exl3-2.75bpw")
    assert recipe.prebuilt is not None and "Serve-4-DGXSparks" in recipe.prebuilt.source
    assert not recipe.layers and "IMAGE" not in recipe.defaults and "BASE_IMAGE" not in recipe.defaults
    assert CHAIN_RECIPES == ["glm53-exl3-tp4", "lab", "lab-vllm"]
    with pytest.raises(UsageError, match="runs a prebuilt image .*no chain"):
        im.load_chain(recipe)


def test_the_real_engine_lab_builds_its_checkpoints_chain_from_the_real_base() -> None:
    """lab-vllm: one layer, serving/Dockerfile.cpu (lab/ckpt_serving_vllm/), FROM BASE = the real base that
    `lab up --engine vllm` loads; build must find vLLM 0.32.0+cpu in it; the ranks run its top."""
    from sparkctl.lab.manage import VLLM_SERVING

    recipe = load_recipe("lab-vllm")
    chain = im.load_chain(recipe)
    assert [(x.name, dict(x.expect)) for x in chain] == [("cpu", {"vllm": "0.32.0+cpu"})]
    assert recipe.defaults["BASE_IMAGE"] == "sparkctl-lab/vllm:0.32.0-cpu"
    assert recipe.defaults["IMAGE"] == chain[-1].tag == "sparkctl-lab/vllm-chain:cpu"
    text = (VLLM_SERVING / "Dockerfile.cpu").read_text()
    assert "ARG BASE\nFROM ${BASE}\n" in text and "COPY README.md " in text and "0.32.0" in text


def test_the_lab_checkpoints_dockerfiles_copy_what_they_ship_in_one_copy_and_one_run() -> None:
    chain = lab_chain()
    assert [x.payload for x in chain] == [("patch_dcp.py",), ("exl3.py",), V145_FILES, ("ablit_runtime.py",),
                                          ("patch_keys3.py",)]
    for layer in chain:
        text = layer.dockerfile.decode()
        assert text.startswith("#"), f"{layer.dockerfile_path}: no header comment"
        assert layer.base_arg == "BASE"
        # One COPY and one RUN that ends with the self-test: every layer-making instruction more is
        # one more layer for each rank's `docker load` (the classic builder commits even an empty RUN).
        made = [line.split()[0] for line in text.splitlines() if line.split()[:1] in (["RUN"], ["COPY"], ["ADD"])]
        assert made == ["COPY", "RUN"], (layer.dockerfile_path, made)


def test_a_missing_dockerfile_names_the_layer_and_the_file() -> None:
    refs = im.load_chain(load_recipe("lab"))
    chain, problems = im.resolve_chain(refs, DIGESTS, {**DOCKERFILES, "Dockerfile.keys": None})
    assert problems == ["serving/Dockerfile.keys (layer keys) is missing"]
    assert [x.name for x in chain] == ["dcp", "mul1", "v145", "keys3"]
    err = im.chain_error({"spark2": problems}, "/models/lab")
    assert "spark2: /models/lab/serving/Dockerfile.keys (layer keys) is missing" in str(err)
    assert "nothing was built" in str(err) and err.exit_code == 2


def test_a_dockerfile_from_a_fixed_image_is_refused_saying_what_it_needs() -> None:
    fixed = b"FROM ghcr.io/miaai-lab/glm-5.3-flash-2x-dgx-sparks:exl3\nCOPY exl3.py /x/\nRUN true\n"
    refs = im.load_chain(load_recipe("lab"))
    _, problems = im.resolve_chain(refs, DIGESTS, {**DOCKERFILES, "Dockerfile.mul1": fixed})
    assert len(problems) == 1
    assert problems[0].startswith("serving/Dockerfile.mul1 (layer mul1) builds FROM ghcr.io/miaai-lab/")
    assert "`ARG <NAME>` + `FROM ${NAME}`" in problems[0]


def test_a_copy_source_that_is_not_in_serving_is_named() -> None:
    refs = im.load_chain(load_recipe("lab"))
    digests = {k: v for k, v in DIGESTS.items() if k != "patch_keys3.py"}
    _, problems = im.resolve_chain(refs, digests, DOCKERFILES)
    assert problems == ["serving/Dockerfile.keys3 (layer keys3) copies patch_keys3.py, which is not in serving/"]


def test_the_parent_argument_is_the_one_the_dockerfile_declares() -> None:
    text = (b"# header\nARG CUDA=13\nARG PARENT_IMAGE\nFROM --platform=linux/arm64 ${PARENT_IMAGE} AS build\n"
            b"COPY --chown=0:0 [\"exl3.py\", \"/x/\"]\nCOPY --from=build /x /y\nFROM build\nRUN true\n")
    chain = lab_chain({**DOCKERFILES, "Dockerfile.mul1": text})
    mul1 = chain[1]
    assert mul1.base_arg == "PARENT_IMAGE" and mul1.payload == ("exl3.py",)
    argv = im.build_argv(load_recipe("lab"), mul1, "/models/lab", DIGESTS, BASE_ID, "sha256:" + "9" * 64)
    assert f"PARENT_IMAGE={BASE_ID}" in argv and f"BASE={BASE_ID}" not in argv


def test_only_names_a_layer() -> None:
    chain = lab_chain()
    assert [x.name for x in im.select_layers(chain, "v145")] == ["v145"]
    with pytest.raises(UsageError, match="use one of: dcp, mul1, v145, keys, keys3"):
        im.select_layers(chain, "v146")


def test_tags_follow_the_recipe_prefix() -> None:
    assert [x.tag for x in lab_chain()][-1] == "sparkctl-lab/chain:keys3"
    assert im.load_chain(load_recipe("glm53-exl3-tp4"))[-1].tag == "sparkctl/glm53-exl3:keys3"


# ------------------------------------------------------------------------------ content hash


def test_content_hash_is_stable_and_sensitive_to_each_input() -> None:
    v145 = lab_chain()[2]
    h = im.content_hash(v145, DIGESTS, BASE_ID)
    assert h == im.content_hash(v145, dict(reversed(list(DIGESTS.items()))), BASE_ID)  # order-free
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", h)
    changed_df = replace(v145, dockerfile=v145.dockerfile + b"# edit\n")
    assert im.content_hash(changed_df, DIGESTS, BASE_ID) != h
    for name in v145.payload:
        assert im.content_hash(v145, {**DIGESTS, name: "f" * 64}, BASE_ID) != h, name
    assert im.content_hash(v145, DIGESTS, "sha256:" + "c" * 64) != h
    # files the layer does not stage do not matter
    assert im.content_hash(v145, {**DIGESTS, "patch_keys3.py": "f" * 64}, BASE_ID) == h
    # a renamed file is a different context, even with the same bytes
    renamed = replace(v145, payload=("v145/build.sh", "v145/exllamav3/__init__.py", "v145/patch_arm64.py"))
    assert im.content_hash(renamed, {**DIGESTS, "v145/patch_arm64.py": DIGESTS["v145/patch_aarch64.py"]}, BASE_ID) != h


# ------------------------------------------------------------------------------ probe output


def test_parse_probe() -> None:
    inspect = json.loads(Path("tests/fixtures/docker/image-inspect.json").read_text())
    text = "\n".join([
        "@@tools", "zstd", "gzip", "@@files", f"{'a' * 64}  ./patch_dcp.py", f"{'b' * 64}  ./v145/build.sh",
        "@@dockerfiles", "Dockerfile.dcp QVJHIEJBU0UK", "- Dockerfile.mul1",
        "@@engine", "ok 20.10.24+dfsg1", "@@images", json.dumps(inspect), "@@end",
    ])
    f = im.parse_probe(text)
    assert f.tools == {"zstd", "gzip"}
    assert f.digests == {"patch_dcp.py": "a" * 64, "v145/build.sh": "b" * 64}
    assert f.dockerfiles == {"Dockerfile.dcp": b"ARG BASE\n", "Dockerfile.mul1": None}
    assert f.engine_ok and f.engine == "20.10.24+dfsg1"
    assert len(f.images) == len(inspect)


def test_parse_probe_engine_down_and_cut_short() -> None:
    f = im.parse_probe("@@tools\n@@files\n@@dockerfiles\n@@engine\ndown Cannot connect to the Docker daemon\n@@images\n@@end\n")
    assert not f.engine_ok and "Cannot connect" in f.engine
    from sparkctl.facts.node_facts import ParseError

    with pytest.raises(ParseError, match="cut short"):
        im.parse_probe("@@tools\n@@files\n")
    with pytest.raises(ParseError, match="garbled"):
        im.parse_probe("@@dockerfiles\nDockerfile.dcp not*base64\n@@end\n")


def test_probe_runs_locally_against_the_lab_checkpoints_serving_folder(tmp_path: Path) -> None:
    model = ckptgen.make_checkpoint(tmp_path / "m")
    (model / "serving" / "Dockerfile.keys").unlink()
    refs = im.load_chain(load_recipe("lab"))
    argv = im.probe_argv(str(model), refs, [])
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin",
                         "DOCKER_HOST": "unix:///nonexistent.sock"})
    f = im.parse_probe(res.stdout)
    assert f.digests == {k: v for k, v in DIGESTS.items() if k != "Dockerfile.keys"}
    assert f.dockerfiles == {**DOCKERFILES, "Dockerfile.keys": None}
    assert not f.engine_ok
    chain, problems = f.chain(refs)
    assert problems == ["serving/Dockerfile.keys (layer keys) is missing"]


# ------------------------------------------------------------------------------ the plan


def test_plan_fresh_node_builds_everything() -> None:
    chain = lab_chain()
    steps = im.plan_build(chain, facts([img("sparkctl-lab/base:bookworm", BASE_ID)]), "sparkctl-lab/base:bookworm")
    assert [s.action for s in steps] == ["build"] * 5
    assert "not on the node" in steps[0].reason and "parent is rebuilt" in steps[1].reason


def test_plan_no_change_skips_everything() -> None:
    chain = lab_chain()
    steps = im.plan_build(chain, facts(built_chain(chain)), "sparkctl-lab/base:bookworm")
    assert [s.action for s in steps] == ["skip"] * 5


def test_plan_a_changed_layer_rebuilds_it_and_those_after_it_only() -> None:
    chain = lab_chain()
    images = built_chain(chain)
    changed = [*chain[:2], replace(chain[2], dockerfile=chain[2].dockerfile + b"#\n"), *chain[3:]]
    steps = im.plan_build(changed, facts(images), "sparkctl-lab/base:bookworm")
    assert [s.action for s in steps] == ["skip", "skip", "build", "build", "build"]
    assert "content changed" in steps[2].reason
    # a payload change does the same
    digests = {**DIGESTS, "ablit_runtime.py": "e" * 64}
    steps = im.plan_build(chain, facts(images, digests), "sparkctl-lab/base:bookworm")
    assert [s.action for s in steps] == ["skip", "skip", "skip", "build", "build"]


def test_plan_new_base_rebuilds_all_and_no_cache_too() -> None:
    chain = lab_chain()
    images = built_chain(chain)
    moved = [img("sparkctl-lab/base:bookworm", "sha256:" + "d" * 64), *images[1:]]
    assert [s.action for s in im.plan_build(chain, facts(moved), "sparkctl-lab/base:bookworm")] == ["build"] * 5
    steps = im.plan_build(chain, facts(images), "sparkctl-lab/base:bookworm", no_cache=True)
    assert steps[0].reason == "--no-cache" and [s.action for s in steps] == ["build"] * 5


def test_plan_base_missing_and_unlabelled_images() -> None:
    chain = lab_chain()
    steps = im.plan_build(chain, facts([]), "sparkctl-lab/base:bookworm")
    assert "pulled first" in steps[0].reason
    foreign = [img("sparkctl-lab/base:bookworm", BASE_ID), img(chain[0].tag, "sha256:" + "1" * 64)]
    assert "not built by sparkctl" in im.plan_build(chain, facts(foreign), "sparkctl-lab/base:bookworm")[0].reason


def test_plan_only() -> None:
    chain = lab_chain()
    images = built_chain(chain)
    steps = im.plan_build(chain, facts(images), "sparkctl-lab/base:bookworm", only="v145", no_cache=True)
    assert [s.action for s in steps] == ["keep", "keep", "build", "stale", "stale"]
    steps = im.plan_build(chain, facts(images[:2]), "sparkctl-lab/base:bookworm", only="v145")
    assert steps[2].action == "blocked" and "sparkctl-lab/chain:mul1" in steps[2].reason


def test_decide_uses_the_label() -> None:
    layer = lab_chain()[0]
    want = im.content_hash(layer, DIGESTS, BASE_ID)
    assert im.decide(layer, DIGESTS, BASE_ID, img(layer.tag, "x", {LABEL_CONTENT_HASH: want})).action == "skip"
    assert im.decide(layer, DIGESTS, None, None).reason == "its parent is rebuilt first"


# ------------------------------------------------------------------------------ build argv


def test_build_argv_stages_on_the_node_and_labels_the_image() -> None:
    recipe = load_recipe("lab")
    layer = lab_chain()[2]
    argv = im.build_argv(recipe, layer, "/models/lab", DIGESTS, BASE_ID, "sha256:" + "9" * 64)
    assert argv[:2] == ["sh", "-c"] and argv[2] == im.BUILD_SCRIPT
    rest = argv[3:]
    assert rest[:3] == ["sparkctl-build", "/models/lab/serving", "3"]
    assert rest[3:9] == [x for name in V145_FILES for x in (name, DIGESTS[name])]
    docker = rest[9:]
    assert docker[:4] == ["env", "DOCKER_BUILDKIT=0", "docker", "build"]
    assert ["--tag", "sparkctl-lab/chain:v145"] == docker[4:6]
    assert f"BASE={BASE_ID}" in docker
    for label in ("sparkctl.recipe=lab", "sparkctl.layer=v145", "sparkctl.content-hash=sha256:" + "9" * 64):
        assert label in docker
    assert any(x.startswith("sparkctl.version=") for x in docker)
    assert docker[-2:] == ["--force-rm", "."]


def test_build_script_stages_only_the_copied_files_and_checks_them(tmp_path: Path) -> None:
    """Run BUILD_SCRIPT locally with a fake `docker build` that lists its context."""
    model = ckptgen.make_checkpoint(tmp_path / "m")
    serving = model / "serving"
    recipe = load_recipe("lab")
    layer = lab_chain()[2]
    argv = im.build_argv(recipe, layer, str(model), DIGESTS, BASE_ID, "sha256:" + "9" * 64)
    cut = argv.index("env")
    fake = [*argv[:cut], "sh", "-c", 'find . -type f | sort; head -1 Dockerfile']
    res = subprocess.run(fake, input=layer.dockerfile, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr
    listing = res.stdout.decode().splitlines()
    assert listing[:4] == ["./Dockerfile", "./v145/build.sh", "./v145/exllamav3/__init__.py", "./v145/patch_aarch64.py"]
    assert listing[4] == layer.dockerfile.decode().splitlines()[0]
    (serving / "v145" / "build.sh").write_text("changed\n")
    res = subprocess.run(fake, input=layer.dockerfile, capture_output=True, timeout=30)
    assert res.returncode == 65 and b"changed while building" in res.stderr


def test_build_step() -> None:
    assert im.build_step("Step 3/5 : RUN python3 -c 1") == (3, 5)
    assert im.build_step(" ---> Running in abc") is None


# ------------------------------------------------------------------------------ shipping


def _save(tags: list[str], layer_lists: list[list[str]]) -> tuple[list[dict[str, Any]], dict[str, Image]]:
    manifest, head = [], {}
    for tag, layers in zip(tags, layer_lists, strict=True):
        cfg = hashlib_hex("cfg" + tag)
        manifest.append({"Config": f"{cfg}.json", "RepoTags": [tag],
                         "Layers": [f"{hashlib_hex(tag + d)}/layer.tar" for d in layers]})
        head[tag] = Image(id="sha256:" + cfg, repo_tags=(tag,), labels={}, layers=tuple(layers))
    return manifest, head


def test_chain_ids_match_dockers_definition() -> None:
    a, b = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    import hashlib

    assert im.chain_ids([a, b]) == [a, "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()]


def test_select_for_rank_sends_only_what_is_missing() -> None:
    d = ["sha256:" + c * 64 for c in "0123"]
    tags = ["p:one", "p:two"]
    manifest, head = _save(tags, [d[:2], d[:4]])
    base = Image(id="sha256:base", repo_tags=("base:x",), labels={}, layers=(d[0],))
    # a rank with only the base gets both images and layers 1..3 once (layer 1 is shared by both)
    sel = im.select_for_rank(manifest, head, [base], tags)
    assert [e["RepoTags"] for e in sel.entries] == [["p:one"], ["p:two"]]
    assert sel.layers == d[1:]
    assert len([m for m in sel.members if m.endswith(".json")]) == 2
    assert len([m for m in sel.members if m.endswith("layer.tar")]) == 3
    # a rank with the first image gets only the second, and only its two new layers
    sel = im.select_for_rank(manifest, head, [base, head["p:one"]], tags)
    assert [e["RepoTags"] for e in sel.entries] == [["p:two"]] and sel.layers == d[2:]
    # a rank with everything gets nothing
    assert im.select_for_rank(manifest, head, [base, *head.values()], tags).empty
    # a rank with an old top (same prefix) gets only the new top layer
    old = Image(id="sha256:old", repo_tags=("p:two",), labels={}, layers=(*d[:3], "sha256:" + "9" * 64))
    sel = im.select_for_rank(manifest, head, [base, head["p:one"], old], tags)
    assert sel.layers == [d[3]]


def test_identical_needs_share_one_stream() -> None:
    d = ["sha256:" + c * 64 for c in "01"]
    manifest, head = _save(["p:one"], [d])
    base = Image(id="sha256:base", repo_tags=("base:x",), labels={}, layers=(d[0],))
    a = im.select_for_rank(manifest, head, [base], ["p:one"])
    b = im.select_for_rank(manifest, head, [base], ["p:one"])
    assert a.key() == b.key()


def test_select_refuses_odd_member_names() -> None:
    manifest = [{"Config": "../../etc/passwd", "RepoTags": ["p:one"], "Layers": []}]
    head = {"p:one": Image(id="sha256:x", repo_tags=("p:one",), labels={}, layers=())}
    with pytest.raises(ValueError, match="unexpected member"):
        im.select_for_rank(manifest, head, [], ["p:one"])


def test_codec_and_scripts() -> None:
    assert im.pick_codec({"zstd", "gzip"}, [{"zstd"}, {"zstd", "gzip"}]) == "zstd"
    assert im.pick_codec({"zstd", "gzip"}, [{"zstd"}, {"gzip"}]) == "gzip"
    assert im.pick_codec({"pigz", "gzip"}, [{"gzip"}]) == "pigz"
    assert im.load_argv("zstd") == ["sh", "-c", im.LOAD_SCRIPT, "sparkctl-load", "zstd"]
    assert im.cleanup_argv("/var/tmp/sparkctl-ship.AbC123") == ["rm", "-rf", "--", "/var/tmp/sparkctl-ship.AbC123"]
    with pytest.raises(ValueError):
        im.cleanup_argv("/")
    with pytest.raises(ValueError):
        im.pack_argv("/var/tmp/sparkctl-ship.x", "gzip", ["-rf"])


def test_parse_saved() -> None:
    folder, manifest = im.parse_saved('/var/tmp/sparkctl-ship.x\n[{"Config": "a.json"}]\n')
    assert folder == "/var/tmp/sparkctl-ship.x" and manifest == [{"Config": "a.json"}]


def test_pack_script_builds_a_loadable_archive(tmp_path: Path) -> None:
    """PACK_SCRIPT, run locally: manifest from stdin first, then the members, links followed."""
    import tarfile

    saved = tmp_path / "sparkctl-ship.abc"
    a, b = "a" * 64, "b" * 64
    (saved / a).mkdir(parents=True)
    (saved / a / "layer.tar").write_bytes(b"layer-bytes")
    (saved / b).mkdir()
    (saved / b / "layer.tar").symlink_to(f"../{a}/layer.tar")
    (saved / f"{'c' * 64}.json").write_text("{}")
    argv = im.pack_argv(str(saved), "gzip", [f"{'c' * 64}.json", f"{b}/layer.tar"])
    res = subprocess.run(argv, input=b'[{"Config": "x"}]', capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "out.tgz"
    out.write_bytes(res.stdout)
    with tarfile.open(out) as tf:
        names = tf.getnames()
        assert names[0] == "manifest.json"
        assert f"{b}/layer.tar" in names
        member = tf.getmember(f"{b}/layer.tar")
        assert member.isfile()  # dereferenced
        assert tf.extractfile(member).read() == b"layer-bytes"  # type: ignore[union-attr]


def _layer_tar(payload: bytes) -> bytes:
    """An uncompressed layer tar (what `docker save` writes; its sha256 is the diff ID)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("opt/file")
        info.size = len(payload)
        tf.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


def _save_stream(entries: list[tuple[str, bytes | str]]) -> bytes:
    """A `docker save`-shaped tar: (name, bytes) files, (name, "->target") links, (name/, b"") dirs."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in entries:
            info = tarfile.TarInfo(name.rstrip("/"))
            if name.endswith("/"):
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif isinstance(data, str):
                info.type, info.linkname = tarfile.SYMTYPE, data.removeprefix("->")
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


FILTER = Path(im.__file__).resolve().parent.parent / "probes" / "save_filter.py"


def _run_filter(root: Path, stream: bytes, needed: list[str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-c", FILTER.read_text(), str(root), *needed], input=stream,
                          capture_output=True, timeout=60)  # fmt: skip


def test_save_filter_keeps_only_the_layers_a_rank_lacks_legacy_layout(tmp_path: Path) -> None:
    """Docker < 25: `<id>/layer.tar`; a layer shared by two images is a link to the other's."""
    base, chain = _layer_tar(b"base " * 1000), _layer_tar(b"chain")
    diff = "sha256:" + hashlib.sha256(chain).hexdigest()
    a, b, c, cfg = "a" * 64, "b" * 64, "c" * 64, "d" * 64
    stream = _save_stream([(f"{a}/", b""), (f"{a}/VERSION", b"1.0"), (f"{a}/json", b"{}"), (f"{a}/layer.tar", base),
                           (f"{b}/", b""), (f"{b}/layer.tar", chain), (f"{c}/", b""), (f"{c}/layer.tar", f"->../{b}/layer.tar"),
                           (f"{cfg}.json", b"{}"), ("repositories", b"{}"), ("manifest.json", b"[]")])  # fmt: skip
    res = _run_filter(tmp_path, stream, [diff])
    assert res.returncode == 0, res.stderr
    assert not (tmp_path / a / "layer.tar").exists()  # the base layer: hashed, not needed, removed
    assert (tmp_path / a / "json").read_bytes() == b"{}" and (tmp_path / f"{cfg}.json").exists()
    assert (tmp_path / b / "layer.tar").read_bytes() == chain
    assert (tmp_path / c / "layer.tar").read_bytes() == chain  # the link, followed
    assert (tmp_path / "manifest.json").exists() and (tmp_path / "repositories").exists()
    assert im.parse_save_stats(res.stdout.decode()) == {"kept": 6, "skipped": 1, "bytes_skipped": len(base)}


def test_save_filter_oci_layout_skips_unneeded_plain_layers_unwritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Docker >= 25: `blobs/sha256/<digest>`. A big plain-tar blob not needed is never written; a
    compressed one (containerd's store: its name is not its diff ID) is kept, as are small blobs."""
    import gzip

    big = _layer_tar(os.urandom(5 << 20))
    needed_layer = _layer_tar(os.urandom(5 << 20))
    packed = gzip.compress(_layer_tar(os.urandom(5 << 20)), compresslevel=1)
    digest = {k: hashlib.sha256(v).hexdigest() for k, v in (("big", big), ("need", needed_layer), ("gz", packed))}
    cfg = b'{"rootfs": {}}'
    stream = _save_stream([("blobs/", b""), ("blobs/sha256/", b""), (f"blobs/sha256/{digest['big']}", big),
                           (f"blobs/sha256/{digest['need']}", needed_layer), (f"blobs/sha256/{digest['gz']}", packed),
                           (f"blobs/sha256/{hashlib.sha256(cfg).hexdigest()}", cfg), ("oci-layout", b"{}"),
                           ("index.json", b"{}"), ("manifest.json", b"[]")])  # fmt: skip
    res = _run_filter(tmp_path, stream, ["sha256:" + digest["need"]])
    assert res.returncode == 0, res.stderr
    blobs = tmp_path / "blobs" / "sha256"
    assert not (blobs / digest["big"]).exists()
    assert (blobs / digest["need"]).read_bytes() == needed_layer
    assert (blobs / digest["gz"]).read_bytes() == packed
    assert (blobs / hashlib.sha256(cfg).hexdigest()).read_bytes() == cfg
    assert im.parse_save_stats(res.stdout.decode())["bytes_skipped"] == len(big)


@pytest.mark.parametrize("entry", [("../escape", b"x"), ("/etc/x", b"x"), (f"{'a' * 64}/layer.tar", "->/etc/passwd"),
                                   (f"{'a' * 64}/../../x", b"x"), ("blobs/sha256/x", b"x")])  # fmt: skip
def test_save_filter_writes_nothing_outside_its_folder(tmp_path: Path, entry: tuple[str, bytes | str]) -> None:
    root = tmp_path / "saved"
    root.mkdir()
    res = _run_filter(root, _save_stream([entry]), [])
    assert res.returncode != 0 and b"unexpected" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"] and not Path("/etc/x").exists()


def test_save_script_fails_when_docker_save_fails_and_leaves_nothing(tmp_path: Path) -> None:
    """The unpacker's exit status is the pipeline's: a failing `docker save` must still fail the step."""
    chain = _layer_tar(b"chain")
    stream = _save_stream([("manifest.json", b'[{"Config": "x"}]'), (f"{'b' * 64}/layer.tar", chain)])
    (tmp_path / "stream.tar").write_bytes(stream)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    docker = bindir / "docker"
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    needed = ["sha256:" + hashlib.sha256(chain).hexdigest()]
    for exit_code in (0, 1):
        docker.write_text(f"#!/bin/sh\ncat {tmp_path / 'stream.tar'}\nexit {exit_code}\n")
        docker.chmod(0o755)
        res = subprocess.run(im.save_argv(["t:1"], needed, FILTER.read_text()), capture_output=True, env=env,
                             timeout=60)  # fmt: skip
        left = sorted(p.name for p in tmp_path.glob("sparkctl-ship.*"))
        if exit_code == 0:
            folder, manifest = im.parse_saved(res.stdout.decode())
            assert res.returncode == 0 and manifest == [{"Config": "x"}] and Path(folder).name in left
            assert (Path(folder) / ("b" * 64) / "layer.tar").read_bytes() == chain
            assert im.parse_save_stats(res.stderr.decode())["kept"] == 2
        else:
            assert res.returncode == 1 and b"docker save failed" in res.stderr
            assert len(left) == 1  # only the first run's folder: the failed one was removed


def test_missing_layers_match_what_select_for_rank_sends() -> None:
    def img(id_: str, tag: str, layers: list[str]) -> Image:
        return Image(id_, (tag,), {}, tuple(layers))

    l1, l2, l3 = ("sha256:" + c * 64 for c in "123")
    head = {"c:dcp": img("sha256:" + "d" * 64, "c:dcp", [l1, l2]), "c:keys3": img("sha256:" + "e" * 64, "c:keys3", [l1, l2, l3])}
    assert im.missing_layers(head, [img("sha256:" + "0" * 64, "base", [l1])], ["c:dcp", "c:keys3"]) == {l2, l3}
    assert im.missing_layers(head, [head["c:dcp"]], ["c:dcp", "c:keys3"]) == {l3}
    assert im.missing_layers(head, list(head.values()), ["c:dcp", "c:keys3"]) == set()
    with pytest.raises(ValueError):
        im.save_argv(["t"], ["sha256:$(x)"], "")


# ------------------------------------------------------------------------------ bake


def _unq(value: Any) -> Any:
    """python-hcl2 keeps the quotes of string literals and keys; strip them for comparisons."""
    if isinstance(value, str):
        return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value
    if isinstance(value, list):
        return [_unq(v) for v in value]
    if isinstance(value, dict):
        return {_unq(k): _unq(v) for k, v in value.items() if k != "__is_block__"}
    return value


def parse_bake(text: str) -> dict[str, Any]:
    import hcl2

    doc = _unq(hcl2.loads(text))
    targets = {name: body for block in doc["target"] for name, body in block.items()}
    groups = {name: body for block in doc["group"] for name, body in block.items()}
    variables = {name: body for block in doc.get("variable", []) for name, body in block.items()}
    return {"targets": targets, "groups": groups, "variables": variables}


def write_serving(dest: Path) -> Path:
    for name, data in SERVING.items():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes(data)
    return dest


@pytest.mark.parametrize("recipe_name", ["glm53-exl3-tp4", "lab"])
def test_bake_file_structure_matches_the_recipe(recipe_name: str, tmp_path: Path) -> None:
    recipe = load_recipe(recipe_name)
    serving = write_serving(tmp_path / "serving")
    chain = local_chain(im.load_chain(recipe), serving)
    staged = stage_contexts(chain, serving, tmp_path / "bake")
    text = render_bake(recipe, chain, base_image=str(recipe.defaults["BASE_IMAGE"]),
                       contexts={k: str(v) for k, v in staged.items()}, registry="ghcr.io/acme")
    bake = parse_bake(text)
    names = recipe.layer_names()
    assert bake["groups"]["default"]["targets"] == names
    assert bake["variables"]["BASE_IMAGE"]["default"] == recipe.defaults["BASE_IMAGE"]
    common = bake["targets"]["_chain"]
    assert common["platforms"] == ["linux/arm64"]
    assert common["labels"]["sparkctl.recipe"] == recipe_name
    assert "output" not in common
    parent = "docker-image://${BASE_IMAGE}"
    for layer in chain:
        t = bake["targets"][layer.name]
        assert t["inherits"] == ["_chain"]
        assert t["args"] == {"BASE": "parent"}
        assert t["contexts"] == {"parent": parent}
        assert t["labels"] == {"sparkctl.layer": layer.name}
        assert t["tags"] == [f"ghcr.io/acme/{recipe.tag_prefix}:{layer.name}"]
        ctx = Path(t["context"])
        assert sorted(p.relative_to(ctx).as_posix() for p in ctx.rglob("*") if p.is_file()) == sorted(
            ["Dockerfile", *layer.payload])
        assert (ctx / "Dockerfile").read_bytes() == layer.dockerfile
        parent = f"target:{layer.name}"
    pushed = parse_bake(render_bake(recipe, chain, base_image="x/y:z", contexts={k: str(v) for k, v in staged.items()},
                                    registry="ghcr.io/acme", push=True))
    assert pushed["targets"]["_chain"]["output"] == ["type=registry"]


def test_bake_sets_the_parent_argument_the_dockerfile_declares(tmp_path: Path) -> None:
    serving = write_serving(tmp_path / "serving")
    (serving / "Dockerfile.keys").write_bytes(b"ARG PARENT\nFROM $PARENT\nCOPY ablit_runtime.py /x/\n")
    recipe = load_recipe("lab")
    chain = local_chain(im.load_chain(recipe), serving)
    staged = stage_contexts(chain, serving, tmp_path / "bake")
    bake = parse_bake(render_bake(recipe, chain, base_image="x/y:z", contexts={k: str(v) for k, v in staged.items()}))
    assert bake["targets"]["keys"]["args"] == {"PARENT": "parent"}


def test_bake_refuses_a_serving_folder_that_cannot_build(tmp_path: Path) -> None:
    serving = write_serving(tmp_path / "serving")
    (serving / "patch_dcp.py").unlink()
    with pytest.raises(UsageError, match=r"Dockerfile.dcp \(layer dcp\) copies patch_dcp.py, which is not in serving/"):
        local_chain(im.load_chain(load_recipe("lab")), serving)


def test_bake_command_writes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from sparkctl.cli import cli

    serving = tmp_path / "m" / "serving"
    serving.mkdir(parents=True)
    write_serving(serving)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NODES", raising=False)
    res = CliRunner().invoke(cli, ["--recipe", "lab", "--model", str(tmp_path / "m"), "bake", "--out", "out/b.hcl"])
    assert res.exit_code == 0, res.output
    bake = parse_bake((tmp_path / "out" / "b.hcl").read_text())
    assert list(bake["targets"]) == ["_chain", *load_recipe("lab").layer_names()]
    assert (tmp_path / "out" / "keys3" / "patch_keys3.py").is_file()
    res = CliRunner().invoke(cli, ["--recipe", "lab", "--model", str(tmp_path / "m"), "bake", "--push"])
    assert res.exit_code != 0


def test_fan_out_ends_every_ranks_stream_before_waiting_for_any_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each `docker load` ends only after its stream's EOF: ending rank 2's stream after rank 1's
    load had finished made the loads run one after another (3 ranks took 3x one)."""
    from sparkctl.commands.build import Board
    from sparkctl.orchestrate import build as B

    events: list[tuple[str, str]] = []

    class FakeStream:  # the part of cluster.Stream fan_out uses
        def __init__(self, name: str, data: list[bytes]) -> None:
            self.name, self.data, self.input_open = name, data, True

        def write(self, data: bytes) -> None: ...
        def read(self, wait: float = 0.0, *, limit: int = 0) -> tuple[bytes, bytes]:
            return (self.data.pop(0) if self.data else b""), b""

        @property
        def ended(self) -> bool:
            return not self.input_open and not self.data

        def close_input(self) -> None:
            events.append(("eof", self.name))
            self.input_open = False

        def exit_status(self) -> int:
            return 0

        def close(self) -> None: ...

    streams = {"head": FakeStream("head", [b"stream"]), "spark2": FakeStream("spark2", []),
               "spark3": FakeStream("spark3", []), "spark4": FakeStream("spark4", [])}  # fmt: skip

    class Cluster:
        def node(self, name: str) -> Any:
            return type("N", (), {"name": name, "open_stream": lambda self, argv, **kw: streams[name]})()

    def wait(stream: Any, sink: bytearray, timeout: float) -> int:
        events.append(("wait", stream.name))
        return 0

    monkeypatch.setattr(B, "_wait_exit", wait)
    ranks = ["spark2", "spark3", "spark4"]
    results = {n: B.RankResult(n, i + 1) for i, n in enumerate(ranks)}
    board = Board(["head", *ranks], ["keys3"], quiet=True)
    B.fan_out(Cluster(), Cluster().node("head"), im.Selection([{"Config": f"{'c' * 64}.json"}], [f"{'c' * 64}.json"], ["sha256:l"]),
              ranks, "/var/tmp/sparkctl-ship.x", "zstd", results, board)  # type: ignore[arg-type]  # fmt: skip
    assert all(r.ok and r.shipped_bytes == len(b"stream") for r in results.values()), results
    ends = [n for kind, n in events if kind == "eof" and n != "head"]
    first_wait = next(i for i, (kind, _) in enumerate(events) if kind == "wait")
    assert sorted(ends) == ranks and all(events.index(("eof", n)) < first_wait for n in ranks), events


def test_version_probe_runs_in_a_python_and_reads_distributions(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "exllamav3-1.4.5.dist-info").mkdir(parents=True)
    (site / "exllamav3-1.4.5.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: exllamav3\nVersion: 1.4.5\n")
    res = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); exec({im.VERSIONS_SCRIPT!r})"],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/nonexistent"})
    versions = im.parse_versions(res.stdout)
    assert versions == {"exllamav3": "1.4.5", "nccl": "absent", "torch": "absent", "vllm": "absent", "cuda": "absent",
                        "nccl.conf": "present" if Path("/etc/nccl.conf").exists() else "absent"}
    assert im.version_problems({"exllamav3": "1.4.5"}, versions) == []
    assert im.version_problems({"exllamav3": "1.4.5"}, {**versions, "exllamav3": "0.0.43"}) == [
        "exllamav3 is 0.0.43, the recipe expects 1.4.5"]
    assert im.versions_argv("t:v145")[:7] == ["run", "--rm", "--network", "none", "--entrypoint", "python3", "t:v145"]


def test_versions_are_compared_with_the_heads() -> None:
    head = {"vllm": "0.33.0", "exllamav3": "1.4.5"}
    assert im.version_disagreements({"spark1": head, "spark2": head, "spark3": {**head, "exllamav3": "0.0.43"}},
                                    "spark1") == {"spark3": "exllamav3 0.0.43 (head: 1.4.5)"}


def test_every_recipe_expects_exllamav3_1_4_5_after_v145() -> None:
    for name in CARD_CHAIN_RECIPES:
        chain = im.load_chain(load_recipe(name))
        assert dict(next(x for x in chain if x.name == "v145").expect) == {"exllamav3": "1.4.5"}, name


def _recipe_with_first_layer(dest: Path, layer: str) -> Path:
    """The lab recipe, its first layer (dcp) renamed: `layer` is the TOML of that table's body."""
    text = (load_recipe("lab").path).read_text()
    assert text.count('[[images.layers]]\nname = "dcp"\n') == 1
    path = dest / "evil.toml"
    path.write_text(text.replace('[[images.layers]]\nname = "dcp"\n', f"[[images.layers]]\n{layer}\n"))
    return path


@pytest.mark.parametrize("layer", ['name = "../../x"\ndockerfile = "Dockerfile.dcp"', 'name = ".."',
                                   'name = "x/../../../x"\ndockerfile = "Dockerfile.dcp"',
                                   'name = "Keys"\ndockerfile = "Dockerfile.dcp"'])
def test_a_layer_name_outside_the_safe_pattern_is_refused_and_bake_removes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], layer: str) -> None:
    """A recipe layer's name becomes a folder (bake's staged context, replaced) and a tag: one that is not
    `[a-z0-9][a-z0-9._-]*` without `..` is refused where the recipe is loaded, exit 2, one line naming the
    recipe file and the key; a folder outside bake's own stays."""
    from tests.conftest import run_cli

    serving = write_serving(tmp_path / "m" / "serving")
    (serving / "Dockerfile...").write_bytes(SERVING["Dockerfile.dcp"])  # `name = ".."`'s default
    recipe = _recipe_with_first_layer(tmp_path, layer)
    canary = tmp_path / "x" / "keep.txt"  # what out/b/../../x, or out/b/.. (bake's own parent), reaches
    canary.parent.mkdir()
    canary.write_text("mine")
    (tmp_path / "out" / "b").mkdir(parents=True)
    (tmp_path / "out" / "keep.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NODES", raising=False)
    code, out, err = run_cli(["--recipe", str(recipe), "--model", str(tmp_path / "m"), "bake",
                              "--out", "out/b/docker-bake.hcl"], capsys)
    assert canary.is_file() and (tmp_path / "out" / "keep.txt").is_file(), "bake removed a folder outside its own"
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and f"{recipe}/images/layers/0/name" in lines[0], err
    assert not (tmp_path / "out" / "b" / "docker-bake.hcl").exists()


def test_bake_never_replaces_a_folder_outside_its_own(tmp_path: Path) -> None:
    """Defence in depth: a layer whose name leaves the bake folder (however it got past the recipe loader) is
    refused before anything there is removed."""
    serving = write_serving(tmp_path / "serving")
    chain = local_chain(im.load_chain(load_recipe("lab")), serving)
    canary = tmp_path / "x" / "keep.txt"
    canary.parent.mkdir()
    canary.write_text("mine")
    (tmp_path / "bake").mkdir()
    evil = [replace(chain[0], name="../x"), *chain[1:]]
    with pytest.raises(UsageError, match=r"\.\./x"):
        stage_contexts(evil, serving, tmp_path / "bake")
    assert canary.read_text() == "mine"
    assert not any((tmp_path / "bake").iterdir())
