"""`sparkctl bench`: vLLM's serving metrics and the model card's throughput table, on a running service.

Without --url it measures the head's API from the settings: http://<head>:PORT, where <head> is the
HostName the ssh config gives the first node's alias, and the model is SERVED_MODEL_NAME.
With several replicas it measures every replica's head at once (one run per head, the same config,
the levels in step) and adds the total; `--replica R` measures one of them.
The flow is orchestrate.bench (run_bench, run_replicas, run_vllm_tool: `vllm bench serve` in the head's
container); the measuring is sparkctl.loadgen (the metrics: sparkctl.measure.metrics). This module is input,
progress and output.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import signals
from ..errors import CheckFailed, Failure, UsageError
from ..loadgen.inputs import (
    DEFAULT_WORKLOADS,
    Workload,
    builtin_workload,
    load_prompt_file,
    parse_int_list,
)
from ..loadgen.level import MIN_REQUESTS, BenchConfig, BenchRun, LevelResult, ProgressSink, describe_load
from ..loadgen.replicas import total_doc
from ..loadgen.report import (
    MULTI_SCHEMA,
    compare,
    compare_total,
    is_replicas_doc,
    load_saved,
    render_compare,
    render_details,
    render_table,
    render_total,
    render_total_compare,
    summarize_failures,
)
from ..loadgen.request import RequestResult, list_models
from ..measure import llama_benchy as llamabenchy
from ..measure import vllm_bench as vllmbench
from ..orchestrate import bench as flow
from ..output import finish, warn
from ..remote.headapi import Endpoint

MAX_ERROR_LINES = 20  # per-request failure lines shown while running; the summary counts them all


@click.command("bench")
@click.option("--url", metavar="URL", help="OpenAI API base URL (default: the head's, http://<head>:PORT).")
@click.option("--model", metavar="NAME", help="Model name to request (default: SERVED_MODEL_NAME, or the "
              "first model the server lists when --url is given).")
@click.option("--workload", metavar="LIST", help="Built-in prompt sets: prose,code,list (default: all three; "
              "only the prompt file when --prompt-file is given alone).")
@click.option("--prompt-file", metavar="FILE", help="Your own prompts: one per line (or *.jsonl); a task named after the file.")
@click.option("--concurrency", metavar="LIST", default="1,2,4,8", show_default=True, help="Concurrency levels.")
@click.option("--num-prompts", "--requests", "n_requests", type=click.IntRange(min=1), metavar="N",
              help=f"Requests per level (default: {MIN_REQUESTS} or 2 × the level's concurrency, whichever "
              "is more; none with --duration). A pP percentile needs 100/(100 − P) of them: p90 10, p99 100.")
@click.option("--duration", type=click.FloatRange(min=0.1), metavar="S",
              help="Per level: send requests for S seconds (those in flight then finish).")
@click.option("--request-rate", type=click.FloatRange(min=0.0, min_open=True), metavar="R",
              help="Requests per second, Poisson arrivals as vLLM's benchmark (--concurrency caps those in "
              "flight, as its --max-concurrency). Default: a closed loop of C streams.")
@click.option("--seed", type=int, default=0, show_default=True, metavar="N", help="Seed of the Poisson arrivals.")
@click.option("--input-len", type=click.IntRange(min=1), metavar="N",
              help="Prompts of N tokens, built and counted with the served model's tokenizer through the "
              "server's /tokenize (vLLM's); the server's own count is reported beside it.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, metavar="N",
              help="Unmeasured requests before the first level.")
@click.option("--output-len", "--max-tokens", "max_tokens", type=click.IntRange(min=1), default=256,
              show_default=True, metavar="N",
              help="Output tokens per request (forced with ignore_eos where the server supports it).")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=300.0, show_default=True, metavar="S",
              help="Limit for one request, connect to last token, in seconds.")
@click.option("--save", metavar="FILE", help="Keep this run (JSON) for a later --compare.")
@click.option("--compare", "compare_file", metavar="FILE", help="Print the change against a saved run.")
@click.option("--api-key-env", metavar="VAR", help="Environment variable holding the API key (default: VLLM_API_KEY).")
@click.option("--replica", type=int, metavar="R", help="Measure replica R's head only (default: every replica's "
              "head, together, and the total).")
@click.option("--tool", type=click.Choice(["sparkctl", "vllm", "llama-benchy"]), default="sparkctl", show_default=True,
              help="vllm: also run vLLM's own `vllm bench serve` in the head's container on the same load "
              f"(random prompts of --input-len tokens, default {vllmbench.DEFAULT_INPUT_LEN}) and print both side by side. "
              "llama-benchy: also run llama-benchy (the optional extra sparkctl-launcher[llama-benchy]) from this machine on "
              "the same endpoint and load, with the served model's tokenizer.json from the head; nothing is downloaded.")
@click.pass_obj
def command(g: object, url: str | None, model: str | None, workload: str | None, prompt_file: str | None,
            concurrency: str, n_requests: int | None, duration: float | None, request_rate: float | None,
            seed: int, input_len: int | None, warmup: int, max_tokens: int, timeout: float,
            save: str | None, compare_file: str | None, api_key_env: str | None, replica: int | None,
            tool: str) -> None:
    """vLLM's serving metrics (TTFT, TPOT, ITL, E2EL, throughput: `vllm bench serve`'s definitions) and the
    model card's table (decode tok/s per stream and aggregate, TTFT, accepted tokens/step)."""
    from ..options import Globals

    assert isinstance(g, Globals)
    levels = parse_int_list(concurrency, "--concurrency")
    if n_requests is not None and n_requests < max(levels) and request_rate is None and duration is None:
        raise UsageError(f"--num-prompts {n_requests} is fewer than the concurrency {max(levels)}: a level needs "
                         "at least one request per stream", fix=f"use --num-prompts {max(levels)} or more")
    if url and replica is not None:
        raise UsageError("--url and --replica both name what to measure", fix="pass one of them")
    if tool == "llama-benchy" and not llamabenchy.available():
        raise UsageError("--tool llama-benchy: llama-benchy is not installed for this Python",
                         fix=f"{llamabenchy.EXTRA} (llama-benchy 0.4)")
    if tool != "sparkctl":
        if url:
            raise UsageError(f"--tool {tool} needs the cluster's settings (the head's container or model folder), "
                             "not --url", fix="leave --url out (and pick a replica with --replica R)")
        if duration is not None and n_requests is None:
            raise UsageError(f"--tool {tool} needs a number of requests per level, not only --duration",
                             fix="add --num-prompts N")
        input_len = input_len or vllmbench.DEFAULT_INPUT_LEN
        if replica is None:
            replica = 0
    workloads = _workloads(workload, prompt_file)
    base = load_saved(compare_file) if compare_file else None  # a bad file fails before measuring
    if save:
        _check_writable(Path(save))
    targets, model, api_key = _target(g, url, model, api_key_env, replica)
    if base is not None and compare_file:
        base = _base_for(base, targets, compare_file)
    model = _model(targets, model, api_key, timeout)
    cfgs = [BenchConfig(endpoint=t.endpoint, model=model, api_key=api_key, workloads=workloads,
                                concurrency=levels, requests=n_requests, warmup=warmup, max_tokens=max_tokens,
                                timeout=timeout, duration=duration, request_rate=request_rate, seed=seed,
                                input_len=input_len) for t in targets]
    if len(targets) > 1:
        _bench_replicas(g, targets, cfgs, base, save)
        return
    (target,), (cfg,) = targets, cfgs
    endpoint = target.endpoint
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    sink = RichProgress(err, enabled=g.verbosity >= 0)
    if g.verbosity >= 0:
        err.print(f"bench {endpoint.url}{target.named} model {model}: {', '.join(w.name for w in workloads)} at "
                  f"C{', C'.join(map(str, levels))}, {describe_load(cfg)}", markup=False)
    with sink:
        run = flow.run_bench(cfg, sink)
    doc = run.to_dict()
    if target.replica is not None:  # --replica R: which replica this one-endpoint document measured
        doc = {"replica": target.replica, "head": target.head, **doc}
    side = ""
    if tool != "sparkctl" and not run.interrupted and doc["workloads"]:
        say = (lambda m: err.print(m, markup=False)) if g.verbosity >= 0 else (lambda m: None)
        view = g.settings().replica(target.replica or 0)
        if tool == "vllm":
            doc["vllm_bench_serve"], side = flow.run_vllm_tool(view, g.ssh_config_path(), cfg, doc, say)
        else:
            doc["llama_benchy"], side = flow.run_llama_benchy_tool(view, g.ssh_config_path(), cfg, doc, say)
    if base is not None:
        doc["compare"] = compare(doc, base)
    if save:
        Path(save).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    _report(g, doc, run, base, save, side)
    if run.interrupted:
        _finish(g, doc, _interrupted())
    problems = summarize_failures(doc)
    if run.stopped and not problems:
        problems = [run.stopped]
    _finish(g, doc, CheckFailed(
        f"{doc['failures']['total'] or 'some'} request(s) failed:\n  " + "\n  ".join(problems),
        fix="see the per-request lines above; the table counts only requests that finished",
        failures=[Failure(None, "request", p, None) for p in problems]) if problems else None)


