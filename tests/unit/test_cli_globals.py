"""Global options after the command (`sparkctl plan --json`), shell completion, NO_COLOR."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from sparkctl.cli import _recipe_names, cli
from sparkctl.output import console
from tests.conftest import write_model


def test_global_options_work_after_the_command_too(clean_env, tmp_path):
    model = write_model(tmp_path / "m", 308_000_000_000, 41)
    env = {"NODES": "a b c d"}
    before = CliRunner().invoke(cli, ["--json", "--model", str(model), "plan", "--local"], env=env)
    after = CliRunner().invoke(cli, ["plan", "--local", "--json", "--model", str(model)], env=env)
    assert before.exit_code == after.exit_code == 0, after.output
    assert json.loads(after.stdout) == json.loads(before.stdout)
    assert json.loads(after.stdout)["plan"]["kv_cache_memory_bytes"] == 15_569_972_224


def test_recipe_and_nodes_after_the_command_reach_the_settings(clean_env, tmp_path):
    model = write_model(tmp_path / "m", 1000, 2)
    r = CliRunner().invoke(cli, ["config", "--json", "--nodes", "x1 x2 x3 x4", "--model", str(model),
                                 "--recipe", "glm53-exl3-2.75bpw"], env={})
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    text = json.dumps(doc)
    assert "glm53-exl3-2.75bpw" in text and "x1 x2 x3 x4" in text.replace('", "', " ")


def test_an_unknown_option_is_still_a_usage_error():
    r = CliRunner().invoke(cli, ["plan", "--jsn"], env={})
    assert r.exit_code == 2 and "No such option" in r.output


def test_recipe_completion_lists_the_shipped_recipes():
    assert _recipe_names(None, None, "glm") == ["glm53-exl3-2.75bpw", "glm53-exl3-tp4"]  # type: ignore[arg-type]
    out = subprocess.run([sys.executable, "-m", "sparkctl", "--recipe", "la"], capture_output=True, text=True,
                         env={**os.environ, "_SPARKCTL_COMPLETE": "bash_complete", "COMP_WORDS": "sparkctl --recipe la",
                              "COMP_CWORD": "2"}, timeout=60)
    assert out.stdout.split() == ["plain,lab"]


def test_no_color_is_honoured(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert console(False).no_color
    monkeypatch.delenv("NO_COLOR")
    assert not console(False).no_color
