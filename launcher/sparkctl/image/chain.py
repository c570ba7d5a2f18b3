"""The image chain: per-layer build contexts, content hashes, and the per-rank plan. Pure: no I/O on nodes.

A recipe's chain is `base → layer 1 → … → layer n`, and it is the checkpoint's own: layer i is
`$MODEL/serving/Dockerfile.<name>` (build context `serving/`), built `FROM` the image of layer i-1
through the build argument the Dockerfile declares for its parent (`ARG X` then `FROM ${X}`; see
sparkctl.image.dockerfile) and tagged `<tag_prefix>:<name>`. The probe reads each node's Dockerfiles and the
digests of its serving/ files; the context is staged **on the node**: sparkctl sends the Dockerfile it
read (and hashed) on the SSH channel's stdin, the node copies only the files its COPY/ADD name next to
it, checks their SHA-256 against what was planned, and builds. So nothing crosses the network, and a
node whose `serving/` differs (the NFS mistake) builds — and labels — what it really has.

Content hash of a layer (label `sparkctl.content-hash`) =
    sha256("sparkctl-content-hash/1", Dockerfile bytes, each staged file's name and bytes, parent key)
where the parent key is the parent's own content hash when sparkctl built it, else (the base) its image
ID. So the same inputs give the same hash on every rank, although a build on each rank gives each image
its own ID (the classic builder stamps creation times): `check` and `status` compare content hashes.
with file bytes entering as their SHA-256 (read on the node with `sha256sum`, one round trip per rank).
A layer whose tag already carries the same hash is not rebuilt; a changed parent changes the hash, so
everything after a rebuilt layer is rebuilt too, and nothing before it.

Shipping (`build --ship`) compares RootFS diff IDs: a rank that already holds the first k layers of an
image (its chain ID exists there) is sent only the rest. `select_for_rank` picks the members of the
head's `docker save` folder that a rank lacks; the docker loader skips a layer whose chain ID it has
without opening its file, so a stripped archive loads to the identical image ID.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..facts.docker_parse import Image, find_image, parse_image_inspect
from ..facts.parsing import NotJson, ParseError, parse_json
from ..spec.builders import LABEL_CONTENT_HASH, LABEL_VERSIONS, docker_build_argv, image_labels
from ..spec.recipes import Recipe
from . import dockerfile

HASH_SCHEME = "sparkctl-content-hash/1"
_PAYLOAD_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
# What `docker save` writes: hex folder names / blobs/sha256/<hex>; anything else is refused.
_MEMBER_RE = re.compile(r"^(?:[0-9a-f]{64}(?:/layer\.tar|\.json)|blobs/sha256/[0-9a-f]{64})$")


# ------------------------------------------------------------------------------------ the chain


@dataclass(frozen=True)
class LayerRef:
    """A layer as the recipe names it: its Dockerfile's name in the checkpoint's serving/ folder."""

    index: int  # 0 = the first layer on the base image
    name: str
    tag: str  # <tag_prefix>:<name>
    dockerfile_name: str  # e.g. Dockerfile.v145
    expect: tuple[tuple[str, str], ...] = ()  # versions the built image must report (recipe `expect`)


@dataclass(frozen=True)
class LayerSpec(LayerRef):
    """A layer resolved against one copy of serving/: the Dockerfile's bytes, the build argument that
    takes the parent image, and the context files its COPY/ADD read (paths relative to serving/)."""

    dockerfile: bytes = b""
    base_arg: str = "BASE"
    payload: tuple[str, ...] = ()

    @property
    def dockerfile_sha256(self) -> str:
        return hashlib.sha256(self.dockerfile).hexdigest()

    @property
    def dockerfile_path(self) -> str:
        return f"serving/{self.dockerfile_name}"


def layer_tag(recipe: Recipe, layer: str) -> str:
    return f"{recipe.tag_prefix}:{layer}"


def load_chain(recipe: Recipe) -> list[LayerRef]:
    """The recipe's layers in build order (their Dockerfiles are read on the node, in serving/)."""
    if recipe.prebuilt is not None:
        raise UsageError(f"recipe {recipe.name} runs a prebuilt image ({recipe.prebuilt.source}): it has no chain",
                         fix="`sparkctl build` gives every rank the head's copy of IMAGE")
    if not recipe.layers:
        raise UsageError(f"recipe {recipe.name} has no [[images.layers]]", fix=f"add the chain to {recipe.path}")
    chain: list[LayerRef] = []
    seen: set[str] = set()
    for i, layer in enumerate(recipe.layers):
        if layer.name in seen:
            raise UsageError(f"{recipe.path}/images/layers/{i}: layer {layer.name!r} is listed twice")
        seen.add(layer.name)
        chain.append(LayerRef(i, layer.name, layer_tag(recipe, layer.name), layer.dockerfile,
                              tuple(sorted(layer.expect.items()))))
    return chain


