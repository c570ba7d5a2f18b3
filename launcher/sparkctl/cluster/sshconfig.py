"""ssh_config: what an alias resolves to, exactly as OpenSSH resolves it (`ssh -G`)."""

from __future__ import annotations

import getpass
import os
import pwd
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import NodeError, UsageError

DEFAULT_SSH_CONFIG = "~/.ssh/config"
_GLOBAL_KNOWN_HOSTS = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")
_USER_KNOWN_HOSTS = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")


# The identity files `ssh -G` lists when the config sets none (OpenSSH's defaults, whether they exist or not).
_SSH_DEFAULT_IDENTITIES = ("id_rsa", "id_ecdsa", "id_ecdsa_sk", "id_ed25519", "id_ed25519_sk", "id_xmss", "id_dsa")


@dataclass(frozen=True)
class SshTarget:
    """What an alias resolves to, the way ssh(1) would resolve it."""

    alias: str
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identities_only: bool
    known_hosts_files: tuple[str, ...]  # UserKnownHostsFile; `trust` writes to the first
    global_known_hosts_files: tuple[str, ...]
    host_key_alias: str | None = None
    hash_known_hosts: bool = False
    ssh_config: str | None = None  # the file it came from, for fix hints
    jumps: tuple[SshTarget, ...] = ()  # ProxyJump hops, in order (each resolved as its own alias)
    proxy_command: str | None = None  # ProxyCommand, its %-tokens expanded (run by the shell, as ssh does)
    certificate_files: tuple[str, ...] = ()  # CertificateFile, tokens and ~ expanded (missing ones kept: said so)
    pkcs11_provider: str | None = None  # PKCS11Provider: not usable here; named if no other key is accepted
    agent: bool = True  # False for `IdentityAgent none`: ssh then asks no agent, and neither does sparkctl
    missing_identity_files: tuple[str, ...] = ()  # IdentityFile paths the config names that do not exist

    @property
    def known_hosts_name(self) -> str:
        """The name ssh looks the host key up under: HostKeyAlias, else host or [host]:port."""
        if self.host_key_alias:
            return self.host_key_alias
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def trust_command(self) -> str:
        parts = ["sparkctl"]
        if self.ssh_config and self.ssh_config != os.path.expanduser(DEFAULT_SSH_CONFIG):
            parts += ["--ssh-config", self.ssh_config]
        return shlex.join([*parts, "trust", self.alias])


@dataclass(frozen=True)
class SshConfig:
    """Which ssh_config OpenSSH reads: `ssh -F path` for a file the user named; for the default
    (~/.ssh/config) no -F, so ssh reads it and /etc/ssh/ssh_config as it always does."""

    path: str | None  # the file, for messages (None: there is no ~/.ssh/config)
    explicit: bool = False

    def ssh_argv(self) -> list[str]:
        return ["-F", self.path] if self.explicit and self.path else []


def load_ssh_config(path: str | Path | None) -> tuple[SshConfig, str | None]:
    """Which ssh_config to resolve aliases with. A missing default (~/.ssh/config) is fine (ssh has its
    defaults); a missing file the user named is a usage error."""
    explicit = path is not None and os.path.expanduser(str(path)) != os.path.expanduser(DEFAULT_SSH_CONFIG)
    resolved = os.path.expanduser(str(path if path is not None else DEFAULT_SSH_CONFIG))
    if not os.path.exists(resolved):
        if explicit:
            raise UsageError(
                f"ssh config {resolved} does not exist",
                fix="pass --ssh-config PATH (or set SPARKCTL_SSH_CONFIG) to the file that names your nodes",
            )
        return SshConfig(None), None
    return SshConfig(resolved, explicit), resolved


# `ssh -G` prints one `key value` line per option, every key lower-case; these may repeat.
_MULTI = {"identityfile", "certificatefile"}
SSH_G_TIMEOUT = 10.0


