"""`sparkctl export systemd`: the supervisor as a systemd unit on the head (pure text + fixed scripts).

The unit runs `sparkctl watch` for one cluster with the env file, the recipe, the ssh config and every
knob that came from the environment or the command line pinned, so what it restarts after a reboot is
what was running. The recipe is pinned by content: the install copies the recipe that ran (a file, or a
shipped one, which a later sparkctl may change) to `RECIPE_DIR/<cluster>/recipe-<sha256>.toml` on the
node, 0600 in a 0700 folder (a recipe's [defaults] may hold a secret), and `--recipe` names that copy;
`--print` names the file's absolute path, or the shipped recipe's name. It starts after the network and Docker; its own restart policy is bounded
(StartLimitBurst within StartLimitIntervalSec). Secrets are never written into it: they stay in the
env file. `down` stops and disables it, so a deliberate `down` stays down; `up` never enables it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

from ..errors import UsageError
from .settings import Settings, is_secret

UNIT_DIR = "/etc/systemd/system"
RECIPE_DIR = "/etc/sparkctl"  # the recipes the installed units run, one folder per cluster
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def unit_name(cluster: str) -> str:
    return f"sparkctl-watch-{cluster}.service"


def recipe_copy_path(cluster: str, content: bytes) -> str:
    """Where the install puts the recipe the unit runs: named by its content, so installing another never
    rewrites the copy a unit already installed runs."""
    return f"{RECIPE_DIR}/{cluster}/recipe-{hashlib.sha256(content).hexdigest()[:16]}.toml"


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


def pinned_environment(s: Settings, ssh_config: str) -> tuple[dict[str, str], list[str]]:
    """The environment the unit sets: the ssh config and every non-secret knob that came from the
    environment or the command line (the env file is named on the command line itself). Returns the
    variables and warnings for secrets that could not be pinned."""
    env = {"SPARKCTL_SSH_CONFIG": ssh_config}
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
              restart_sec: int = 30, burst: int = 3, interval_sec: int = 3600) -> str:
    envs = "\n".join(f"Environment={_escape(f'{k}={v}', dollar=False)}" for k, v in sorted(env.items()))
    return f"""# Written by `sparkctl export systemd`; `sparkctl down` stops and disables it.
[Unit]
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


# Install the recipe's copy first (root): from stdin, 0600 in a 0700 folder. Exit 4: not root; 3: not written.
INSTALL_RECIPE = r'''f="$1"; d="${f%/*}"
[ "$(id -u)" = 0 ] || exit 4
umask 077 && mkdir -p -- "$d" && chmod 700 -- "$d" && cat > "$f.tmp" && mv -f -- "$f.tmp" "$f" || exit 3'''

# Install on the head (root): write the unit from stdin, then remove the cluster's other recipe copies (the
# unit that ran them is replaced), reload, enable and start it. Exit 4: not root; 5: no systemctl (the file is
# written, nothing enabled).
INSTALL = r'''u="$1"; d="$2"; keep="$3"
[ "$(id -u)" = 0 ] || exit 4
umask 022 && mkdir -p -- "$d" && cat > "$d/$u.tmp" && mv -f -- "$d/$u.tmp" "$d/$u" || exit 3
for f in "${keep%/*}"/recipe-*.toml; do [ "$f" = "$keep" ] || rm -f -- "$f"; done
command -v systemctl >/dev/null 2>&1 || exit 5
systemctl daemon-reload && systemctl enable --now -- "$u"'''

# `down`: stop and disable the unit when it is installed; nothing to do (exit 0) otherwise.
DISABLE = r'''u="$1"; d="$2"
[ -f "$d/$u" ] || exit 0
command -v systemctl >/dev/null 2>&1 || exit 0
systemctl disable --now -- "$u"'''


def install_recipe_argv(path: str) -> list[str]:
    return ["sh", "-c", INSTALL_RECIPE, "sparkctl-export-recipe", path]


def install_argv(cluster: str, recipe_copy: str) -> list[str]:
    return ["sh", "-c", INSTALL, "sparkctl-export", unit_name(cluster), UNIT_DIR, recipe_copy]


def disable_argv(cluster: str) -> list[str]:
    return ["sh", "-c", DISABLE, "sparkctl-unit-off", unit_name(cluster), UNIT_DIR]
