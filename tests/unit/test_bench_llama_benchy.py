"""`bench --tool llama-benchy`: llama-benchy from this machine on the same endpoint and load, its result beside
sparkctl's, nothing downloaded. Offline against the lab's stand-in on loopback: a fake llama-benchy (a
`llama_benchy` package ahead of the real one on the path) records what it was given and checks it could run
without a network; with the real llama-benchy 0.4 installed (the optional extra), one real run too."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from sparkctl.loadgen import inputs, level
from sparkctl.measure import llama_benchy as llamabenchy
from sparkctl.orchestrate import bench as flow
from sparkctl.remote import headapi
from tests.conftest import run_cli
from tests.unit.test_bench_load import fake_cluster
from tests.unit.test_bench_load import standin as _standin

standin = _standin  # test_bench_load's stand-in on loopback, a module fixture

FAKE = r'''
"""Stands in for llama-benchy 0.4: records its argv and environment, reads its prompt text from --book-url
and its tokenizer from --tokenizer (a local file), writes a result as its --format json --save-result does."""
import json, os, sys, urllib.request
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1]
with urllib.request.urlopen(opt("--book-url"), timeout=10) as r:
    book = r.read().decode()
json.load(open(opt("--tokenizer")))
with open(os.environ["FAKE_LB_LOG"], "a") as f:
    f.write(json.dumps({"argv": args, "book": book[:200], "offline": os.environ.get("HF_HUB_OFFLINE"),
                        "home": os.environ.get("HOME"),
                        "cmdline": open("/proc/self/cmdline", "rb").read().decode("utf-8", "replace")}) + "\n")
c = int(opt("--concurrency"))
m = lambda v: {"mean": v, "std": 0.0, "values": [v]}
res = {"version": "0.4.0", "model": opt("--model"), "max_concurrency": c, "benchmarks": [
    {"concurrency": c, "context_size": 0, "prompt_size": int(opt("--pp")), "response_size": int(opt("--tg")),
     "is_context_prefill_phase": False, "e2e_ttft": m(20.0), "tg_req_throughput": m(50.0), "tg_throughput": m(50.0 * c)}]}
json.dump(res, open(opt("--save-result"), "w"))
'''

TOKENIZER = {"version": "1.0", "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1}, "unk_token": "[UNK]"}}


@pytest.fixture
def fake_llama_benchy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "fake" / "llama_benchy"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(FAKE)
    log = tmp_path / "llama-benchy.log"
    monkeypatch.syspath_prepend(str(pkg.parent))
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    monkeypatch.setenv("FAKE_LB_LOG", str(log))
    return log


class _Node:
    def __init__(self, files: dict[str, str], calls: list[list[str]]) -> None:
        self.files, self.calls = files, calls

    def run(self, argv: list[str], *, stdin: bytes | None = None, timeout: float | None = None, env: object = None):
        from sparkctl.cluster import RunResult

        self.calls.append(list(argv))
        assert argv[:2] == ["cat", "--"]
        if argv[2] in self.files:
            return RunResult(self.files[argv[2]], "", 0, 0.0)
        return RunResult("", f"cat: {argv[2]}: No such file or directory", 1, 0.0)


def _cluster(monkeypatch: pytest.MonkeyPatch, files: dict[str, str], calls: list[list[str]]) -> None:
    fake_cluster(monkeypatch, _Node(files, calls))


def _settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, port: str) -> Path:
    for k in list(os.environ):
        if k in ("SPARKCTL_ENV_FILE", "RECIPE", "TP", "DCP", "VLLM_API_KEY", "REPLICAS"):
            monkeypatch.delenv(k)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NODES", "spark1 spark2 spark3 spark4")
    monkeypatch.setenv("MODEL", "/models/x y")
    monkeypatch.setenv("PORT", port)
    monkeypatch.setenv("SERVED_MODEL_NAME", "m")
    ssh = tmp_path / "ssh_config"
    ssh.write_text("Host spark1\n  HostName 127.0.0.1\n  User root\n")
    return ssh


def test_tool_llama_benchy_runs_it_on_the_same_load_with_nothing_downloaded(standin, fake_llama_benchy, tmp_path,
                                                                            monkeypatch, capsys):
    calls: list[list[str]] = []
    _cluster(monkeypatch, {"/models/x y/tokenizer.json": json.dumps(TOKENIZER)}, calls)
    ssh = _settings_env(monkeypatch, tmp_path, standin.rsplit(":", 1)[1])
    monkeypatch.setenv("BENCH_KEY", "s3cret-key")
    save = tmp_path / "run.json"
    code, out, err = run_cli(["--ssh-config", str(ssh), "bench", "--tool", "llama-benchy", "--workload", "prose",
                              "--concurrency", "1,2", "--num-prompts", "3", "--output-len", "8", "--warmup", "0",
                              "--input-len", "16", "--api-key-env", "BENCH_KEY", "--save", str(save)], capsys)
    assert code == 0, err
    assert calls == [["cat", "--", "/models/x y/tokenizer.json"]]  # the served model's own tokenizer, from the head
    runs = [json.loads(x) for x in fake_llama_benchy.read_text().splitlines()]
    a = runs[0]["argv"]
    assert a[a.index("--base-url") + 1] == f"{standin}/v1" and a[a.index("--model") + 1] == "m"
    assert (a[a.index("--pp") + 1], a[a.index("--tg") + 1]) == ("16", "8") and "--exact-tg" in a
    assert [(r["argv"][r["argv"].index("--concurrency") + 1], r["argv"][r["argv"].index("--runs") + 1])
            for r in runs] == [("1", "3"), ("2", "2")]  # 3 requests per level: ceil(3 / C) batches of C
    assert a[a.index("--book-url") + 1].startswith("http://127.0.0.1:")  # its text, served here on loopback
    assert inputs.PROMPTS["prose"][0] in runs[0]["book"]
    assert all(r["offline"] == "1" and r["home"] != os.environ.get("HOME") for r in runs)
    assert "| mean TTFT (ms) |" in out and "| 20.0 |" in out and "llama-benchy" in out
    doc = json.loads(save.read_text())  # --save keeps the tool's own JSON, the key masked in its argv
    assert doc["llama_benchy"]["levels"][1]["result"]["benchmarks"][0]["tg_throughput"]["mean"] == 100.0
    assert "s3cret" not in save.read_text()
    # the key reaches llama-benchy's own argv, never its process's command line (ps, /proc/PID/cmdline)
    assert all(r["argv"][r["argv"].index("--api-key") + 1] == "s3cret-key" for r in runs)
    assert all("s3cret" not in r["cmdline"] for r in runs)


def test_tool_llama_benchy_without_a_tokenizer_json_on_the_head_says_so(standin, fake_llama_benchy, tmp_path,
                                                                       monkeypatch, capsys):
    _cluster(monkeypatch, {}, [])
    ssh = _settings_env(monkeypatch, tmp_path, standin.rsplit(":", 1)[1])
    code, out, err = run_cli(["--ssh-config", str(ssh), "bench", "--tool", "llama-benchy", "--workload", "prose",
                              "--concurrency", "1", "--num-prompts", "1", "--output-len", "4", "--warmup", "0"], capsys)
    assert code == 1 and "tokenizer.json" in err and "spark1" in err and "Traceback" not in err
    assert not fake_llama_benchy.exists()  # llama-benchy never started


def test_tool_llama_benchy_not_installed_is_bad_input(monkeypatch, capsys):
    monkeypatch.setattr(llamabenchy, "available", lambda: False)
    code, out, err = run_cli(["bench", "--tool", "llama-benchy"], capsys)
    assert code == 2 and "sparkctl-launcher[llama-benchy]" in err


def test_the_side_by_side_table_reads_llama_benchys_definitions() -> None:
    mine = {"mean_ttft_ms": 22.0, "per_stream_tok_s": {"mean": 40.0}, "output_throughput": 80.0}
    theirs = {"concurrency": 2, "e2e_ttft": {"mean": 20.0}, "tg_req_throughput": {"mean": 50.0},
              "tg_throughput": {"mean": 100.0}}
    text = llamabenchy.side_by_side([(2, mine, llamabenchy.level_of({"benchmarks": [theirs]}, 2))])
    assert "| mean TTFT (ms) | 22.0 | 20.0 | +10.0% |" in text
    assert "| per-request decode tok/s | 40.00 | 50.00 | -20.0% |" in text
    assert "| output / generation tok/s (all requests) | 80.0 | 100.0 | -20.0% |" in text
    assert llamabenchy.level_of({"benchmarks": [{**theirs, "is_context_prefill_phase": True}]}, 2) is None


REAL = importlib.util.find_spec("llama_benchy") is not None and importlib.util.find_spec("tokenizers") is not None


# ./one-shot.sh installs the extra; under CI=true a missing llama-benchy fails this test instead of skipping it
@pytest.mark.skipif(not REAL and os.environ.get("CI") != "true",
                    reason="llama-benchy is not installed (the optional extra sparkctl-launcher[llama-benchy])")
def test_the_real_llama_benchy_runs_offline_on_the_stand_in(standin, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for p in inputs.PROMPTS["prose"] for w in p.split()} | {"[UNK]"})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = level.BenchConfig(endpoint=headapi.Endpoint.parse(standin), model="m", concurrency=[2], requests=2,
                            warmup=0, max_tokens=8, input_len=16, workloads=[inputs.builtin_workload("prose")])
    doc = flow.run_bench(cfg).to_dict()  # sparkctl's run first, as `bench --tool llama-benchy` does
    said: list[str] = []
    work = tmp_path / "work"
    work.mkdir()
    out, side = flow.run_llama_benchy(cfg, doc, tmp_path / "tokenizer.json", said.append, python=sys.executable,
                                      work=work)
    run = llamabenchy.level_of(out["levels"][0]["result"], 2)
    assert run is not None and run["tg_req_throughput"]["mean"] > 0 and run["e2e_ttft"]["mean"] > 0
    assert "| per-request decode tok/s |" in side and said == ["llama-benchy on " + standin + ", C=2, 1 runs ..."]
