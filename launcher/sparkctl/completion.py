"""Shell completion of option and argument values (click's `shell_complete` callbacks).

A callback runs on every TAB, in a process click starts for it: it is offline (no SSH connection, files
only), it prints nothing, and it never raises: whatever goes wrong (no ssh config, settings that do not
load) completes nothing. What the line said so far (`--ssh-config`, `--recipe`, `--env-file`, before
or after the command) is the Globals that `options.line_globals` rebuilds, since click only parses the line
when it completes: the group's callback, which makes the Globals of a run, does not run.

Only the standard library is imported here at module level: cli.py imports this module, and
`sparkctl --help` must stay fast.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import io
import os
import re
import shlex
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import click

Completer = Callable[[click.Context, click.Parameter, str], list[str]]


def _quiet(fn: Callable[[click.Context, click.Parameter, str], Iterable[str]]) -> Completer:
    """A completion callback that never raises, prints or warns, and keeps what starts with the word."""

    @functools.wraps(fn)
    def complete(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                return [c for c in fn(ctx, param, incomplete) if c.startswith(incomplete)]
        except Exception:
            return []

    return complete


# ------------------------------------------------------------------------------ node names

USER_SSH_CONFIG = "~/.ssh/config"
SYSTEM_SSH_CONFIG = "/etc/ssh/ssh_config"
_MAX_INCLUDE_DEPTH = 16  # OpenSSH's READCONF_MAX_DEPTH
_KEYWORD = re.compile(r"\s*([A-Za-z]+)(?:\s*=\s*|\s+)(.*)")


def ssh_host_aliases(path: str | None) -> list[str]:
    """The `Host` aliases of an ssh_config, in file order, following `Include` (globs; a relative path is
    under ~/.ssh, or /etc/ssh from the system file, as OpenSSH has it). Patterns (`*`, `?`) and negations
    (`!`) name no host and are left out. `path` as sparkctl passes it to ssh: the user's own config
    (None or ~/.ssh/config) means that file and /etc/ssh/ssh_config, as `ssh` reads both; any other
    file is `ssh -F` and the only one read. Unreadable files are skipped; this never raises."""
    user = os.path.expanduser(USER_SSH_CONFIG)
    resolved = os.path.expanduser(path) if path else user
    files = [(resolved, False)] if resolved != user else [(user, False), (SYSTEM_SSH_CONFIG, True)]
    out: dict[str, None] = {}
    for file, system in files:
        _read_hosts(file, system, 0, out)
    return list(out)


def _read_hosts(path: str, system: bool, depth: int, out: dict[str, None]) -> None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return
    for line in lines:
        m = _KEYWORD.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        keyword, rest = m.group(1).lower(), m.group(2)
        try:
            words = shlex.split(rest, comments=True)
        except ValueError:  # an unbalanced quote: ssh refuses the file; take the words as they are
            words = rest.split()
        if keyword == "host":
            for pattern in words:
                if not any(c in pattern for c in "*?!"):
                    out.setdefault(pattern, None)
        elif keyword == "include" and depth < _MAX_INCLUDE_DEPTH:
            base = "/etc/ssh" if system else os.path.expanduser("~/.ssh")
            for word in words:
                pattern = os.path.join(base, os.path.expanduser(word))  # an absolute path stays itself
                for included in sorted(glob.glob(pattern)):
                    _read_hosts(included, system, depth + 1, out)


@_quiet
def node_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """NODE arguments and --nodes: the Host aliases of the ssh config in effect. A name completes as a word
    of its own; the last name of a quoted list (--nodes 'spark1 sp<TAB>') does not: bash puts a candidate
    in place of the whole word, its opening quote included, and `spark1 spark2` there would be two words."""
    from .options import line_globals

    return ssh_host_aliases(line_globals(ctx).ssh_config_path())


# ------------------------------------------------------------------------------ image layers


@_quiet
def layer_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """build --only: the layers of the recipe in effect (--recipe, RECIPE in the environment or the env
    file, else the default), read from the recipe file; the rest of the settings need not be valid."""
    from .options import line_globals

    settings = line_globals(ctx).settings(validate=False, strict_keys=False)
    names: list[str] = settings.recipe.layer_names()
    return names


# ------------------------------------------------------------------------------ ranks


@_quiet
def rank_numbers(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """--rank: 0..N-1, N the ranks of the replica (--replica given earlier, else 0) of the settings in
    effect. Settings whose topology does not load (no NODES, NODES that do not split into TP groups, a
    TP that is not a number) complete nothing; the knobs the topology does not read (MODEL) need not be set."""
    from .options import line_globals

    replica = ctx.params.get("replica")
    settings: Any = line_globals(ctx).settings(validate=False, strict_keys=False)
    view = settings.replica(replica if isinstance(replica, int) else 0)
    return [str(r) for r in range(len(view.service.ranks))]
