"""The lifecycle paths nothing else tested, on local nodes that really run every command.

The nodes are local folders (tests/unit/localnodes.py) with a stateful `docker` stand-in that records
every call in order, so the order of actions across nodes is observable: `up` starts the workers before
the head, `down` removes the head first, a failed `up` rolls back, `status` exits 1 when a rank is gone,
`logs --rank`/`-f`, `audit`'s merge by time, `build --dry-run` changes nothing, and `wait` does not call
a service ready whose /v1/models lacks the model or whose chat fails.
"""

from __future__ import annotations

import http.server
import json
import socketserver
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]
SERVED = "lab-model"


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    with served_scene(monkeypatch, tmp_path, NODES, {"SERVED_MODEL_NAME": SERVED, "VLLM_API_KEY": "k-local"}) as ln:
        (ln.root / "docker-calls.jsonl").unlink()  # the scene is set: record only what sparkctl does
        yield ln


def calls(ln: LocalNodes, verb: str) -> list[tuple[str, int]]:
    """(node, order) of every `docker VERB ...`, in the order they happened. `run` counts the ranks'
    `run --detach` only: the argv judge's `run --rm` on the head (argvjudge) starts no rank."""
    want = ["run", "--detach"] if verb == "run" else [verb]
    return [(c["node"], c["seq"]) for c in ln.docker_calls() if c["argv"][:len(want)] == want]


def containers(ln: LocalNodes, name: str) -> list[str]:
    r = ln.docker(name, "ps", "-aq", "--filter", "label=sparkctl.cluster=t")
    return r.stdout.split()


def test_up_starts_every_worker_before_the_head(nodes: LocalNodes, capsys: Any) -> None:
    code, out, err = run(["up"], capsys)
    assert code == 0, err
    runs = calls(nodes, "run")
    assert sorted(n for n, _ in runs) == sorted(NODES)
    head_at = next(seq for n, seq in runs if n == "spark1")
    assert all(seq < head_at for n, seq in runs if n != "spark1"), runs
    assert out.index("started rank 0 on spark1") > max(out.index(f"started rank {r}") for r in (1, 2, 3))


def test_a_failed_up_rolls_back_everything_it_started(nodes: LocalNodes, capsys: Any) -> None:
    (nodes.root / "docker-fail-spark3").touch()  # `docker run` fails there: not a signal, a plain error
    code, out, err = run(["up"], capsys)
    assert code == 1
    assert "spark3" in err and "stub refuses to run here" in err
    assert not [n for n, _ in calls(nodes, "run") if n == "spark1"], "the head started after a worker failed"
    assert all(containers(nodes, n) == [] for n in NODES), "a container survived the rollback"
    started = [n for n, _ in calls(nodes, "run") if n != "spark3"]
    assert started, "nothing was started, so nothing was rolled back"
    assert all((nodes.home(n) / ".sparkctl" / "t").is_dir() for n in NODES)
    assert not list((nodes.home("spark2") / ".sparkctl" / "t").glob("rank*.env")), "the env file stayed"


def test_down_removes_the_head_first(nodes: LocalNodes, capsys: Any) -> None:
    assert run(["up"], capsys)[0] == 0
    code, out, err = run(["down"], capsys)
    assert code == 0, err
    removed = calls(nodes, "rm")
    head_at = next(seq for n, seq in removed if n == "spark1")
    assert all(head_at < seq for n, seq in removed if n != "spark1"), removed
    assert all(containers(nodes, n) == [] for n in NODES)


def test_status_exits_1_when_a_rank_is_gone(nodes: LocalNodes, capsys: Any) -> None:
    from tests.kit.local import local_standin
    from tests.unit.test_standin import write_checkpoint

    assert run(["up"], capsys)[0] == 0
    with local_standin(write_checkpoint(nodes.root / "served"), env={}, served_name=SERVED,
                       extra_args=["--api-key", "k-local"]) as url:
        code, out, err = run(["--json", "status", "--url", url], capsys)
        assert code == 0, out + err  # the control: all ranks up, the head healthy
        doc = json.loads(out)
        assert doc["ok"] is True and SERVED in doc["head"]["models"]
        gone = containers(nodes, "spark3")
        nodes.docker("spark3", "rm", "-f", *gone)
        code, out, err = run(["--json", "status", "--url", url], capsys)
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and "rank 2 (spark3): no container" in doc["problems"]


