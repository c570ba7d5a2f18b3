"""Everything a node (or the service it runs) answers is untrusted: fuzz every parser of it.

Each parser gets garbage, wrong types, oversized and truncated input and must give either a result
(a finding) or a clean SparkctlError: never another exception, never an unbounded allocation. The
HTTP answers come from a real server on loopback, so `requests`' own failure modes are covered too.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sparkctl.cluster import NodeError, RunResult
from sparkctl.errors import SparkctlError
from sparkctl.facts import promtext
from sparkctl.facts.setup_facts import SetupFacts, setup_facts_from_probe
from sparkctl.loadgen import report, request
from sparkctl.orchestrate.status import metrics_summary
from sparkctl.probes.ckpt_scan import _encode
from sparkctl.remote.lockdir import LockOwner
from sparkctl.remote.readiness import MAX_JSON_ANSWER, PHASES, BadAnswer, HeadApi, phase_of
from sparkctl.remote.service import ContainerState, inspect_cluster
from sparkctl.spec.planner import CheckpointInfo, checkpoint_from_scan, kv_terms

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON values of every type, nested a little: what a hostile node can print where JSON is expected.
scalars = st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30) | \
    st.floats(allow_nan=True) | st.text(max_size=30)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
# Text with the characters that break naive parsers: control, non-ASCII, digits of other scripts.
nasty_text = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(list("²٣{}[]\":,\n\r\x00 -1e9")),
                     max_size=200)
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on this, not ValueError


# --------------------------------------------------------------------------- docker inspect JSON


def inspect_doc() -> st.SearchStrategy[Any]:
    labels = st.dictionaries(st.sampled_from(["sparkctl.rank", "sparkctl.config-hash", "sparkctl.content-hash",
                                              "x"]), json_values | nasty_text, max_size=3) | json_values
    state = st.fixed_dictionaries({}, optional={
        "Status": json_values, "Running": json_values, "ExitCode": json_values | nasty_text,
        "StartedAt": json_values | st.sampled_from(["2026-13-99T99:99:99Z", "9999-99-99T00:00:00", "x"]),
        "Error": json_values}) | json_values
    return st.fixed_dictionaries({}, optional={
        "Id": json_values, "Name": json_values, "Image": json_values, "RestartCount": json_values | nasty_text,
        "Config": st.fixed_dictionaries({}, optional={"Labels": labels}) | json_values, "State": state})


@FAST
@given(inspect_doc())
def test_container_state_from_any_inspect_object(doc: dict[str, Any]) -> None:
    c = ContainerState.from_inspect(doc)
    assert c.rank is None or (isinstance(c.rank, int) and 0 <= c.rank < 10**9)
    assert isinstance(c.exit_code, int) and abs(c.exit_code) < 10**9
    assert isinstance(c.restarts, int) and isinstance(c.running, bool)
    assert c.config_hash is None or isinstance(c.config_hash, str)
    assert len(c.id) <= 64 and len(c.name) <= 256 and len(c.error) <= 500
    assert c.uptime_s() is None or isinstance(c.uptime_s(), float)


def test_container_state_known_traps() -> None:
    c = ContainerState.from_inspect({"Config": {"Labels": {"sparkctl.rank": "²"}},  # isdigit() but not int()
                                     "State": {"ExitCode": "x", "Running": "false", "StartedAt": "2026-13-01T00:00:00"},
                                     "RestartCount": 10**400})
    assert (c.rank, c.exit_code, c.running, c.restarts) == (None, 0, False, 0)
    assert ContainerState.from_inspect({"Config": {"Labels": []}, "State": [], "Id": "a" * 10**6}).id == "a" * 64


@dataclass
class FakeNode:
    stdout: str
    exit_code: int = 0
    name: str = "n1"

    def run(self, argv: list[str], *, timeout: float | None = None, stdin: bytes | None = None) -> RunResult:
        return RunResult(self.stdout, "boom\n" if self.exit_code else "", self.exit_code, 0.0)


@FAST
@given(st.one_of(nasty_text, json_values.map(json.dumps), st.lists(inspect_doc(), max_size=3).map(json.dumps)))
def test_inspect_cluster_any_output(out: str) -> None:
    try:
        states = inspect_cluster(FakeNode(out), "c")  # type: ignore[arg-type]
    except NodeError as exc:
        assert exc.kind == "output" and "\n" not in exc.reason
        return
    assert all(isinstance(s, ContainerState) for s in states)


def test_inspect_cluster_deep_nesting_and_failure() -> None:
    with pytest.raises(NodeError, match="nested too deeply"):
        inspect_cluster(FakeNode(DEEP), "c")  # type: ignore[arg-type]
    with pytest.raises(NodeError, match="cannot list containers: boom"):
        inspect_cluster(FakeNode("", exit_code=1), "c")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- log phases


PHASE_LINES = ["INFO rendezvous of 4 ranks", "Starting to load model /models/lab", "Loading weights took 3s",
               "Capturing CUDA graph shapes", "INFO:     Application startup complete."]


@FAST
@given(st.lists(st.sampled_from(PHASE_LINES) | st.text(max_size=300)
                | st.binary(max_size=300).map(lambda b: b.decode("latin-1")), max_size=20))
def test_phase_of_any_lines(lines: list[str]) -> None:
    order = ["starting", *(name for name, _ in PHASES)]
    got = phase_of(lines)
    # The furthest phase any single line shows (log order does not matter: ranks interleave)...
    assert got == max((phase_of([ln]) for ln in lines), key=order.index, default="starting")
    # ...so more lines never move it back.
    assert order.index(phase_of([*lines, "Loading weights"])) >= order.index(got)


def test_phase_of_huge_lines_is_linear() -> None:
    lines = ["Loading " * 200_000, "\x00\xff" * 500_000, "Application startup complete" + "x" * 1_000_000]
    assert phase_of(lines) == "ready"  # linear time: bench/suite_timings.py


# ----------------------------------------------------------------------------------- lock owner


@FAST
@given(st.one_of(nasty_text, json_values.map(json.dumps),
                 st.fixed_dictionaries({"who": json_values, "pid": json_values, "since": json_values,
                                        "command": json_values, "token": json_values}).map(json.dumps)))
def test_lock_owner_parse_any_text(text: str) -> None:
    owner = LockOwner.parse(text)
    assert owner is None or (isinstance(owner.pid, int) and isinstance(owner.who, str) and len(owner.who) <= 256)


def test_lock_owner_known_traps() -> None:
    assert LockOwner.parse(DEEP) is None
    assert LockOwner.parse('{"who":"a","pid":1e400,"since":"s","command":"c","token":"t"}') is None  # inf
    assert LockOwner.parse('{"who":"a","pid":' + "9" * 5000 + ',"since":"s","command":"c","token":"t"}') is None
    assert LockOwner.parse("x" * 10_000_000) is None
    ok = LockOwner("me@h", 7, "now", "up", "tok")
    assert LockOwner.parse(ok.to_json() + "\ntrailing") == ok


# -------------------------------------------------------------------------------------- setup's probe

SETUP_SECTIONS = ("user", "uid", "groups", "sudo", "nofile", "memlock", "machine-id", "ssh-route", "infiniband",
                  "ip-addr", "neigh", "earlyoom", "ctk", "docker-group", "files", "fabric-doc")


def _setup_probe(parts: list[tuple[str, str, int]]) -> str:
    return "".join(f"@@sparkctl 00112233aabbccdd begin {name}\n{body}\n@@sparkctl 00112233aabbccdd end {name} {rc}\n"
                   for name, body, rc in parts)


@FAST
@given(st.lists(st.tuples(st.sampled_from(SETUP_SECTIONS),
                          st.one_of(nasty_text, json_values.map(json.dumps),
                                    st.sampled_from(["client\t10.0.0.1\n[{\"dev\": 7}]", "netdev\th\te\tx",
                                                     "@@dev\teth0\n[{\"lladdr\": []}]", "/etc/x\tabsent", DEEP[:5000]])),
                          st.sampled_from([0, 0, 1])), max_size=12))
def test_setup_facts_from_any_probe_output(parts: list[tuple[str, str, int]]) -> None:
    facts = setup_facts_from_probe(_setup_probe(parts), "00112233aabbccdd")
    assert isinstance(facts, SetupFacts) and all(isinstance(p, str) for p in facts.problems)
    assert all(isinstance(m, str) for macs in facts.neighbours.values() for m in macs)


def test_setup_facts_known_traps() -> None:
    f = setup_facts_from_probe(_setup_probe([("ip-addr", DEEP, 0), ("infiniband", "netdev\th\te0\t1", 0),
                                             ("neigh", "@@dev\t$(x)\n[]", 0), ("fabric-doc", DEEP, 0)]),
                               "00112233aabbccdd")
    assert f.ports == [] and f.neighbours == {} and f.fabric_doc is None and len(f.problems) >= 3


# -------------------------------------------------------------------------------------- metrics


@FAST
@given(st.lists(st.one_of(nasty_text, st.sampled_from(["vllm:num_requests_running", "vllm:kv_cache_usage_perc"]).map(
    lambda n: n + ' {a="b"} '), st.from_regex(r"vllm:num_requests_waiting\{[^}]*\} (nan|inf|-inf|1e999|x|7)",
                                             fullmatch=True)), max_size=20).map("\n".join))
def test_metrics_summary_any_text(text: str) -> None:
    out = metrics_summary(text)
    assert set(out) <= {"requests_running", "requests_waiting", "kv_cache_usage", "generation_tokens"}
    assert all(isinstance(v, float) for v in out.values())


def test_metrics_summary_bounded_on_a_huge_answer() -> None:
    # Series are summed (one per label set), over the first 20,000 lines only: the work is bounded.
    assert metrics_summary("vllm:num_requests_running 1\n" * 2_000_000) == {"requests_running": 20000.0}


# --------------------------------------------------------------------------- checkpoint scan


def _blob(text: str) -> dict[str, Any]:
    return {"data": _encode(text.encode("utf-8", "surrogatepass"), "zlib")}


def scan_doc() -> st.SearchStrategy[Any]:
    """What a hostile node's ckpt_scan could print (the planner reads it from the head)."""
    config = st.fixed_dictionaries({}, optional={
        k: st.integers(min_value=-5, max_value=10**40) | json_values
        for k in ("num_hidden_layers", "num_nextn_predict_layers", "kv_lora_rank", "qk_rope_head_dim",
                  "index_head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size", "head_dim")})
    shard_names = st.sampled_from(["a.safetensors", "../x", ".h", "b/c.safetensors"]) | st.text(max_size=5)
    index = st.fixed_dictionaries({}, optional={
        "weight_map": st.dictionaries(st.text(max_size=8), shard_names | json_values, max_size=3) | json_values,
        "metadata": st.fixed_dictionaries({}, optional={"total_size": json_values}) | json_values})
    summary = st.fixed_dictionaries({}, optional={
        "weight_map": json_values | st.just(True), "total_size": st.integers(min_value=-(2**70), max_value=2**70),
        "shards": st.dictionaries(shard_names, json_values, max_size=3) | json_values, "error": json_values})
    entry = st.just({"missing": True}) | json_values | nasty_text.map(_blob)
    js = st.fixed_dictionaries({}, optional={
        "config.json": entry | config.map(json.dumps).map(_blob) | st.just(_blob(DEEP)),
        "model.safetensors.index.json": entry | index.map(json.dumps).map(_blob) |
        summary.map(lambda x: {"summary": x})}) | json_values
    sizes = st.integers(min_value=-(2**70), max_value=2**70) | json_values | nasty_text
    files = st.dictionaries(shard_names, st.fixed_dictionaries({"size": sizes}) | json_values, max_size=3) | json_values
    return st.fixed_dictionaries({"files": files, "json": js}, optional={"error": json_values})


