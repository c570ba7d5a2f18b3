"""`sparkctl bench` on several replicas: every replica's head measured at once (levels in step), each
replica's table and the total; `--replica R`; a head that is down; Ctrl-C; --save/--compare.

Two replicas of TP4 on eight nodes (GPUS_PER_NODE=1): heads spark1 and spark5. PORT is one knob, the
same on every head (they are different hosts), so the ssh config points the heads' HostNames at two
loopback addresses, 127.0.0.1 and 127.0.0.2, with one server bound to each on the same port."""

from __future__ import annotations

import _thread
import json
import os
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkctl.errors import UsageError
from sparkctl.facts import promtext
from sparkctl.loadgen import inputs, level, replicas, report
from sparkctl.orchestrate import bench as flow
from sparkctl.remote import headapi
from tests.conftest import run_cli
from tests.kit.local import free_port, local_standin
from tests.unit.test_bench import models_or, ok_stream, send_json, stream_app, tiny_server

NODES = [f"spark{i}" for i in range(1, 9)]
HEADS = {"spark1": "127.0.0.1", "spark5": "127.0.0.2"}
KEY = "sk-bench-secret-4f1d"
QUICK = ["--workload", "code", "--concurrency", "1,2", "--requests", "2", "--max-tokens", "16", "--warmup", "1"]


def cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, port: int, *, nodes: list[str] = NODES,
            hostnames: dict[str, str] = HEADS) -> list[str]:
    """Settings of len(nodes)/4 replicas (env), an ssh config; returns the global flags for run_cli."""
    ssh = tmp_path / "ssh_config"
    ssh.write_text("".join(f"Host {n}\n  HostName {hostnames.get(n, '127.0.0.1')}\n  User root\n" for n in nodes))
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k in ("SPARKCTL_ENV_FILE", "RECIPE", "TP", "DCP", "VLLM_API_KEY", "REPLICAS", "MASTER_ADDR"):
            monkeypatch.delenv(k)
    env = {"NODES": " ".join(nodes), "MODEL": "/models/x", "PORT": str(port), "SERVED_MODEL_NAME": "m",
           "TP": "4", "GPUS_PER_NODE": "1", "VLLM_API_KEY": KEY}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return ["--ssh-config", str(ssh)]


