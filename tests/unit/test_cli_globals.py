"""Global options after the command (`sparkctl plan --json`), shell completion, NO_COLOR."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator

import click
from click.testing import CliRunner

from sparkctl.cli import COMMANDS, _recipe_names, cli
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


def _every_command(cmd: click.Command, ctx: click.Context) -> Iterator[tuple[click.Command, click.Context]]:
    yield cmd, ctx
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            assert sub is not None, name
            yield from _every_command(sub, click.Context(sub, info_name=name, parent=ctx))


def test_no_parameter_name_is_shared_by_a_command_and_a_global_option():
    """The global options' hidden copies on each command must not share a param name with the command's own
    parameters: trust's NODE... argument (`nodes`) did, and click warned three times on every `sparkctl trust`."""
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # click's "used by an argument and another parameter" fails the test
        for cmd, ctx in _every_command(cli, click.Context(cli, info_name="sparkctl")):
            cmd.make_parser(ctx)
            cmd.get_help(ctx)
            names = [p.name for p in cmd.get_params(ctx)]
            assert len(names) == len(set(names)), (ctx.command_path, names)
            r = CliRunner().invoke(cli, [*ctx.command_path.split()[1:], "--help"], env={})
            assert r.exit_code == 0 and r.exception is None, (ctx.command_path, r.exception, r.output)
            seen.add(ctx.command_path)
    assert {f"sparkctl {name}" for name in COMMANDS} <= seen


def test_recipe_completion_lists_the_shipped_recipes():
    assert _recipe_names(None, None, "glm") == ["glm53-exl3-2.75bpw", "glm53-exl3-tp4"]  # type: ignore[arg-type]
    out = subprocess.run([sys.executable, "-m", "sparkctl", "--recipe", "la"], capture_output=True, text=True,
                         env={**os.environ, "_SPARKCTL_COMPLETE": "bash_complete", "COMP_WORDS": "sparkctl --recipe la",
                              "COMP_CWORD": "2"}, timeout=60)
    assert out.stdout.split() == ["plain,lab", "plain,lab-vllm"]


def test_no_color_is_honoured(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert console(False).no_color
    monkeypatch.delenv("NO_COLOR")
    assert not console(False).no_color


def _command_names(group: click.Group, ctx: click.Context) -> set[str]:
    """Every command's and subcommand's click name under `group` (what `ctx.info_name` is when it runs)."""
    names: set[str] = set()
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        names.add(name)
        if isinstance(command, click.Group):
            names |= _command_names(command, click.Context(command, info_name=name, parent=ctx))
    return names


def test_every_name_that_changes_the_cluster_is_a_real_command():
    """options.CHANGES_CLUSTER holds click names (`model sync` is "sync"); a name no command has turns strict
    env-file keys on for nothing and hides which command was meant."""
    from sparkctl.options import CHANGES_CLUSTER

    names = _command_names(cli, click.Context(cli, info_name="sparkctl"))
    assert {"up", "sync", "systemd"} <= names  # the walk reaches subcommands
    assert sorted(CHANGES_CLUSTER - names) == []