def resolve_chain(chain: Sequence[LayerRef], files: Mapping[str, str],
                  dockerfiles: Mapping[str, bytes | None]) -> tuple[list[LayerSpec], list[str]]:
    """Resolve every layer against one serving/ folder: `files` maps each file (relative path) to its
    SHA-256, `dockerfiles` each Dockerfile name to its bytes (None: not there). Returns the layers and
    the problems (one line each: what is missing or what the Dockerfile would need)."""
    out: list[LayerSpec] = []
    problems: list[str] = []
    for ref in chain:
        where = f"serving/{ref.dockerfile_name} (layer {ref.name})"
        text = dockerfiles.get(ref.dockerfile_name)
        if text is None:
            problems.append(f"{where} is missing")
            continue
        info = dockerfile.parse(text.decode("utf-8", errors="replace"))
        if info.base_arg is None:
            problems.append(f"{where} builds FROM {info.first_from or '(nothing)'}, not from a build argument: "
                            "sparkctl passes the previous layer's image as `ARG <NAME>` + `FROM ${NAME}`; "
                            "change the file to take its parent that way")
            continue
        payload, unmatched = dockerfile.match_sources(info.sources, files)
        for src in unmatched:
            problems.append(f"{where} copies {src}, which is not in serving/")
        bad = [f for f in payload if not _PAYLOAD_NAME_RE.match(f) or ".." in f.split("/")]
        for name in bad:
            problems.append(f"{where} copies serving/{name!r}: sparkctl stages only plain names "
                            "(letters, digits, '.', '_', '-', '/')")
        if unmatched or bad:
            continue
        out.append(LayerSpec(ref.index, ref.name, ref.tag, ref.dockerfile_name, ref.expect, text, info.base_arg,
                             tuple(payload)))
    return out, problems


def select_layers(chain: Sequence[LayerRef], only: str | None) -> list[LayerRef]:
    """The layers `--only` names (all of them without it)."""
    if only is None:
        return list(chain)
    for layer in chain:
        if layer.name == only:
            return [layer]
    raise UsageError(f"--only {only}: no such layer", fix=f"use one of: {', '.join(x.name for x in chain)}")


def serving_dir(model: str | Path) -> str:
    return f"{str(model).rstrip('/')}/serving"


# ------------------------------------------------------------------------------------ hashing


def parent_key(image: Image) -> str:
    """What a child's content hash says of its parent: the parent's content hash if sparkctl built it
    (the same on every rank), else its image ID (a base pulled or loaded: the same on every rank too)."""
    return image.labels.get(LABEL_CONTENT_HASH) or image.id


