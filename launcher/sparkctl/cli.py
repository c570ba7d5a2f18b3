"""The `sparkctl` command line.

Global options go before the command (`sparkctl --env-file X check`) or after it, as click users expect
(`sparkctl check --json`); a command's own option of the same name wins. Each command lives in its own
module under sparkctl/commands/ and is imported only when it runs, so `sparkctl --help` is fast and
a command that is missing its optional parts cannot break the others.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from typing import Any

import click

from . import __version__, output, signals
from .completion import node_names
from .errors import SparkctlError, UsageError, failure_document
from .options import Globals, globals_from, line_globals
from .signals import signal_name

# command name -> (module under sparkctl.commands, one-line help shown by `sparkctl --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("config", "Show the resolved settings and where each value came from."),
    "plan": ("plan", "Plan memory per rank and the exact KV-cache bytes (offline)."),
    "recipe": ("recipe", "List, show, validate shipped recipes; write one from a checkpoint's config.json."),
    "render": ("render", "Render env.tp4 and the per-rank docker/vllm command lines (offline)."),
    "setup": ("setup", "Plan (and with --yes apply) what fresh nodes need: fabric addresses, sudoers, limits, earlyoom."),
    "check": ("check", "Preflight every node in parallel; write env.tp4 with the discovered pins."),
    "nccl-report": ("nccl_report", "Explain NCCL_DEBUG=INFO logs: per rank NCCL version, transport, findings."),
    "verify-model": ("verify_model", "Verify the checkpoint's layout and EXL3 ABI from its headers."),
    "model": ("model", "Pull the checkpoint to the head (Hub) and sync it to the ranks, node to node."),
    "build": ("build", "Build the image chain on every rank (or once, shipping missing layers)."),
    "endpoint": ("endpoint", "Render nginx.conf: one OpenAI endpoint over every replica's head (offline)."),
    "bake": ("bake", "Render docker-bake.hcl for CI builds of the image chain (linux/arm64)."),
    "deploy": ("deploy", "Pull, sync, check, build, up, wait: what is not done yet (--plan, then --yes)."),
    "up": ("lifecycle", "Start the service: workers, then the head."),
    "wait": ("lifecycle", "Wait until the service answers a real completion."),
    "status": ("lifecycle", "Report every rank's container and the head's health."),
    "logs": ("lifecycle", "Show or follow the ranks' logs, prefixed by rank."),
    "down": ("lifecycle", "Stop the service: head first, then workers."),
    "lock": ("lifecycle", "Show or break the cluster lock."),
    "audit": ("lifecycle", "Show the audit lines sparkctl wrote on every node."),
    "watch": ("watch", "Supervise the service: restart the whole group when a rank, the head or a node fails."),
    "diagnose": ("diagnose", "Collect one redacted bundle for a bug report (check, status, logs, versions, kernel lines)."),
    "history": ("history", "List the services `up` started on this cluster: when, by whom, image, config."),
    "rollback": ("history", "Bring a previous image and config back up (the last one, or --to N|HASH)."),
    "exec": ("rank_exec", "Run a command (argv) in a rank's container."),
    "export": ("export", "Export the supervisor as a systemd unit on the head (`export systemd`)."),
    "trust": ("trust", "Show a node's host key and record it in known_hosts."),
    "bench": ("bench", "Measure decode tok/s, TTFT and accepted tokens/step on a running service."),
    "lab": ("lab", "Build or remove the built-in lab cluster (root)."),
}


def _recipe_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion for --recipe: the recipes sparkctl ships."""
    from .spec.resources import recipes_dir

    return [n for n in sorted(p.stem for p in recipes_dir().glob("*.toml")) if n.startswith(incomplete)]


# The global options, declared once: on the group, and again on every command (see _with_globals).
_GLOBALS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--env-file",), dict(metavar="PATH", help="Cluster env file (else $SPARKCTL_ENV_FILE, else env/cluster.env).")),
    (("--nodes",), dict(metavar="'H1 H2 ...'", help="SSH host aliases, head first (env: NODES).",
                        shell_complete=node_names)),
    (("--model",), dict(metavar="DIR", help="Checkpoint folder, same path on every node (env: MODEL).")),
    (("--recipe",), dict(metavar="NAME", help="Recipe name or path to a recipe file (env: RECIPE).",
                         shell_complete=_recipe_names)),
    (("--ssh-config",), dict(metavar="PATH", help="ssh_config with the node aliases (env: SPARKCTL_SSH_CONFIG).")),
    (("--events",), dict(metavar="FILE|-", help="Write one JSON line per event of long work to FILE (- : stdout).")),
    (("--json", "as_json"), dict(is_flag=True, help="Print exactly one JSON document on stdout.")),
    (("-v", "--verbose"), dict(count=True, help="More detail (-vv shows tracebacks).")),
    (("-q", "--quiet"), dict(is_flag=True, help="Only errors.")),
]


