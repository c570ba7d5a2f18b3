"""sparkctl bench's load shapes against the lab's stand-in on loopback: prompts of a length in tokens
(built and counted through the server's /tokenize), the server's usage beside sparkctl's counts,
Poisson arrivals (--request-rate), --duration and --num-prompts. No verdict depends on timing: the
arrivals are checked as the schedule sparkctl drew (benchmetrics.arrival_times), the rest as counts."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest

from sparkctl import benchmetrics, loadgen
from sparkctl.errors import CheckFailed
from sparkctl.lab.local import local_standin
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from sparkctl.lab.ckptgen import make_checkpoint

    model = tmp_path_factory.mktemp("standin") / "tiny"
    make_checkpoint(model, "tiny")
    with local_standin(model, env={"STANDIN_DECODE_TOK_S": "2000", "STANDIN_TTFT_S": "0.01"}) as url:
        yield url


def cfg(url: str, **kw: object) -> loadgen.BenchConfig:
    base: dict[str, object] = {"workloads": [loadgen.builtin_workload("prose")], "concurrency": [2], "requests": 4,
                               "warmup": 0, "max_tokens": 8}
    base.update(kw)
    return loadgen.BenchConfig(endpoint=loadgen.Endpoint.parse(url), model="m", **base)  # type: ignore[arg-type]


def test_tokenizer_builds_prompts_of_the_asked_length_each_with_its_tag(standin):
    tok = loadgen.Tokenizer(loadgen.Endpoint.parse(standin), "m", None)
    text, n = tok.prompt_of("[abc-1]", "a few words of filler", 40)
    assert n == 40 and len(tok.encode(text)) == 40 and text.startswith("[abc-1]")


def test_input_len_prompts_are_counted_by_the_server_too(standin):
    run = loadgen.run_bench(cfg(standin, input_len=24))
    lv = run.to_dict()["workloads"]["prose"][0]
    assert lv["completed"] == 4 and lv["prompt_tokens_built"] == 4 * 24
    # the stand-in counts a chat prompt as its tokenizer counts the text: the server's usage agrees
    assert lv["total_input_tokens"] == 4 * 24
    assert lv["total_output_tokens"] == 4 * 8 and lv["output_chunks"] >= 4
    assert all(r["prompt_tokens"] == 24 and r["prompt_tokens_built"] == 24 for r in lv["results"])


def test_input_len_on_a_server_without_tokenize_fails_naming_it(monkeypatch, standin):
    def no_tokenize(*a: object, **k: object) -> tuple[int, object]:
        return 404, {"detail": "Not Found"}

    monkeypatch.setattr(loadgen, "http_post_json", no_tokenize)
    with pytest.raises(CheckFailed, match="needs the server's /tokenize"):
        loadgen.run_bench(cfg(standin, input_len=8))


def test_request_rate_sends_on_vllms_poisson_schedule(standin):
    c = cfg(standin, requests=6, request_rate=50.0, seed=3, concurrency=[6])
    run = loadgen.run_bench(c)
    lv = run.levels[0]
    assert lv.request_rate == 50.0 and len(lv.ok) == 6
    doc = lv.to_dict()
    assert doc["request_rate"] == 50.0 and doc["max_concurrency"] == 6
    # each request is sent no earlier than its arrival in the seeded schedule (never before: a lower bound)
    sched = benchmetrics.arrival_times(6, 50.0, random.Random(3))
    for r, at in zip(lv.requests, sched, strict=True):
        assert r.start >= lv.started + at


def test_duration_without_num_prompts_runs_until_time_is_up(standin):
    c = cfg(standin, requests=None, duration=0.5, concurrency=[2])
    assert c.requests_for(2) is None
    lv = loadgen.run_bench(c).levels[0]
    assert lv.ok and not lv.failed and len(lv.requests) >= 2
    # no request is sent once the duration is up (0.25 s: between the clock check and the send)
    assert max(r.start for r in lv.requests) - min(r.start for r in lv.requests) <= 0.5 + 0.25


def test_cli_prints_n_and_vllms_metrics_and_json_names(standin, capsys):
    args = ["bench", "--url", standin, "--workload", "prose", "--concurrency", "1", "--num-prompts", "3",
            "--output-len", "8", "--warmup", "0", "--input-len", "16"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert "TPOT mean" in out and "n<10" not in out.split("TPOT")[0]
    assert "3 requests per level" in err and "16-token prompts" in err
    assert "input tokens: 48 built (/tokenize), the server counted 48" in out
    code, out, err = run_cli(["--json", *args], capsys)
    lv = json.loads(out)["workloads"]["prose"][0]
    assert lv["completed"] == 3 and lv["p90_ttft_ms"] is None and lv["n_ttft"] == 3
    assert lv["mean_tpot_ms"] is not None and lv["total_input_tokens"] == 48


def test_cli_load_shape_input_is_checked(capsys):
    for bad in (["--request-rate", "0"], ["--request-rate", "x"], ["--duration", "0"], ["--input-len", "0"],
                ["--num-prompts", "1", "--concurrency", "2"]):
        code, out, err = run_cli(["bench", "--url", "http://127.0.0.1:9", *bad], capsys)
        assert code == 2, (bad, err)
