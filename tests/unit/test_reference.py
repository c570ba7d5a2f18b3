"""docs/reference.md is the command reference the code makes: regenerated in memory, it must be the file's
exact text, and every command, subcommand and option it lists has help of its own."""

from __future__ import annotations

import click

from sparkctl import reference
from sparkctl.cli import COMMANDS, cli


def test_the_reference_file_is_the_generated_reference():
    assert reference.REFERENCE_FILE.read_text() == reference.reference_text(), (
        f"docs/reference.md is stale: regenerate it with `{reference.REGENERATE}` from the repository's root")


def _walk(cmd: click.Command, path: list[str], parent: click.Context):
    ctx = click.Context(cmd, info_name=path[-1], parent=parent)
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            assert sub is not None, path + [name]
            yield from _walk(sub, [*path, name], ctx)


def _every_command():
    root = click.Context(cli, info_name="sparkctl")
    for name in COMMANDS:
        cmd = cli.get_command(root, name)
        assert cmd is not None, name
        yield from _walk(cmd, ["sparkctl", name], root)


def test_every_command_and_option_has_help_and_is_in_the_reference():
    text = reference.reference_text()
    missing = []
    for path, cmd in _every_command():
        words = " ".join(path)
        assert f"# {words}\n" in text, f"{words} is not in the reference"
        if not (cmd.help or cmd.short_help) or "(not built yet)" in (cmd.help or ""):
            missing.append(words)
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                if not p.help:
                    missing.append(f"{words} {p.opts[0]}")
                assert f"`{', '.join(p.opts)}" in text, f"{words} {p.opts[0]} is not in the reference"
    assert missing == [], "commands or options without help (their --help says nothing about them)"


def test_the_reference_does_not_depend_on_the_terminal(monkeypatch):
    first = reference.reference_text()
    monkeypatch.setenv("COLUMNS", "37")
    assert reference.reference_text() == first


def test_the_global_options_are_listed_once():
    text = reference.reference_text()
    assert text.count("`--env-file PATH`") == 1
    assert text.count("`--ssh-config PATH`") == 1