def served(url: str) -> float:
    """Requests the stand-in has completed (its /metrics' vllm:request_success_total)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:  # noqa: S310 - loopback
        samples = promtext.parse(resp.read().decode())
    return promtext.total(samples, "vllm:request_success_total") or 0.0


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, list[str]]]:
    """Two stand-in engines on the same port, at 127.0.0.1 and 127.0.0.2, both asking for KEY."""
    from sparkctl.lab.ckptgen import make_checkpoint

    model = tmp_path_factory.mktemp("standin") / "tiny"
    make_checkpoint(model, "tiny")
    env = {"STANDIN_DECODE_TOK_S": "2000", "STANDIN_TTFT_S": "0.02", "STANDIN_ACCEPT_RATE": "0.5"}
    spec = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}', "--api-key", KEY]
    port = free_port()
    with local_standin(model, env=env, extra_args=spec, host="127.0.0.1", port=port) as one, \
            local_standin(model, env=env, extra_args=spec, host="127.0.0.2", port=port) as two:
        yield port, [one, two]


def test_every_replica_is_measured_at_once_and_the_total_is_their_sum(heads, monkeypatch, tmp_path, capsys):
    port, urls = heads
    flags = cluster(monkeypatch, tmp_path, port)
    before = [served(u) for u in urls]
    code, out, err = run_cli([*flags, "--json", "bench", *QUICK], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == report.MULTI_SCHEMA
    assert [(d["replica"], d["head"], d["url"]) for d in doc["replicas"]] == [
        (0, "spark1", f"http://127.0.0.1:{port}"), (1, "spark5", f"http://127.0.0.2:{port}")]
    # each head served the warm-up and both levels (1 + 2 + 2 requests), counted on the server
    assert [served(u) - n for u, n in zip(urls, before, strict=True)] == [5.0, 5.0]
    assert KEY not in out and KEY not in err
    total = doc["total"]["workloads"]["code"]
    per = [d["workloads"]["code"] for d in doc["replicas"]]
    assert [t["concurrency"] for t in total] == [1, 2]
    for k, t in enumerate(total):
        levels = [p[k] for p in per]
        assert all(lv["agg_tok_s"] for lv in levels)
        assert t["agg_tok_s"] == pytest.approx(sum(lv["agg_tok_s"] for lv in levels), abs=1e-3)
        assert t["throughput_tok_s"] == pytest.approx(sum(lv["throughput_tok_s"] for lv in levels), abs=1e-3)
        assert (t["requests"], t["ok"], t["failed"], t["replicas"], t["of"]) == (4, 4, 0, 2, 2)
        assert t["streams"] == 2 * t["concurrency"] and t["completion_tokens"] == 4 * 16
        assert t["ttft_p50_worst_s"] == max(lv["ttft_s"]["p50"] for lv in levels) and not t["partial"]
    # the text: each replica's table headed by its replica and head, then the total
    code, out, err = run_cli([*flags, "bench", *QUICK], capsys)
    assert code == 0, err
    i0 = out.index(f"replica 0 (head spark1, http://127.0.0.1:{port}):")
    i1 = out.index(f"replica 1 (head spark5, http://127.0.0.2:{port}):")
    it = out.index("Total over 2 replicas")
    assert i0 < i1 < it and out.count("| Task | C1 per-stream | C2 agg |") == 2
    assert "| code | 2 | 4 | 2/2 | 4/4 | 0 |" in out[it:]
    assert "bench 2 replicas together" in err and KEY not in out + err


def test_replica_r_measures_that_replicas_head_only(heads, monkeypatch, tmp_path, capsys):
    port, urls = heads
    flags = cluster(monkeypatch, tmp_path, port)
    before = [served(u) for u in urls]
    code, out, err = run_cli([*flags, "--json", "bench", "--replica", "1", *QUICK], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["replica"], doc["head"], doc["url"]) == (1, "spark5", f"http://127.0.0.2:{port}")
    assert doc["schema"] == report.SCHEMA and "total" not in doc and "replicas" not in doc
    assert [served(u) - n for u, n in zip(urls, before, strict=True)] == [0.0, 5.0]
    for bad in ("2", "-1"):
        code, _, err = run_cli([*flags, "bench", "--replica", bad, *QUICK], capsys)
        assert code == 2 and f"replica {bad} does not exist" in err and "(0..1;" in err
    code, _, err = run_cli([*flags, "bench", "--replica", "1", "--url", urls[0], *QUICK], capsys)
    assert code == 2 and "--url and --replica" in err
    assert [served(u) - n for u, n in zip(urls, before, strict=True)] == [0.0, 5.0]


def test_a_head_that_is_down_fails_the_command_naming_its_replica(heads, monkeypatch, tmp_path, capsys):
    port, urls = heads
    flags = cluster(monkeypatch, tmp_path, port, hostnames={"spark1": "127.0.0.1", "spark5": "127.0.0.3"})
    before = [served(u) for u in urls]
    code, out, err = run_cli([*flags, "bench", *QUICK], capsys)
    assert code == 1 and out == ""
    assert f"replica 1 (head spark5): cannot reach the API at http://127.0.0.3:{port}" in err
    assert "connection refused" in err and "replica 0" not in err and "Traceback" not in err
    assert [served(u) - n for u, n in zip(urls, before, strict=True)] == [0.0, 0.0]  # nothing was measured


def test_one_replica_failing_mid_run_stops_it_alone_and_fails_the_command(monkeypatch, tmp_path, capsys):
    """Replica 1's head lists the model but answers every request 503: its run stops after the warm-up
    and leaves the level sync, so replica 0 is not held at the next level and measures every level."""
    port = free_port()

    def overloaded(h: Any) -> None:
        send_json(h, 503, {"error": {"message": "overloaded"}})

    with tiny_server(stream_app(ok_stream(4), delay=0.005), "127.0.0.1", port), \
            tiny_server(lambda h: models_or(h, overloaded), "127.0.0.2", port):
        flags = cluster(monkeypatch, tmp_path, port)
        code, out, err = run_cli([*flags, "--json", "bench", "--workload", "code", "--concurrency", "1,2,4",
                                  "--requests", "4", "--max-tokens", "4", "--warmup", "1", "--timeout", "5"], capsys)
    assert code == 1
    doc = json.loads(out)
    r0, r1 = doc["replicas"]
    assert [lv["ok"] for lv in r0["workloads"]["code"]] == [4, 4, 4] and not r0["stopped"]
    assert not any("out of step" in n for n in r0["notes"])  # not held until the sync's timeout either
    assert r1["workloads"] == {} and "no warm-up request succeeded" in r1["stopped"]
    assert [(t["replicas"], t["partial"]) for t in doc["total"]["workloads"]["code"]] == [(1, True)] * 3
    summary = err[err.index("request(s) failed"):]
    assert "replica 1 (head spark5): 1 × http:" in summary and "overloaded" in summary
    assert "replica 0" not in summary


def test_levels_run_in_step_across_replicas():
    """A level starts on any replica only once every replica has ended the level before: replica 1's head
    is slow, and replica 0 still waits for it at every level's start."""
    order: list[tuple[int, str, str]] = []
    lock = threading.Lock()

    class Record(level.ProgressSink):
        def __init__(self, r: int) -> None:
            self.r = r

        def level_started(self, workload: str, concurrency: int, total: int) -> None:
            with lock:
                order.append((self.r, "start", f"{workload} C{concurrency}"))

        def level_done(self, lv: level.LevelResult) -> None:
            with lock:
                order.append((self.r, "done", f"{lv.workload} C{lv.concurrency}"))

    port = free_port()
    with tiny_server(stream_app(ok_stream(4)), "127.0.0.1", port) as fast, \
            tiny_server(stream_app(ok_stream(4), delay=0.03), "127.0.0.2", port) as slow:
        cfgs = [level.BenchConfig(endpoint=headapi.Endpoint.parse(u), model="m", workloads=[inputs.builtin_workload("list")],
                              concurrency=[1, 2, 4], requests=4, warmup=1, max_tokens=4, timeout=5.0)
                for u in (fast, slow)]
        runs = flow.run_replicas(cfgs, [Record(0), Record(1)])
    assert all(not r.failures() and not r.stopped and len(r.levels) == 3 for r in runs)
    labels = ["warmup C1", "list C1", "list C2", "list C4"]
    for prev, nxt in zip(labels, labels[1:], strict=False):
        last_done = max(order.index((r, "done", prev)) for r in (0, 1))
        first_start = min(order.index((r, "start", nxt)) for r in (0, 1))
        assert last_done < first_start, (prev, nxt, order)


