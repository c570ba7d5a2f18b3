"""`sparkctl trust NODE...`: show a node's host key and, once confirmed, record it in known_hosts.

This is the only place sparkctl adds a host key, and only after a person saw the fingerprint
(or said --yes). The key goes to the first UserKnownHostsFile of the node's ssh config entry,
under the name ssh itself looks up ([host]:port for a non-22 port, HostKeyAlias when set), hashed
when the entry says HashKnownHosts yes. A changed key is refused, naming the old and the new fingerprints,
unless `--replace` is given (then it is asked, or --yes): only that host's old lines of that key type leave
the file. With `UserKnownHostsFile none` (or /dev/null) there is no file to write: refused before connecting.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

import click

from ..cluster import (
    DEFAULT_CONNECT_TIMEOUT,
    HostKeyVerdict,
    Jumps,
    SshTarget,
    fetch_host_key,
    fingerprint,
    judge_host_key,
    load_ssh_config,
    no_known_hosts_file,
    record_host_key,
    resolve_target,
)
from ..completion import node_names
from ..errors import CheckFailed
from ..options import Globals
from ..output import emit_json


@click.command(name="trust")
@click.argument("nodes", nargs=-1, required=True, metavar="NODE...", shell_complete=node_names)
@click.option(
    "-y", "--yes", is_flag=True, help="Record the key without asking (you checked the fingerprint)."
)
@click.option(
    "--replace", is_flag=True,
    help="Replace a CHANGED host key (verify the new fingerprint out of band first): this host's old lines "
         "of that key type are removed from the known_hosts file sparkctl writes.",
)
@click.option(
    "--timeout",
    type=float,
    default=DEFAULT_CONNECT_TIMEOUT,
    show_default=True,
    help="Connect timeout, seconds.",
)
@click.pass_obj
def command(g: Globals, nodes: tuple[str, ...], yes: bool, replace: bool, timeout: float) -> None:
    """Show NODE's host key (type and SHA256 fingerprint) and record it in known_hosts."""
    config, config_path = load_ssh_config(g.ssh_config_path())
    report: list[dict[str, Any]] = []
    hops = Jumps()  # a node behind ProxyJump: its hops must already be trusted (trust them first)
    try:
        _trust(g, nodes, yes, replace, timeout, config, config_path, hops, report)
    finally:
        hops.close()


def _trust(g: Globals, nodes: tuple[str, ...], yes: bool, replace: bool, timeout: float, config: Any,
           config_path: str | None, hops: Jumps, report: list[dict[str, Any]]) -> None:
    targets = [resolve_target(name, config, config_path) for name in nodes]
    for target in targets:  # before any connection: a node with no file to write refuses the whole run
        if not target.known_hosts_files:
            raise no_known_hosts_file(target)
    for name, target in zip(nodes, targets, strict=True):
        key_type, blob = fetch_host_key(target, timeout=timeout, jumps=hops)
        verdict = judge_host_key(target, key_type, blob)
        entry: dict[str, Any] = {
            "node": name,
            "host": target.known_hosts_name,
            "key_type": key_type,
            "fingerprint": verdict.fingerprint,
            "status": verdict.status,
        }
        report.append(entry)
        click.echo(f"{name} ({target.known_hosts_name}) offers {key_type} {verdict.fingerprint}", err=g.json)
        if verdict.status == "trusted":
            click.echo("  already trusted; nothing to do", err=g.json)
            continue
        if verdict.status == "revoked":
            raise CheckFailed(f"{name}: this host key is marked @revoked in known_hosts; not trusting it", node=name,
                              fix=f"do not connect to {name} until its administrator says why the key was revoked "
                                  "and which key it offers now")
        if verdict.status == "changed":
            _changed(name, target, key_type, verdict, replace)
        question = "Replace the old key with this one?" if verdict.status == "changed" else "Trust this key?"
        if not yes and not click.confirm(f"  {question}", default=False, err=True):
            raise CheckFailed(f"{name}: host key not trusted (you declined)", node=name,
                              fix=f"compare the fingerprint with the one {name} shows (ssh-keygen -lf on its host "
                                  "key), then run `sparkctl trust` again and answer y")
        entry["recorded_in"] = record_host_key(target, key_type, blob)
        click.echo(f"  recorded in {entry['recorded_in']}", err=g.json)
        elsewhere = [e for e in verdict.known if os.path.realpath(e.path) != entry["recorded_in"]]
        for e in elsewhere:  # a file sparkctl does not write: the old line stays there (ssh then trusts both)
            click.secho(f"  the old key stays at {e.path}:{e.line}: remove it there "
                        f"(ssh-keygen -R {shlex.quote(target.known_hosts_name)} -f {shlex.quote(e.path)})",
                        fg="yellow", err=True)
    if g.json:
        emit_json({"trusted": report})


def _changed(name: str, target: SshTarget, key_type: str, verdict: HostKeyVerdict, replace: bool) -> None:
    """Say loudly that the key changed, old and new fingerprints; refuse unless --replace was given."""
    old = [f"{e.key_type} {fingerprint(e.key_blob)} ({e.path}:{e.line})" for e in verdict.known]
    click.secho(
        f"  WARNING: THE HOST KEY OF {name} HAS CHANGED. Someone may be intercepting the connection\n"
        f"  (man-in-the-middle), or the host was reinstalled. known_hosts has:",
        fg="red",
        bold=True,
        err=True,
    )
    for line in old:
        click.secho(f"    {line}", fg="red", err=True)
    click.secho(f"  and the host now offers {key_type} {verdict.fingerprint}", fg="red", err=True)
    if not replace:
        raise CheckFailed(
            f"{name}: the host key of {target.known_hosts_name} changed: known_hosts has {'; '.join(old)}, the "
            f"host offers {key_type} {verdict.fingerprint}; not replaced",
            fix=f"check the new fingerprint out of band (on the host: ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub); "
                f"if the change is expected, run `{target.trust_command()} --replace`",
            node=name,
        )