def content_hash(layer: LayerSpec, digests: Mapping[str, str], parent_id: str) -> str:
    """sha256 over the Dockerfile, each staged file (name + bytes, as their SHA-256) and the parent key."""
    h = hashlib.sha256()

    def put(kind: str, name: str, value: str) -> None:
        h.update(f"{kind}\0{name}\0{value}\n".encode())

    put("scheme", HASH_SCHEME, "")
    put("file", "Dockerfile", layer.dockerfile_sha256)
    for name in sorted(layer.payload):
        if name not in digests:
            raise UsageError(f"layer {layer.name}: payload file {name} has no digest (missing from serving/)")
        put("file", name, digests[name])
    put("parent", "", parent_id)
    return "sha256:" + h.hexdigest()


def chain_error(problems: Mapping[str, Sequence[str]], model: str) -> UsageError:
    """One error for every node whose serving/ cannot build the chain: which node, which file, why."""
    lines = [f"{node}: {serving_dir(model)}/{p.removeprefix('serving/')}" for node, ps in problems.items() for p in ps]
    return UsageError(
        "the checkpoint's image chain cannot be built, nothing was built:\n  " + "\n  ".join(lines),
        fix="put the checkpoint's serving/ folder (its Dockerfile.* and what they copy) in place on those nodes "
            "(same MODEL path everywhere; an NFS server node must bind-mount its own export at that path)",
    )


# ------------------------------------------------------------------------------------ node facts

# One round trip per rank: tools, every file of serving/ with its digest, the chain's Dockerfiles (base64),
# the engine, and the chain's images.
PROBE_SCRIPT = r"""# sparkctl build probe. $1 = serving dir, $2 = number of Dockerfiles, then their names, then image refs.
set -u
serving=$1; n=$2; shift 2
echo "@@tools"
for t in zstd pigz gzip tar sha256sum mktemp base64; do command -v "$t" >/dev/null 2>&1 && echo "$t"; done
echo "@@files"
if [ -d "$serving" ]; then (cd "$serving" && find . -type f -exec sha256sum {} + 2>/dev/null | head -n 5000); fi
echo "@@dockerfiles"
i=0
while [ "$i" -lt "$n" ]; do
  f=$1; shift; i=$((i + 1))
  if [ -f "$serving/$f" ] && text=$(base64 < "$serving/$f" | tr -d '\n'); then
    echo "$f $text"
  else
    echo "- $f"
  fi
done
echo "@@engine"
if v=$(docker version --format '{{.Server.Version}}' 2>&1); then
  echo "ok $v"
else
  echo "down $(printf '%s' "$v" | tr '\n' ' ' | cut -c1-400)"
fi
echo "@@images"
if [ "$#" -gt 0 ]; then docker image inspect "$@" 2>/dev/null; fi
echo "@@end"
"""


@dataclass(frozen=True)
class RankFacts:
    """What the probe found on one rank."""

    tools: frozenset[str]
    digests: dict[str, str]  # file under serving/ (relative path) -> sha256 hex
    dockerfiles: dict[str, bytes | None]  # the chain's Dockerfile names -> bytes (None: not there)
    engine_ok: bool
    engine: str  # server version, or why the engine is not reachable
    images: tuple[Image, ...] = ()

    def image(self, ref: str) -> Image | None:
        return find_image(self.images, ref)

    def chain(self, refs: Sequence[LayerRef]) -> tuple[list[LayerSpec], list[str]]:
        """The chain as this rank's serving/ defines it, and what keeps it from building."""
        return resolve_chain(refs, self.digests, self.dockerfiles)


def probe_argv(model: str, chain: Sequence[LayerRef], refs: Sequence[str]) -> list[str]:
    names = list(dict.fromkeys(layer.dockerfile_name for layer in chain))
    return ["sh", "-c", PROBE_SCRIPT, "sparkctl-probe", serving_dir(model), str(len(names)), *names, *refs]


