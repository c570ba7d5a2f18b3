"""`sparkctl bench`: the model card's throughput table, measured the card's way, on a running service.

Without --url it measures the head's API from the settings: http://<head>:PORT, where <head> is the
HostName the ssh config gives the first node's alias, and the model is SERVED_MODEL_NAME.
The measuring itself is in sparkctl.loadgen; this module is input, progress and output.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import loadgen
from ..errors import CheckFailed, UsageError
from ..output import emit_json, warn

MAX_ERROR_LINES = 20  # per-request failure lines shown while running; the summary counts them all


@click.command("bench")
@click.option("--url", metavar="URL", help="OpenAI API base URL (default: the head's, http://<head>:PORT).")
@click.option("--model", metavar="NAME", help="Model name to request (default: SERVED_MODEL_NAME, or the "
              "first model the server lists when --url is given).")
@click.option("--workload", metavar="LIST", help="Built-in prompt sets: prose,code,list (default: all three; "
              "only the prompt file when --prompt-file is given alone).")
@click.option("--prompt-file", metavar="FILE", help="Your own prompts: one per line (or *.jsonl); a task named after the file.")
@click.option("--concurrency", metavar="LIST", default="1,2,4,8", show_default=True, help="Concurrency levels.")
@click.option("--requests", "n_requests", type=click.IntRange(min=1), metavar="N",
              help="Requests per level (default: 2 × the level's concurrency).")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, metavar="N",
              help="Unmeasured requests before the first level.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True, metavar="N",
              help="Output tokens per request (forced with ignore_eos where the server supports it).")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=300.0, show_default=True, metavar="S",
              help="Limit for one request, connect to last token, in seconds.")
@click.option("--save", metavar="FILE", help="Keep this run (JSON) for a later --compare.")
@click.option("--compare", "compare_file", metavar="FILE", help="Print the change against a saved run.")
@click.option("--api-key-env", metavar="VAR", help="Environment variable holding the API key (default: VLLM_API_KEY).")
@click.pass_obj
def command(g: object, url: str | None, model: str | None, workload: str | None, prompt_file: str | None,
            concurrency: str, n_requests: int | None, warmup: int, max_tokens: int, timeout: float,
            save: str | None, compare_file: str | None, api_key_env: str | None) -> None:
    """Measure decode tok/s (C1 per stream, C2/C4/C8 aggregate), TTFT and accepted tokens/step."""
    from ..cli import Globals

    assert isinstance(g, Globals)
    levels = loadgen.parse_int_list(concurrency, "--concurrency")
    if n_requests is not None and n_requests < max(levels):
        raise UsageError(f"--requests {n_requests} is fewer than the concurrency {max(levels)}: a level needs "
                         "at least one request per stream", fix=f"use --requests {max(levels)} or more")
    workloads = _workloads(workload, prompt_file)
    base = loadgen.load_saved(compare_file) if compare_file else None  # a bad file fails before measuring
    if save:
        _check_writable(Path(save))
    endpoint, model, api_key = _target(g, url, model, api_key_env)
    models = loadgen.list_models(endpoint, api_key, timeout=min(timeout, 10.0))
    if model is None:
        if not models:
            raise UsageError(f"cannot tell which model {endpoint.url} serves (its /v1/models gives no list)",
                             fix="pass --model NAME")
        model = models[0]
    elif models is not None and model not in models:
        raise UsageError(f"{endpoint.url} serves {', '.join(models) or 'no model'}, not {model!r}",
                         fix=f"pass --model {models[0]}" if models else "check the service")
    cfg = loadgen.BenchConfig(endpoint=endpoint, model=model, api_key=api_key, workloads=workloads,
                            concurrency=levels, requests=n_requests, warmup=warmup, max_tokens=max_tokens,
                            timeout=timeout)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    sink = RichProgress(err, enabled=g.verbosity >= 0)
    if g.verbosity >= 0:
        err.print(f"bench {endpoint.url} model {model}: {', '.join(w.name for w in workloads)} at "
                  f"C{', C'.join(map(str, levels))}, {max_tokens}-token outputs", markup=False)
    with sink:
        run = loadgen.run_bench(cfg, sink)
    doc = run.to_dict()
    if base is not None:
        doc["compare"] = loadgen.compare(doc, base)
    if save:
        Path(save).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    _report(g, doc, run, base, save)
    if run.interrupted:
        raise click.exceptions.Exit(130)
    problems = loadgen.summarize_failures(doc)
    if run.stopped and not problems:
        problems = [run.stopped]
    if problems:
        raise CheckFailed(f"{doc['failures']['total'] or 'some'} request(s) failed:\n  " + "\n  ".join(problems),
                          fix="see the per-request lines above; the table counts only requests that finished")


def _workloads(workload: str | None, prompt_file: str | None) -> list[loadgen.Workload]:
    names = [w.strip() for w in (workload or "").split(",") if w.strip()]
    if not names and not prompt_file:
        names = list(loadgen.DEFAULT_WORKLOADS)
    out = [loadgen.builtin_workload(n) for n in dict.fromkeys(names)]
    if prompt_file:
        wl = loadgen.load_prompt_file(prompt_file)
        if wl.name in {w.name for w in out}:
            wl = loadgen.Workload(f"{wl.name} (file)", wl.prompts)
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


def _target(g: Any, url: str | None, model: str | None,
            api_key_env: str | None) -> tuple[loadgen.Endpoint, str | None, str | None]:
    """The endpoint, the model (None: ask the server) and the API key (never printed)."""
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
        return loadgen.Endpoint.parse(url), model, api_key
    s = g.settings()
    warn(s.warnings)
    # The head's address is its HostName in the ssh config, resolved as every other command does.
    from ..cluster import load_ssh_config, resolve_target
    from ..service import api_base_url

    config, config_path = load_ssh_config(g.ssh_config_path())
    if len(s.topology.replicas) > 1:  # each replica is its own service: bench measures one endpoint
        warn([f"bench measures replica 0 (head {s.head}); the other replicas serve apart "
              "(--url http://<their head>:PORT to measure one of them)"])
    host = resolve_target(s.head, config, config_path).hostname
    if api_key is None:
        api_key = s.get("VLLM_API_KEY")
    return loadgen.Endpoint.parse(api_base_url(host, s.getint("PORT"))), model or s.get("SERVED_MODEL_NAME"), api_key


def _report(g: Any, doc: dict[str, Any], run: loadgen.BenchRun, base: dict[str, Any] | None, save: str | None) -> None:
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    notes = list(doc["notes"])
    if run.interrupted:
        notes.insert(0, "interrupted (Ctrl-C): the table shows what was measured before it")
    if run.stopped:
        notes.insert(0, f"stopped early: {run.stopped}")
    chunks = sum(lv["tokens_counted_from_chunks"] for lvs in doc["workloads"].values() for lv in lvs)
    if chunks:
        notes.append(f"{chunks} request(s) had no usage chunk: their tokens were counted as chunks "
                     "(under-reports tok/s when a chunk carries several tokens)")
    if not any(lv.get("spec_decode") for lvs in doc["workloads"].values() for lv in lvs) and doc["workloads"]:
        notes.append("no spec-decode counters in /metrics (speculative decoding off?): accepted tok/step is —")
    if g.json:
        emit_json(doc)
        for n in notes:
            err.print(f"note: {n}", markup=False)
        return
    out = [loadgen.render_table(doc), "", loadgen.render_details(doc)]
    if base is not None:
        out += ["", loadgen.render_compare(doc, base)]
    out += [f"note: {n}" for n in notes]
    if save:
        out.append(f"saved to {save}")
    click.echo("\n".join(out))


class RichProgress(loadgen.ProgressSink):
    """A progress bar per level on stderr, and a line for each failed request (up to MAX_ERROR_LINES)."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 console=console, refresh_per_second=4, disable=not enabled)
        self._task: Any = None
        self._errors = 0
        self._failed = 0
        self._lock = threading.Lock()

    def __enter__(self) -> RichProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def level_started(self, workload: str, concurrency: int, total: int) -> None:
        self._failed = 0
        self._task = self.progress.add_task(f"{workload} C{concurrency}", total=total, info="")

    def request_done(self, workload: str, concurrency: int, result: loadgen.RequestResult) -> None:
        with self._lock:
            if not result.ok and not result.cancelled:
                self._failed += 1
                self._errors += 1
                if self._errors <= MAX_ERROR_LINES:
                    self.console.print(f"[red]failed[/] {workload} C{concurrency} #{result.index}: "
                                       f"{_escape(result.error or '')}")
                elif self._errors == MAX_ERROR_LINES + 1:
                    self.console.print("(more failures: see the summary)")
            rate = result.decode_tok_s
            info = f"last {rate:.1f} tok/s, TTFT {result.ttft_s:.2f}s" if rate and result.ttft_s else ""
            if self._failed:
                info += f" [red]{self._failed} failed[/]"
        if self._task is not None:
            self.progress.update(self._task, advance=1, info=info)

    def level_done(self, level: loadgen.LevelResult) -> None:
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
