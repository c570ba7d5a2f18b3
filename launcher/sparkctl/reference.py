"""docs/reference.md, the command reference: generated from the click commands themselves, never written by hand.

Every command and subcommand in `sparkctl --help`'s order: its usage line, its help text and each of its own
options and arguments (type, default, help); the global options once, at the top. The text depends on nothing
but the code (no terminal width, no environment), so a unit test regenerates it and compares
(tests/unit/test_reference.py). Regenerate with `python -m sparkctl.reference` from the repository's root.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import click

from .cli import COMMANDS, cli

REFERENCE_FILE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
REGENERATE = "PYTHONPATH=launcher python -m sparkctl.reference"

_HEADER = f"""\
# sparkctl command reference

Generated from the commands' own definitions by `{REGENERATE}` (from the repository's root); do not
edit it by hand: a unit test fails when it differs from what the code says. `sparkctl COMMAND --help`
prints the same text.
"""


def _text(help_text: str | None) -> str:
    """A help text as markdown paragraphs: click's `\\b` (keep-lines) markers and `\\f` tails dropped."""
    text = inspect.cleandoc(help_text or "").split("\f", 1)[0]
    return "\n".join(line for line in text.splitlines() if line.strip() != "\b").strip()


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _default(param: click.Parameter) -> str:
    value: Any = param.default
    if isinstance(param, click.Option) and param.count:
        return ""
    if value is None or value is click.core.UNSET or value == () or value == []:
        return ""
    if isinstance(param, click.Option) and param.is_flag and not param.secondary_opts:
        return "on" if value is True else ""
    if callable(value):
        return "computed when the command runs"
    if isinstance(param, click.Option) and isinstance(param.show_default, str):
        return param.show_default
    if isinstance(value, bool) and isinstance(param, click.Option) and param.secondary_opts:
        return param.opts[0] if value else param.secondary_opts[0]
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value)
    return str(value)


def _kind(param: click.Parameter) -> str:
    if isinstance(param, click.Option):
        if param.count:
            return "count (repeatable)"
        if param.is_flag:
            return "flag"
    t = param.type
    if isinstance(t, click.Choice):
        kind = "one of " + ", ".join(str(c) for c in t.choices)
    elif isinstance(t, click.Path):
        kind = "path"
    elif isinstance(t, click.IntRange | click.FloatRange):
        kind = _range(t)
    else:
        kind = {"text": "text", "integer": "integer", "float": "number", "boolean": "true|false"}.get(t.name, t.name)
    if param.multiple if isinstance(param, click.Option) else False:
        kind += ", repeatable"
    if param.nargs == -1:
        kind += ", any number"
    return kind


def _range(t: click.IntRange | click.FloatRange) -> str:
    kind = "integer" if isinstance(t, click.IntRange) else "number"
    low = None if t.min is None else ("above " if t.min_open else "at least ") + str(t.min)
    high = None if t.max is None else ("below " if t.max_open else "at most ") + str(t.max)
    if t.min is not None and t.max is not None and not t.min_open and not t.max_open:
        return f"{kind}, {t.min} to {t.max}"
    return ", ".join([kind, *(b for b in (low, high) if b)])


def _param_line(param: click.Parameter, ctx: click.Context) -> str:
    if isinstance(param, click.Argument):
        name = param.make_metavar(ctx)
        what = ["argument", _kind(param), "required" if param.required else "optional"]
        help_text = ""
    else:
        assert isinstance(param, click.Option)
        names = " / ".join(", ".join(opts) for opts in (param.opts, param.secondary_opts) if opts)
        metavar = "" if param.is_flag or param.count else " " + param.make_metavar(ctx)
        name = names + metavar
        what = [_kind(param)]
        if param.required:
            what.append("required")
        help_text = _one_line(_text(param.help))
    default = _default(param)
    if default:
        what.append(f"default: `{default}`")
    return f"- `{name}` ({'; '.join(what)})" + (f": {help_text}" if help_text else "")


def _section(cmd: click.Command, path: list[str], parent: click.Context, out: list[str]) -> None:
    ctx = click.Context(cmd, info_name=path[-1], parent=parent, terminal_width=100, max_content_width=100)
    out += ["", f"{'#' * min(len(path), 4)} {' '.join(path)}", "", "```",
            f"Usage: {' '.join(path)} {' '.join(cmd.collect_usage_pieces(ctx))}".rstrip(), "```", ""]
    out.append(_text(cmd.help) or _text(cmd.short_help))
    params = [p for p in cmd.params if not getattr(p, "hidden", False) and p.name != "help"]
    if params:
        out += ["", "Options and arguments:", ""]
        out += [_param_line(p, ctx) for p in params]
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                _section(sub, [*path, name], ctx, out)


def reference_text() -> str:
    """docs/reference.md's exact text."""
    root = click.Context(cli, info_name="sparkctl", terminal_width=100, max_content_width=100)
    out = [_HEADER.rstrip(), "", "## sparkctl", "", "```",
           f"Usage: sparkctl {' '.join(cli.collect_usage_pieces(root))}", "```", "", _text(cli.help), "",
           "Global options: given before the command or after it (`sparkctl --json status`, "
           "`sparkctl status --json`); a command's own option of the same name wins.", ""]
    out += [_param_line(p, root) for p in cli.params]
    out += ["- `-h, --help` (flag): Show the help and exit (every command and subcommand takes it).", "",
            "Commands:", ""]
    out += [f"- [`{name}`](#sparkctl-{name}): {help_text}" for name, (_, help_text) in COMMANDS.items()]
    for name in COMMANDS:
        cmd = cli.get_command(root, name)
        assert cmd is not None
        _section(cmd, ["sparkctl", name], root, out)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0]) if args else REFERENCE_FILE
    if not target.parent.is_dir():  # an installed sparkctl: no checkout's docs/ beside it
        sys.exit(f"{target.parent} is not a folder: give the file to write (python -m sparkctl.reference FILE)")
    target.write_text(reference_text())
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
