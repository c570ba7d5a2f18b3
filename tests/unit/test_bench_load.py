"""sparkctl bench's load shapes against the lab's stand-in on loopback: prompts of a length in tokens
(built and counted through the server's /tokenize), the server's usage beside sparkctl's counts,
Poisson arrivals (--request-rate), --duration and --num-prompts. No verdict depends on timing: the
arrivals are checked as the schedule sparkctl drew (benchmetrics.arrival_times), the rest as counts."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest

from sparkctl.errors import CheckFailed
from sparkctl.loadgen import inputs, level, request
from sparkctl.measure import metrics as benchmetrics
from sparkctl.orchestrate import bench as flow
from sparkctl.remote import headapi
from tests.conftest import run_cli
from tests.kit.local import local_standin


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from sparkctl.lab.ckptgen import make_checkpoint

    model = tmp_path_factory.mktemp("standin") / "tiny"
    make_checkpoint(model, "tiny")
    with local_standin(model, env={"STANDIN_DECODE_TOK_S": "2000", "STANDIN_TTFT_S": "0.01"}) as url:
        yield url


def cfg(url: str, **kw: object) -> level.BenchConfig:
    base: dict[str, object] = {"workloads": [inputs.builtin_workload("prose")], "concurrency": [2], "requests": 4,
                               "warmup": 0, "max_tokens": 8}
    base.update(kw)
    return level.BenchConfig(endpoint=headapi.Endpoint.parse(url), model="m", **base)  # type: ignore[arg-type]


def test_tokenizer_builds_prompts_of_the_asked_length_each_with_its_tag(standin):
    tok = request.Tokenizer(headapi.Endpoint.parse(standin), "m", None)
    text, n = tok.prompt_of("[abc-1]", "a few words of filler", 40)
    assert n == 40 and len(tok.encode(text)) == 40 and text.startswith("[abc-1]")


def test_input_len_prompts_are_counted_by_the_server_too(standin):
    run = flow.run_bench(cfg(standin, input_len=24))
    lv = run.to_dict()["workloads"]["prose"][0]
    assert lv["completed"] == 4 and lv["prompt_tokens_built"] == 4 * 24
    # the stand-in counts a chat prompt as its tokenizer counts the text: the server's usage agrees
    assert lv["total_input_tokens"] == 4 * 24
    assert lv["total_output_tokens"] == 4 * 8 and lv["output_chunks"] >= 4
    assert all(r["prompt_tokens"] == 24 and r["prompt_tokens_built"] == 24 for r in lv["results"])


def test_input_len_on_a_server_without_tokenize_fails_naming_it(monkeypatch, standin):
    def no_tokenize(*a: object, **k: object) -> tuple[int, object]:
        return 404, {"detail": "Not Found"}

    monkeypatch.setattr(headapi.HeadApi, "post_json", no_tokenize)
    with pytest.raises(CheckFailed, match="needs the server's /tokenize"):
        flow.run_bench(cfg(standin, input_len=8))


def test_request_rate_sends_on_vllms_poisson_schedule(standin):
    c = cfg(standin, requests=6, request_rate=50.0, seed=3, concurrency=[6])
    run = flow.run_bench(c)
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
    lv = flow.run_bench(c).levels[0]
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


# ============================================================================ --tool vllm

FAKE_VLLM = r'''#!/usr/bin/env python3
"""Stands in for `vllm bench serve` in the head's container: records its argv and environment, writes a
result where --result-dir/--result-filename say, as vLLM's --save-result does."""
import json, os, sys
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1]
with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
    f.write(json.dumps({"argv": args, "key": os.environ.get("OPENAI_API_KEY")}) + "\n")
print("============ Serving Benchmark Result ============")
n = int(opt("--num-prompts"))
res = {"completed": n, "total_input_tokens": n * int(opt("--random-input-len")),
       "total_output_tokens": n * int(opt("--random-output-len")), "mean_ttft_ms": 12.5, "mean_tpot_ms": 0.5,
       "output_throughput": 100.0, "ttfts": [0.01] * n}
with open(os.path.join(opt("--result-dir"), opt("--result-filename")), "w") as f:
    json.dump(res, f)
'''


# A `docker` whose one container is $FAKE_CONTAINER: `container inspect NAME` answers for it alone, and
# `exec [-i] NAME CMD...` runs CMD here (the container's part dropped). Every call is logged.
FAKE_DOCKER = r'''#!/bin/sh
echo "$*" >> "$FAKE_DOCKER_LOG"
case "$1" in
  container) [ "$3" = "$FAKE_CONTAINER" ]; exit $? ;;
  exec) shift; [ "$1" = "-i" ] && shift; name="$1"; shift
        [ "$name" = "$FAKE_CONTAINER" ] || { echo "Error: No such container: $name" >&2; exit 1; }
        exec "$@" ;;