def parse_probe(text: str) -> RankFacts:
    """Parse PROBE_SCRIPT's output (sections start with `@@name`)."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("@@") and " " not in line:
            current = sections.setdefault(line[2:], [])
        elif current is not None:
            current.append(line)
    if "end" not in sections:
        raise ParseError("the build probe's output is cut short (no @@end)")
    digests: dict[str, str] = {}
    for line in sections.get("files", []):
        m = re.fullmatch(r"([0-9a-f]{64}) [ *]\./(.+)", line)
        if m:
            digests[m.group(2)] = m.group(1)
    dockerfiles: dict[str, bytes | None] = {}
    for line in sections.get("dockerfiles", []):
        name, _, value = line.partition(" ")
        if name == "-":
            dockerfiles[value] = None
        elif name:
            try:
                dockerfiles[name] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise ParseError(f"the build probe sent {name} garbled") from None
    engine_line = " ".join(sections.get("engine", [])).strip()
    status, _, detail = engine_line.partition(" ")
    images_text = "\n".join(sections.get("images", [])).strip()
    images = tuple(parse_image_inspect(images_text)) if images_text else ()
    return RankFacts(
        tools=frozenset(x.strip() for x in sections.get("tools", []) if x.strip()),
        digests=digests,
        dockerfiles=dockerfiles,
        engine_ok=status == "ok",
        engine=detail.strip() or "no answer from `docker version`",
        images=images,
    )


# ------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Step:
    layer: str
    action: str  # build | skip | keep (--only: not touched) | stale (--only: parent changes) | blocked
    reason: str
    content_hash: str | None = None  # None: the parent is built first, so its ID is not known yet


def decide(layer: LayerSpec, digests: Mapping[str, str], parent_id: str | None, existing: Image | None,
           *, no_cache: bool = False) -> Step:
    """Build or skip one layer, given the parent's image ID (None: the parent is about to be rebuilt)."""
    if parent_id is None:
        return Step(layer.name, "build", "its parent is rebuilt first")
    want = content_hash(layer, digests, parent_id)
    if no_cache:
        return Step(layer.name, "build", "--no-cache", want)
    if existing is None:
        return Step(layer.name, "build", f"{layer.tag} is not on the node", want)
    have = existing.labels.get(LABEL_CONTENT_HASH)
    if have == want:
        return Step(layer.name, "skip", "content hash matches", want)
    if not have:
        return Step(layer.name, "build", f"{layer.tag} was not built by sparkctl (no content-hash label)", want)
    return Step(layer.name, "build", "content changed (Dockerfile, payload or parent image)", want)


def plan_build(chain: Sequence[LayerSpec], facts: RankFacts, base_ref: str, *, only: str | None = None,
               no_cache: bool = False) -> list[Step]:
    """What a build on this rank will do, layer by layer. Layers after a rebuilt one show as rebuilt
    (their parent's ID is only known once it is built); the build itself re-decides with real IDs."""
    base = facts.image(base_ref)
    parent_id: str | None = parent_key(base) if base else None
    rebuilt = False  # an earlier layer is (re)built: every later one gets a new parent
    steps: list[Step] = []
    for layer in chain:
        existing = facts.image(layer.tag)
        if only is not None and layer.name != only:
            if rebuilt:
                steps.append(Step(layer.name, "stale", f"--only {only} gives it a new parent; run `sparkctl build`"))
            else:
                steps.append(Step(layer.name, "keep", f"--only {only}"))
                parent_id = parent_key(existing) if existing else None
            continue
        if layer.index == 0 and base is None:
            step = Step(layer.name, "build", f"base image {base_ref} is not on the node: it is pulled first")
        elif parent_id is None and not rebuilt:
            prev = chain[layer.index - 1].tag
            step = Step(layer.name, "blocked", f"its parent {prev} is not on the node: build the chain first")
        else:
            step = decide(layer, facts.digests, None if rebuilt else parent_id, existing, no_cache=no_cache)
        steps.append(step)
        if step.action == "skip" and existing is not None:
            parent_id = parent_key(existing)
        else:
            rebuilt = True
    return steps


# ------------------------------------------------------------------------------------ build argv