def ssh_g(alias: str, config: SshConfig, flags: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """OpenSSH's own resolution of `alias` (`ssh -G`): Include, Match, Host patterns, canonicalisation,
    defaults — exactly what `ssh alias` would use (`flags`: `-l USER`, `-p PORT` of a ProxyJump spec,
    as `ssh -J` passes them). Raises NodeError when ssh cannot resolve it."""
    import subprocess

    argv = ["ssh", "-G", *config.ssh_argv(), *flags, "--", alias]  # `--`: an alias is never an option
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=SSH_G_TIMEOUT, stdin=subprocess.DEVNULL,
                           check=False)
    except FileNotFoundError:
        raise NodeError(alias, "config", "the OpenSSH client (`ssh`) is not installed: sparkctl resolves node "
                        "aliases with `ssh -G`, as ssh itself does", "install openssh-client") from None
    except subprocess.TimeoutExpired:
        raise NodeError(alias, "config", f"`ssh -G {alias}` did not answer in {SSH_G_TIMEOUT:g}s (a `Match exec` "
                        "that hangs?)", "fix the ssh config entry") from None
    if r.returncode != 0:
        why = " | ".join(ln for ln in r.stderr.strip().splitlines() if "Pseudo-terminal" not in ln)[-400:]
        raise NodeError(alias, "config", f"ssh cannot resolve {alias!r}: {why or f'exit {r.returncode}'}",
                        f"fix the ssh config ({config.path or '~/.ssh/config'}), e.g. `ssh -G {alias}` shows the problem")
    opts: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        key, _, value = line.strip().partition(" ")
        key = key.lower()
        if key in _MULTI:
            opts.setdefault(key, []).append(value.strip())
        elif key and key not in opts:
            opts[key] = [value.strip()]
    return opts


def _one(opts: Mapping[str, list[str]], key: str, default: str = "") -> str:
    values = opts.get(key)
    return values[0] if values else default


def _jump_specs(value: str) -> list[tuple[str | None, str, int | None]]:
    """ProxyJump's `[user@]host[:port]` (or `ssh://[user@]host[:port]`) list, comma-separated."""
    out: list[tuple[str | None, str, int | None]] = []
    for raw in value.split(","):
        spec = raw.strip().removeprefix("ssh://")
        user, _, hostport = spec.rpartition("@")
        host, port = hostport, None
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:]+)(?::(\d+))?", hostport)
        if m:
            host = m.group(1) or m.group(3)
            p = m.group(2) or m.group(4)
            port = int(p) if p else None
        out.append((user or None, host, port))
    return out


def resolve_target(alias: str, config: SshConfig, config_path: str | None = None, *,
                   _depth: int = 0, _flags: tuple[str, ...] = ()) -> SshTarget:
    """Resolve one alias exactly as ssh(1) does (`ssh -G`), ProxyJump hops and ProxyCommand included."""
    opts = ssh_g(alias, config, _flags)
    try:
        port = int(_one(opts, "port", "22"))
    except ValueError:
        raise NodeError(alias, "config", f"bad Port {_one(opts, 'port')!r} in the ssh config",
                        "fix its Port line") from None
    user = _one(opts, "user") or getpass.getuser()
    hostname = _one(opts, "hostname", alias)
    # %k: HostKeyAlias, else the alias as given (not the HostName): what ssh substitutes
    tokens = {"%d": os.path.expanduser("~"), "%u": getpass.getuser(), "%h": hostname, "%n": alias,
              "%p": str(port), "%r": user, "%k": _one(opts, "hostkeyalias", alias)}
    # `ssh -G` prints ProxyCommand as written (tokens unexpanded) and omits it for `ProxyCommand none`;
    # of ProxyCommand and ProxyJump it prints only the one that came first, as ssh uses only that one.
    written = _one(opts, "proxycommand", "none")
    proxy_command = None if written.lower() == "none" else _expand_proxy_command(alias, written, tokens)
    if proxy_command is not None and _one(opts, "proxyusefdpass", "no").lower() == "yes":
        raise NodeError(alias, "config", "ProxyUseFdpass yes is not supported: sparkctl reads and writes the "
                        "ProxyCommand's stdin and stdout, it does not take a socket from it",
                        f"set `ProxyUseFdpass no` for {alias!r} (with a ProxyCommand that carries the bytes, "
                        "e.g. `nc %h %p`), or use ProxyJump")
    proxy_jump = _one(opts, "proxyjump", "none")
    jumps: list[SshTarget] = []
    if proxy_jump.lower() != "none":
        if _depth > 8:
            raise NodeError(alias, "config", "ProxyJump chain too deep (a loop?)", "fix the ssh config")
        for juser, jhost, jport in _jump_specs(proxy_jump):
            # a hop's user and port from the spec reach `ssh -G` as `ssh -J` passes them (-l, -p), so a
            # hop's own ProxyCommand sees them as %r and %p
            flags = (*(("-l", juser) if juser else ()), *(("-p", str(jport)) if jport else ()))
            hop = resolve_target(jhost, config, config_path, _depth=_depth + 1, _flags=flags)
            jumps += [*hop.jumps, replace(hop, jumps=())]
    # ssh -G lists the default identity files when none is set: only those that exist are candidates
    # (ssh itself skips the missing ones).
    # `IdentityFile none` is no file (ssh skips it), never a file named none in the current directory.
    named = [w for w in " ".join(opts.get("identityfile", [])).split() if w.lower() != "none"]
    named_paths = _split_paths(" ".join(named), tokens)
    identities = tuple(p for p in named_paths if os.path.exists(p))
    # What ssh says "no such identity: PATH" of: a file the config names that is not there (not one of the
    # defaults `ssh -G` lists whether or not they exist).
    defaults = {os.path.expanduser(f"~/.ssh/{n}") for n in _SSH_DEFAULT_IDENTITIES}
    missing_identities = tuple(p for p in named_paths if not os.path.exists(p) and p not in defaults)
    certificates = _split_paths(" ".join(opts.get("certificatefile", [])), tokens)
    known = _known_hosts_paths(opts.get("userknownhostsfile"), _USER_KNOWN_HOSTS)
    global_known = _known_hosts_paths(opts.get("globalknownhostsfile"), _GLOBAL_KNOWN_HOSTS)
    host_key_alias = _one(opts, "hostkeyalias")
    return SshTarget(
        alias=alias,
        hostname=hostname,
        port=port,
        user=user,
        identity_files=identities,
        missing_identity_files=missing_identities,
        identities_only=_one(opts, "identitiesonly", "no").lower() == "yes",
        known_hosts_files=tuple(p for p in known if p != "/dev/null"),
        global_known_hosts_files=tuple(p for p in global_known if p != "/dev/null"),
        host_key_alias=host_key_alias if host_key_alias and host_key_alias.lower() != "none" else None,
        hash_known_hosts=_one(opts, "hashknownhosts", "no").lower() == "yes",
        ssh_config=config_path,
        jumps=tuple(jumps),
        proxy_command=proxy_command,
        certificate_files=certificates,
        pkcs11_provider=None if _one(opts, "pkcs11provider", "none").lower() == "none" else _one(opts, "pkcs11provider"),
        agent=_one(opts, "identityagent") != "none",
    )