esac
exit 1
'''


class _LocalNode:
    """Runs what `bench --tool vllm` sends the head under the real sh, with the fake `docker` above and the
    fake `vllm` on PATH."""

    def __init__(self, env: dict[str, str], calls: list[list[str]]) -> None:
        self.env, self.calls = env, calls

    def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None, env: object = None):
        import subprocess

        from sparkctl.cluster import RunResult

        self.calls.append(list(argv))
        p = subprocess.run(argv, input=stdin, capture_output=True, env=self.env, timeout=60, check=False)
        return RunResult(p.stdout.decode(), p.stderr.decode(), p.returncode, 0.0)


def fake_cluster(monkeypatch: pytest.MonkeyPatch, node: object) -> None:
    """`cluster.Cluster` of the head spark1 alone, whose node is `node` (what `bench --tool ...` runs there)."""
    from sparkctl import cluster

    class FakeCluster:
        def __init__(self, names: list[str], ssh_config: object) -> None:
            assert names == ["spark1"]

        def __enter__(self) -> FakeCluster:
            return self

        def __exit__(self, *a: object) -> None:
            pass

        def node(self, name: str) -> object:
            return node

    monkeypatch.setattr(cluster, "Cluster", FakeCluster)


@pytest.mark.parametrize("running", ["sparkctl-rank0", "sparkctl-sparkctl-rank0"])
def test_tool_vllm_runs_vllm_bench_serve_in_the_heads_container_with_the_same_load(standin, capsys, tmp_path,
                                                                                    monkeypatch, running):
    """The head's container is the default cluster's `sparkctl-rank0`, or `sparkctl-sparkctl-rank0` for a
    service an earlier sparkctl started (the name it gave then): either is the one the bench runs in."""
    import os

    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("vllm", FAKE_VLLM), ("docker", FAKE_DOCKER)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    log = tmp_path / "vllm.log"
    calls: list[list[str]] = []
    node_env = {"PATH": f"{bindir}:/usr/bin:/bin", "FAKE_VLLM_LOG": str(log), "TMPDIR": str(tmp_path),
                "FAKE_DOCKER_LOG": str(tmp_path / "docker.log"), "FAKE_CONTAINER": running}

    fake_cluster(monkeypatch, _LocalNode(node_env, calls))
    port = standin.rsplit(":", 1)[1]
    ssh = tmp_path / "ssh_config"
    ssh.write_text("Host spark1\n  HostName 127.0.0.1\n  User root\n")
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k in ("SPARKCTL_ENV_FILE", "RECIPE", "TP", "DCP", "VLLM_API_KEY", "REPLICAS", "CLUSTER_NAME"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NODES", "spark1 spark2 spark3 spark4")
    monkeypatch.setenv("MODEL", "/models/x y")
    monkeypatch.setenv("PORT", port)
    monkeypatch.setenv("SERVED_MODEL_NAME", "m")
    monkeypatch.setenv("BENCH_KEY", "s3cret-key")
    code, out, err = run_cli(["--ssh-config", str(ssh), "bench", "--tool", "vllm", "--workload", "prose",
                              "--concurrency", "1,2", "--num-prompts", "2", "--output-len", "8", "--warmup", "0",
                              "--input-len", "16", "--api-key-env", "BENCH_KEY"], capsys)
    assert code == 0, err
    runs = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["argv"][r["argv"].index("--max-concurrency") + 1] for r in runs] == ["1", "2"]
    a = runs[0]["argv"]
    assert a[:2] == ["bench", "serve"] and a[a.index("--base-url") + 1] == f"http://127.0.0.1:{port}"
    assert a[a.index("--tokenizer") + 1] == "/models/x y"  # one word, spaces and all
    assert (a[a.index("--random-input-len") + 1], a[a.index("--random-output-len") + 1],
            a[a.index("--num-prompts") + 1]) == ("16", "8", "2")
    assert "--ignore-eos" in a and runs[0]["key"] == "s3cret-key"  # the key reached vLLM's client ...
    assert not any("s3cret" in w for c in calls for w in c)  # ... on stdin, on no command line
    execs = [ln for ln in (tmp_path / "docker.log").read_text().splitlines() if ln.startswith("exec")]
    assert len(execs) == 2 and all(ln.startswith(f"exec -i {running} sh -c") for ln in execs), execs
    assert "| mean TTFT (ms) |" in out and "| 12.5 |" in out and "vllm bench serve" in out
    assert not list(tmp_path.glob("tmp*"))  # the result's temp dir is removed


def test_tool_vllm_refuses_url(capsys):
    code, out, err = run_cli(["bench", "--tool", "vllm", "--url", "http://127.0.0.1:9"], capsys)
    assert code == 2 and "head's container" in err


def test_cli_duration_and_request_rate_levels_of_no_fixed_size(standin, capsys):
    code, out, err = run_cli(["--json", "bench", "--url", standin, "--workload", "prose", "--concurrency", "2",
                              "--duration", "0.3", "--request-rate", "20", "--output-len", "4", "--warmup", "0"],
                             capsys)
    assert code == 0, err
    assert "sent for 0.3 s per level" in err and "Poisson arrivals at 20 req/s" in err
    doc = json.loads(out)
    lv = doc["workloads"]["prose"][0]
    assert doc["config"]["num_prompts"] == {"C2": None} and lv["request_rate"] == 20.0 and lv["completed"] >= 1