def test_logs_rank_shows_only_that_rank_and_follow_follows(nodes: LocalNodes, capsys: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkctl.cluster import fanout

    assert run(["up"], capsys)[0] == 0
    connected: list[str] = []
    transport = fanout.connect  # the harness's

    def counting(target: Any, **kw: Any) -> Any:
        connected.append(target.alias)
        return transport(target, **kw)

    monkeypatch.setattr(fanout, "connect", counting)
    code, out, err = run(["logs", "--rank", "2", "--tail", "5"], capsys)
    assert code == 0, err
    assert connected == ["spark3"]  # the other nodes are not even connected to
    lines = out.splitlines()
    assert lines and all(ln.startswith("[2 spark3] ") for ln in lines), out
    logs = [c for c in nodes.docker_calls() if c["argv"][:1] == ["logs"]]
    assert [c["node"] for c in logs] == ["spark3"]
    assert logs[0]["argv"] == ["logs", "--tail", "5", "sparkctl-t-rank2"]
    code, out, err = run(["logs", "-f", "--rank", "0", "--rank", "3"], capsys)
    assert code == 0, err
    followed = [c for c in nodes.docker_calls() if c["argv"][:1] == ["logs"]][1:]
    assert sorted(c["node"] for c in followed) == ["spark1", "spark4"]
    assert all("--follow" in c["argv"] for c in followed)
    assert {ln.split("]")[0] for ln in out.splitlines()} == {"[0 spark1", "[3 spark4"}
    code, _, err = run(["logs", "--rank", "4"], capsys)
    assert code == 2 and "ranks are 0..3" in err


def test_audit_merges_every_node_by_time(nodes: LocalNodes, capsys: Any) -> None:
    when = {"spark1": ["2026-01-01T00:00:03Z", "2026-01-01T00:00:07Z"], "spark2": ["2026-01-01T00:00:01Z"],
            "spark3": ["2026-01-01T00:00:05Z"], "spark4": ["2026-01-01T00:00:02Z", "2026-01-01T00:00:06Z"]}
    for n, stamps in when.items():
        d = nodes.home(n) / ".sparkctl" / "t"
        d.mkdir(parents=True)
        (d / "audit.log").write_text("not json\n" + "".join(json.dumps({"when": w, "who": "u@h", "action": f"a-{n}"})
                                                             + "\n" for w in stamps))
    code, out, err = run(["--json", "audit"], capsys)
    assert code == 0, err
    got = [(e["when"], e["node"]) for e in json.loads(out)["entries"]]
    assert got == sorted((w, n) for n, ws in when.items() for w in ws)
    code, out, _ = run(["audit", "--tail", "1"], capsys)  # the last line per node
    assert [ln.split()[1] for ln in out.splitlines()] == ["spark2", "spark3", "spark4", "spark1"]


def test_build_dry_run_changes_nothing(nodes: LocalNodes, capsys: Any) -> None:
    code, out, err = run(["build", "--dry-run"], capsys)
    assert code == 0, err
    assert "dcp" in out and "keys3" in out and "build" in out
    verbs = {c["argv"][0] for c in nodes.docker_calls()}
    assert verbs <= {"version", "image"}, verbs  # looked; built, pulled and loaded nothing
    assert not any(c["argv"][:1] in (["build"], ["load"], ["tag"], ["rmi"]) for c in nodes.docker_calls())
    code, out, err = run(["build"], capsys)  # the control: the same plan really builds
    assert code == 0, err
    # each of the 5 layers: its Dockerfile, then a label-only build that records its versions
    assert len(calls(nodes, "build")) == 2 * 5 * len(NODES)


# ------------------------------------------------------------------------------- wait's last steps


@contextmanager
def head_api(answer: Callable[[str], tuple[int, Any]]) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def reply(self) -> None:
            code, body = answer(self.path)
            data = json.dumps(body).encode() if not isinstance(body, str) else body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = reply  # noqa: N815 - http.server's names

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True

    srv = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _models(names: list[str]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": n, "object": "model"} for n in names]}


CHAT_OK = {"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
           "content": "hello there from the head"}, "finish_reason": "stop"}], "usage": {"completion_tokens": 5}}


