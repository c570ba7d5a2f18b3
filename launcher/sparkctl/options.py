"""The global options as a command sees them: `Globals` (what --env-file, --nodes, --json ... said; a command
turns it into Settings), which commands change the cluster (`CHANGES_CLUSTER`), and `line_globals` (the same,
rebuilt from the line for shell completion). Below `cli` and `commands/` both: each imports it, it imports
neither."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import click

# Commands (by click name: `model sync` is "sync") that change the cluster: an unknown env-file key is an error.
CHANGES_CLUSTER = frozenset({"up", "down", "build", "bake", "rollback", "watch", "pull", "sync", "systemd", "deploy",
                             "setup"})
# Commands that refuse an unknown or twice-set env-file key (exit 2) where the others only warn: those that
# change the cluster, and `check`, their preflight, which must say what `up` will say, not let it through.
STRICT_KEYS = CHANGES_CLUSTER | {"check"}


@dataclass
class Globals:
    """What the global options said; commands turn it into Settings."""

    env_file: str | None = None
    nodes: str | None = None
    model: str | None = None
    recipe: str | None = None
    ssh_config: str | None = None
    json: bool = False
    verbosity: int = 0
    events: str | None = None  # --events FILE|-: one JSON line per event of long work (progress.py)
    # knobs a command's own options set (`up --image`, `rollback`): highest precedence, like flags
    extra_overrides: dict[str, str] = field(default_factory=dict)

    def cli_overrides(self) -> dict[str, str]:
        """The CLI flags that are also knobs, highest precedence."""
        out: dict[str, str] = dict(self.extra_overrides)
        if self.nodes is not None:
            out["NODES"] = self.nodes
        if self.model is not None:
            out["MODEL"] = self.model
        if self.recipe is not None:
            out["RECIPE"] = self.recipe
        return out

    def settings(self, **kwargs: Any) -> Any:
        from .spec.settings import load_settings

        # Commands that change the cluster refuse unknown env-file keys (exit 2); the others warn.
        ctx = click.get_current_context(silent=True)
        kwargs.setdefault("strict_keys", bool(ctx and ctx.info_name in STRICT_KEYS))

        return load_settings(
            env_file=self.env_file,
            cli=self.cli_overrides(),
            environ=dict(os.environ),
            **kwargs,
        )

    def ssh_config_path(self) -> str:
        if self.ssh_config:
            return self.ssh_config
        return os.environ.get("SPARKCTL_SSH_CONFIG") or os.path.expanduser("~/.ssh/config")


def globals_from(params: dict[str, Any]) -> Globals:
    """The Globals of the group's own options (their values as click parsed them)."""

    def text(name: str) -> str | None:
        value = params.get(name)
        return value if isinstance(value, str) else None  # completion: a value click could not parse

    verbose = params.get("verbose")
    return Globals(
        env_file=text("env_file"),
        nodes=text("nodes"),
        model=text("model"),
        recipe=text("recipe"),
        ssh_config=text("ssh_config"),
        events=text("events"),
        json=params.get("as_json") is True,
        verbosity=-1 if params.get("quiet") is True else verbose if isinstance(verbose, int) else 0,
    )


_LINE_GLOBALS = "sparkctl.line_globals"


def line_globals(ctx: click.Context) -> Globals:
    """What the global options on the line say, for completion callbacks: the Globals of the run when
    there is one, else (click only parses the line when it completes it) one made from the group's
    parsed options, kept in ctx.meta (shared by the whole context chain) so that the global options
    after the command fold into it too (_set_global)."""
    g = ctx.find_object(Globals)
    if g is not None:
        return g
    made = ctx.meta.get(_LINE_GLOBALS)
    if not isinstance(made, Globals):
        made = ctx.meta[_LINE_GLOBALS] = globals_from(ctx.find_root().params)
    return made
