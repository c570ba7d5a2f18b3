"""`pip install sparkctl-launcher` without the `lab` extra: every production command runs, `sparkctl lab` says how
to get the extra.

A fresh interpreter hides the extra's modules (docker, typing_extensions) behind a meta-path blocker, as if
they were not installed, then imports every sparkctl module outside the lab and runs every production
command's `--help` (subcommands too); `sparkctl lab ...` must end with one line and exit 2, no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HIDDEN = ("docker", "typing_extensions")

SCRIPT = r"""
import contextlib, importlib, importlib.abc, io, json, pkgutil, sys

HIDDEN = %r


class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
for name in [m for m in sys.modules if m.partition(".")[0] in HIDDEN]:
    del sys.modules[name]

import click

import sparkctl
from sparkctl import cli

report = {"import_errors": {}, "help": {}, "lab": {}}
for info in pkgutil.walk_packages(sparkctl.__path__, "sparkctl."):
    name = info.name
    if name.startswith(("sparkctl.lab", "sparkctl.probes")) or name in ("sparkctl.__main__", "sparkctl.commands.lab"):
        continue  # the lab itself; scripts shipped to nodes; `python -m sparkctl` runs the CLI on import
    try:
        importlib.import_module(name)
    except Exception as exc:
        report["import_errors"][name] = f"{type(exc).__name__}: {exc}"


def run(words):
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(words)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def helps(words, cmd):
    yield words
    if isinstance(cmd, click.Group):
        ctx = click.Context(cmd)
        for sub in cmd.list_commands(ctx):
            yield from helps([*words, sub], cmd.get_command(ctx, sub))


group_ctx = click.Context(cli.cli)
for name in cli.COMMANDS:
    if name == "lab":
        continue
    for words in helps([name], cli.cli.get_command(group_ctx, name)):
        report["help"][" ".join(words)] = run([*words, "--help"])
for words in (["lab", "up"], ["lab", "status"], ["lab", "--help"], ["lab"]):
    report["lab"][" ".join(words)] = run(words)
report["docker_loaded"] = any(m.partition(".")[0] in HIDDEN for m in sys.modules)
print(json.dumps(report))
"""


def _report() -> dict:
    r = subprocess.run([sys.executable, "-c", SCRIPT % (HIDDEN,)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_without_the_lab_extra_every_production_command_runs_and_lab_says_how_to_install() -> None:
    report = _report()
    assert report["import_errors"] == {}
    assert not report["docker_loaded"]
    failed = {words: r for words, r in report["help"].items() if r["code"] != 0 or "Usage:" not in r["stdout"]}
    assert failed == {}
    assert {"plan", "up", "check", "model pull", "export systemd"} <= set(report["help"])
    for words, r in report["lab"].items():
        assert r["code"] == 2, (words, r)
        lines = r["stderr"].strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r["stderr"], (words, r["stderr"])
        assert "pip install 'sparkctl-launcher[lab]'" in lines[0] and "docker" in lines[0]