@pytest.mark.parametrize(("case", "expected"), [
    ("ready", None),
    ("model-missing", "not ready within 2s"),
    ("chat-fails", "the head answered HTTP 500"),
])
def test_wait_needs_the_model_listed_and_a_chat_answer(nodes: LocalNodes, capsys: Any, case: str,
                                                       expected: str | None) -> None:
    def answer(path: str) -> tuple[int, Any]:
        if path == "/health":
            return 200, ""
        if path == "/v1/models":
            return 200, _models(["some-other-model"] if case == "model-missing" else [SERVED])
        if path == "/v1/chat/completions":
            return (500, {"error": {"message": "boom"}}) if case == "chat-fails" else (200, CHAT_OK)
        return 404, {}

    assert run(["up"], capsys)[0] == 0
    with head_api(answer) as url:
        code, out, err = run(["wait", "--timeout", "2", "--url", url], capsys)
    if expected is None:
        assert code == 0, err
        assert "hello there from the head" in out
    else:
        assert code == 1 and expected in err, err


def test_wait_names_a_missing_shard_in_vllms_words(nodes: LocalNodes, capsys: Any, tmp_path: Path) -> None:
    """A rank whose folder lacks a shard dies during load; however many lines vLLM prints after the
    cause, `wait` names it (vLLM's own words) and says how to mend the folder. The log is the
    stand-in's real output for that case followed by the head's shutdown lines."""
    from sparkctl.lab import standin_vllm as standin
    from tests.unit.test_standin import write_checkpoint

    model = write_checkpoint(tmp_path / "ckpt", shards=3)
    (model / "model-00002-of-00003.safetensors").unlink()
    res = subprocess.run([sys.executable, standin.__file__, "serve", str(model), "--port", "0"],
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    after = [f"(EngineCore pid=9) ERROR 11-29 10:00:23 [core.py:1584] line {i} of the shutdown" for i in range(30)]
    assert run(["up"], capsys)[0] == 0
    (nodes.root / "docker-logs-spark3").write_text(res.stderr + "\n".join(after) + "\n")
    (nodes.root / "docker-exited-spark3").touch()
    with head_api(lambda path: (503, "")) as url:
        code, out, err = run(["wait", "--timeout", "20", "--url", url], capsys)
    assert code == 1, err
    assert "rank 2 on spark3 died (exited, exit code 1)" in err
    assert ("a shard the index names is missing: FileNotFoundError: Weight files referenced in index but "
            f"missing: {{'{model}/model-00002-of-00003.safetensors'}}") in err
    assert "sparkctl model sync" in err and "sparkctl verify-model" in err


# ------------------------------------------------------------------------------- lock --force-unlock


def test_force_unlock_breaks_a_live_foreign_holder_and_audits_it(nodes: LocalNodes, capsys: Any) -> None:
    """A holder on another host that still renews its lease is neither dead nor stale: `up` refuses,
    naming it; `lock --force-unlock` breaks it, says whose it was, and the audit keeps who did."""
    from sparkctl.remote.lockdir import LockOwner, acquire_argv, new_owner

    theirs = LockOwner(**{**new_owner("up").__dict__, "who": "alice@laptop", "host": "laptop", "pid": 4242,
                          "machine_id": "f" * 32, "boot_id": "b" * 32})
    got = subprocess.run(acquire_argv("t", theirs), cwd=nodes.home("spark1"), env=nodes.env_for("spark1"),
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    code, out, err = run(["--json", "lock", "status"], capsys)
    assert code == 0 and json.loads(out)["locked"] is True
    code, out, err = run(["up"], capsys)
    assert code == 1 and "alice@laptop" in err and "locked" in err, err
    assert containers(nodes, "spark1") == []
    code, out, err = run(["--json", "lock", "--force-unlock"], capsys)
    assert code == 0, err
    assert json.loads(out)["broken"]["who"] == "alice@laptop" and "token" not in json.loads(out)["broken"]
    code, out, err = run(["--json", "lock", "status"], capsys)
    assert json.loads(out)["locked"] is False
    code, out, err = run(["--json", "audit"], capsys)
    broken = [e for e in json.loads(out)["entries"] if e.get("action") == "lock-broken"]
    assert len(broken) == 1 and "alice@laptop" in broken[0]["detail"], broken
    code, out, err = run(["--json", "lock", "--force-unlock"], capsys)  # nothing to break: says so
    assert code == 0 and json.loads(out)["broken"] is None


@pytest.fixture
def legacy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    """The default cluster ("sparkctl") serving under the names an earlier sparkctl gave its ranks
    (`sparkctl-sparkctl-rankN`): today's `up`, then every container renamed in the nodes' engines."""
    with served_scene(monkeypatch, tmp_path, NODES, {"SERVED_MODEL_NAME": SERVED, "CLUSTER_NAME": "sparkctl"}) as ln:
        assert run_cli_quiet(["up"]) == 0
        for n in NODES:
            state_file = ln.root / f"docker-{n}.json"
            state = json.loads(state_file.read_text())
            for c in state["containers"].values():
                assert c["Name"].startswith("/sparkctl-rank"), c["Name"]  # today's name
                c["Name"] = c["Name"].replace("/sparkctl-rank", "/sparkctl-sparkctl-rank")
            state_file.write_text(json.dumps(state))
        (ln.root / "docker-calls.jsonl").unlink()
        yield ln


def run_cli_quiet(argv: list[str]) -> int:
    from sparkctl.cli import main

    try:
        main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def _names(ln: LocalNodes) -> dict[str, list[str]]:
    out = {}
    for n in NODES:
        state = json.loads((ln.root / f"docker-{n}.json").read_text())
        out[n] = sorted(c["Name"].lstrip("/") for c in state["containers"].values())
    return out


def test_a_service_under_the_legacy_names_is_the_running_service(legacy: LocalNodes, capsys: Any) -> None:
    """An identical `up` keeps it (labels, not names, say what is ours); status, logs and exec reach it."""
    code, out, err = run(["up"], capsys)
    assert code == 0, err
    assert calls(legacy, "run") == [] and calls(legacy, "rm") == [], "the running service was replaced"
    code, out, err = run(["--json", "status"], capsys)  # exit 1: no engine answers /health in this scene
    doc = json.loads(out)
    assert [(r["rank"], r["state"], r["config_current"]) for r in doc["ranks"]] == [
        (i, "running", True) for i in range(4)], out
    assert doc["orphans"] == [] and doc["problems"] == ["head /health: no answer"], out
    code, out, err = run(["logs", "--rank", "1", "--tail", "5"], capsys)
    assert code == 0 and "serving sparkctl-sparkctl-rank1" in out, out + err
    code, out, err = run(["exec", "--rank", "2", "--", "echo", "hi"], capsys)
    assert code == 0 and "exec in sparkctl-sparkctl-rank2: echo hi" in out, out + err


def test_a_changed_up_replaces_the_legacy_names_and_down_removes_them(legacy: LocalNodes, capsys: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run(["up", "--recreate"], capsys)
    assert code == 0, err
    assert _names(legacy) == {n: [f"sparkctl-rank{i}"] for i, n in enumerate(NODES)}
    code, out, err = run(["logs", "--rank", "1", "--tail", "5"], capsys)
    assert code == 0 and "serving sparkctl-rank1" in out, out + err
    code, out, err = run(["down"], capsys)
    assert code == 0 and _names(legacy) == {n: [] for n in NODES}, err


def test_down_removes_a_service_under_the_legacy_names(legacy: LocalNodes, capsys: Any) -> None:
    code, out, err = run(["down"], capsys)
    assert code == 0, err
    assert _names(legacy) == {n: [] for n in NODES}