# Runs on the node: stage the context (Dockerfile from stdin + the listed payload files, checked against
# the digests that were hashed), then `docker build` in it. The context folder is always removed.
BUILD_SCRIPT = r"""# sparkctl build: $1 = serving dir, $2 = number of payload files, then (name sha256) pairs, then argv.
set -eu
serving=$1; n=$2; shift 2
ctx=$(mktemp -d "${TMPDIR:-/tmp}/sparkctl-build.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
trap 'exit 130' INT TERM HUP
cat > "$ctx/Dockerfile"
i=0
while [ "$i" -lt "$n" ]; do
  name=$1; want=$2; shift 2; i=$((i + 1))
  case "$name" in */*) mkdir -p -- "$ctx/${name%/*}" ;; esac
  cp -- "$serving/$name" "$ctx/$name"
  got=$(sha256sum < "$ctx/$name"); got=${got%% *}
  if [ "$got" != "$want" ]; then
    echo "sparkctl: $serving/$name changed while building (sha256 $got, planned $want); run sparkctl build again" >&2
    exit 65
  fi
done
cd "$ctx"
"$@"
"""


def build_argv(recipe: Recipe, layer: LayerSpec, model: str, digests: Mapping[str, str], parent_id: str,
               chash: str, *, no_cache: bool = False) -> list[str]:
    """The remote command that stages this layer's context on the node and builds it (stdin: Dockerfile).

    The classic builder is used on purpose (DOCKER_BUILDKIT=0): it takes the parent by image ID,
    so the image built is exactly the one the content hash names, and it needs no buildx plugin.
    """
    labels = image_labels(recipe.name, layer.name, chash)
    docker = docker_build_argv(layer.tag, parent_id, labels, ".", no_cache=no_cache, base_arg=layer.base_arg)
    docker = [*docker[:-1], "--force-rm", docker[-1]]
    pairs = [x for name in layer.payload for x in (name, digests[name])]
    return ["sh", "-c", BUILD_SCRIPT, "sparkctl-build", serving_dir(model), str(len(layer.payload)), *pairs,
            "env", "DOCKER_BUILDKIT=0", *docker]


# ------------------------------------------------------------------------------------ versions

# Run inside a built image (`--entrypoint python3`, no network, no GPU): the versions that matter, each
# from its distribution's metadata; vLLM from `vllm --version` when it is not a distribution (the lab's
# stand-in); NCCL from torch when torch has it, else from the nvidia-nccl wheel; the CUDA torch was built
# for (the driver must be new enough for it); whether /etc/nccl.conf is there (it overrides the recipe's
# NCCL settings). "absent" otherwise.
VERSIONS_SCRIPT = r"""
import importlib.metadata as m, json, os, shutil, subprocess
def dist(*names):
    for n in names:
        try:
            return m.version(n)
        except Exception:
            pass
    return None
out = {"vllm": dist("vllm"), "torch": dist("torch"), "exllamav3": dist("exllamav3"), "nccl": None}
if out["vllm"] is None and shutil.which("vllm"):
    try:
        words = subprocess.run(["vllm", "--version"], capture_output=True, text=True, timeout=60).stdout.split()
        out["vllm"] = words[-1] if words else None
    except Exception:
        pass
try:
    import torch
    v = torch.cuda.nccl.version()
    out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
except Exception:
    out["nccl"] = dist("nvidia-nccl-cu13", "nvidia-nccl-cu12")
try:
    import torch
    out["cuda"] = torch.version.cuda
except Exception:
    out["cuda"] = os.environ.get("CUDA_VERSION")
out["nccl.conf"] = "present" if os.path.exists("/etc/nccl.conf") else None
print("@@versions " + json.dumps({k: v or "absent" for k, v in out.items()}, sort_keys=True))
"""


def versions_argv(tag: str) -> list[str]:
    """`docker run` of the version probe in a built layer (arguments for Node.docker)."""
    return ["run", "--rm", "--network", "none", "--entrypoint", "python3", tag, "-c", VERSIONS_SCRIPT]


