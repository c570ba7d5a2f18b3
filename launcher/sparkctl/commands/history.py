"""`sparkctl history` and `sparkctl rollback`: the releases `up` recorded, and bringing one back.

The flows: orchestrate/history.py (read the head's history) and orchestrate/rollback.py (pick an
entry, resolve its knobs, `start_service` under the lock). Here: the flags and the printing.
"""

from __future__ import annotations

import click

from ..orchestrate import history
from ..orchestrate.rollback import rollback
from ..output import console, emit_json, warn
from ..spec.settings import Settings
from .common import globals_of, one_replica, settings_of


@click.command("history")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True,
              help="Show this many entries at most, newest first.")
@click.pass_context
def history_cmd(ctx: click.Context, limit: int) -> None:
    """What `up` started on this cluster, newest first: when, by whom, image content hash, config."""
    g = globals_of(ctx)
    s = settings_of(g)
    releases = history.releases(s, g.ssh_config_path(), limit)
    if g.json:
        emit_json({"cluster": s.cluster_name, "history": [r.as_dict() for r in releases]})
        return
    out = console(False)
    if not releases:
        out.print(f"cluster {s.cluster_name}: no history yet (`up` records every service it starts)", markup=False)
    for r in releases:
        out.print(f"{r.n:>3}  {r.when}  {r.who}  config {r.config_hash}  image {r.image} "
                  f"content {(r.image_content_hash or 'unknown')[:12]}  ({r.source})", markup=False)


@click.command("rollback")
@click.option("--to", "to", metavar="N|HASH", help="History entry number (1 = newest) or a config/content hash.")
@click.pass_context
def rollback_cmd(ctx: click.Context, to: str | None) -> None:
    """Bring a previous service back (default: the one before the newest) through `up`'s own path."""
    g = globals_of(ctx)
    s0 = one_replica(settings_of(g), "rollback")
    out = console(g.json)

    def resolve(overrides: dict[str, str]) -> Settings:
        g.extra_overrides = {**g.extra_overrides, **overrides}
        return settings_of(g)

    done = rollback(s0, g.ssh_config_path(), to, resolve=resolve, say=lambda m: out.print(m, markup=False))
    s, target, outcome = done.settings, done.target, done.outcome
    doc = {"changed": outcome.changed, "config_hash": outcome.config_hash, "image": s.get("IMAGE"),
           "entry": target.as_dict()}
    if outcome.config_hash != target.config_hash:
        why = "the image is now named by its content-hash tag" if s.get("IMAGE") != target.image \
            else "the fabric pins or a secret differ from then"
        warn([f"the config hash is {outcome.config_hash}, not the recorded {target.config_hash}: {why}"])
    if g.json:
        emit_json(doc)
    else:
        out.print(f"rollback: running image {s.get('IMAGE')} with config {outcome.config_hash}"
                  + ("" if outcome.changed else " (it was already running)") + "; next: `sparkctl wait`",
                  markup=False)


COMMANDS = {"history": history_cmd, "rollback": rollback_cmd}