# The param name of a global option's hidden copy on a command: global_<name>, so it never shares a
# name with the command's own parameters (trust's NODE... argument is `nodes`: click warned on every run).
_HIDDEN_PREFIX = "global_"


def _set_global(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """A global option given after the command: fold it into the Globals the group made."""
    g = ctx.find_object(Globals)
    if g is None and ctx.resilient_parsing:  # click completing the line: the group's callback did not run
        g = line_globals(ctx)
    if g is None or value in (None, False, 0):
        return
    name = str(param.name).removeprefix(_HIDDEN_PREFIX)
    if name == "as_json":
        g.json = True
    elif name == "verbose":
        g.verbosity = max(g.verbosity, 0) + int(value)
    elif name == "quiet":
        g.verbosity = -1
    else:
        setattr(g, str(name), value)


def _with_globals(cmd: click.Command) -> click.Command:
    """Let `cmd` (and a group's subcommands) take the global options too, unless it has its own."""
    taken = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    for decls, attrs in _GLOBALS:
        opts = [d for d in decls if d.startswith("-")]
        if taken & set(opts):
            continue
        name = _HIDDEN_PREFIX + str(click.Option(list(decls)).name)  # global_nodes, global_as_json, ...
        cmd.params.append(click.Option([*opts, name], expose_value=False, callback=_set_global, hidden=True,
                                       **attrs))
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _with_globals(sub)
    return cmd


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module_name, help_text = COMMANDS[cmd_name]
        try:
            module = importlib.import_module(f"sparkctl.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"sparkctl.commands.{module_name}":
                raise
            return _not_built(cmd_name, help_text)
        cmd = getattr(module, "COMMANDS", {}).get(cmd_name) or getattr(module, "command", None)
        if cmd is None:
            return _not_built(cmd_name, help_text)
        if not getattr(cmd, "_sparkctl_globals", False):
            _with_globals(cmd)
            cmd._sparkctl_globals = True
        return cmd  # type: ignore[no-any-return,unused-ignore]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help from the table, so listing commands imports none of them.
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_text) for name, (_, help_text) in COMMANDS.items()])


def _not_built(name: str, help_text: str) -> click.Command:
    @click.command(name=name, help=help_text + " (not built yet)", context_settings={"ignore_unknown_options": True})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def stub(args: tuple[str, ...]) -> None:
        raise UsageError(f"`sparkctl {name}` is not built yet in this version ({__version__})")

    return stub


def _global_options(f: Any) -> Any:
    for decls, attrs in reversed(_GLOBALS):
        f = click.option(*decls, **attrs)(f)
    return f


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@_global_options
@click.version_option(__version__, prog_name="sparkctl")
@click.pass_context
def cli(
    ctx: click.Context,
    env_file: str | None,
    nodes: str | None,
    model: str | None,
    recipe: str | None,
    ssh_config: str | None,
    events: str | None,
    as_json: bool,
    verbose: int,
    quiet: bool,
) -> None:
    """sparkctl: bring up a multi-node vLLM service on GPU nodes over SSH and Docker."""
    ctx.obj = globals_from(ctx.params)


def main(argv: list[str] | None = None) -> None:
    """Entry point: maps sparkctl's errors to exit codes and never shows a user a traceback."""
    try:
        _main(argv)
    finally:
        # The command is over, whatever its status: a signal from now on (while the interpreter joins
        # threads and exits) is noted and changes nothing, neither the cluster nor the exit status.
        signals.commit()


def _wants_json(words: list[str]) -> bool:
    """Was the command given --json (a global or a command's own)? Read from the words, not from what click
    parsed: a line click refuses (an unknown option, a bad value) still gets its document. Words after
    `--` are another program's (`exec -- CMD --json`)."""
    return "--json" in (words[:words.index("--")] if "--" in words else words)