def parse_versions(text: str) -> dict[str, str]:
    for line in reversed(text.splitlines()):
        if line.startswith("@@versions "):
            doc = parse_json(line.removeprefix("@@versions "))
            if isinstance(doc, dict):
                return {str(k): str(v) for k, v in doc.items()}
    raise ParseError("the version probe printed no @@versions line")


def version_problems(expect: Mapping[str, str], versions: Mapping[str, str]) -> list[str]:
    """What a built layer reports against what the recipe expects of it."""
    return [f"{key} is {versions.get(key, 'absent')}, the recipe expects {want}"
            for key, want in sorted(expect.items()) if versions.get(key) != want]


def version_disagreements(by_rank: Mapping[str, Mapping[str, str]], head: str) -> dict[str, str]:
    """Ranks whose image reports other versions than the head's for the same layer (node -> what differs)."""
    ref = by_rank.get(head) or next(iter(by_rank.values()), {})
    out: dict[str, str] = {}
    for node, versions in by_rank.items():
        diff = [f"{k} {versions.get(k, 'absent')} (head: {ref.get(k, 'absent')})"
                for k in sorted(set(ref) | set(versions)) if versions.get(k) != ref.get(k)]
        if diff:
            out[node] = ", ".join(diff)
    return out


def label_versions_argv(tag: str, versions: Mapping[str, str]) -> list[str]:
    """Record the versions on the layer's image as a label: a build of `FROM <the image ID>` (sent on
    stdin, no context) that adds only the label — no filesystem layer, the other labels (content
    hash included) inherited — and takes the tag over. `check` reads it from the image inspect it does."""
    doc = json.dumps(dict(sorted(versions.items())), separators=(",", ":"))
    return ["env", "DOCKER_BUILDKIT=0", "docker", "build", "--quiet", "--tag", tag, "--label", f"{LABEL_VERSIONS}={doc}", "-"]


def read_versions(image: Image) -> dict[str, str] | None:
    """The versions label of an image sparkctl built (None: no label, or not readable)."""
    raw = image.labels.get(LABEL_VERSIONS)
    if not raw:
        return None
    try:
        doc = parse_json(raw)
    except ParseError:
        return None
    return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else None


_STEP_RE = re.compile(r"^Step (\d+)/(\d+) :")


def build_step(line: str) -> tuple[int, int] | None:
    """`Step 3/5 : RUN ...` (the classic builder's progress) -> (3, 5)."""
    m = _STEP_RE.match(line)
    return (int(m.group(1)), int(m.group(2))) if m else None


# ------------------------------------------------------------------------------------ shipping


def chain_ids(diff_ids: Sequence[str]) -> list[str]:
    """The chain ID of every prefix of a layer list (the key the engine stores layers under)."""
    out: list[str] = []
    for i, diff in enumerate(diff_ids):
        if i == 0:
            out.append(diff)
        else:
            out.append("sha256:" + hashlib.sha256(f"{out[-1]} {diff}".encode()).hexdigest())
    return out


def held_chain_ids(images: Iterable[Image]) -> set[str]:
    """Every chain ID a rank is known to hold: all prefixes of the images it reported."""
    held: set[str] = set()
    for img in images:
        held.update(chain_ids(img.layers))
    return held


