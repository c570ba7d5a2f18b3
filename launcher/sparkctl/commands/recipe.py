"""`sparkctl recipe list | show NAME | validate FILE | new --model DIR|REPO`: the recipes sparkctl ships, one
recipe's file, a recipe file judged as loading judges it, and a new recipe from a checkpoint's config.json
(the reading: orchestrate/recipe.py; the choices: spec/recipe_new.py)."""

from __future__ import annotations

import os
import tempfile
import tomllib
from pathlib import Path

import click

from ..errors import Failure, UsageError
from ..orchestrate.recipe import read_model
from ..output import console, emit_json
from ..spec.recipe_new import GB10_NODE_MEMORY_BYTES, base_plan_inputs, draft, recipe_like_text, recipe_text
from ..spec.recipe_schema import default_problems
from ..spec.recipes import available_recipes, load_recipe
from ..spec.settings import IMAGE_RE
from .common import globals_of


@click.group("recipe")
def recipe_cmd() -> None:
    """List, show, validate and write recipes."""


@recipe_cmd.command("list")
@click.pass_context
def list_cmd(ctx: click.Context) -> None:
    """The shipped recipes: name, TP, image mode and description."""
    g = globals_of(ctx)
    rows = []
    for name in available_recipes():
        r = load_recipe(name)
        rows.append({"name": name, "tp": r.defaults.get("TP"), "max_model_len": r.defaults.get("MAX_MODEL_LEN"),
                     "image": "prebuilt" if r.prebuilt else "chain", "description": r.description})
    if g.json:
        emit_json({"recipes": rows})
        return
    c = console(False)
    for row in rows:
        c.print(f"{row['name']:<28} TP{row['tp']:<3} {row['image']:<9} {row['description']}", markup=False,
                soft_wrap=True)


@recipe_cmd.command("show")
@click.argument("name")
@click.pass_context
def show_cmd(ctx: click.Context, name: str) -> None:
    """Print a recipe's file (a shipped NAME, or a path)."""
    r = load_recipe(name)
    text = r.path.read_text()
    _report(ctx, {"name": r.name, "path": str(r.path), "text": text}, text.rstrip("\n"))


def _report(ctx: click.Context, doc: dict[str, object], text: str) -> None:
    """The command's answer: `doc` as JSON with --json, else `text`."""
    if globals_of(ctx).json:
        emit_json(doc)
    else:
        click.echo(text)


def validate_file(path: str) -> list[str]:
    """Load the file as `up` would (the schema, then the sections' own rules), then the knobs' rules on its
    [defaults]; a UsageError for the first shape problem, the list of knob problems otherwise."""
    r = load_recipe(path)
    return [f"recipe {r.path}/{p}" for p in default_problems(r.defaults)]


@recipe_cmd.command("validate")
@click.argument("file")
@click.pass_context
def validate_cmd(ctx: click.Context, file: str) -> None:
    """Judge a recipe file (or a shipped NAME): exit 0 when it loads, 2 with one line per problem."""
    problems = validate_file(file)
    if problems:
        raise UsageError("\n".join(problems), fix="fix each value as its line says (the knobs: docs/recipes.md)",
                         failures=[Failure(None, "recipe", p, None) for p in problems])
    _report(ctx, {"file": file, "valid": True}, f"{file}: valid")


@recipe_cmd.command("new")
@click.option("--model", "model", required=True, metavar="DIR|REPO",
              help="A checkpoint folder on this machine, or a Hub repo id (only config.json is downloaded).")
@click.option("--nodes", "nodes", type=click.IntRange(1, 64), default=2, show_default=True,
              help="DGX Spark nodes to serve it on (TP = nodes).")
@click.option("--out", "out", metavar="FILE", help="Write the recipe here (default: print it).")
@click.option("--name", "name", metavar="NAME", help="The recipe's name (default: from the model, -tpN).")
@click.option("--image", "image", metavar="REF", help="The vLLM image, pinned by digest (repo@sha256:...).")
@click.option("--node-memory", "node_memory", type=int, metavar="BYTES", default=GB10_NODE_MEMORY_BYTES,
              show_default=True, help="Memory of one node.")
@click.option("--like", "like", metavar="RECIPE",
              help="Take the platform (image, memory model, container, env, ports, fabric test) from this recipe, "
                   "a shipped NAME or a FILE; plan only the model's own values.")
@click.pass_context
def new_cmd(ctx: click.Context, model: str, nodes: int, out: str | None, name: str | None, image: str | None,
            node_memory: int, like: str | None) -> None:
    """Write a recipe for a checkpoint from its config.json, every choice explained in a comment; refuse (exit
    2, with the numbers) a model that cannot split over the nodes or fit on them."""
    if image is not None and (not IMAGE_RE.match(image) or "@sha256:" not in image):
        raise UsageError(f"--image {image}: pin the image by its digest (repo@sha256:<64 hex>)")
    if like is not None and image is not None:
        raise UsageError("--like and --image: the image is the base recipe's", fix="leave one out")
    src = read_model(model)
    if like is not None:
        try:
            base = load_recipe(like)  # judged as every recipe is: a bad base is the user's one-line error
        except UsageError as exc:
            raise UsageError(f"--like {like}: {exc.message.removeprefix(f'RECIPE={like!r}: ')}", fix=exc.fix) from None
        raw = tomllib.loads(base.path.read_text())
        memory, profile, seqs = base_plan_inputs(raw)
        d = draft(src, nodes, node_memory=memory, name=name, profile=profile, dense_block=profile.kv_block_tokens,
                  max_full_seqs=seqs)
        text = recipe_like_text(d, src, nodes, raw, base.name)
    else:
        d = draft(src, nodes, node_memory=node_memory, name=name)
        text = recipe_text(d, src, nodes, image=image, node_memory=node_memory)
    _check_written(text)
    if out:
        target = Path(out)
        if target.exists():
            raise UsageError(f"--out {out}: exists; sparkctl does not overwrite a file", fix="choose another path")
        tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, target)
    _report(ctx, {"name": d.name, "out": out, "tp": d.tp, "max_model_len": d.max_model_len,
                  "weights_per_rank": d.weights_per_rank, "kv_cache_bytes": d.kv_bytes, "why": d.why,
                  **({} if out else {"text": text})},
            f"wrote {out}: {d.name}, TP={d.tp}, MAX_MODEL_LEN={d.max_model_len:,}" if out else text.rstrip("\n"))


def _check_written(text: str) -> None:
    """What `recipe new` writes must load as every recipe does (a bug otherwise, never the user's)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "new.toml"
        path.write_text(text)
        problems = validate_file(str(path))
    if problems:
        raise AssertionError("recipe new wrote a recipe that does not validate: " + "; ".join(problems))


COMMANDS = {"recipe": recipe_cmd}
