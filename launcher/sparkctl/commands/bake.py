"""`sparkctl bake [--out PATH] [--payload DIR] [--push] [--registry REF]`: the chain as a docker-bake.hcl.

For CI (buildx exists there, under QEMU for linux/arm64): one target per layer, in the recipe's order,
each built FROM the previous target through a named build context (`contexts = { parent =
"target:<prev>" }`, `args = { <the Dockerfile's parent ARG> = "parent" }`); the first target's parent is the recipe's
BASE_IMAGE. Group "default" = every layer in order.

Each target's context is staged next to the bake file (`<out dir>/<layer>/`: the checkpoint's
serving/Dockerfile.<layer> and only the files its COPY/ADD name, from --payload, default $MODEL/serving),
so a CI build sees exactly what `sparkctl build` stages on a node. A missing Dockerfile or copied file is
an error naming the file and the layer before anything is written.

CI images carry sparkctl.recipe / layer / version labels but no sparkctl.content-hash: that hash
includes the parent image ID on the node, which a registry build cannot know.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from typing import Any

import click
import jinja2

from .. import __version__
from ..errors import UsageError
from ..image import chain as im
from ..spec.recipes import Recipe
from ..spec.resources import data_dir

PLATFORMS = ("linux/arm64",)  # GB10 (Grace) nodes
_REGISTRY_RE = re.compile(r"^[a-z0-9][a-z0-9._:/-]{0,200}$")


def target_tags(recipe: Recipe, layer: str, registry: str | None) -> list[str]:
    tag = im.layer_tag(recipe, layer)
    return [f"{registry.rstrip('/')}/{tag}" if registry else tag]


def render_bake(recipe: Recipe, chain: list[im.LayerSpec], *, base_image: str, contexts: dict[str, str],
                registry: str | None = None, push: bool = False, filename: str = "docker-bake.hcl") -> str:
    """The bake file's text (pure). `contexts` maps each layer to its staged context folder."""
    targets: list[dict[str, Any]] = []
    parent = "docker-image://${BASE_IMAGE}"
    for layer in chain:
        targets.append({"name": layer.name, "context": contexts[layer.name], "parent": parent, "arg": layer.base_arg,
                        "tags": target_tags(recipe, layer.name, registry)})
        parent = f"target:{layer.name}"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False)  # noqa: S701 - HCL, not HTML
    for value in [base_image, registry or "", *contexts.values()]:
        if '"' in value or "\\" in value or "\n" in value or "${" in value or "%{" in value:
            raise UsageError(f"{value!r} cannot be written into an HCL string")
    return env.get_template("docker-bake.hcl.j2").render(
        recipe=recipe.name, version=__version__, layers=chain, targets=targets,
        base_image=base_image, platforms=PLATFORMS, push=push, filename=filename,
    )


def local_chain(refs: list[im.LayerRef], serving: Path) -> list[im.LayerSpec]:
    """The chain as a local serving/ folder defines it (the same resolution `build` does on a node)."""
    if not serving.is_dir():
        raise UsageError(f"{serving} is not a folder", fix="pass --payload the checkpoint's serving/ folder (or set MODEL)")
    files = {p.relative_to(serving).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(serving.rglob("*")) if p.is_file()}
    dockerfiles = {ref.dockerfile_name: ((serving / ref.dockerfile_name).read_bytes()
                                         if (serving / ref.dockerfile_name).is_file() else None) for ref in refs}
    chain, problems = im.resolve_chain(refs, files, dockerfiles)
    if problems:
        raise UsageError("the chain cannot be built from " + str(serving) + ", nothing was written:\n  "
                         + "\n  ".join(problems), fix="pass --payload the checkpoint's serving/ folder (or set MODEL)")
    return chain


def stage_contexts(chain: list[im.LayerSpec], payload: Path, dest: Path) -> dict[str, Path]:
    """Copy each layer's Dockerfile and the files it copies into dest/<layer>/ (replacing it). A folder that
    is not a child of dest is refused before anything is removed (the recipe loader already refuses such names)."""
    out: dict[str, Path] = {}
    for layer in chain:
        ctx = dest / layer.name
        if ctx.resolve().parent != dest.resolve() or ctx.name != layer.name:
            raise UsageError(f"layer {layer.name!r}: its bake context {ctx} is not a folder of {dest}; nothing removed",
                             fix="name the layer with lower-case letters, digits, '.', '_', '-' in the recipe")
    for layer in chain:
        ctx = dest / layer.name
        if ctx.exists():
            shutil.rmtree(ctx)
        ctx.mkdir(parents=True)
        (ctx / "Dockerfile").write_bytes(layer.dockerfile)
        for name in layer.payload:
            (ctx / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(payload / name, ctx / name)
        out[layer.name] = ctx
    return out


@click.command(name="bake")
@click.option("--out", "out", default="build/bake/docker-bake.hcl", show_default=True, metavar="PATH",
              help="Where to write the bake file; the per-layer contexts are staged next to it.")
@click.option("--payload", metavar="DIR", help="The serving/ payload folder (default: $MODEL/serving).")
@click.option("--push", is_flag=True, help="Targets push to the registry (output type=registry).")
@click.option("--registry", metavar="REF", help="Prefix for the tags, e.g. ghcr.io/OWNER.")
@click.pass_context
def command(ctx: click.Context, out: str, payload: str | None, push: bool, registry: str | None) -> None:
    """Render docker-bake.hcl for CI builds of the image chain (linux/arm64)."""
    settings = ctx.obj.settings(validate=False)  # no nodes are needed to render a bake file
    recipe = settings.recipe
    if recipe.prebuilt is not None:
        raise UsageError(f"recipe {recipe.name} runs a prebuilt image ({recipe.prebuilt.source}): there is no chain "
                         "to bake", fix="`sparkctl build` gives every rank the published image (IMAGE)")
    base = str(settings.get("BASE_IMAGE") or "")
    if not base:
        raise UsageError("BASE_IMAGE is not set", fix=f"set it, or give recipe {recipe.name} a BASE_IMAGE default")
    if registry is not None and not _REGISTRY_RE.match(registry):
        raise UsageError(f"--registry {registry!r} is not a registry reference (e.g. ghcr.io/owner)")
    if push and not registry:
        raise UsageError("--push needs --registry (where to push)", fix="e.g. --registry ghcr.io/OWNER")
    if payload is None:
        model = settings.get("MODEL")
        if not model:
            raise UsageError("no payload folder", fix="pass --payload DIR (the checkpoint's serving/) or set MODEL")
        payload = im.serving_dir(model)
    chain = local_chain(im.load_chain(recipe), Path(payload))
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staged = stage_contexts(chain, Path(payload), out_path.parent)
    contexts = {name: os.path.relpath(path) for name, path in staged.items()}
    text = render_bake(recipe, chain, base_image=base, contexts=contexts, registry=registry, push=push,
                       filename=str(out_path))
    out_path.write_text(text)
    if ctx.obj.json:
        from ..output import emit_json

        emit_json({"file": str(out_path), "recipe": recipe.name, "targets": [layer.name for layer in chain],
                   "contexts": contexts, "push": push})
    else:
        click.echo(str(out_path))
