"""`sparkctl config`: the resolved settings, each with its source; secrets redacted."""

from __future__ import annotations

import click
from rich.table import Table

from ..output import console, emit_json, warn
from ..spec.settings import REDACTED, knob_doc


@click.command("config")
@click.pass_obj
def command(g: object) -> None:
    """Show every resolved setting and where its value came from (secrets are [REDACTED])."""
    from ..options import Globals

    assert isinstance(g, Globals)
    s = g.settings()
    warn(s.warnings)
    data = s.as_dict(redact=True)
    if g.json:
        emit_json({"recipe": s.recipe.name, "env_file": str(s.env_file) if s.env_file else None,
                   "settings": data, "warnings": s.warnings})
        return
    table = Table(title=f"sparkctl settings (recipe {s.recipe.name})", title_justify="left")
    table.add_column("key", style="bold")
    table.add_column("value", overflow="fold")
    table.add_column("source", style="dim")
    for key, item in data.items():
        value = item["value"]
        shown = " ".join(value) if isinstance(value, list) else ("" if value is None else str(value))
        table.add_row(key, shown if shown != REDACTED else f"[red]{REDACTED}[/]", item["source"])
    c = console(False)
    c.print(table)
    if g.verbosity > 0:
        for key in data:
            c.print(f"  {key}: {knob_doc(key, s.container_env_prefixes()) or ''}")
