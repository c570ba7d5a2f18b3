"""Every command's `--json` failure has one shape (errors.failure_document, data/failure.schema.json): one
document on stdout with `ok` false, `error` (one line, the reason itself), `fix`, `node`, `failures` (each
{node, kind, reason, fix}) and `exit_code`, the process's own status. The table drives every command and
subcommand of the click group into a failure offline (a loopback port nothing listens on, a bad env file, a
missing file, an option click refuses); a command without a row fails the test. The `lab` rows are options
click refuses before anything runs.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest

from sparkctl import cli, output
from sparkctl.errors import SCHEMA_PATH, SHAPE_KEYS, CheckFailed, Failure, failure_document
from tests.conftest import run_cli
from tests.unit.test_json_failures import lab_recipe_here

# path -> (argv after the global options, the exit status). {R}: the refused loopback nodes (two, one port
# nothing listens on); {BAD}: an env file with a bad value; {TMP}: the test's folder.
R = "{R}"
CASES: dict[tuple[str, ...], tuple[list[str], int]] = {
    ("config",): (["--env-file", "{BAD}", "config"], 2),
    ("plan",): ([R, "plan"], 1),
    ("recipe", "list"): (["recipe", "list", "--no-such-option"], 2),
    ("recipe", "show"): (["recipe", "show", "no-such-recipe"], 2),
    ("recipe", "validate"): (["recipe", "validate", "{TMP}/bad.toml"], 2),
    ("recipe", "new"): (["recipe", "new", "--model", "{TMP}/no-such-folder"], 2),
    ("render",): ([R, "render"], 1),
    ("setup",): ([R, "setup"], 1),
    ("check",): ([R, "check", "--connect-timeout", "3"], 1),
    ("nccl-report",): (["nccl-report", "{TMP}/no-such.log"], 2),
    ("verify-model",): ([R, "verify-model"], 1),
    ("model", "pull"): ([R, "model", "pull"], 2),  # MODEL_REVISION unset
    ("model", "sync"): ([R, "model", "sync"], 1),
    ("build",): ([R, "build", "--dry-run"], 1),
    ("endpoint",): (["--env-file", "{BAD}", "endpoint"], 2),
    ("bake",): (["bake", "--push"], 2),
    ("deploy",): ([R, "deploy", "--yes"], 1),
    ("up",): ([R, "up"], 1),
    ("wait",): ([R, "wait"], 1),
    ("status",): ([R, "status"], 1),
    ("logs",): ([R, "logs"], 1),
    ("down",): ([R, "down"], 1),
    ("lock",): ([R, "lock", "--force-unlock"], 1),
    ("lock", "status"): ([R, "lock", "status"], 1),
    ("audit",): ([R, "audit"], 1),
    ("watch",): (["--env-file", "{BAD}", "watch"], 2),
    ("diagnose",): ([R, "diagnose", "--out", "{TMP}"], 2),
    ("history",): ([R, "history"], 1),
    ("rollback",): ([R, "rollback"], 1),
    ("exec",): ([R, "exec", "--", "true"], 1),
    ("export", "systemd"): ([R, "export", "systemd"], 1),
    ("trust",): ([R, "trust", "nodeA", "--yes"], 1),
    ("bench",): ([R, "bench"], 1),
    # the lab (root, never run by unit tests): only what click refuses before the command runs
    ("lab",): (["lab", "up", "--nodes", "0"], 2),
    ("lab", "up"): (["lab", "up", "--nodes", "0"], 2),
    ("lab", "status"): (["lab", "status", "--no-such-option"], 2),
    ("lab", "down"): (["lab", "down", "--no-such-option"], 2),
    ("lab", "torch"): (["lab", "torch", "--no-such-option"], 2),
}
# Rows whose document may have no `fix`: `lab` without the lab extra says its one line, the install command
# in it (tests/unit/test_no_lab_extra.py holds it to one line on stderr).
NO_FIX: set[tuple[str, ...]] = {("lab",)}


def command_paths() -> list[tuple[str, ...]]:
    """Every command a user can run, from the click group itself: each leaf, and each group that runs
    without a subcommand (`lock --force-unlock`)."""
    ctx = click.Context(cli.cli)
    paths: list[tuple[str, ...]] = []

    def walk(cmd: click.Command, path: tuple[str, ...]) -> None:
        if isinstance(cmd, click.Group):
            if cmd.invoke_without_command:
                paths.append(path)
            for name, sub in cmd.commands.items():
                walk(sub, (*path, name))
        else:
            paths.append(path)

    for name in cli.cli.list_commands(ctx):
        cmd = cli.cli.get_command(ctx, name)
        assert cmd is not None, name
        walk(cmd, (name,))
    return paths


def test_every_command_has_a_row() -> None:
    missing = [" ".join(p) for p in command_paths() if p not in CASES]
    assert not missing, f"add a failure case to CASES for: {missing}"


@pytest.fixture
def place(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """No env file and no knobs from this machine; the lab recipe; two nodes whose port nothing listens on."""
    lab_recipe_here(monkeypatch, tmp_path, tp=2, also_drop=("SSH_AUTH_SOCK",))
    monkeypatch.setenv("HOME", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp_path / "ssh_config"
    cfg.write_text("".join(f"Host {n}\n  HostName 127.0.0.1\n  Port {port}\n  User root\n"
                           f"  UserKnownHostsFile {tmp_path / 'known_hosts'}\n  IdentitiesOnly yes\n"
                           for n in ("nodeA", "nodeB")))
    (tmp_path / "bad.env").write_text("NODES=nodeA\nTP=x\n")
    (tmp_path / "bad.toml").write_text('name = "bad"\n[defaults]\nTP = 0\n')
    yield {"cfg": str(cfg), "tmp": str(tmp_path)}


def _argv(row: list[str], place: dict[str, str], nodes: str) -> list[str]:
    out: list[str] = []
    for word in row:
        if word == R:
            out += ["--ssh-config", place["cfg"], "--nodes", nodes]
        else:
            out.append(word.replace("{BAD}", f"{place['tmp']}/bad.env").replace("{TMP}", place["tmp"]))
    return out


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    return run_cli(argv, capsys)


def check_shape(doc: Any, code: int, *, fix_needed: bool = True) -> None:
    """The one shape: the schema, and what it cannot say (the exit status, no "see stderr")."""
    jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text())).validate(doc)
    assert set(SHAPE_KEYS) <= set(doc)
    assert doc["ok"] is False and doc["exit_code"] == code and type(doc["exit_code"]) is int
    assert isinstance(doc["error"], str) and doc["error"].strip() and "\n" not in doc["error"]
    assert "see stderr" not in doc["error"] and "internal error" not in doc["error"]
    assert doc["node"] is None or isinstance(doc["node"], str)
    assert isinstance(doc["failures"], list)
    for f in doc["failures"]:
        assert {"node", "kind", "reason", "fix"} <= set(f), f
        assert isinstance(f["kind"], str) and isinstance(f["reason"], str) and f["reason"]
    if fix_needed:
        assert isinstance(doc["fix"], str) and doc["fix"].strip(), doc


@pytest.mark.parametrize("path", command_paths(), ids=" ".join)
def test_every_command_fails_in_the_one_shape(path: tuple[str, ...], place: dict[str, str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    row, want = CASES[path]
    nodes = "nodeA nodeB"
    argv = _argv(row, place, nodes)
    at = argv.index(path[0])
    at = argv.index(path[-1], at)  # --json right after the command's own name (`model pull --json`)
    argv.insert(at + 1, "--json")
    code, out, err = _run(argv, capsys)
    assert out.endswith("\n") and out.count("\n") == 1, (out, err)  # one compact document, nothing else
    doc = json.loads(out)
    assert code == want, (code, doc, err)
    check_shape(doc, code, fix_needed=path not in NO_FIX)


def test_a_node_failure_names_the_node_in_its_failures(place: dict[str, str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """up on two refused nodes: the first line is the error, each node a failure with its own fix."""
    code, out, _ = _run(_argv([R, "up", "--json"], place, "nodeA nodeB"), capsys)
    doc = json.loads(out)
    assert code == 1 and [f["node"] for f in doc["failures"]] == ["nodeA", "nodeB"]
    assert all(f["kind"] == "refused" and "sshd" in f["fix"] for f in doc["failures"])
    assert doc["error"] == "up refused: 2 node(s) unreachable, nothing was changed: nodeA, nodeB"
    assert doc["node"] is None and "sshd" in doc["fix"]


def test_down_keeps_its_own_keys_beside_the_shape(place: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(_argv([R, "down", "--json"], place, "nodeA nodeB"), capsys)
    doc = json.loads(out)
    assert code == 1 and set(doc["failed"]) == {"nodeA", "nodeB"} and isinstance(doc["seconds"], float)
    assert doc["node"] is None and [f["kind"] for f in doc["failures"]] == ["refused", "refused"]


def test_a_bare_exit_status_says_the_last_warning_not_see_stderr(monkeypatch: pytest.MonkeyPatch,
                                                                 place: dict[str, str],
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A command that ends with sys.exit after saying why: the failure path keeps what it said."""
    from sparkctl.commands import check

    def said_and_left(*a: Any, **k: Any) -> None:
        output.warn(["the disk on nodeA is full"])
        sys.exit(3)

    class Entered:
        def __enter__(self) -> None:
            said_and_left()

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(check, "Cluster", lambda *a, **k: Entered())
    code, out, _ = _run(["--nodes", "nodeA nodeB", "check", "--json"], capsys)
    doc = json.loads(out)
    assert code == 3 and doc["error"] == "the disk on nodeA is full"
    check_shape(doc, 3, fix_needed=False)


def test_the_failure_document_takes_the_first_line_and_the_failures_fixes() -> None:
    doc = failure_document("start failed on 2 node(s):\n  a: x\n  b: y", exit_code=1,
                           failures=[Failure("a", "docker", "x", "fix a"), Failure("b", "docker", "y", "fix b")])
    assert doc["error"] == "start failed on 2 node(s): a, b" and doc["fix"] == "a: fix a; b: fix b"
    assert "details" not in doc
    one = failure_document("one thing\nand its detail", exit_code=2, fix="do it")
    assert one["error"] == "one thing" and one["details"] == ["and its detail"] and one["failures"] == []
    same = failure_document("x:", exit_code=1, failures=[Failure("a", "k", "r", "f"), Failure("b", "k", "r", "f")])
    assert same["fix"] == "f" and same["error"] == "x: a, b"
    check_shape(CheckFailed("boom", fix="f", extra={"ok": True, "findings": []}).to_json(), 1)
