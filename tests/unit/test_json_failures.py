"""`--json` keeps its promise on failures too: every exit of a command given --json prints
exactly one JSON document on stdout. A command that fails before printing its own ends with the
failure's: `ok: false`, the error, the node (when it is about one), the fix, the exit code. A command
that printed its document and then fails (check's findings) prints no second one. Human text stays on
stderr. Offline: a bad env file, a refused SSH connection on loopback, click's own usage errors, a
signal, a bug.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from sparkctl import cli
from sparkctl.cluster import NodeError

FIELDS = {"ok", "error", "node", "fix", "failures", "exit_code"}


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out, err = capsys.readouterr()
    code = exc.value.code
    return (code if isinstance(code, int) else 0 if code is None else 1), out, err


def _one_document(out: str) -> dict[str, Any]:
    """stdout is one JSON document and nothing else (a pipe: one compact line)."""
    assert out.endswith("\n") and out.count("\n") == 1, out
    doc = json.loads(out)
    assert isinstance(doc, dict)
    return doc


def lab_recipe_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tp: int, also_drop: tuple[str, ...] = ()) -> None:
    """Work in tmp_path with no env file and no knobs from this machine's environment (nor `also_drop`): the lab
    recipe at TP `tp`, DCP 1, MODEL an empty folder."""
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k in ("NODES", "MODEL", "RECIPE", "TP", "DCP", *also_drop) or \
                k.startswith("SPARKCTL_") and k != "SPARKCTL_TEST_CACHE":
            monkeypatch.delenv(k)
    (tmp_path / "m").mkdir()
    monkeypatch.setenv("RECIPE", "lab")
    monkeypatch.setenv("TP", str(tp))
    monkeypatch.setenv("DCP", "1")
    monkeypatch.setenv("MODEL", str(tmp_path / "m"))


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No env file, no knobs from this machine's environment; the lab recipe on one node."""
    lab_recipe_here(monkeypatch, tmp_path, tp=1)
    return tmp_path


@pytest.fixture
def refused(env: Path) -> tuple[str, str]:
    """An ssh config whose one alias is a loopback port nothing listens on: the connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = env / "ssh_config"
    cfg.write_text(f"Host nodeA\n  HostName 127.0.0.1\n  Port {port}\n  User root\n"
                   f"  UserKnownHostsFile {env / 'known_hosts'}\n  IdentitiesOnly yes\n"
                   f"  IdentityFile {env / 'no_key'}\n")
    return "nodeA", str(cfg)


# Every command that loads the settings, each given a bad env file: exit 2 and one document.
COMMANDS = [
    ["config"], ["plan", "--local"], ["render"], ["check"], ["verify-model"], ["build", "--dry-run"], ["endpoint"],
    ["bake"], ["up"], ["wait"], ["status"], ["logs"], ["down"], ["lock", "status"], ["audit"], ["watch"], ["history"],
    ["rollback"], ["exec", "--", "true"], ["export", "systemd", "--print"], ["bench"],
    ["model", "pull"], ["model", "sync"], ["deploy"], ["deploy", "--yes"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: " ".join(a))
def test_a_bad_env_file_gives_one_failure_document(env: Path, capsys: pytest.CaptureFixture[str],
                                                   argv: list[str]) -> None:
    bad = env / "bad.env"
    bad.write_text("NODES=nodeA\nTP=x\n")
    code, out, err = _main(["--env-file", str(bad), *argv[:1], "--json", *argv[1:]], capsys)
    doc = _one_document(out)
    assert code == 2 and FIELDS <= set(doc), (code, out, err)
    assert doc["ok"] is False and doc["exit_code"] == 2 and doc["node"] is None
    assert "TP='x'" in doc["error"] and "must be a whole number" in doc["error"]
    assert "error: TP='x'" in err  # the person's line still goes to stderr


def test_a_missing_env_file_says_the_fix(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _main(["--env-file", str(env / "nope.env"), "check", "--json"], capsys)
    doc = _one_document(out)
    assert code == 2 and doc["ok"] is False and "not found" in doc["error"]
    assert doc["fix"] and "--env-file" in doc["fix"]


def test_without_json_a_failure_prints_nothing_on_stdout(env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (env / "bad.env").write_text("TP=x\n")
    code, out, err = _main(["--env-file", str(env / "bad.env"), "check"], capsys)
    assert code == 2 and out == "" and "error: TP='x'" in err


def test_a_refused_connection_names_the_node_and_the_fix(refused: tuple[str, str],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    node, cfg = refused
    code, out, err = _main(["--ssh-config", cfg, "--nodes", node, "lock", "status", "--json"], capsys)
    doc = _one_document(out)
    assert code == 1 and doc["ok"] is False and doc["exit_code"] == 1, (out, err)
    assert doc["node"] == node and doc["kind"] == "refused", doc
    assert "connection refused" in doc["error"] and "sshd" in doc["fix"]


def test_a_command_ending_itself_after_stderr_still_prints_a_document(refused: tuple[str, str],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`logs` has no document of its own: it says why on stderr and exits 1; --json still gets one."""
    node, cfg = refused
    code, out, err = _main(["--ssh-config", cfg, "--nodes", node, "logs", "--json"], capsys)
    doc = _one_document(out)
    assert code == 1 and doc["ok"] is False and doc["exit_code"] == 1 and "connection refused" in err