def _json_failure(wanted: bool, doc: dict[str, Any]) -> None:
    """`--json` promises one document on stdout: a failing command ends with the failure's, of the one shape
    (errors.failure_document: ok false, error, fix, node, failures, exit_code). Never a second document."""
    if wanted and not output.documents_emitted():
        if set(doc) >= {"ok", "error", "fix", "node", "failures", "exit_code"}:
            output.emit_json(doc)
        else:
            output.emit_json(failure_document(doc["error"], exit_code=doc["exit_code"], fix=doc.get("fix")))


def _main(argv: list[str] | None) -> None:
    words = list(sys.argv[1:] if argv is None else argv)
    verbose = "-vv" in words
    as_json = _wants_json(words)
    output.reset_documents()
    signals.reset()  # one command per call (tests call main() many times in one process)
    signals.install()  # SIGTERM and SIGHUP roll back and release the lock like Ctrl-C (signals.py)
    try:
        rv = cli.main(args=argv, prog_name="sparkctl", standalone_mode=False)
    except click.exceptions.Abort as exc:  # click wraps KeyboardInterrupt (so signals.Interrupted) in Abort
        cause = exc.__cause__
        name = cause.name if isinstance(cause, signals.Interrupted) else "SIGINT"
        code = cause.exit_code if isinstance(cause, signals.Interrupted) else 130
        click.echo(f"interrupted ({name})", err=True)
        _json_failure(as_json, {"error": f"interrupted ({name})", "exit_code": code})
        sys.exit(code)
    except signals.CleanupAborted as exc:  # the cleaner has said what it left where
        click.echo(f"aborted by a third signal ({signal_name(exc.signum)})", err=True)
        _json_failure(as_json, {"error": f"aborted by a third signal ({signal_name(exc.signum)})",
                                "exit_code": 128 + exc.signum})
        sys.exit(128 + exc.signum)
    except click.exceptions.Exit as exc:
        if exc.exit_code:  # a command's own status (help and --version exit 0 and print no document)
            _json_failure(as_json, {"error": _status_words(exc.exit_code), "exit_code": exc.exit_code})
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        code = 2 if isinstance(exc, click.UsageError | click.BadParameter) else exc.exit_code
        where = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx else "sparkctl"
        _json_failure(as_json, {"error": exc.format_message(), "fix": f"see `{where} --help`", "exit_code": code})
        sys.exit(code)
    except SparkctlError as exc:
        if not exc.shown:
            click.echo(f"error: {exc}", err=True)
        _json_failure(as_json, exc.to_json())
        sys.exit(exc.exit_code)
    except KeyboardInterrupt as exc:
        code = exc.exit_code if isinstance(exc, signals.Interrupted) else 130
        click.echo(f"interrupted ({signal_name(code - 128)})", err=True)
        _json_failure(as_json, {"error": f"interrupted ({signal_name(code - 128)})", "exit_code": code})
        sys.exit(code)
    except SystemExit as exc:  # a command that ended itself (sys.exit(1) after saying why on stderr)
        if exc.code not in (0, None):
            code = exc.code if isinstance(exc.code, int) else 1
            _json_failure(as_json, {"error": _status_words(code), "exit_code": code})
        raise
    except Exception as exc:  # a bug in sparkctl: one line, the traceback only on request
        if verbose:
            traceback.print_exc()
        click.echo(f"internal error: {type(exc).__name__}: {exc} (run with -vv for the traceback)", err=True)
        _json_failure(as_json, {"error": f"internal error: {type(exc).__name__}: {exc}", "exit_code": 1,
                                "fix": "run with -vv for the traceback, and report this bug"})
        sys.exit(1)
    code = rv if isinstance(rv, int) else 0  # click hands a command's ctx.exit(N) back as its return value
    if code:
        _json_failure(as_json, {"error": _status_words(code), "exit_code": code})
    sys.exit(code)


def _status_words(code: int) -> str:
    """A status a command gave without raising its reason (commands raise a SparkctlError; this is the
    net under them): the last warning it printed, else the status itself."""
    if code > 128:
        return f"interrupted ({signal_name(code - 128)})"
    said = output.last_said()
    return said if said else f"the command ended with exit status {code} without saying why"


if __name__ == "__main__":
    main()
