"""`sparkctl bench`'s flow, top to bottom.

  run_bench(cfg)                         one endpoint
    warm-up                              loadgen.level.run_level, unmeasured, the built-in prompt
    every workload × every level         run_level; a level where nothing succeeded stops the run
  run_replicas(cfgs)                     several replicas' heads at once: one run_bench per head in its own
                                         thread, a LevelSync (loadgen.replicas) keeping the levels in step
  run_vllm_tool(settings, ...)           `--tool vllm`: `vllm bench serve` in the head's container, one run
                                         per level of the first workload, over one SSH connection (vllmbench)
  fetch_tokenizer + run_llama_benchy     `--tool llama-benchy`: the served model's tokenizer.json copied from
                                         the head, then llama-benchy from this machine, one run per level,
                                         its prompt text served on loopback (llamabenchy)

commands/bench.py parses the flags, calls these and prints; loadgen/ measures.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import CheckFailed
from ..loadgen.inputs import WARMUP_PROMPT, Workload
from ..loadgen.level import BenchConfig, BenchRun, ProgressSink, Sampling, level_bound_s, run_level
from ..loadgen.replicas import LevelSync, SyncedSink
from ..loadgen.request import Canceller, RequestResult
from ..measure import llama_benchy as llamabenchy
from ..measure import vllm_bench as vllmbench
from ..spec.settings import Settings
from ..threads import spawn, wait_all, wait_bounded


class _Stop(Exception):
    pass


def run_bench(cfg: BenchConfig, progress: ProgressSink | None = None, *,
              canceller: Canceller | None = None, run: BenchRun | None = None) -> BenchRun:
    """Warm-up, then every workload at every concurrency level. Ctrl-C ends it early with what was
    measured (run.interrupted); a level where no request succeeded ends it too (run.stopped).
    Ctrl-C reaches the main thread only: a run in another thread is stopped through `canceller`
    (its cancel(), from the main thread: run_replicas), and fills the `run` it is given, so what it
    measured can be read even while it is still winding down."""
    progress = progress or ProgressSink()
    run = run or BenchRun(cfg, started=time.time())
    canceller = canceller or Canceller()
    sampling = Sampling(cfg, os.urandom(4).hex())
    try:
        if canceller.stop.is_set():
            raise _Stop
        if cfg.warmup > 0:
            lv = run_level(cfg, sampling, Workload("warmup", (WARMUP_PROMPT,)), min(cfg.warmup, max(cfg.concurrency)),
                           cfg.warmup, canceller, progress, measure_spec=False, shaped=False)
            run.warmup = lv.requests
            if lv.interrupted:
                raise _Stop
            if not any(r.ok for r in lv.requests):
                run.stopped = f"no warm-up request succeeded: {_first_error(lv.requests)}"
                raise _Stop
        for wl in cfg.workloads:
            for c in cfg.concurrency:
                if canceller.stop.is_set():
                    raise _Stop
                lv = run_level(cfg, sampling, wl, c, cfg.requests_for(c), canceller, progress)
                run.levels.append(lv)
                if lv.interrupted:
                    raise _Stop
                if not lv.ok:
                    run.stopped = f"no request succeeded at {wl.name} C{c}: {_first_error(lv.requests)}"
                    raise _Stop
    except _Stop:
        pass
    except KeyboardInterrupt:  # between levels (e.g. while reading /metrics)
        canceller.cancel()
    run.interrupted = canceller.stop.is_set()
    for name in sampling.dropped:
        run.notes.append(f"the server refused `{name}` (HTTP 400); it was left out of the requests"
                         + (": outputs may end before max_tokens" if name == "ignore_eos" else ""))
    run.finished = time.time()
    return run


def run_replicas(cfgs: Sequence[BenchConfig], sinks: Sequence[ProgressSink], *, canceller: Canceller | None = None,
                 sync_timeout: float | None = None, join_s: float = 12.0) -> list[BenchRun]:
    """One run_bench per config (one per replica's head), side by side in threads, levels in step.
    Call it from the main thread: Ctrl-C there cancels every run (one shared Canceller) and returns what
    each measured (run.interrupted), waiting at most `join_s` for the runs to wind down. A run that ends
    early (run.stopped) leaves the others to go on. A bug in one run cancels the others and raises."""
    canceller = canceller or Canceller()
    n = len(cfgs)
    sync = LevelSync(n, sync_timeout if sync_timeout is not None else max(level_bound_s(c) for c in cfgs))
    now = time.time()
    runs = [BenchRun(cfg, started=now) for cfg in cfgs]
    errors: list[BaseException | None] = [None] * n

    def one(i: int) -> None:
        try:
            run_bench(cfgs[i], SyncedSink(sinks[i], sync, i), canceller=canceller, run=runs[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors[i] = exc
            canceller.cancel()
        finally:
            sync.leave(i)

    threads = [spawn(functools.partial(one, i), f"bench-replica{i}") for i in range(n)]
    try:
        wait_all(threads)
    except KeyboardInterrupt:
        canceller.cancel()
        sync.abort("interrupted")
        wait_bounded(threads, join_s)
    interrupted = canceller.stop.is_set()
    for run, done in zip(runs, threads, strict=True):
        if interrupted:
            run.interrupted = True
        if not done.is_set() or not run.finished:
            run.finished = time.time()
            if not done.is_set():
                run.notes.append(f"still winding down after {join_s:g} s: its last level may be missing")
        if sync.broken and sync.broken != "interrupted":
            run.notes.append(f"the replicas' levels went out of step ({sync.broken}); from there on each "
                             "replica went on alone, and the total adds levels that did not run together")
    for exc in errors:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            raise exc
    return runs


def _first_error(results: list[RequestResult]) -> str:
    for r in results:
        if r.error:
            return r.error
    return "no request finished"


def run_vllm_tool(s: Settings, ssh_config: str | Path | None, cfg: BenchConfig, doc: dict[str, Any],
                  say: Callable[[str], None]) -> tuple[dict[str, Any], str]:
    """`vllm bench serve` in the head's container of replica view `s`, one run per level of the first workload
    of `doc` (sparkctl's run, just measured), over one SSH connection to the head; its results (lists left
    out) and the side-by-side table."""
    from ..cluster import Cluster
    from ..spec.builders import CONTAINER, container_name, rank_docker_argv

    head, container = s.head, container_name(s.cluster_name, 0)
    task, levels = next(iter(doc["workloads"].items()))
    out: dict[str, Any] = {"container": container, "head": head, "workload_compared": task, "levels": []}
    pairs = []
    assert cfg.input_len is not None
    with Cluster([head], ssh_config) as cluster:
        node = cluster.node(head)
        for lv in levels:
            c = int(lv["concurrency"])
            argv = vllmbench.bench_serve_argv(
                base_url=f"http://127.0.0.1:{s.getint('PORT')}", model=cfg.model, tokenizer=str(s.get("MODEL")),
                input_len=cfg.input_len, output_len=cfg.max_tokens, num_prompts=int(lv["requests"]),
                max_concurrency=c, request_rate=cfg.request_rate, seed=cfg.seed, temperature=cfg.temperature,
                top_p=cfg.top_p)
            say(f"vllm bench serve in {container} on {head}, C={c}, {lv['requests']} prompts ...")
            r = node.run(rank_docker_argv(s.cluster_name, 0, vllmbench.exec_argv(CONTAINER, argv)), stdin=((cfg.api_key or "") + "\n").encode(),
                         timeout=level_bound_s(cfg) + 120)
            if r.exit_code != 0:
                raise CheckFailed(f"vllm bench serve in {container} on {head} exited {r.exit_code}: "
                                  f"{(r.stderr or r.stdout).strip()[-600:]}", node=head,
                                  fix="see its output; the serving image must have vLLM with `vllm bench serve`")
            theirs = vllmbench.parse_result(r.stdout, f"{head} ({container})")
            out["levels"].append({"concurrency": c, "argv": argv,
                                  "result": {k: v for k, v in theirs.items() if not isinstance(v, list)}})
            pairs.append((c, lv, theirs))
    return out, vllmbench.side_by_side(pairs)


def fetch_tokenizer(s: Settings, ssh_config: str | Path | None, dest: Path) -> Path:
    """The served model's tokenizer.json, copied from MODEL on the head of replica view `s` to `dest`
    (llama-benchy reads it locally instead of asking a hub)."""
    from ..cluster import Cluster

    head, src = s.head, f"{str(s.get('MODEL')).rstrip('/')}/tokenizer.json"
    with Cluster([head], ssh_config) as cluster:
        r = cluster.node(head).run(["cat", "--", src], timeout=120)
    if r.exit_code != 0 or not r.stdout.strip():
        raise CheckFailed(f"--tool llama-benchy needs the served model's tokenizer.json, and {src} on {head} "
                          f"cannot be read: {(r.stderr or 'empty').strip()[:300]}", node=head,
                          fix="a model folder with a tokenizer.json (what `transformers` saves for a fast tokenizer)")
    path = dest / "tokenizer.json"
    path.write_text(r.stdout, encoding="utf-8")
    return path


@contextlib.contextmanager
def serve_text(text: str) -> Iterator[str]:
    """A URL on loopback that answers `text` (llama-benchy's --book-url), for as long as the block runs."""
    body = text.encode("utf-8")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    spawn(httpd.serve_forever, "bench-llama-benchy-text")
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/prompts.txt"
    finally:
        httpd.shutdown()
        httpd.server_close()


def run_llama_benchy(cfg: BenchConfig, doc: dict[str, Any], tokenizer: Path, say: Callable[[str], None], *,
                     python: str = sys.executable, work: Path) -> tuple[dict[str, Any], str]:
    """llama-benchy from this machine on `cfg`'s endpoint, one run per level of the first workload of `doc`
    (sparkctl's run, just measured), on the same load; its own JSON per level, and the side-by-side table.
    Nothing is downloaded (llamabenchy's docstring says how); `work` is a folder it may write in."""
    assert cfg.input_len is not None
    task, levels = next(iter(doc["workloads"].items()))
    prompts = next((w.prompts for w in cfg.workloads if w.name == task), cfg.workloads[0].prompts)
    text = "\n\n".join(prompts[i % len(prompts)] for i in range(max(64, 4 * len(prompts))))
    env = llamabenchy.environment(os.environ, work)
    out: dict[str, Any] = {"tool": "llama-benchy", "workload_compared": task, "levels": []}
    pairs = []
    with serve_text(text) as book_url:
        for lv in levels:
            c = int(lv["concurrency"])
            result = work / f"llama-benchy-c{c}.json"
            argv = llamabenchy.argv(python=python, base_url=cfg.endpoint.url, model=cfg.model, tokenizer=str(tokenizer),
                                    input_len=cfg.input_len, output_len=cfg.max_tokens, concurrency=c,
                                    runs=llamabenchy.runs_for(int(lv["requests"]), c), book_url=book_url,
                                    result=str(result))
            say(f"llama-benchy on {cfg.endpoint.url}, C={c}, {llamabenchy.runs_for(int(lv['requests']), c)} runs ...")
            try:
                r = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True,  # noqa: S603 - fixed argv
                                   input=llamabenchy.stdin_for(cfg.api_key),
                                   timeout=level_bound_s(cfg) + 300, check=False)
            except subprocess.TimeoutExpired:
                raise CheckFailed(f"llama-benchy on {cfg.endpoint.url} did not finish C={c} in time") from None
            if r.returncode != 0:
                raise CheckFailed(f"llama-benchy exited {r.returncode}: {(r.stderr or r.stdout).strip()[-600:]}",
                                  fix=f"see its output; it is the optional extra: {llamabenchy.EXTRA}")
            theirs = llamabenchy.read_result(result, cfg.endpoint.url)
            out["levels"].append({"concurrency": c, "argv": argv[3:],  # no secret in it: the key went on stdin
                                   "result": theirs})
            pairs.append((c, lv, llamabenchy.level_of(theirs, c)))
    return out, llamabenchy.side_by_side(pairs)


def run_llama_benchy_tool(s: Settings, ssh_config: str | Path | None, cfg: BenchConfig, doc: dict[str, Any],
                          say: Callable[[str], None]) -> tuple[dict[str, Any], str]:
    """`--tool llama-benchy`: the tokenizer from the head of replica view `s`, then run_llama_benchy, in a
    temporary folder removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="sparkctl-llama-benchy-") as tmp:
        work = Path(tmp)
        tokenizer = fetch_tokenizer(s, ssh_config, work)
        return run_llama_benchy(cfg, doc, tokenizer, say, work=work)