@dataclass
class Selection:
    """What one rank needs from the head's `docker save`: manifest entries (one per image whose ID
    differs there) and the members to send (configs + only the layers it lacks)."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    members: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)  # the diff IDs sent

    @property
    def empty(self) -> bool:
        return not self.entries

    def key(self) -> str:
        """Ranks with the same key get byte-identical streams (one stream from the head, fanned out)."""
        return json.dumps([self.entries, self.members], sort_keys=True)


def _rank_lacks(head: Mapping[str, Image], rank_images: Iterable[Image],
                tags: Sequence[str]) -> Iterator[tuple[str, Image, list[tuple[int, str, str]]]]:
    """Per tag whose head image the rank does not have under that tag: (tag, the head's image, and
    (position, chain ID, diff ID) of each of its layers the rank does not hold, by chain ID)."""
    rank_images = list(rank_images)
    rank_tags = {t: img for img in rank_images for t in img.repo_tags}
    held = held_chain_ids(rank_images)
    for tag in tags:
        img = head[tag]
        have = rank_tags.get(tag)
        if have is not None and have.id == img.id:
            continue  # the rank already has this very image under this tag
        lacking = [(i, cid, diff) for i, (cid, diff) in enumerate(zip(chain_ids(img.layers), img.layers, strict=True))
                   if cid not in held]  # fmt: skip
        yield tag, img, lacking


def select_for_rank(manifest: Sequence[Mapping[str, Any]], head: Mapping[str, Image],
                    rank_images: Iterable[Image], tags: Sequence[str]) -> Selection:
    """Pick what a rank lacks. `manifest` is the head's `docker save` manifest.json for `tags` (in chain
    order); `head` maps each tag to the head's image; `rank_images` is what the rank reported."""
    by_tag = {t: entry for entry in manifest for t in (entry.get("RepoTags") or [])}
    for tag in tags:
        if tag not in by_tag:
            raise ValueError(f"{tag} is not in the head's docker save manifest")
    sel = Selection()
    sent: set[str] = set()
    for tag, img, lacking in _rank_lacks(head, rank_images, tags):
        entry = by_tag[tag]
        layers_paths = list(entry.get("Layers") or [])
        if len(layers_paths) != len(img.layers):
            raise ValueError(f"{tag}: manifest lists {len(layers_paths)} layers, the image has {len(img.layers)}")
        _check_member(str(entry["Config"]))
        sel.entries.append({"Config": entry["Config"], "RepoTags": [tag], "Layers": layers_paths})
        sel.members.append(str(entry["Config"]))  # the loader reads every entry's config
        for i, cid, diff in lacking:  # a held layer: the loader finds it by chain ID, never opens the file
            if cid in sent:
                continue
            _check_member(layers_paths[i])
            sent.add(cid)
            sel.members.append(layers_paths[i])
            sel.layers.append(diff)
    sel.members = list(dict.fromkeys(sel.members))
    return sel


def _check_member(path: str) -> None:
    if not _MEMBER_RE.match(path):
        raise ValueError(f"unexpected member {path!r} in docker save output")


# Runs on the head: save the chain's tags into a private folder and print it and the manifest. With
# python3 there (check needs it on the head too), probes/save_filter.py unpacks only the layers some
# rank lacks ($2: their diff IDs); without it, tar unpacks everything. A failing `docker save` fails
# this even though the unpacker's status is the pipeline's (POSIX sh has no pipefail).
SAVE_SCRIPT = r"""# sparkctl ship: $1 = save_filter.py's source, $2 = the diff IDs needed, then the tags.
set -eu
filter=$1; needed=$2; shift 2
dir=$(mktemp -d "${TMPDIR:-/var/tmp}/sparkctl-ship.XXXXXX")
fail() { rm -rf "$dir"; echo "$1" >&2; exit 1; }
if command -v python3 >/dev/null 2>&1; then
  # shellcheck disable=SC2086 # $needed: diff IDs, one word each
  { docker save "$@" || : > "$dir/.save-failed"; } | python3 -c "$filter" "$dir" $needed >&2 ||
    fail "unpacking the docker save stream failed"
else
  { docker save "$@" || : > "$dir/.save-failed"; } | tar -x -C "$dir" -f - || fail "tar -x of docker save failed"
fi
[ ! -e "$dir/.save-failed" ] || fail "docker save failed"
echo "$dir"
cat "$dir/manifest.json"
"""

