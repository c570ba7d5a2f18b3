"""The serving image's own vLLM judges every rank's argv before any rank starts (argv_verdict).

Offline, on local nodes that really run every command (tests/unit/localnodes.py): the stub `docker`
answers the judge's `docker run --rm ... --label sparkctl.purpose=argv-judge` with the verdicts that
$STUB_ROOT/argv-judge asks for (tests/unit/stub_docker.py), and records each argv it judged. The real
vLLM's verdicts are tests/realengine/test_argv_judge.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]
NNODES_REFUSED = {"verdict": "refused", "stage": "parse", "vllm": "0.10.1",
                  "words": "vllm serve: error: unrecognized arguments: --nnodes 4 --node-rank 0"}  # sparkrun #287
STANDIN = {"verdict": "not-judged", "stage": "import",
           "words": "python3 in this image cannot import vllm (ModuleNotFoundError: No module named 'vllm')"}


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # each test starts with no verdict cached
    with served_scene(monkeypatch, tmp_path, NODES, {"VLLM_API_KEY": "k-secret-argv"}) as ln:
        (ln.root / "docker-calls.jsonl").unlink()  # the scene is set: record only what sparkctl does
        yield ln


def judge_plan(ln: LocalNodes, plan: dict[str, Any]) -> None:
    (ln.root / "argv-judge").write_text(json.dumps(plan))


def judge_runs(ln: LocalNodes) -> list[dict[str, Any]]:
    return [c for c in ln.docker_calls()
            if c["argv"][:1] == ["run"] and "sparkctl.purpose=argv-judge" in c["argv"]]


def rank_starts(ln: LocalNodes) -> list[dict[str, Any]]:
    return [c for c in ln.docker_calls() if c["argv"][:2] == ["run", "--detach"]]


def containers(ln: LocalNodes, name: str) -> list[str]:
    return ln.docker(name, "ps", "-aq", "--filter", "label=sparkctl.cluster=t").stdout.split()


def check(capsys: Any) -> dict[str, dict[str, Any]]:
    """`check --json`'s argv row by node (the local scene fails other rows: no GPU, no fabric; not ours)."""
    code, out, err = run(["--json", "check"], capsys)
    assert code in (0, 1) and "Traceback" not in err, err
    return argv_findings(out)


def argv_findings(out: str) -> dict[str, dict[str, Any]]:
    doc = json.loads(out)
    return {f["node"]: f for f in doc["findings"] if f["check"] == "argv"}


def test_up_refuses_with_vllms_words_and_starts_nothing(nodes: LocalNodes, capsys: Any) -> None:
    judge_plan(nodes, NNODES_REFUSED)
    code, out, err = run(["up"], capsys)
    assert code == 1, err
    assert "up refused, nothing was started" in err
    assert "unrecognized arguments: --nnodes 4 --node-rank 0" in err and "vLLM 0.10.1" in err
    assert "spark1 rank 0" in err and "spark4 rank 3" in err
    assert "VLLM_EXTRA_ARGS" in err  # the fix
    assert len(judge_runs(nodes)) == 1 and judge_runs(nodes)[0]["node"] == "spark1"  # once, on the head
    assert rank_starts(nodes) == [] and all(containers(nodes, n) == [] for n in NODES)
    assert all(not list((nodes.home(n) / ".sparkctl" / "t").glob("rank*.env")) for n in NODES)
    judged = [json.loads(line) for line in (nodes.root / "argv-judged.jsonl").read_text().splitlines()]
    assert [a[:2] for a in judged] == [["vllm", "serve"]] * 4  # every rank's argv, as up renders it
    assert [a[a.index("--node-rank") + 1] for a in judged] == ["0", "1", "2", "3"]


def test_check_fails_the_refused_ranks_by_node_and_rank(nodes: LocalNodes, capsys: Any) -> None:
    judge_plan(nodes, {"refuse": "--headless", "verdict": "refused", "stage": "parse",
                       "words": "vllm serve: error: unrecognized arguments: --headless"})
    code, out, err = run(["--json", "check"], capsys)
    assert code == 1
    rows = argv_findings(out)
    assert rows["spark1"]["status"] == "ok"  # the head has no --headless
    for rank, n in enumerate(NODES[1:], start=1):
        assert rows[n]["status"] == "fail", rows[n]
        assert f"{n} rank {rank}" in rows[n]["reason"] and "unrecognized arguments: --headless" in rows[n]["reason"]
        assert rows[n]["fix"]
    code, out, err = run(["check"], capsys)  # the table: a row `argv`
    assert code == 1 and "argv" in out and "refused (parse)" in out