def test_check_json_on_a_refused_connection_is_the_reports_document_only(
        refused: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """check turns a refused node into a finding: its report is the failure's document (its findings beside
    the failure's keys), one document."""
    node, cfg = refused
    code, out, _ = _main(["--ssh-config", cfg, "--nodes", node, "check", "--json", "--connect-timeout", "3"], capsys)
    doc = _one_document(out)
    assert code == 1 and doc["ok"] is False and "findings" in doc and doc["exit_code"] == 1
    assert doc["node"] == node and doc["failures"][0]["kind"] == "ssh" and "sshd" in doc["fix"]
    ssh = next(f for f in doc["findings"] if f["check"] == "ssh")
    assert ssh["node"] == node and ssh["status"] == "fail" and ssh["short"] == "refused"


def test_a_node_error_out_of_check_is_one_document(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """What a connection refused before any finding looks like (the ProxyCommand refusal was one)."""
    from sparkctl.commands import check

    def refuse(*a: Any, **k: Any) -> None:
        raise NodeError("spark2", "config", "ProxyCommand is not supported", "use ProxyJump for 'spark2'")

    monkeypatch.setattr(check, "Cluster", lambda *a, **k: _Entered(refuse))
    code, out, err = _main(["--nodes", "spark2", "check", "--json"], capsys)
    doc = _one_document(out)
    assert code == 1 and doc == {"ok": False, "error": "spark2: ProxyCommand is not supported", "node": "spark2",
                                 "fix": "use ProxyJump for 'spark2'", "exit_code": 1, "kind": "config",
                                 "reason": "ProxyCommand is not supported",
                                 "failures": [{"node": "spark2", "kind": "config", "reason": "ProxyCommand is not "
                                               "supported", "fix": "use ProxyJump for 'spark2'"}]}, doc
    assert "error: spark2: ProxyCommand is not supported" in err


class _Entered:
    def __init__(self, on_enter: Any) -> None:
        self.on_enter = on_enter

    def __enter__(self) -> Any:
        return self.on_enter()

    def __exit__(self, *exc: object) -> None:
        return None


def test_several_failed_nodes_are_each_in_the_document(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from sparkctl.cluster import raise_failed
    from sparkctl.commands import check

    def fail(*a: Any, **k: Any) -> None:
        raise_failed("connect", {"a": NodeError("a", "refused", "refused", "start sshd on a"),
                                 "b": NodeError("b", "timeout", "timed out", "check b's network")})

    monkeypatch.setattr(check, "Cluster", lambda *a, **k: _Entered(fail))
    code, out, _ = _main(["--nodes", "a", "check", "--json"], capsys)
    doc = _one_document(out)
    assert code == 1 and doc["node"] is None and "on 2 node(s)" in doc["error"]
    assert [(f["node"], f["kind"], f["fix"]) for f in doc["failures"]] == [
        ("a", "refused", "start sshd on a"), ("b", "timeout", "check b's network")]


@pytest.mark.parametrize("argv, words", [
    (["check", "--json", "--no-such-option"], "No such option"),
    (["--json", "check", "--timeout", "soon"], "'soon' is not a valid float"),
    (["--json"], "Missing command"),
    (["--json", "no-such-command"], "No such command"),
])
def test_a_line_click_refuses_still_gets_its_document(env: Path, capsys: pytest.CaptureFixture[str],
                                                      argv: list[str], words: str) -> None:
    code, out, err = _main(argv, capsys)
    doc = _one_document(out)
    assert code == 2 and doc["ok"] is False and doc["exit_code"] == 2 and words in doc["error"], doc
    assert doc["fix"].endswith("--help`") and "Usage:" in err


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_before_any_document_prints_one(env: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str], signum: int, code: int) -> None:
    from sparkctl import signals
    from sparkctl.commands import check

    def interrupted(*a: Any, **k: Any) -> None:
        raise signals.Interrupted(signum)

    monkeypatch.setattr(check, "Cluster", lambda *a, **k: _Entered(interrupted))
    got, out, _ = _main(["--nodes", "x", "check", "--json"], capsys)
    doc = _one_document(out)
    assert got == code and doc["exit_code"] == code and doc["ok"] is False
    assert doc["error"] == f"interrupted ({signal.Signals(signum).name})"


def test_a_bug_is_one_document_too(env: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    from sparkctl.commands import check

    def bug(*a: Any, **k: Any) -> None:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(check, "Cluster", lambda *a, **k: _Entered(bug))
    code, out, err = _main(["--nodes", "x", "check", "--json"], capsys)
    doc = _one_document(out)
    assert code == 1 and doc["error"] == "internal error: ZeroDivisionError: division by zero"
    assert "-vv" in doc["fix"] and "internal error" in err


def test_a_document_already_printed_is_never_followed_by_a_second(env: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`down`'s failure is one document: its own keys beside the failure's."""
    from sparkctl.commands import lifecycle

    monkeypatch.setattr(lifecycle, "down", lambda *a, **k: {"nodeA": NodeError("nodeA", "refused", "refused")})
    code, out, _ = _main(["--nodes", "nodeA", "down", "--json"], capsys)
    doc = _one_document(out)
    assert code == 1 and set(doc) == {"ok", "failed", "seconds", *FIELDS} and doc["ok"] is False
    assert doc["node"] == "nodeA" and doc["error"] == "down did not finish on 1 node(s): nodeA: refused"


def test_help_and_version_print_no_failure_document(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _main(["check", "--json", "--help"], capsys)
    assert code == 0 and out.startswith("Usage:") and '"ok"' not in out
    code, out, _ = _main(["--version", "--json"], capsys)
    assert code == 0 and "version" in out and '"ok"' not in out


def test_only_the_commands_own_words_ask_for_json() -> None:
    assert cli._wants_json(["check", "--json"]) and cli._wants_json(["--json", "plan"])
    assert not cli._wants_json(["exec", "--rank", "0", "--", "tool", "--json"])
    assert cli._wants_json(["exec", "--json", "--", "tool"])
    assert not cli._wants_json(["check"])