# Runs on the head, once per distinct selection: the manifest arrives on stdin, the members come from the
# saved folder (-h: docker save writes a layer shared by two images once and links the other), and the
# stream leaves compressed.
PACK_SCRIPT = r"""# sparkctl ship: $1 = saved folder, $2 = compressor, then members. stdin = manifest.json
set -eu
dir=$1; codec=$2; shift 2
sel=$(mktemp -d "$dir/sel.XXXXXX")
cat > "$sel/manifest.json"
case "$codec" in
  zstd) z="zstd -q -3 -T0 -c" ;;
  pigz) z="pigz -c -3" ;;
  *) z="gzip -c -3" ;;
esac
tar -c -h -f - -C "$sel" manifest.json -C "$dir" -- "$@" | $z
"""

# Runs on a rank: decompress (when docker load cannot) and load.
LOAD_SCRIPT = r"""set -eu
case "$1" in
  zstd) zstd -q -d -c | docker load ;;
  *) docker load ;;
esac
"""


def save_argv(tags: Sequence[str], needed: Iterable[str], filter_source: str) -> list[str]:
    ids = sorted(set(needed))
    for diff in ids:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", diff):
            raise ValueError(f"not a diff ID: {diff!r}")
    return ["sh", "-c", SAVE_SCRIPT, "sparkctl-save", filter_source, " ".join(ids), *tags]


def missing_layers(head: Mapping[str, Image], rank_images: Iterable[Image], tags: Sequence[str]) -> set[str]:
    """The diff IDs of the head's chain layers a rank lacks (what select_for_rank will send it), known
    before anything is saved: what the head's `docker save` has to keep for this rank."""
    return {diff for _, _, lacking in _rank_lacks(head, rank_images, tags) for _, _, diff in lacking}


def parse_save_stats(stderr: str) -> dict[str, int]:
    """save_filter.py's last line ("kept K skipped S bytes_skipped B"); {} without the filter."""
    for line in reversed(stderr.splitlines()):
        words = line.split()
        if len(words) == 6 and words[0::2] == ["kept", "skipped", "bytes_skipped"] and all(
            w.isdigit() for w in words[1::2]
        ):
            return {"kept": int(words[1]), "skipped": int(words[3]), "bytes_skipped": int(words[5])}
    return {}


def pack_argv(saved: str, codec: str, members: Sequence[str]) -> list[str]:
    for m in members:
        _check_member(m)
    return ["sh", "-c", PACK_SCRIPT, "sparkctl-pack", saved, codec, *members]


def load_argv(codec: str) -> list[str]:
    return ["sh", "-c", LOAD_SCRIPT, "sparkctl-load", codec]


def cleanup_argv(saved: str) -> list[str]:
    if not re.fullmatch(r"/[A-Za-z0-9._/-]*/sparkctl-ship\.[A-Za-z0-9]+", saved) or ".." in saved.split("/"):
        raise ValueError(f"refusing to remove {saved!r}: not a sparkctl-ship folder")
    return ["rm", "-rf", "--", saved]


def pick_codec(head_tools: Iterable[str], rank_tools: Iterable[Iterable[str]]) -> str:
    """zstd when the head and every receiving rank have it; else gzip (pigz on the head when there):
    docker load reads gzip itself, so the ranks need nothing for it."""
    head = set(head_tools)
    if "zstd" in head and all("zstd" in set(t) for t in rank_tools):
        return "zstd"
    return "pigz" if "pigz" in head else "gzip"


def parse_saved(text: str) -> tuple[str, list[dict[str, Any]]]:
    """SAVE_SCRIPT's output: the folder on the first line, then manifest.json."""
    first, _, rest = text.partition("\n")
    try:
        manifest = parse_json(rest)
    except NotJson as exc:
        raise ParseError(f"docker save manifest.json is not JSON ({exc.reason})") from None
    if not isinstance(manifest, list):
        raise ParseError("docker save manifest.json is not a list")
    return first.strip(), manifest