@dataclass(frozen=True)
class Target:
    """One endpoint to measure: --url's, the only replica's head, or replica `replica`'s head."""

    endpoint: Endpoint
    replica: int | None = None  # None: --url, or a cluster of one replica (today's document)
    head: str | None = None

    @property
    def label(self) -> str:
        return f"replica {self.replica} (head {self.head})"

    @property
    def named(self) -> str:
        return "" if self.replica is None else f" ({self.label})"


def _bench_replicas(g: Any, targets: list[Target], cfgs: list[BenchConfig], base: dict[str, Any] | None,
                    save: str | None) -> None:
    """Every replica's head at once, levels in step; each replica's table, then the total."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    cfg = cfgs[0]
    if g.verbosity >= 0:
        err.print(f"bench {len(targets)} replicas together, model {cfg.model}: "
                  f"{', '.join(w.name for w in cfg.workloads)} at C{', C'.join(map(str, cfg.concurrency))} per "
                  f"replica, {describe_load(cfg)}", markup=False)
        for t in targets:
            err.print(f"  {t.label}: {t.endpoint.url}", markup=False)
    bar = _progress_bar(err, g.verbosity >= 0)
    sinks = [RichProgress(err, enabled=g.verbosity >= 0, prefix=f"r{t.replica} ", progress=bar) for t in targets]
    with bar:
        runs = flow.run_replicas(cfgs, sinks)
    docs = [{"replica": t.replica, "head": t.head, "url": t.endpoint.url, **run.to_dict()}
            for t, run in zip(targets, runs, strict=True)]
    total = total_doc(docs)
    interrupted = any(run.interrupted for run in runs)
    doc: dict[str, Any] = {
        "schema": MULTI_SCHEMA, "model": cfg.model, "started": docs[0]["started"],
        "duration_s": max(d["duration_s"] for d in docs), "config": docs[0]["config"],
        "interrupted": interrupted, "replicas": docs, "total": total,
        "failures": {"total": total["failures"]["total"]},
    }
    if base is not None:
        doc["compare"] = {"replicas": [{"replica": d["replica"], **compare(d, b)}
                                       for d, b in zip(docs, base["replicas"], strict=True)],
                          "total": compare_total(total, base["total"])}
    if save:
        Path(save).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    notes: dict[str, list[int]] = {}
    for d, run in zip(docs, runs, strict=True):
        for n in _notes(d, run):
            notes.setdefault(n, []).append(d["replica"])
    lines = [n if len(rs) == len(docs) else f"replica {', '.join(map(str, rs))}: {n}" for n, rs in notes.items()]
    if g.json:
        for n in lines:
            err.print(f"note: {n}", markup=False)
    else:
        out: list[str] = []
        for d in docs:
            out += [f"replica {d['replica']} (head {d['head']}, {d['url']}):", "", render_table(d), "",
                    render_details(d), ""]
        out.append(render_total(total))
        if base is not None:
            for d, b in zip(docs, base["replicas"], strict=True):
                out += ["", f"replica {d['replica']}: {render_compare(d, b)}"]
            out += ["", render_total_compare(total, base["total"])]
        out += [f"note: {n}" for n in lines]
        if save:
            out.append(f"saved to {save}")
        click.echo("\n".join(out))
    if interrupted:
        _finish(g, doc, _interrupted())
    problems: list[str] = []
    for t, d, run in zip(targets, docs, runs, strict=True):
        mine = summarize_failures(d)
        if run.stopped and not mine:
            mine = [run.stopped]
        problems += [f"{t.label}: {p}" for p in mine]
    _finish(g, doc, CheckFailed(
        f"{total['failures']['total'] or 'some'} request(s) failed:\n  " + "\n  ".join(problems),
        fix="see the per-request lines above; the tables count only requests that finished",
        failures=[Failure(None, "request", p, None) for p in problems]) if problems else None)


def _base_for(base: dict[str, Any], targets: list[Target], path: str) -> dict[str, Any]:
    """The saved run to compare with, like with like: every replica with a saved run of the same replicas,
    one endpoint (--url, --replica R, a one-replica cluster) with a one-endpoint run, and --replica R also
    with replica R of a saved run of every replica.
    Anything else is refused (exit 2) before measuring, rather than compared wrongly."""
    fix = ("compare like with like: a run of every replica with a saved run of the same replicas, "
           "--replica R with a one-endpoint run or with replica R of a saved run of every replica, "
           "--url with a one-endpoint run")
    if is_replicas_doc(base):
        saved = [d["replica"] for d in base["replicas"]]
        if len(targets) > 1:
            now = [t.replica for t in targets]
            if saved != now:
                raise UsageError(f"--compare {path}: the saved run measured replicas {saved}, this one measures "
                                 f"replicas {now}", fix=fix)
            return base
        r = targets[0].replica
        if r is None:
            raise UsageError(f"--compare {path} holds a run of {len(saved)} replicas together; this run measures "
                             f"one endpoint ({targets[0].endpoint.url})", fix=fix)
        for d in base["replicas"]:
            if d["replica"] == r:
                return dict(d)
        raise UsageError(f"--compare {path}: the saved run has no replica {r} (it measured {saved})", fix=fix)
    if len(targets) > 1:
        raise UsageError(f"--compare {path} holds a run of one endpoint ({base.get('url', '?')}); this run "
                         f"measures {len(targets)} replicas together", fix=fix)
    r, saved_r = targets[0].replica, base.get("replica")
    if r is not None and isinstance(saved_r, int) and saved_r != r:
        raise UsageError(f"--compare {path} holds a run of replica {saved_r}; this run measures replica {r}", fix=fix)
    return base


def _model(targets: list[Target], model: str | None, api_key: str | None, timeout: float) -> str:
    """The model to request: checked against what every head lists (a head that cannot be reached fails here,
    named, before anything is measured)."""
    from ..cluster import parallel

    def ask(t: Target) -> list[str] | None | CheckFailed:
        try:
            return list_models(t.endpoint, api_key, timeout=min(timeout, 10.0))
        except CheckFailed as exc:
            if len(targets) == 1:
                raise
            return exc

    answers = [ask(targets[0])] if len(targets) == 1 else parallel([functools.partial(ask, t) for t in targets])
    down = [(t, a) for t, a in zip(targets, answers, strict=True) if isinstance(a, CheckFailed)]
    if down:
        raise CheckFailed("\n".join(f"{t.label}: {a.message}" for t, a in down),
                          fix=f"{down[0][1].fix}; or measure the other replicas one by one with --replica R")
    lists = [a for a in answers if not isinstance(a, CheckFailed)]
    for t, models in zip(targets, lists, strict=True):
        where = t.endpoint.url + t.named
        if model is None:
            if not models:
                raise UsageError(f"cannot tell which model {where} serves (its /v1/models gives no list)",
                                 fix="pass --model NAME")
            model = models[0]
        elif models is not None and model not in models:
            raise UsageError(f"{where} serves {', '.join(models) or 'no model'}, not {model!r}",
                             fix=f"pass --model {models[0]}" if models else "check the service")
    assert model is not None
    return model


def _workloads(workload: str | None, prompt_file: str | None) -> list[Workload]:
    names = [w.strip() for w in (workload or "").split(",") if w.strip()]
    if not names and not prompt_file:
        names = list(DEFAULT_WORKLOADS)
    out = [builtin_workload(n) for n in dict.fromkeys(names)]
    if prompt_file:
        wl = load_prompt_file(prompt_file)
        if wl.name in {w.name for w in out}:
            wl = Workload(f"{wl.name} (file)", wl.prompts)
        out.append(wl)
    return out


def _check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--save {path}: folder {parent} does not exist")
    if path.is_dir():
        raise UsageError(f"--save {path} is a folder", fix="name a file, e.g. bench-run.json")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--save {path}: not writable")


def _target(g: Any, url: str | None, model: str | None, api_key_env: str | None,
            replica: int | None = None) -> tuple[list[Target], str | None, str | None]:
    """The endpoints (one, or every replica's head), the model (None: ask the server) and the API key
    (never printed)."""
    api_key: str | None = None
    if api_key_env:
        if not os.environ.get(api_key_env):
            raise UsageError(f"--api-key-env {api_key_env}: that environment variable is not set or empty")
        api_key = os.environ[api_key_env]
    if url:
        if api_key is None:  # the env file may hold the key even when the URL is given
            try:
                api_key = g.settings(validate=False).get("VLLM_API_KEY")
            except UsageError:
                api_key = os.environ.get("VLLM_API_KEY") or None
        return [Target(Endpoint.parse(url))], model, api_key
    s = g.settings()
    warn(s.warnings)
    # Each head's address is its HostName in the ssh config, resolved as every other command does.
    from ..cluster import load_ssh_config, resolve_target
    from ..remote.service import api_base_url

    config, config_path = load_ssh_config(g.ssh_config_path())
    views = s.replicas() if replica is None else [s.replica(replica)]  # replica(R) checks the range (exit 2)
    targets = []
    for v in views:
        host = resolve_target(v.head, config, config_path).hostname
        targets.append(Target(Endpoint.parse(api_base_url(host, v.getint("PORT"))),
                              None if replica is None and len(views) == 1 else v.replica_index, v.head))
    if api_key is None:
        api_key = s.get("VLLM_API_KEY")
    return targets, model or s.get("SERVED_MODEL_NAME"), api_key


def _interrupted_by() -> str:
    """The signal that stopped the run (sparkctl's handlers note it), else Ctrl-C."""
    got = signals.received()
    return signals.signal_name(got[0]) if got else "Ctrl-C"


def _finish(g: Any, doc: dict[str, Any], failure: CheckFailed | None) -> None:
    """The end (output.finish). On a failure the document's `failures` is the failure's list of every command
    (errors.failure_document): bench's own request counts move to `request_failures`."""
    if failure is not None and isinstance(doc.get("failures"), dict):
        doc = {**{k: v for k, v in doc.items() if k != "failures"}, "request_failures": doc["failures"]}
    finish(g.json, doc, failure)


def _interrupted() -> CheckFailed:
    """An interrupted bench: its partial document rides with the failure; the status is 128 + the signal."""
    code = _interrupted_status()
    return CheckFailed(f"interrupted ({signals.signal_name(code - 128)}): the figures are of what finished",
                       exit_code=code, shown=True, fix=None)


def _interrupted_status() -> int:
    """128 + the signal that stopped the run, as every other command exits (130 for Ctrl-C, 143 for SIGTERM)."""
    got = signals.received()
    return 128 + got[0] if got else 130


def _notes(doc: dict[str, Any], run: BenchRun) -> list[str]:
    notes = list(doc["notes"])
    if run.interrupted:
        notes.insert(0, f"interrupted ({_interrupted_by()}): the table shows what was measured before it")
    if run.stopped:
        notes.insert(0, f"stopped early: {run.stopped}")
    chunks = sum(lv["tokens_counted_from_chunks"] for lvs in doc["workloads"].values() for lv in lvs)
    if chunks:
        notes.append(f"{chunks} request(s) had no usage chunk: their tokens were counted as chunks "
                     "(under-reports tok/s when a chunk carries several tokens)")
    levels = [lv for lvs in doc["workloads"].values() for lv in lvs]
    if levels:  # the server's usage counts beside sparkctl's own
        built = [lv["prompt_tokens_built"] for lv in levels if lv.get("prompt_tokens_built") is not None]
        server_in = sum(lv.get("total_input_tokens") or 0 for lv in levels)
        server_out = sum(lv.get("total_output_tokens") or 0 for lv in levels)
        chunks = sum(lv.get("output_chunks") or 0 for lv in levels)
        notes.append((f"input tokens: {sum(built)} built (/tokenize), the server counted {server_in}" if built
                      else f"input tokens: the server counted {server_in}")
                     + f" (usage.prompt_tokens, chat template included); output tokens: the server counted "
                     f"{server_out} (usage.completion_tokens), in {chunks} streamed chunks")
    if not any(lv.get("spec_decode") for lvs in doc["workloads"].values() for lv in lvs) and doc["workloads"]:
        notes.append("no spec-decode counters in /metrics (speculative decoding off?): accepted tok/step is —")
    return notes


def _report(g: Any, doc: dict[str, Any], run: BenchRun, base: dict[str, Any] | None, save: str | None,
            side: str = "") -> None:
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    notes = _notes(doc, run)
    if g.json:  # the document is printed at the end (output.finish), with the failure's keys when it failed
        for n in notes:
            err.print(f"note: {n}", markup=False)
        return
    out = [render_table(doc), "", render_details(doc)]
    if side:
        out += ["", side]
    if base is not None:
        out += ["", render_compare(doc, base)]
    out += [f"note: {n}" for n in notes]
    if save:
        out.append(f"saved to {save}")
    click.echo("\n".join(out))


def _progress_bar(console: Console, enabled: bool) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                    console=console, refresh_per_second=4, disable=not enabled)


class RichProgress(ProgressSink):
    """A progress bar per level on stderr, and a line for each failed request (up to MAX_ERROR_LINES, per
    sink). With several replicas each has its sink (`prefix` names it) on one shared `progress`."""

    def __init__(self, console: Console, enabled: bool = True, *, prefix: str = "",
                 progress: Progress | None = None) -> None:
        self.console = console
        self.enabled = enabled
        self.prefix = prefix
        self.progress = progress or _progress_bar(console, enabled)
        self._task: Any = None
        self._errors = 0
        self._failed = 0
        self._lock = threading.Lock()

    def __enter__(self) -> RichProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def level_started(self, workload: str, concurrency: int, total: int | None) -> None:
        self._failed = 0
        self._task = self.progress.add_task(f"{self.prefix}{workload} C{concurrency}", total=total, info="")

    def request_done(self, workload: str, concurrency: int, result: RequestResult) -> None:
        with self._lock:
            if not result.ok and not result.cancelled:
                self._failed += 1
                self._errors += 1
                if self._errors <= MAX_ERROR_LINES:
                    self.console.print(f"[red]failed[/] {_escape(self.prefix)}{workload} C{concurrency} #{result.index}: "
                                       f"{_escape(result.error or '')}")
                elif self._errors == MAX_ERROR_LINES + 1:
                    self.console.print("(more failures: see the summary)")
            rate = result.decode_tok_s
            info = f"last {rate:.1f} tok/s, TTFT {result.ttft_s:.2f}s" if rate and result.ttft_s else ""
            if self._failed:
                info += f" [red]{self._failed} failed[/]"
        if self._task is not None:
            self.progress.update(self._task, advance=1, info=info)

    def level_done(self, level: LevelResult) -> None:
        if self._task is None:
            return
        d = level.to_dict()
        rate = d["agg_tok_s"] if level.concurrency > 1 else d["per_stream_tok_s"]["mean"]
        what = "agg" if level.concurrency > 1 else "per-stream"
        tps = (d.get("spec_decode") or {}).get("tokens_per_step")
        info = (f"{what} {rate:.1f} tok/s, TTFT p50 {d['ttft_s']['p50']:.2f}s" if rate is not None
                and d["ttft_s"]["p50"] is not None else "no request finished")
        if tps:
            info += f", {tps:.2f} tok/step"
        if level.failed:
            info += f" [red]{len(level.failed)} failed[/]"
        self.progress.update(self._task, info=info)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)