# The tokens ssh(1) expands in ProxyCommand (any other `%x` makes ssh refuse the command:
# "unknown key %x"); checked against OpenSSH 9.2's ssh.
_PROXY_TOKENS = ("%h", "%k", "%n", "%p", "%r")


def _expand_proxy_command(alias: str, command: str, tokens: Mapping[str, str]) -> str:
    """ProxyCommand with %h %k %n %p %r and %% replaced, as ssh replaces them before `exec`-ing the
    command with the user's shell; the rest (quotes, $VARS, ~) is that shell's."""
    out, i = [], 0
    while i < len(command):
        c = command[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        tok = command[i:i + 2]
        if tok == "%%":
            out.append("%")
        elif tok in _PROXY_TOKENS:
            out.append(tokens[tok])
        else:
            raise NodeError(alias, "config", f"ProxyCommand {command!r}: ssh does not expand {tok!r} there "
                            f"(only {' '.join(_PROXY_TOKENS)} and %%)", "fix the ProxyCommand line in the ssh config")
        i += 2
    return "".join(out)


def _known_hosts_paths(printed: list[str] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """UserKnownHostsFile / GlobalKnownHostsFile as `ssh -G` printed them, read as ssh reads them: `none`
    is no file at all (never a file of that name); ~ is the passwd home (ssh's tilde_expand, not $HOME);
    nothing is %-expanded again (`ssh -G` prints UserKnownHostsFile with its %-tokens and ${VARS} already
    expanded, so a `%%h` it printed as `%h` is a file of that name; ssh expands no token in
    GlobalKnownHostsFile); a relative path is opened in the current directory, as ssh opens it (ssh never
    changes directory), so it is made absolute here, which names it in every message."""
    words = (printed[0] if printed else "").split() or list(default)
    if [w.lower() for w in words] == ["none"]:
        return ()
    return tuple(os.path.abspath(_tilde(w)) for w in words)


def _tilde(path: str) -> str:
    """ssh's tilde expansion: `~` and `~/x` from the passwd entry of this uid, `~user/x` from user's."""
    if not path.startswith("~"):
        return path
    user, sep, rest = path[1:].partition("/")
    try:
        home = pwd.getpwnam(user).pw_dir if user else pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return os.path.expanduser(path)  # ssh itself stops at such a name; `ssh -G` already accepted it
    return os.path.join(home, rest.lstrip("/")) if sep and rest.strip("/") else home


def _split_paths(value: str | None, tokens: Mapping[str, str]) -> tuple[str, ...]:
    if not value:
        return ()
    out = []
    for raw in value.split():
        for tok, rep in tokens.items():
            raw = raw.replace(tok, rep)
        out.append(os.path.expanduser(raw.replace("%%", "%")))
    return tuple(out)