@FAST
@given(scan_doc())
def test_checkpoint_from_any_scan(doc: dict[str, Any]) -> None:
    try:
        info = checkpoint_from_scan(doc, Path("/m"), "n1")
    except SparkctlError:
        return
    assert isinstance(info, CheckpointInfo)
    assert all(s.size is None or 0 <= s.size <= 1 << 50 for s in info.shards)
    assert all("/" not in s.name and not s.name.startswith(".") for s in info.shards)
    try:  # the planner's reading of a config a node handed over
        terms = kv_terms(info.config, "fp8", 4, Path("/m"))
    except SparkctlError:
        return
    assert all(0 <= t.bytes_per_token < 2**64 for t in terms)


def test_checkpoint_scan_known_traps() -> None:
    good = {"config.json": _blob(json.dumps({"num_hidden_layers": 2}))}
    for bad in [{"files": {"a.safetensors": {"size": "12"}}, "json": good},
                {"files": {"a.safetensors": {"size": -1}}, "json": good},
                {"files": {"a.safetensors": {"size": 10**30}}, "json": good},
                {"files": [1], "json": good},
                {"files": {}, "json": {"config.json": _blob("{\"a\": " + "1" * 5000 + "}")}},
                {"files": {}, "json": {**good, "model.safetensors.index.json": _blob('{"weight_map": []}')}},
                {"files": {}, "json": {**good, "model.safetensors.index.json":
                                       _blob('{"weight_map": {"w": "../../etc/passwd"}}')}},
                {"files": {}, "json": {**good, "model.safetensors.index.json":
                                       {"summary": {"weight_map": True, "shards": {"../../etc/passwd": {}}}}}},
                {"files": {}, "json": {**good, "model.safetensors.index.json": {"summary": {"weight_map": False}}}},
                {"error": {"code": "dir-missing", "message": "no"}}, {"error": "boom"}, {"json": [], "files": {}},
                {"json": {"config.json": "x"}, "files": {}}, {"json": {"config.json": {"data": 5}}, "files": {}},
                {"json": {"config.json": {"data": "!!notbase64"}}, "files": {}}, []]:
        with pytest.raises(SparkctlError):
            checkpoint_from_scan(bad, Path("/m"), "n1")


