"""The recipe file's JSON Schema: the shipped file is the generated one, every shipped recipe passes the
real `jsonschema` against it, and loading a recipe refuses what the schema refuses in one line that names
the file, the key and what is expected (never an internal error)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from sparkctl.errors import UsageError
from sparkctl.spec.recipe_schema import SCHEMA_FILE, first_problem, recipe_schema, recipe_schema_text
from sparkctl.spec.recipes import available_recipes, load_recipe
from sparkctl.spec.resources import recipes_dir

SHIPPED = available_recipes()


def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_schema_file_is_the_generated_schema():
    assert SCHEMA_FILE.read_text() == recipe_schema_text(), (
        "data/recipe.schema.json is stale: regenerate it with "
        "python -c 'from sparkctl.spec.recipe_schema import *; SCHEMA_FILE.write_text(recipe_schema_text())'")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_passes_the_schema(name):
    data = tomllib.loads((recipes_dir() / f"{name}.toml").read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _validator().iter_errors(data)]
    assert errors == []
    assert first_problem(recipe_schema(), data) is None
    load_recipe(name)


def _minimal() -> dict:
    return tomllib.loads((recipes_dir() / "lab-vllm.toml").read_text())


BROKEN = [
    ("missing required default", lambda d: d["defaults"].pop("PORT"), "defaults/PORT", "missing"),
    ("wrong type", lambda d: d["defaults"].update(TP="four"), "defaults/TP", "expected a whole number"),
    ("bool for an int", lambda d: d["defaults"].update(MASTER_PORT=True), "defaults/MASTER_PORT", "whole number"),
    ("out of range", lambda d: d["defaults"].update(PORT=70000), "defaults/PORT", "from 1 to 65535"),
    ("not a choice", lambda d: d["defaults"].update(SPEC_METHOD="eagle"), "defaults/SPEC_METHOD", "one of: mtp"),
    ("unknown default", lambda d: d["defaults"].update(MAX_MODEL_LENGTH=4), "defaults/MAX_MODEL_LENGTH", "unknown"),
    ("a cluster's key", lambda d: d["defaults"].update(NODES="a b"), "defaults/NODES", "unknown key"),
    ("unknown section", lambda d: d.update(serving={}), "serving", "unknown key"),
    ("unknown memory key", lambda d: d["memory"].update(overhead=3), "memory/overhead", "unknown key"),
    ("string list item", lambda d: d["vllm"].update(extra_args=["--a", 3]), "vllm/extra_args/1", "a string"),
    ("env value", lambda d: d["container"]["env"].update(X=1), "container/env/X", "a string"),
    ("layer key", lambda d: d["images"]["layers"][0].update(payload=["x"]), "images/layers/0/payload", "unknown"),
    ("mtp without k", lambda d: d["defaults"].update(SPEC_METHOD="mtp"), "defaults/SPEC_K", "missing"),
    ("fabric bool", lambda d: d["fabric"].update(expect_rdma="no"), "fabric/expect_rdma", "true or false"),
]


@pytest.mark.parametrize(("what", "brk", "key", "said"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_recipe_is_one_line_naming_file_key_and_expectation(tmp_path, what, brk, key, said):
    data = _minimal()
    brk(data)
    assert list(_validator().iter_errors(data)), f"the real jsonschema accepts the {what} recipe too"
    path = tmp_path / "mine.toml"
    path.write_text(_toml(data))
    with pytest.raises(UsageError) as exc:
        load_recipe(str(path))
    message = exc.value.message
    assert "\n" not in message
    assert message.startswith(f"recipe {path}/{key}: ")
    assert said in message


def test_a_model_only_recipe_names_the_first_missing_knob(tmp_path):
    path = tmp_path / "qwen3-8b.toml"
    path.write_text('name = "qwen3-8b"\n[defaults]\nSERVED_MODEL_NAME = "Qwen3-8B"\nMODEL_REPO = "Qwen/Qwen3-8B"\n')
    with pytest.raises(UsageError) as exc:
        load_recipe(str(path))
    assert exc.value.message == (f"recipe {path}/defaults/TP: missing, expected a whole number from 1 to 1024 "
                                 "(Tensor-parallel size (one GPU per rank on GB10))")


def _toml(data: dict, prefix: str = "") -> str:
    """A TOML writer for recipe documents (tables, arrays of tables, scalars, lists): the test's own."""
    lines, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            tables.append((key, value))
        else:
            lines.append(f"{json.dumps(key)} = {json.dumps(value)}")
    out = "\n".join(lines) + "\n"
    for key, value in tables:
        name = f"{prefix}{json.dumps(key)}"
        if isinstance(value, list):
            for item in value:
                out += f"[[{name}]]\n" + _toml(item, f"{name}.")
        else:
            out += f"[{name}]\n" + _toml(value, f"{name}.")
    return out


def test_the_toml_writer_round_trips_every_shipped_recipe():
    for name in SHIPPED:
        data = tomllib.loads(Path(recipes_dir() / f"{name}.toml").read_text())
        assert tomllib.loads(_toml(data)) == data