def test_a_second_check_reads_the_cached_verdict_and_new_inputs_are_judged_again(
        nodes: LocalNodes, capsys: Any, tmp_path: Path) -> None:
    first = check(capsys)
    assert len(judge_runs(nodes)) == 1 and {f["status"] for f in first.values()} == {"ok"}
    rows = check(capsys)
    assert len(judge_runs(nodes)) == 1, "the cached verdict was not used"
    assert all("(cached)" in f["reason"] for f in rows.values()) and len(rows) == len(NODES)
    config = tmp_path / "model" / "config.json"  # another config.json: another key
    doc = json.loads(config.read_text())
    config.write_text(json.dumps({**doc, "sparkctl_test_marker": 1}))
    check(capsys)
    assert len(judge_runs(nodes)) == 2, "a changed config.json was not judged again"
    code, out, err = run(["up"], capsys)  # up renders the same argv as check: cached too
    assert code == 0, err
    assert len(judge_runs(nodes)) == 2 and "argv: accepted by vLLM 0.33.0" in out and "(cached)" in out


def test_a_judge_past_its_bound_is_not_judged_and_up_starts(nodes: LocalNodes, capsys: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    judge_plan(nodes, {"sleep": 3})
    monkeypatch.setenv("ARGV_JUDGE_TIMEOUT_S", "0.5")
    rows = check(capsys)
    assert {f["status"] for f in rows.values()} == {"warn"}  # a warning, not a failure
    assert "ARGV_JUDGE_TIMEOUT_S=0.5" in rows["spark1"]["reason"]
    (judged,) = judge_runs(nodes)
    name = judged["argv"][judged["argv"].index("--name") + 1]
    removed = [c for c in nodes.docker_calls() if c["argv"][:2] == ["rm", "-f"] and name in c["argv"]]
    assert removed and removed[0]["node"] == "spark1", "the judge's container was not removed after its bound"
    code, out, err = run(["up"], capsys)
    assert code == 0, err
    assert "argv not judged" in err and len(rank_starts(nodes)) == len(NODES)


def test_the_standin_engine_is_not_judged_and_up_starts_with_one_warning(nodes: LocalNodes, capsys: Any) -> None:
    judge_plan(nodes, STANDIN)
    rows = check(capsys)
    assert {f["status"] for f in rows.values()} == {"warn"} and "cannot import vllm" in rows["spark3"]["reason"]
    code, out, err = run(["up"], capsys)
    assert code == 0, err
    assert err.count("argv not judged") == 1 and "cannot import vllm" in err
    assert len(rank_starts(nodes)) == len(NODES)


def test_off_judges_nothing(nodes: LocalNodes, capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    judge_plan(nodes, NNODES_REFUSED)
    monkeypatch.setenv("ARGV_JUDGE_TIMEOUT_S", "0")
    assert {f["status"] for f in check(capsys).values()} == {"skip"}
    code, out, err = run(["up"], capsys)
    assert code == 0 and judge_runs(nodes) == [] and "argv not judged" not in err, err
    assert not [s for s in nodes.sent if "argv-judge" in s.command], "the judge asked the head for its image"


def test_the_judges_container_has_no_network_no_secret_and_a_read_only_model(nodes: LocalNodes, capsys: Any,
                                                                             tmp_path: Path) -> None:
    check(capsys)
    (call,) = judge_runs(nodes)
    argv = call["argv"]
    assert argv[:3] == ["run", "--rm", "--interactive"] and argv[argv.index("--network") + 1] == "none"
    assert argv[argv.index("--entrypoint") + 1] == "python3" and argv[argv.index("--pull") + 1] == "never"
    assert f"type=bind,source={tmp_path / 'model'},target={tmp_path / 'model'},readonly" in argv
    assert not any("k-secret-argv" in a for a in argv)
    sent = [s for s in nodes.sent if "argv-judge" in s.command]
    assert sent and not any("k-secret-argv" in s.command for s in sent)


class _OneRank:
    """Just what argvjudge.judge reads of the settings, for the tests that drive it with a fake head."""
    image, model, cluster_name = "vendor/vllm:9", "/m", "t"

    def get(self, key: str, default: Any = None) -> Any:
        return default


def _one_rank() -> Any:
    from sparkctl.spec.builders import RankSpec
    from sparkctl.spec.settings import RankPins

    return RankSpec(0, "spark1", RankPins(), {}, ["vllm", "serve", "/m"])


def test_a_head_without_the_image_is_not_judged() -> None:
    from sparkctl.cluster.channel import RunResult
    from sparkctl.remote import argv_verdict as argvjudge

    class Head:
        name = "spark1"
        runs: list[list[str]] = []

        def run(self, argv: list[str], **_: Any) -> RunResult:
            self.runs.append(list(argv))
            return RunResult("@@noimage Error: No such image: vendor/vllm:9\n", "", 0, 0.0)

    S, spec = _OneRank, _one_rank()
    j = argvjudge.judge(Head(), S(), [spec])  # type: ignore[arg-type]
    (v,) = j.verdicts
    assert v.verdict == "not-judged" and v.stage == "image" and "No such image: vendor/vllm:9" in v.words
    assert len(Head.runs) == 1, "a judge ran without the image"
    (f,) = argvjudge.findings(j, S())  # type: ignore[arg-type]
    assert f.status == "warn" and "build" in f.fix


@pytest.mark.parametrize("stdout", ["@@noimage \n", "@@noimage\n"])
def test_a_silent_image_lookup_is_told_in_words_never_as_the_scripts_marker(stdout: str) -> None:
    """docker's inspect failing without a word: check's warning names the image and says so, and never shows
    the lookup script's internal marker line."""
    from sparkctl.cluster.channel import RunResult
    from sparkctl.remote import argv_verdict as argvjudge

    class Head:
        name = "spark1"

        def run(self, argv: list[str], **_: Any) -> RunResult:
            return RunResult(stdout, "", 0, 0.0)

    S, spec = _OneRank, _one_rank()
    (v,) = argvjudge.judge(Head(), S(), [spec]).verdicts  # type: ignore[arg-type]
    assert v.stage == "image" and "@@" not in v.words
    assert f"has no image {S.image}" in v.words and "said nothing more" in v.words
    (f,) = argvjudge.findings(argvjudge.judge(Head(), S(), [spec]), S())  # type: ignore[arg-type]
    assert "@@" not in f.reason and "@@" not in f.short and "@@" not in f.fix


def test_the_verdict_lines_are_read_among_vllms_own_output() -> None:
    from sparkctl.remote.argv_verdict import MARK, parse_output

    text = "\n".join(["INFO vllm says", MARK + '{"rank": 1, "verdict": "ok"}', MARK + "{not json",
                      "@@sparkctl-argv", MARK + '{"rank": 0, "verdict": "refused", "words": "x"}'])
    assert parse_output(text) == {1: {"rank": 1, "verdict": "ok"}, 0: {"rank": 0, "verdict": "refused", "words": "x"}}


def test_a_signal_while_the_judge_runs_removes_its_container_and_is_raised(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """SIGTERM (or Ctrl-C) during the judge's `docker run`: the judge's container is removed by name before the
    interruption goes on to `up`'s own handling (seen in the lab: `sparkctl-signals-argv-judge` outlived `up`)."""
    from sparkctl.cluster.channel import RunResult
    from sparkctl.remote import argv_verdict as argvjudge

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(argvjudge, "judge_run_argv",
                        lambda settings, specs, name: ["docker", "run", "--rm", "--name", name, "judge"])

    class Head:
        name = "spark1"
        runs: list[list[str]] = []

        def run(self, argv: list[str], **_: Any) -> RunResult:
            self.runs.append(list(argv))
            if argv[:3] == ["docker", "run", "--rm"]:
                raise KeyboardInterrupt
            return RunResult("@@image sha256:abc\n@@config none\n", "", 0, 0.0)

    S, spec = _OneRank, _one_rank()
    with pytest.raises(KeyboardInterrupt):
        argvjudge.judge(Head(), S(), [spec])  # type: ignore[arg-type]
    name = Head.runs[-2][Head.runs[-2].index("--name") + 1]
    assert name.startswith("sparkctl-t-argv-judge-") and Head.runs[-1] == ["docker", "rm", "-f", name], Head.runs


def _lab_settings() -> Any:
    from sparkctl.spec.settings import load_settings

    return load_settings(cli={}, environ={"NODES": " ".join(NODES), "MODEL": "/m", "RECIPE": "lab",
                                                  "CLUSTER_NAME": "t"})


def _judge_head(started: list[str], both: Any) -> Any:
    """A head whose `docker run --name N` holds N while it runs, refusing a second container of that name as
    Docker does; each judge waits (bounded) until two are in flight at once, then gives its verdict."""
    import threading

    from sparkctl.cluster.channel import RunResult

    names: set[str] = set()
    lock = threading.Lock()

    class Head:
        name = "spark1"
        runs: list[list[str]] = []

        def run(self, argv: list[str], **_: Any) -> RunResult:
            self.runs.append(list(argv))
            if argv[:2] != ["docker", "run"]:
                return RunResult("@@image sha256:abc\n@@config none\n", "", 0, 0.0)
            name = argv[argv.index("--name") + 1]
            with lock:
                if name in names:
                    return RunResult("", f'docker: Error response from daemon: Conflict. The container name "/{name}" '
                                         "is already in use by container \"0123\".", 125, 0.0)
                names.add(name)
                started.append(name)
                if len(started) == 2:
                    both.set()
            both.wait(10)
            with lock:
                names.discard(name)  # --rm
            return RunResult('@@sparkctl-argv {"rank": 0, "verdict": "ok", "vllm": "0.33.0"}\n', "", 0, 0.0)

    return Head()


def test_two_judges_of_one_cluster_at_once_both_give_a_verdict(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """A `check` and an `up` of one cluster judging at the same moment: each run's container has a name of its
    own, so neither is refused by Docker for the other's name (which made one of them "not judged")."""
    import threading

    from sparkctl.remote import argv_verdict as argvjudge

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    started: list[str] = []
    both = threading.Event()
    head = _judge_head(started, both)
    settings, spec = _lab_settings(), _one_rank()
    out: list[Any] = [None, None]

    def one(i: int) -> None:
        out[i] = argvjudge.judge(head, settings, [spec])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [[v.verdict for v in j.verdicts] for j in out] == [["ok"], ["ok"]], [j.verdicts for j in out]
    assert len(set(started)) == 2 and all(n.startswith("sparkctl-t-argv-judge-") for n in started), started


def test_a_judge_past_its_bound_removes_its_own_container_only(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """After its bound a judge removes its container by the name it gave it: never another run's judge."""
    from sparkctl.cluster import NodeError
    from sparkctl.cluster.channel import RunResult
    from sparkctl.remote import argv_verdict as argvjudge

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)

    class Head:
        name = "spark1"
        runs: list[list[str]] = []

        def run(self, argv: list[str], **_: Any) -> RunResult:
            self.runs.append(list(argv))
            if argv[:2] == ["docker", "run"]:
                raise NodeError("spark1", "command-timeout", "timed out")
            return RunResult("@@image sha256:abc\n@@config none\n", "", 0, 0.0)

    settings, spec = _lab_settings(), _one_rank()
    for _ in range(2):
        (v,) = argvjudge.judge(Head(), settings, [spec]).verdicts  # type: ignore[arg-type]
        assert v.verdict == "not-judged" and v.stage == "timeout"
    runs = [r for r in Head.runs if r[:2] == ["docker", "run"]]
    removals = [r for r in Head.runs if r[:2] == ["docker", "rm"]]
    names = [r[r.index("--name") + 1] for r in runs]
    assert len(set(names)) == 2, names
    assert removals == [["docker", "rm", "-f", n] for n in names], (names, removals)