# ------------------------------------------------------------------------------ the head's HTTP


class Answers:
    """What the loopback server answers next: (status, content type, body) per path."""

    def __init__(self) -> None:
        self.by_path: dict[str, tuple[int, bytes]] = {}
        self.truncate = False


@pytest.fixture(scope="module")
def head() -> Iterator[tuple[str, Answers]]:
    answers = Answers()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            if self.command == "POST":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, body = answers.by_path.get(self.path, (404, b""))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) + (100 if answers.truncate else 0)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answers
    finally:
        server.shutdown()
        server.server_close()


bodies = st.one_of(nasty_text.map(str.encode), st.binary(max_size=100), json_values.map(lambda v: json.dumps(v).encode()),
                   st.fixed_dictionaries({"data": json_values}).map(lambda v: json.dumps(v).encode()),
                   st.fixed_dictionaries({"choices": json_values}).map(lambda v: json.dumps(v).encode()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from([200, 200, 401, 500, 503]), bodies, st.booleans())
@example(200, b"[1, 2]", False)  # JSON, but not an object: every reader must say so, not crash
@example(200, b'"data"', False)
@example(200, b"null", False)
@example(200, b'{"data": {"id": "m"}, "choices": "x"}', False)
def test_head_api_any_answer(head: tuple[str, Answers], status: int, body: bytes, truncate: bool) -> None:
    url, answers = head
    answers.truncate = truncate
    for path in ("/v1/models", "/v1/chat/completions", "/metrics", "/health"):
        answers.by_path[path] = (status, body)
    api = HeadApi(url, "k", timeout=2)
    try:
        models = api.models()
        assert all(isinstance(m, str) for m in models)
    except (SparkctlError, requests.RequestException):  # wait_ready's guard turns these into findings
        pass
    try:
        text, _ = api.chat("m", "hi", timeout=2)
        assert isinstance(text, str)
    except (SparkctlError, requests.RequestException):
        pass
    assert api.metrics() is None or isinstance(api.metrics(), str)
    assert api.health() in (status, None)


def test_head_api_shapes_and_caps(head: tuple[str, Answers]) -> None:
    url, answers = head
    answers.truncate = False
    api = HeadApi(url, timeout=5)
    answers.by_path["/v1/models"] = (200, b"[1, 2]")
    with pytest.raises(BadAnswer, match="not an object"):
        api.models()
    answers.by_path["/v1/models"] = (200, b'{"data": [{"id": 5}, {"id": "m"}, "x"]}')
    assert api.models() == ["m"]
    answers.by_path["/v1/models"] = (200, b"{" + b" " * (MAX_JSON_ANSWER + 10) + b"}")
    with pytest.raises(BadAnswer, match="larger than"):
        api.models()
    answers.by_path["/v1/chat/completions"] = (200, b'{"choices": [{"message": {"content": ["x"]}, "text": "t"}]}')
    assert api.chat("m", "p")[0] == "t"
    answers.by_path["/v1/chat/completions"] = (200, DEEP.encode())
    with pytest.raises(BadAnswer, match="not JSON"):
        api.chat("m", "p")


# ----------------------------------------------------------------------------- bench's parsers


@FAST
@given(st.text(max_size=400))
def test_bench_prometheus_and_error_bodies(text: str) -> None:
    for s in promtext.parse(text):
        assert isinstance(s.value, float) and isinstance(s.labels, dict)
    assert isinstance(request._error_message(text.encode("utf-8", "surrogatepass")), str)


def test_bench_prometheus_pathological_line_is_fast() -> None:
    # Garbage in, no sample out (and no exception); its speed: bench/suite_timings.py
    assert list(promtext.parse("a{" + "}" * 20_000 + " x\n" + ("a{" + '"' * 20_000) + "\n" + "a " * 20_000)) == []


@FAST
@given(st.lists(st.binary(max_size=80) | json_values.map(lambda v: json.dumps(v).encode()), max_size=8))
def test_bench_stream_tracker_any_events(events: list[bytes]) -> None:
    tr = request._Tracker()
    tr.feed(events, 1.0)
    tr.feed_bulk(b"".join(b"data: " + e + b"\n\n" for e in events), 2.0)
    assert tr.usage_tokens is None or isinstance(tr.usage_tokens, int)
    assert tr.error is None or len(tr.error) <= 300


@FAST
@given(st.fixed_dictionaries({"schema": st.just(report.SCHEMA), "workloads": st.dictionaries(
    st.text(max_size=5), json_values, max_size=2)}))
def test_bench_saved_run_any_content(tmp_path_factory: pytest.TempPathFactory, doc: dict[str, Any]) -> None:
    p = tmp_path_factory.mktemp("saved") / "run.json"
    p.write_text(json.dumps(doc))
    try:
        base = report.load_saved(p)
    except SparkctlError:
        return
    assert isinstance(report.render_compare(base, base), str) and isinstance(report.render_table(base), str)


def test_bench_saved_run_damaged_level_is_bad_input(tmp_path: Path) -> None:
    p = tmp_path / "run.json"
    for levels in ([{"concurrency": "x"}], [{"concurrency": 2, "agg_tok_s": "fast", "ttft_s": {"p50": None}}],
                   [{"concurrency": 1, "per_stream_tok_s": {"mean": 1.0}, "ttft_s": {"p50": 1.0},
                     "spec_decode": {"drafts": 1, "accepted": "many"}}], "abc"):
        p.write_text(json.dumps({"schema": report.SCHEMA, "workloads": {"prose": levels}}))
        with pytest.raises(SparkctlError, match="damaged"):
            report.load_saved(p)
