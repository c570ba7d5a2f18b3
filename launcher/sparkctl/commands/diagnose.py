"""`sparkctl diagnose [--out FILE] [--json]`: one redacted, bounded .tar.gz for a bug report.

The flow is orchestrate/diagnose.py (what is gathered, from where, how it is redacted and capped). Here:
the flags and the report. It works with the service down, a node unreachable or the head gone: what
could not be gathered is in the manifest, with why. `--json` prints the manifest.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

import click

from ..errors import UsageError
from ..orchestrate import diagnose as D
from ..output import console, emit_json, warn
from .common import globals_of, settings_of


@click.command("diagnose")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The archive to write (default: sparkctl-diagnose-<cluster>-<UTC time>.tar.gz here).")
@click.option("--tail", type=click.IntRange(1, 100000), default=200, show_default=True,
              help="Log lines per container (and audit lines per node).")
@click.option("--kernel-lines", type=click.IntRange(1, 100000), default=200, show_default=True,
              help="The kernel's OOM/Xid/NVRM/mlx5 lines per node, at most.")
@click.option("--timeout", type=click.FloatRange(1, 600), default=20.0, show_default=True,
              help="Per-node timeout of each remote command, s.")
@click.option("--file-cap", type=click.IntRange(1024), default=D.FILE_CAP, show_default=True,
              help="Bytes per file at most (the last bytes are kept).")
@click.option("--archive-cap", type=click.IntRange(4096), default=D.TOTAL_CAP, show_default=True,
              help="Bytes of files in the archive at most.")
@click.option("--no-check", is_flag=True, help="Leave out `check` (its probes and the argv judge).")
@click.pass_context
def command(ctx: click.Context, out: Path | None, tail: int, kernel_lines: int, timeout: float, file_cap: int,
            archive_cap: int, no_check: bool) -> None:
    """Collect one redacted bundle for a bug report: check, status, lock, history, audit, every node's
    versions, fabric ports, kernel lines and the ranks' state and logs, with a manifest."""
    g = globals_of(ctx)
    s = settings_of(g)
    if out is not None and out.exists() and out.is_dir():
        raise UsageError(f"--out {out}: is a directory", fix="give a file name, e.g. --out bundle.tar.gz")
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = out or Path(f"sparkctl-diagnose-{s.cluster_name}-{stamp}.tar.gz")
    local = [p for p in (s.env_file, Path("env/env.tp4")) if p is not None and Path(p).is_file()]
    bundle = D.collect(s, g.ssh_config_path(), tail=tail, klines=kernel_lines, timeout=timeout,
                       local_files=[Path(p) for p in local], with_check=not no_check)
    manifest = D.write_archive(bundle, out, list(s.secrets().values()), file_cap=file_cap,
                               total_cap=archive_cap, cluster=s.cluster_name, nodes=s.nodes)
    manifest["archive"] = str(out)
    if g.json:
        emit_json(manifest)
        return
    missing = [f for f in manifest["files"] if f.get("missing")]
    c = console(False)
    c.print(f"wrote {out}: {len(manifest['files']) - len(missing)} files, redacted "
            f"(caps: {file_cap} bytes a file, {archive_cap} in all); attach it to the bug report", markup=False)
    for n, why in manifest["unreachable"].items():
        warn([f"{n}: unreachable, its files are missing: {why}"])
    if missing:
        warn([f"{len(missing)} file(s) missing (the manifest says why): "
              + ", ".join(f["path"] for f in missing[:8]) + (" …" if len(missing) > 8 else "")])
