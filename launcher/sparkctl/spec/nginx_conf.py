"""One endpoint over the replicas: nginx's configuration, rendered (sparkctl runs no router of its own).

Pure: `nginx_config` takes the heads as (host, port) pairs -- the address the proxy host reaches each
replica's head at -- and returns a complete, standalone nginx.conf (templates/nginx.conf.j2). Every
value that reaches the text is checked first: a host is a host name, an IPv4 address or an IPv6
address (bare or in brackets), a port an int in 1..65535, a path a plain absolute path. Anything else
is a UsageError, so no value can end a directive (`;`), open a block (`{`) or start a comment (`#`).

Why nginx (README, "One endpoint over replicas"): every distribution packages it, `least_conn` suits
long streaming completions, and there is no service of ours to keep.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Sequence
from typing import Any

import jinja2

from .. import __version__
from ..errors import UsageError
from .resources import data_dir
from .settings import Settings

# RFC 1123 labels; '_' too (nginx and most resolvers take it, and it can end nothing in nginx's syntax)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")
_CLUSTER_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
_PATH_RE = re.compile(r"/[A-Za-z0-9._/+-]*")

HOST_RULE = "a host name (letters, digits, '-', '_', '.'), an IPv4 address or an IPv6 address ([::1] or ::1)"


def nginx_host(host: Any, what: str = "head") -> str:
    """`host` as it goes into nginx.conf (an IPv6 address in brackets), or a UsageError."""
    if not isinstance(host, str) or not host:
        raise UsageError(f"{what} host {host!r}: not {HOST_RULE}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        addr = ipaddress.ip_address(bare)
    except ValueError:
        addr = None
    if addr is not None:
        if isinstance(addr, ipaddress.IPv6Address):
            if addr.scope_id:
                raise UsageError(f"{what} host {host!r}: an IPv6 address with a zone (%{addr.scope_id}) "
                                 "cannot be an nginx upstream", fix="use a global or unique-local address")
            return f"[{addr.compressed}]"
        if bare != host:
            raise UsageError(f"{what} host {host!r}: only an IPv6 address goes in brackets")
        return str(addr)
    if bare != host or len(host) > 253 or not _HOSTNAME_RE.fullmatch(host):
        raise UsageError(f"{what} host {host!r}: not {HOST_RULE}",
                         fix="set the node's HostName in the ssh config to its name or address")
    if all(label.isdigit() for label in host.rstrip(".").split(".")):
        raise UsageError(f"{what} host {host!r}: not a valid IPv4 address")
    return host


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:  # bool is not a port
        raise UsageError(f"{what} {value!r}: must be a whole number in {lo}..{hi}")
    return value


def _port(value: Any, what: str) -> int:
    return _int(value, what, 1, 65535)


def upstream_name(cluster: str) -> str:
    """nginx's name for the group of heads: `sparkctl_<cluster>` in letters, digits and '_'."""
    if not isinstance(cluster, str) or not _CLUSTER_RE.fullmatch(cluster):
        raise UsageError(f"cluster name {cluster!r}: lower-case letters, digits, '.', '_', '-' (max 63)")
    return "sparkctl_" + re.sub(r"[^a-z0-9_]", "_", cluster)


def _state_dir(path: Any) -> str | None:
    if path is None:
        return None
    if not isinstance(path, str) or not _PATH_RE.fullmatch(path) or "/../" in path + "/":
        raise UsageError(f"state dir {path!r}: an absolute path of letters, digits and '._/+-' only",
                         fix="pick a plain directory, e.g. $PWD/env/nginx")
    return path.rstrip("/") or "/"


def _template_env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # noqa: S701 - renders nginx.conf, not HTML; every value is validated above
    )


def nginx_config(
    heads: Sequence[tuple[str, int]],
    *,
    listen: int,
    api_key_set: bool,
    cluster: str = "sparkctl",
    listen_host: str | None = None,
    state_dir: str | None = None,
    max_fails: int = 3,
    fail_timeout_s: int = 30,
    connect_timeout_s: int = 5,
    read_timeout_s: int = 3600,
    max_body_mb: int = 64,
) -> str:
    """A complete nginx.conf: one `least_conn` upstream of `heads`, one server on `listen`.

    heads: (host, port) per replica head, as the proxy host reaches it. listen_host: the address to
    listen on (None: every IPv4 address). state_dir: where nginx keeps its pid file, logs and temp
    files (an absolute path; None: nginx's compiled-in places, right for a root nginx or the
    nginx image). api_key_set only chooses the note at the top: the key itself is never an input.
    """
    if isinstance(heads, str | bytes) or not heads:
        raise UsageError("no replica head to proxy to", fix="NODES names the head of the (first) replica")
    rendered: list[tuple[str, int]] = []
    for i, head in enumerate(heads):
        if not isinstance(head, tuple | list) or len(head) != 2:
            raise UsageError(f"head {i}: {head!r} is not a (host, port) pair")
        pair = (nginx_host(head[0]), _port(head[1], f"head {head[0]!r} port"))
        if pair in rendered:
            raise UsageError(f"head {pair[0]}:{pair[1]} is named twice (it would get twice the requests)")
        rendered.append(pair)
    port = _port(listen, "listen port")
    listen_address = str(port) if listen_host is None else f"{nginx_host(listen_host, 'listen')}:{port}"
    return _template_env().get_template("nginx.conf.j2").render(
        version=__version__,
        cluster=cluster,
        upstream=upstream_name(cluster),
        heads=rendered,
        listen=port,
        listen_address=listen_address,
        api_key_set=bool(api_key_set),
        state_dir=_state_dir(state_dir),
        max_fails=_int(max_fails, "max_fails", 0, 1000),
        fail_timeout_s=_int(fail_timeout_s, "fail_timeout_s", 1, 86400),
        connect_timeout_s=_int(connect_timeout_s, "connect_timeout_s", 1, 3600),
        read_timeout_s=_int(read_timeout_s, "read_timeout_s", 1, 7 * 86400),
        max_body_mb=_int(max_body_mb, "max_body_mb", 1, 1 << 20),
    )


def heads_of(settings: Settings, resolve: Callable[[str], str]) -> list[tuple[str, int]]:
    """One (host, port) per replica head, in replica order: every replica serves its API on PORT at its
    head. `resolve` turns an alias into the address the proxy host reaches it at (the command passes the
    HostName the user's ssh config gives, as `ssh -G` resolves it)."""
    port = settings.getint("PORT")
    return [(resolve(head), port) for head in settings.topology.heads]
