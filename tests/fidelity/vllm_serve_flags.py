"""Write `vllm serve`'s real option table to sparkctl's data file (run in a venv with vLLM installed).

    python tests/fidelity/vllm_serve_flags.py [OUT]     # default: launcher/sparkctl/data/vllm-serve-flags.json

It builds the serve parser exactly as `vllm` builds it (FlexibleArgumentParser + ServeSubcommand) and
records, for every option string, the dest it sets, how many values it takes (argparse's nargs: null =
one value, 0 = none), the constant a value-less flag stores, and its choices. sparkctl reads the file at
run time (no vLLM needed) to refuse VLLM_EXTRA_ARGS flags it owns; the lab's stand-in builds its parser
from it. tests/fidelity/test_extra_args_rules.py checks the file still equals what this prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "launcher" / "sparkctl" / "data" / "vllm-serve-flags.json"


def serve_parser() -> argparse.ArgumentParser:
    """The `vllm serve` subparser, built the way vllm/entrypoints/cli/main.py builds it."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = top.add_subparsers(required=False, dest="subparser")
    return ServeSubcommand().subparser_init(subparsers)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)


def describe(parser: argparse.ArgumentParser) -> dict[str, Any]:
    import vllm

    options: dict[str, dict[str, Any]] = {}
    # The parser's own registry, which argparse matches against: it also holds the hidden option
    # strings (the `--no-enable-x` forms vLLM keeps out of help), which action.option_strings lacks.
    for opt, action in parser._option_string_actions.items():
        entry: dict[str, Any] = {"dest": action.dest, "nargs": action.nargs, "action": type(action).__name__}
        if action.nargs in (0, "?"):
            negative = getattr(action, "negative_option_strings", None)  # vLLM's EnableDisableAction
            if negative is not None:
                entry["const"] = opt not in negative
            elif isinstance(action, argparse.BooleanOptionalAction):
                entry["const"] = not opt.startswith("--no-")
            elif isinstance(action, argparse._HelpAction | argparse._VersionAction):
                entry["const"] = None
            else:
                entry["const"] = _jsonable(action.const)
        if action.choices is not None:
            entry["choices"] = [str(c) for c in action.choices]
        options[opt] = entry
    positionals = [a.dest for a in parser._actions if not a.option_strings]
    return {
        "vllm_version": vllm.__version__,
        "allow_abbrev": parser.allow_abbrev,
        "prefix_chars": parser.prefix_chars,
        "positionals": positionals,
        "options": dict(sorted(options.items())),
    }


def render() -> str:
    return json.dumps(describe(serve_parser()), indent=1, sort_keys=False) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render())
    print(f"wrote {out}")