def test_level_sync_a_party_that_leaves_or_a_timeout_never_holds_the_others():
    sync = replicas.LevelSync(2)
    results: list[bool] = []
    th = threading.Thread(target=lambda: results.append(sync.arrive(0, "x C1")), daemon=True)
    th.start()
    sync.leave(1)  # party 1 ended (stopped early, failed): party 0 goes on without it
    th.join(10)
    assert not th.is_alive() and results == [True] and sync.broken is None
    sync = replicas.LevelSync(2, timeout=0.05)  # party 1 never arrives: the wait ends, the sync is broken
    assert sync.arrive(0, "x C2") is False and sync.broken and "replica(s) 1" in sync.broken
    assert sync.arrive(0, "x C4") is False  # broken stays broken: no more waiting
    sync = replicas.LevelSync(2)
    sync.abort("interrupted")
    assert sync.arrive(1, "x C1") is False


def test_ctrl_c_cancels_every_replica_and_reports_what_was_measured(monkeypatch, tmp_path, capsys):
    """The signal reaches the main thread only: it cancels both replicas' streams (their requests end
    as cancelled, not failed), the command prints what it has and exits 130. The interrupt comes when
    both heads have a request of the first level (3 s each), so it lands inside that level."""
    port = free_port()
    slow = stream_app(ok_stream(60), delay=0.05)
    posts = {"n": 0}
    lock = threading.Lock()

    def app(h: Any) -> None:
        if h.command == "POST":
            with lock:
                posts["n"] += 1
                if posts["n"] == 2:  # one request of C1 on each head
                    _thread.interrupt_main()
        slow(h)

    with tiny_server(app, "127.0.0.1", port), tiny_server(app, "127.0.0.2", port):
        flags = cluster(monkeypatch, tmp_path, port)
        code, out, err = run_cli([*flags, "--json", "bench", "--workload", "prose", "--concurrency", "1,2",
                                  "--requests", "2", "--max-tokens", "60", "--warmup", "0"], capsys)
    assert code == 130, err
    doc = json.loads(out)
    assert doc["interrupted"] is True and posts["n"] == 2
    for d in doc["replicas"]:
        assert d["interrupted"] and d["failures"]["total"] == 0, d["failures"]
        (lv,) = d["workloads"]["prose"]
        assert lv["interrupted"] and lv["cancelled"] == 1, d["workloads"]
        assert not any("winding down" in n for n in d["notes"])
    assert "Traceback" not in err


