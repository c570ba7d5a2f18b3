"""`sparkctl endpoint [--out PATH] [--listen PORT] [--bind ADDR] [--state-dir DIR] [--print]`: nginx.conf for
one OpenAI endpoint over every replica's head (offline: only `ssh -G` runs, to resolve the heads' aliases).

The heads are `endpoint.heads_of(settings)`, each at the HostName the user's ssh config gives its alias:
the address this machine reaches it at. Run nginx here, or on any host that reaches the heads at those
addresses (README, "One endpoint over replicas"). The API key is never written: clients send it and
nginx passes it through to the heads, which check it.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import click

from ..output import console, emit_json, warn
from ..spec.nginx_conf import heads_of, nginx_config
from ..spec.settings import Settings

DEFAULT_OUT = Path("env/nginx.conf")


def render_endpoint(settings: Settings, ssh_config_path: str, *, listen: int | None, bind: str | None,
                    state_dir: str | None) -> tuple[str, dict[str, Any]]:
    """The nginx.conf text and what it says (for --json): heads resolved through the ssh config."""
    from ..cluster import load_ssh_config, resolve_target

    config, config_path = load_ssh_config(ssh_config_path)
    aliases: list[str] = []

    def resolve(alias: str) -> str:
        aliases.append(alias)
        return resolve_target(alias, config, config_path).hostname

    heads = heads_of(settings, resolve)
    port = listen if listen is not None else settings.getint("PORT")
    text = nginx_config(heads, listen=port, api_key_set=bool(settings.get("VLLM_API_KEY")),
                        cluster=settings.cluster_name, listen_host=bind, state_dir=state_dir)
    summary: dict[str, Any] = {
        "heads": [{"node": a, "host": h, "port": p} for a, (h, p) in zip(aliases, heads, strict=True)],
        "listen": f"{bind}:{port}" if bind else str(port),
        "api_key_set": bool(settings.get("VLLM_API_KEY")),
        "state_dir": state_dir,
    }
    return text, summary


def _loopback(bind: str | None) -> bool:
    if bind is None:
        return False
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return bind == "localhost"


@click.command("endpoint")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True,
              help="Where to write nginx.conf.")
@click.option("--listen", type=click.IntRange(1, 65535), metavar="PORT",
              help="Port the endpoint listens on (default: PORT, the heads' port).")
@click.option("--bind", metavar="ADDR", help="Address to listen on (default: every IPv4 address).")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Keep nginx's pid file, logs and temp files here (to run nginx as yourself); "
                   "default: nginx's own places.")
@click.option("--print", "print_conf", is_flag=True, help="Also print nginx.conf on stdout.")
@click.pass_obj
def command(g: object, out: Path, listen: int | None, bind: str | None, state_dir: Path | None,
            print_conf: bool) -> None:
    """Render nginx.conf: one OpenAI endpoint over every replica's head (least_conn, streaming)."""
    from ..options import Globals

    assert isinstance(g, Globals)
    s = g.settings()
    warn(s.warnings)
    state = str(state_dir.resolve()) if state_dir is not None else None
    text, summary = render_endpoint(s, g.ssh_config_path(), listen=listen, bind=bind, state_dir=state)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if state is not None:
        Path(state).mkdir(parents=True, exist_ok=True)  # nginx makes its temp dirs, not this one
    if not summary["api_key_set"] and not _loopback(bind):
        where = f"on {bind}" if bind else "on every address"
        warn([f"no VLLM_API_KEY: the endpoint answers anyone who reaches it {where} "
              "(set VLLM_API_KEY, or --bind 127.0.0.1)"])
    if g.json:
        emit_json({"nginx_conf": str(out), **summary})
        return
    c = console(print_conf)  # with --print, stdout is nginx.conf alone
    heads = ", ".join(f"{h['node']} at {h['host']}:{h['port']}" for h in summary["heads"])
    c.print(f"wrote {out}: listen {summary['listen']} -> {heads}", markup=False)
    early_log = f" -e {state}/error.log" if state else ""  # nginx's compiled-in log, before the config is read
    c.print(f"run: nginx -c {out.resolve()}{early_log} -g 'daemon off;'", markup=False)
    if print_conf:
        click.echo(text, nl=False)
