"""`sparkctl export systemd`: the supervisor as a systemd unit on the head (pure text + fixed scripts).

The unit runs `sparkctl watch` for one cluster on the head, with the env file, the recipe and every knob
that came from the environment or the command line pinned, so what it restarts after a reboot is what was
running. Every path in it is a path on the head, never one of the machine that wrote it: the install copies
the recipe that ran (a file, or a shipped one, which a later sparkctl may change) to
`RECIPE_DIR/<cluster>/recipe-<sha256>.toml` and the env file to `RECIPE_DIR/<cluster>/cluster-<sha256>.env`,
0600 in a 0700 folder (both may hold secrets), and the unit names those copies; `--print` prints the very
same unit (its comment says which local file goes where). The program is `--sparkctl PATH`, else
`sparkctl` as systemd finds it (its fixed search path, SEARCH_PATH; the install refuses a head where it
finds none); the ssh config is the head's root's own (~/.ssh/config) unless a path on the head is given.
It starts after the network and Docker; its own restart policy is bounded
(StartLimitBurst within StartLimitIntervalSec). Secrets are never written into it: they stay in the
env file. `down` stops and disables it, so a deliberate `down` stays down; `up` never enables it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from .settings import Settings, is_secret

UNIT_DIR = "/etc/systemd/system"
RECIPE_DIR = "/etc/sparkctl"  # the recipes and env files the installed units run, one folder per cluster
DEFAULT_PROGRAM = "sparkctl"  # without --sparkctl: found by systemd in SEARCH_PATH on the head
SEARCH_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # systemd's, for a bare ExecStart
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def unit_name(cluster: str) -> str:
    return f"sparkctl-watch-{cluster}.service"


def recipe_copy_path(cluster: str, content: bytes) -> str:
    """Where the install puts the recipe the unit runs: named by its content, so installing another never
    rewrites the copy a unit already installed runs."""
    return f"{RECIPE_DIR}/{cluster}/recipe-{hashlib.sha256(content).hexdigest()[:16]}.toml"


def env_copy_path(cluster: str, content: bytes) -> str:
    """Where the install puts the env file the unit reads (named by its content, as the recipe's copy)."""
    return f"{RECIPE_DIR}/{cluster}/cluster-{hashlib.sha256(content).hexdigest()[:16]}.env"


@dataclass(frozen=True)
class UnitInstall:
    """What `export systemd` installs on a node: the unit, the files it names (path there, bytes; the
    recipe's copy first) and the program ExecStart runs (checked on the node before anything is written)."""
    name: str
    text: str
    files: tuple[tuple[str, bytes], ...]
    program: str

    @property
    def recipe(self) -> str:
        return self.files[0][0]


def _escape(word: str, *, dollar: bool) -> str:
    """One word in systemd's double quotes: backslash and quote escaped, `%` (specifiers) doubled,
    and in ExecStart `$` doubled (else systemd expands it as a variable)."""
    if _CONTROL.search(word):
        raise UsageError(f"{word!r} has a control character: it cannot go into a systemd unit")
    out = word.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    if dollar:
        out = out.replace("$", "$$")
    return f'"{out}"'


def exec_line(argv: Sequence[str]) -> str:
    return " ".join(_escape(a, dollar=True) for a in argv)


def unquote_exec(line: str) -> list[str]:
    """ExecStart's words as systemd passes them (for the lab, which has no systemd, to run it directly).
    Only the quoting `exec_line` writes is understood."""
    words: list[str] = []
    for m in re.finditer(r'"((?:[^"\\]|\\.)*)"', line):
        w = re.sub(r"\\(.)", r"\1", m.group(1))
        words.append(w.replace("%%", "%").replace("$$", "$"))
    return words


def pinned_environment(s: Settings, ssh_config: str | None = None) -> tuple[dict[str, str], list[str]]:
    """The environment the unit sets: every non-secret knob that came from the environment or the command
    line (the env file is named on the command line itself), and the ssh config when one on the head is
    given. Returns the variables and warnings for secrets that could not be pinned."""
    env = {"SPARKCTL_SSH_CONFIG": ssh_config} if ssh_config else {}
    warnings = []
    for key, v in sorted(s.values.items()):
        if not v.source.startswith(("environment", "command line", "--")) or key == "RECIPE":
            continue
        if is_secret(key):
            warnings.append(f"{key} comes from the {v.source}: it is not written into the unit; put it in the "
                            "env file, which the unit reads")
            continue
        env[key] = v.raw
    return env, warnings


def unit_text(*, cluster: str, argv: Sequence[str], env: dict[str, str], description: str = "",
              restart_sec: int = 30, burst: int = 3, interval_sec: int = 3600, notes: Sequence[str] = ()) -> str:
    envs = "\n".join(f"Environment={_escape(f'{k}={v}', dollar=False)}" for k, v in sorted(env.items()))
    said = "".join(f"# {_CONTROL.sub(' ', n)}\n" for n in notes)
    return f"""# Written by `sparkctl export systemd`; `sparkctl down` stops and disables it.
{said}[Unit]
Description={description or f"sparkctl supervisor for cluster {cluster}"}
Wants=network-online.target docker.service
After=network-online.target docker.service
StartLimitIntervalSec={interval_sec}
StartLimitBurst={burst}

[Service]
Type=simple
{envs}
ExecStart={exec_line(argv)}
Restart=on-failure
RestartSec={restart_sec}
KillSignal=SIGTERM
SuccessExitStatus=143
TimeoutStopSec=60

[Install]
WantedBy=multi-user.target
"""


# Install the recipe's copy first (root): from stdin, 0600 in a 0700 folder; then the env file's the same way.
# With a program (the recipe's run): first check that the unit can run it (an executable absolute path, or a
# name systemd finds in its search path). Exit 4: not root; 3: not written; 6: no such program there.
INSTALL_RECIPE = r'''f="$1"; d="${f%/*}"; prog="$2"
[ "$(id -u)" = 0 ] || exit 4
case "$prog" in
  "") ;;
  /*) [ -f "$prog" ] && [ -x "$prog" ] || exit 6 ;;
  *) ( PATH="$3"; command -v -- "$prog" ) >/dev/null 2>&1 || exit 6 ;;
esac
umask 077 && mkdir -p -- "$d" && chmod 700 -- "$d" && cat > "$f.tmp" && mv -f -- "$f.tmp" "$f" || exit 3'''

# Install on the head (root): write the unit from stdin, then remove the cluster's other recipe copies (the
# unit that ran them is replaced), reload, enable and start it. Exit 4: not root; 5: no systemctl (the file is
# written, nothing enabled).
INSTALL = r'''u="$1"; d="$2"; keep="$3"; keep_env="$4"
[ "$(id -u)" = 0 ] || exit 4
umask 022 && mkdir -p -- "$d" && cat > "$d/$u.tmp" && mv -f -- "$d/$u.tmp" "$d/$u" || exit 3
for f in "${keep%/*}"/recipe-*.toml "${keep%/*}"/cluster-*.env; do
  [ "$f" = "$keep" ] || [ "$f" = "$keep_env" ] || rm -f -- "$f"
done
command -v systemctl >/dev/null 2>&1 || exit 5
systemctl daemon-reload && systemctl enable --now -- "$u"'''

# `down`: stop and disable the unit when it is installed; nothing to do (exit 0) otherwise.
DISABLE = r'''u="$1"; d="$2"
[ -f "$d/$u" ] || exit 0
command -v systemctl >/dev/null 2>&1 || exit 0
systemctl disable --now -- "$u"'''


def install_recipe_argv(path: str, program: str = "") -> list[str]:
    """Write one file the unit names (stdin); with `program`, first check the unit can run it there."""
    return ["sh", "-c", INSTALL_RECIPE, "sparkctl-export-recipe", path, program, SEARCH_PATH]


def install_argv(cluster: str, recipe_copy: str, env_copy: str = "") -> list[str]:
    return ["sh", "-c", INSTALL, "sparkctl-export", unit_name(cluster), UNIT_DIR, recipe_copy, env_copy]


def disable_argv(cluster: str) -> list[str]:
    return ["sh", "-c", DISABLE, "sparkctl-unit-off", unit_name(cluster), UNIT_DIR]
