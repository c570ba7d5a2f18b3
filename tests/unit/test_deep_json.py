"""Deeply nested JSON from a node is that node's bad answer, never an internal error.

`json.loads` raises RecursionError (not ValueError) on `[[[[...` a few thousand levels deep, and a document
that does parse a few hundred levels deep makes the code that later prints or re-dumps it hit the same
limit. Every parser of what a node, its containers or the head's API answer goes through
`parsing.parse_json`, which refuses both with ParseError; here each entry point gets the two hostile shapes
through its real parse path and must give its own per-node answer (a finding, a problem, None, its error).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkctl.cluster import NodeError, RunResult
from sparkctl.cluster.channel import Node
from sparkctl.errors import SparkctlError
from sparkctl.facts import docker_parse, parsing
from sparkctl.facts.parsing import ParseError, parse_json
from sparkctl.image import chain as images
from sparkctl.loadgen import inputs, report, request
from sparkctl.measure import vllm_bench as vllmbench
from sparkctl.orchestrate import model_pull, model_sync, verify_model
from sparkctl.remote import argv_verdict as argvjudge
from sparkctl.rules import nccl
from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]
SHAPES = {"list": "[" * 100_000, "object": '{"a":' * 50_000}
PARSEABLE_BUT_DEEP = "[" * 500 + "]" * 500  # json.loads takes it; repr() or json.dumps of it deeper in a stack fail
shapes = pytest.mark.parametrize("deep", list(SHAPES.values()), ids=list(SHAPES))


def _result(stdout: str, code: int = 0) -> RunResult:
    return RunResult(stdout, "", code, 0.1)


# --------------------------------------------------------------------------- the shared helper


@shapes
def test_parse_json_refuses_deep_nesting_with_its_own_error(deep: str) -> None:
    with pytest.raises(ParseError, match="nested too deeply"):
        parse_json(deep)
    with pytest.raises(ParseError, match="nested too deeply"):
        parse_json(deep.encode())


def test_parse_json_refuses_a_document_that_parses_but_is_too_deep_to_walk() -> None:
    assert len(json.loads(PARSEABLE_BUT_DEEP)) == 1  # what json alone accepts
    with pytest.raises(ParseError, match="nested too deeply"):
        parse_json(PARSEABLE_BUT_DEEP)


def test_parse_json_keeps_ordinary_documents_and_brackets_inside_strings() -> None:
    nested = "[" * parsing.MAX_JSON_DEPTH + "]" * parsing.MAX_JSON_DEPTH
    assert parse_json(nested) is not None
    doc = {"s": "[" * 5000 + "\\\"{" * 100, "t": ["]" * 10, {"u": [1, 2.5, None, True]}]}
    assert parse_json(json.dumps(doc)) == doc
    assert parse_json(json.dumps(doc).encode("utf-16")) == doc  # json.loads' encodings stay accepted


@pytest.mark.parametrize("bad", ["", "{", "nul", '{"a": 1} x', "1" * 5000, b"\xff\xfe\xfa", b'"\xc3"', None])
def test_parse_json_turns_every_other_failure_into_parse_error(bad: str | bytes) -> None:
    with pytest.raises(ParseError):
        parse_json(bad)  # type: ignore[arg-type]


tricky = st.text(alphabet='[]{}"\\ a\n\x00é', max_size=12)
values = st.recursive(st.none() | st.booleans() | st.integers() | tricky,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky, inner, max_size=3),
                      max_leaves=20)


@given(values, st.booleans(), st.integers(min_value=parsing.MAX_JSON_DEPTH - 2, max_value=parsing.MAX_JSON_DEPTH + 2))
@settings(max_examples=200, deadline=None)
def test_parse_json_depth_is_exact_whatever_the_strings_hold(value: Any, ascii_only: bool, depth: int) -> None:
    """Strings full of brackets, quotes and backslashes never change the depth counted: a value wrapped to
    exactly MAX_JSON_DEPTH levels comes back equal, one level more is refused."""
    wrapped = value
    inner = 1 if isinstance(value, (list, dict)) else 0
    for i in range(depth - inner):
        wrapped = [wrapped, "]\\\"["] if i % 2 else {"k[": wrapped}
    text = json.dumps(wrapped, ensure_ascii=ascii_only)
    levels = depth + _depth(value) - inner
    if levels <= parsing.MAX_JSON_DEPTH:
        assert parse_json(text) == wrapped
    else:
        with pytest.raises(ParseError, match="nested too deeply"):
            parse_json(text)


def _depth(v: Any) -> int:
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    return 0


def test_a_big_flat_document_is_checked_quickly() -> None:
    doc = json.dumps([{"name": f"model.layers.{i}.w", "shape": [4096, 4096], "dtype": "BF16"} for i in range(60_000)])
    t0 = time.perf_counter()
    json.loads(doc)
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    parse_json(doc)
    assert time.perf_counter() - t0 < 3 * plain + 0.5


# --------------------------------------------------------------------------- each entry point


@shapes
def test_argv_judge_ignores_a_deep_verdict_line(deep: str) -> None:
    good = argvjudge.MARK + json.dumps({"rank": 0, "ok": True})
    assert argvjudge.parse_output(f"{argvjudge.MARK}{deep}\n{good}\n") == {0: {"rank": 0, "ok": True}}


@shapes
def test_nccl_log_with_a_deep_fabric_event_still_parses(deep: str) -> None:
    log = nccl.parse(f"{nccl.FABRIC_MARK}{deep}\n{nccl.FABRIC_MARK}{json.dumps({'event': 'done'})}\n")
    assert [e["event"] for e in log.events] == ["done"]


@shapes
@pytest.mark.parametrize("code", [200, 500])
def test_docker_api_deep_answer_is_a_problem_of_that_section(deep: str, code: int) -> None:
    nonce = "n0nce"
    ps = f"HTTP/1.1 {code} OK\r\nServer: Docker/27.3.1 (linux)\r\n\r\n{deep}"
    out = f"socket unix:///run/docker.sock\n{ps}\n@@sparkctl {nonce} http {code}\n"
    facts = docker_parse.parse_docker_api(out, "", 0, nonce)
    assert facts.containers is None and "docker-ps" in facts.problems
    if code == 200:
        assert "nested too deeply" in facts.problems["docker-ps"]


@shapes
def test_docker_cli_json_deep_is_a_node_error(deep: str) -> None:
    node = SimpleNamespace(name="spark2", docker=lambda args, timeout=None: _result(deep))
    with pytest.raises(NodeError) as exc:
        Node.docker_json(node, ["inspect", "x"])  # type: ignore[arg-type]
    assert exc.value.node == "spark2"


@shapes
def test_docker_container_inspect_deep_is_a_parse_error(deep: str) -> None:
    with pytest.raises(ParseError, match="nested too deeply"):
        docker_parse.parse_container_inspect(deep)


@shapes
def test_image_versions_deep_label_and_probe_and_save_manifest(deep: str) -> None:
    img = docker_parse.Image("sha256:" + "a" * 64, ("t:1",), {images.LABEL_VERSIONS: deep}, ())
    assert images.read_versions(img) is None
    with pytest.raises(ParseError):
        images.parse_versions(f"@@versions {deep}\n")
    with pytest.raises(ParseError):
        images.parse_saved(f"/var/tmp/x\n{deep}")


@shapes
def test_vllm_bench_deep_result_names_the_node(deep: str) -> None:
    with pytest.raises(SparkctlError, match="spark1"):
        vllmbench.parse_result(f"{vllmbench.MARKER}\n{deep}", "spark1")


@shapes
def test_model_sync_scan_and_describe_deep_are_node_errors(deep: str) -> None:
    node = SimpleNamespace(name="spark3", run_script=lambda *a, **k: _result(deep))
    for fn in (model_sync.scan_node, model_sync.describe_node):
        with pytest.raises(NodeError) as exc:
            fn(node, "/m")  # type: ignore[arg-type]
        assert exc.value.node == "spark3"


@shapes
def test_model_pull_deep_answer_is_the_heads_error(deep: str) -> None:
    with pytest.raises(SparkctlError, match="spark1"):
        model_pull.answer_of(_result("{" + deep), "spark1", "python3")


@shapes
def test_model_pull_deep_progress_line_is_skipped(deep: str) -> None:
    class Session:
        polls = [True, False]

        def __init__(self) -> None:
            self.err = bytearray(f"@@progress {deep}\n@@progress {{\"bytes\": 1, \"total\": 2}}\n".encode())

        def poll(self, _: float) -> bool:
            return self.polls.pop(0)

        def finish(self) -> RunResult:
            return _result("")

    seen: list[tuple[int, int]] = []
    model_pull._drive(Session(), lambda b, t, _s: seen.append((b, t)), 0.0)
    assert seen == [(1, 2)]


@shapes
def test_verify_model_deep_scan_is_that_nodes_finding(deep: str) -> None:
    good = verify_model._scans({"spark1": _result(json.dumps({"ok": 1}))})[0]
    scans, findings = verify_model._scans({"spark1": _result(json.dumps({"ok": 1})), "spark2": _result(deep)})
    assert scans == good
    assert [(f.code, f.where) for f in findings] == [("node-scan-failed", "spark2")]


@shapes
def test_head_api_error_body_and_stream_events(deep: str) -> None:
    assert request._error_message(deep.encode()) == deep[:300]
    tracker = request._Tracker()
    tracker.feed([deep.encode(), b'{"choices": [{"delta": {"content": "x"}}]}'], 1.0)
    assert tracker.malformed == 1


@shapes
def test_local_json_files_deep_are_usage_errors(deep: str, tmp_path: Path) -> None:
    saved = tmp_path / "run.json"
    saved.write_text(deep)
    with pytest.raises(SparkctlError, match="not JSON"):
        report.load_saved(saved)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(f'"hello"\n{deep}\n')
    with pytest.raises(SparkctlError, match="line 2"):
        inputs.load_prompt_file(prompts)
    from sparkctl.measure import llama_benchy as llamabenchy

    with pytest.raises(SparkctlError, match="not JSON"):
        llamabenchy.read_result(saved, "spark1")


# --------------------------------------------------------------------------- whole commands, on local nodes


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    with served_scene(monkeypatch, tmp_path, NODES, {}) as ln:
        yield ln


@pytest.mark.parametrize("shape", list(SHAPES))
def test_audit_skips_a_deep_line_of_one_node(nodes: LocalNodes, capsys: Any, shape: str) -> None:
    for n in NODES:
        log = nodes.home(n) / ".sparkctl" / "t" / "audit.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"when": f"2026-01-0{n[-1]}T00:00:00Z", "who": "ann", "action": "up"})]
        log.write_text("\n".join(lines + ([SHAPES[shape]] if n == "spark2" else [])) + "\n")
    code, out, err = run(["--json", "audit"], capsys)
    assert code == 0, err
    assert "internal error" not in err
    assert [e["node"] for e in json.loads(out)["entries"]] == NODES


@pytest.mark.parametrize("shape", list(SHAPES))
def test_verify_model_with_a_deep_config_json_is_a_finding(nodes: LocalNodes, capsys: Any, tmp_path: Path,
                                                           shape: str) -> None:
    (tmp_path / "model" / "config.json").write_text(SHAPES[shape])
    code, out, err = run(["--json", "verify-model"], capsys)
    assert "internal error" not in err and "Traceback" not in err
    assert code == 1, err
    codes = {f["code"] for f in json.loads(out)["findings"]}
    assert "json-invalid" in codes, codes


@shapes
def test_build_ship_with_a_deep_save_manifest_names_the_head(deep: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkctl.orchestrate import build

    img = docker_parse.Image("sha256:" + "a" * 64, ("t:1",), {}, ("sha256:" + "b" * 64,))
    monkeypatch.setattr(build, "inspect_images", lambda node, tags: [img])
    head = SimpleNamespace(name="spark1", run=lambda *a, **k: RunResult(f"/var/tmp/x\n{deep}", "", 0, 0.1))
    cluster = SimpleNamespace(names=["spark1", "spark2"], node=lambda n: head)
    facts = {n: SimpleNamespace(image=lambda t: None, images=[], tools=["gzip"]) for n in ("spark1", "spark2")}
    board = SimpleNamespace(note=lambda *a: None)
    with pytest.raises(SparkctlError, match="spark1: docker save"):
        build.ship_images(cluster, ["t:1"], facts, {"spark2": SimpleNamespace(ship_note="")},  # type: ignore[arg-type]
                          board, ["spark2"])  # type: ignore[arg-type]


@shapes
def test_a_deep_download_marker_in_model_is_no_marker(deep: str, tmp_path: Path) -> None:
    """The marker lives in MODEL, which others may write: the node probes read a deep one as none."""
    from sparkctl.probes import hf_pull, model_node

    (tmp_path / model_node.MARKER).write_text(deep)
    assert hf_pull.read_marker(str(tmp_path)) is None
    doc = model_node.describe(str(tmp_path))
    assert doc["exists"] and doc.get("marker") is None
