"""`sparkctl recipe list | show | validate | new` as a user runs them: the shipped recipes listed and shown,
a broken file refused in one line (exit 2), and `new` from a local checkpoint folder and from a Hub repo id
whose config.json comes from a stubbed downloader (the network is never used)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from sparkctl.orchestrate import recipe as orchestrate_recipe
from sparkctl.spec.recipes import available_recipes
from tests.conftest import run_cli, write_model

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for key in ("SPARKCTL_ENV_FILE", "RECIPE", "NODES", "MODEL"):
        monkeypatch.delenv(key, raising=False)


def test_list_names_every_shipped_recipe(capsys):
    rc, out, _ = run_cli(["--json", "recipe", "list"], capsys)
    assert rc == 0
    assert [r["name"] for r in json.loads(out)["recipes"]] == available_recipes()


def test_show_prints_the_file(capsys):
    rc, out, _ = run_cli(["recipe", "show", "glm53-exl3-tp4"], capsys)
    assert rc == 0 and tomllib.loads(out)["name"] == "glm53-exl3-tp4"


def test_validate_refuses_a_model_only_recipe_in_one_line(capsys, tmp_path):
    path = tmp_path / "qwen3-8b.toml"
    path.write_text('name = "qwen3-8b"\n[defaults]\nSERVED_MODEL_NAME = "Qwen3-8B"\nMODEL_REPO = "Qwen/Qwen3-8B"\n')
    rc, out, err = run_cli(["recipe", "validate", str(path)], capsys)
    assert rc == 2
    first = err.strip().splitlines()[0]
    assert first == (f"error: recipe {path}/defaults/TP: missing, expected a whole number from 1 to 1024 "
                     "(Tensor-parallel size (one GPU per rank on GB10))")
    assert "internal error" not in err and "Traceback" not in err


def test_plan_with_that_recipe_is_the_same_one_line_not_an_internal_error(capsys, tmp_path):
    path = tmp_path / "qwen3-8b.toml"
    path.write_text('name = "qwen3-8b"\n[defaults]\nSERVED_MODEL_NAME = "Qwen3-8B"\n')
    model = write_model(tmp_path / "m", 1000, 1, config=json.loads((CONFIGS / "qwen3-4b.json").read_text()))
    rc, _, err = run_cli(["--recipe", str(path), "--nodes", "a b", "--model", str(model), "plan", "--local"], capsys)
    assert rc == 2 and "defaults/TP: missing" in err and "internal error" not in err


def test_validate_runs_the_knobs_rules_on_the_defaults(capsys, tmp_path):
    text = (Path(orchestrate_recipe.__file__).parents[1] / "recipes" / "lab-vllm.toml").read_text()
    path = tmp_path / "bad-image.toml"
    path.write_text(text.replace('IMAGE = "sparkctl-lab/vllm-chain:cpu"', 'IMAGE = "not an image"'))
    rc, _, err = run_cli(["recipe", "validate", str(path)], capsys)
    assert rc == 2 and f"recipe {path}/defaults/IMAGE: " in err and "a Docker image reference" in err


@pytest.mark.parametrize("name", available_recipes())
def test_every_shipped_recipe_validates(capsys, name):
    rc, out, _ = run_cli(["recipe", "validate", name], capsys)
    assert rc == 0 and out.strip() == f"{name}: valid"


def test_new_from_a_local_folder_writes_a_recipe_that_validates(capsys, tmp_path):
    model = write_model(tmp_path / "Qwen3-4B", 8_044_000_000, 3,
                        config=json.loads((CONFIGS / "qwen3-4b.json").read_text()))
    out_file = tmp_path / "qwen3.toml"
    rc, out, err = run_cli(["recipe", "new", "--model", str(model), "--nodes", "2", "--out", str(out_file)], capsys)
    assert rc == 0, err
    assert out.startswith(f"wrote {out_file}: qwen3-4b-tp2, TP=2")
    rc, out, _ = run_cli(["recipe", "validate", str(out_file)], capsys)
    assert rc == 0
    rc, _, err = run_cli(["recipe", "new", "--model", str(model), "--out", str(out_file)], capsys)
    assert rc == 2 and "exists" in err  # never overwritten


def test_new_refuses_nodes_the_heads_do_not_divide(capsys, tmp_path):
    model = write_model(tmp_path / "Qwen3-4B", 8_044_000_000, 3,
                        config=json.loads((CONFIGS / "qwen3-4b.json").read_text()))
    rc, out, err = run_cli(["recipe", "new", "--model", str(model), "--nodes", "3"], capsys)
    assert rc == 2 and out == ""
    assert "num_attention_heads=32 is not divisible by TP=3" in err


def test_new_from_a_hub_repo_reads_only_config_json(capsys, tmp_path, monkeypatch):
    asked: list[tuple[str, str]] = []
    cfg = tmp_path / "dl" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text((CONFIGS / "gpt-oss-20b.json").read_text())

    def download(repo: str, filename: str) -> Path | None:
        asked.append((repo, filename))
        return cfg if filename == "config.json" else None

    def listing(repo: str) -> dict[str, int]:
        return {"config.json": 1805, "model-00000-of-00002.safetensors": 4_625_017_896,
                "model-00001-of-00002.safetensors": 4_115_586_736, "model-00002-of-00002.safetensors": 4_055_141_184}

    monkeypatch.setattr(orchestrate_recipe, "hub_downloader", download)
    monkeypatch.setattr(orchestrate_recipe, "hub_lister", listing)
    rc, out, err = run_cli(["--json", "recipe", "new", "--model", "openai/gpt-oss-20b", "--nodes", "2"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert asked == [("openai/gpt-oss-20b", "config.json")]  # no weight, no other file
    assert doc["name"] == "gpt-oss-20b-tp2" and doc["max_model_len"] == 131072
    assert doc["weights_per_rank"] == (4_625_017_896 + 4_115_586_736 + 4_055_141_184 + 1) // 2
    text = doc["text"]
    assert 'MODEL_REPO = "openai/gpt-oss-20b"' in text and "sliding window 128" in text


def test_new_like_a_shipped_recipe_writes_one_that_validates_and_refuses_what_cannot_be(capsys, tmp_path):
    model = write_model(tmp_path / "Qwen3-4B", 8_044_000_000, 3,
                        config=json.loads((CONFIGS / "qwen3-4b.json").read_text()))
    out_file = tmp_path / "like.toml"
    rc, out, err = run_cli(["recipe", "new", "--model", str(model), "--like", "lab-vllm", "--out", str(out_file)],
                           capsys)
    assert rc == 0, err
    assert tomllib.loads(out_file.read_text())["defaults"]["NODE_MEMORY_BYTES"] == 16_000_000_000
    assert run_cli(["recipe", "validate", str(out_file)], capsys)[0] == 0
    rc, out, err = run_cli(["recipe", "new", "--model", str(model), "--like", "nosuch"], capsys)
    assert rc == 2 and out == "" and "--like nosuch: no such recipe" in err and "Traceback" not in err
    rc, out, err = run_cli(["recipe", "new", "--model", str(model), "--like", "lab-vllm",
                            "--image", "vllm/vllm-openai@sha256:" + "a" * 64], capsys)
    assert rc == 2 and "--like and --image" in err