def test_save_and_compare_like_with_like(heads, monkeypatch, tmp_path, capsys):
    port, urls = heads
    flags = cluster(monkeypatch, tmp_path, port)
    multi, single = tmp_path / "multi.json", tmp_path / "single.json"
    code, _, err = run_cli([*flags, "bench", *QUICK, "--save", str(multi)], capsys)
    assert code == 0, err
    saved = report.load_saved(multi)
    assert saved["schema"] == report.MULTI_SCHEMA and [d["replica"] for d in saved["replicas"]] == [0, 1]
    code, out, err = run_cli([*flags, "--json", "bench", *QUICK, "--compare", str(multi)], capsys)
    assert code == 0, err
    cmp = json.loads(out)["compare"]
    assert [c["replica"] for c in cmp["replicas"]] == [0, 1]
    assert cmp["total"]["code"]["C2"]["old"] == saved["total"]["workloads"]["code"][1]["agg_tok_s"]
    code, out, err = run_cli([*flags, "bench", *QUICK, "--compare", str(multi)], capsys)
    assert code == 0, err
    assert "replica 1: Change against" in out and "Change of the total" in out
    # --replica R compares with the saved run's replica R
    code, out, err = run_cli([*flags, "--json", "bench", "--replica", "1", *QUICK, "--compare", str(multi),
                              "--save", str(single)], capsys)
    assert code == 0, err
    assert json.loads(out)["compare"]["base"]["url"] == f"http://127.0.0.2:{port}"
    # anything else is refused before measuring (exit 2), not compared wrongly
    before = [served(u) for u in urls]
    code, _, err = run_cli([*flags, "bench", "--url", urls[0], *QUICK, "--compare", str(multi)], capsys)
    assert code == 2 and "holds a run of 2 replicas together" in err
    code, _, err = run_cli([*flags, "bench", *QUICK, "--compare", str(single)], capsys)
    assert code == 2 and "holds a run of one endpoint" in err and "measures 2 replicas" in err
    code, _, err = run_cli([*flags, "bench", "--replica", "0", *QUICK, "--compare", str(single)], capsys)
    assert code == 2 and "holds a run of replica 1; this run measures replica 0" in err
    assert [served(u) - n for u, n in zip(urls, before, strict=True)] == [0.0, 0.0]
    # a damaged file of several replicas is bad input
    bad = json.loads(multi.read_text())
    bad["replicas"][1]["workloads"]["code"][1]["agg_tok_s"] = "fast"
    multi.write_text(json.dumps(bad))
    with pytest.raises(UsageError, match="damaged"):
        report.load_saved(multi)


def test_one_replica_keeps_todays_output(heads, monkeypatch, tmp_path, capsys):
    port, urls = heads
    flags = cluster(monkeypatch, tmp_path, port, nodes=NODES[:4])
    before = [served(u) for u in urls]
    code, out, err = run_cli([*flags, "--json", "bench", *QUICK], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert list(doc) == ["schema", "url", "model", "started", "duration_s", "config", "definitions", "interrupted",
                         "stopped", "notes", "warmup", "workloads", "failures"]
    assert doc["schema"] == report.SCHEMA and doc["url"] == f"http://127.0.0.1:{port}"
    code, out, err = run_cli([*flags, "bench", *QUICK], capsys)
    assert code == 0, err
    assert out.startswith("| Task | C1 per-stream | C2 agg | accepted tok/step | TTFT p50 (s) |")
    assert "replica" not in out and "Total over" not in out and "replica" not in err
    assert err.startswith(f"bench http://127.0.0.1:{port} model m:")
    assert [served(u) - n for u, n in zip(urls, before, strict=True)] == [10.0, 0.0]


def test_a_saved_run_of_replicas_any_damage_is_bad_input(tmp_path):
    from tests.unit.test_bench import seed_doc

    docs = [{"replica": r, "head": h, **seed_doc(1.0 + r / 10)} for r, h in enumerate(HEADS)]
    good = {"schema": report.MULTI_SCHEMA, "replicas": docs, "total": replicas.total_doc(docs)}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(good))
    assert report.load_saved(path) == good
    assert "| prose | 2 | 4 | 2/2 |" in report.render_total(good["total"])
    damaged: list[Any] = [
        {**good, "replicas": "two"}, {**good, "replicas": [1, 2]}, {**good, "replicas": []},
        {k: v for k, v in good.items() if k != "total"}, {**good, "total": []},
        {**good, "total": {**good["total"], "workloads": {"prose": [{"concurrency": 2}]}}},
        {**good, "total": {**good["total"], "workloads": {"prose": [{**good["total"]["workloads"]["prose"][0],
                                                                      "agg_tok_s": "fast"}]}}},
        {**good, "replicas": [{**docs[0], "replica": "0"}, docs[1]]},
        {**good, "replicas": [{k: v for k, v in docs[0].items() if k != "workloads"}, docs[1]]},
    ]
    for doc in damaged:
        path.write_text(json.dumps(doc))
        with pytest.raises(UsageError, match="damaged|not a sparkctl bench run"):
            report.load_saved(path)
