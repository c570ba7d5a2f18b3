"""The run's JSON document: its schema and definitions, reading a saved run, the tables, and --compare.
Everything here works on the document, so a saved run renders and compares like a fresh one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..facts.parsing import ParseError, parse_json
from ..measure import metrics as benchmetrics

SCHEMA = "sparkctl-bench/2"  # /2: vLLM's metric definitions and names
OLD_SCHEMAS = ("sparkctl-bench/1", "sparkctl-bench-replicas/1")  # read for --compare (their TTFT and tok/s were defined otherwise: noted)
MULTI_SCHEMA = "sparkctl-bench-replicas/2"  # several replicas: {replicas: [{replica, head, url, ...SCHEMA doc}], total}


DEFINITIONS = {
    "vllm": benchmetrics.DEFINITIONS,  # the level's flat keys named as vLLM names them (mean_ttft_ms, ...)
    "sparkctl": {  # sparkctl's own quantities, for the model card's table
        "decode_tok_s": "per stream: (N − 1) ÷ (E2EL − TTFT) = 1 ÷ TPOT, N = usage.completion_tokens",
        "per_stream_tok_s": "mean / p50 / p90 of the level's per-stream decode_tok_s",
        "agg_tok_s": "C × the level's mean per-stream decode_tok_s (the card's 'summed across streams')",
        "throughput_tok_s": "= output_throughput (vLLM's): all output tokens ÷ duration",
        "ttft_s": "vLLM's TTFT in seconds: p50 / p90 / min / max",
        "tokens_per_step": "1 + Δaccepted ÷ Δdrafts over the level (vLLM spec-decode counters in /metrics)",
        "client_cpu_pct": "bench's own CPU time ÷ level wall time, in % of one core",
        "prompt_tokens_built": "--input-len: the prompt's tokens as the server's /tokenize counted them "
                               "(the server's own count, chat template included, is total_input_tokens)",
    },
}


def is_replicas_doc(doc: dict[str, Any]) -> bool:
    """A run of several replicas (MULTI_SCHEMA: replicas + total), not one endpoint's run (SCHEMA)."""
    return doc.get("schema") in (MULTI_SCHEMA, "sparkctl-bench-replicas/1")


def rounded(value: float | None, nd: int) -> float | None:
    return None if value is None else round(value, nd)


def load_saved(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        doc = parse_json(p.read_bytes())
    except OSError as exc:
        raise UsageError(f"saved run {p}: cannot be read ({exc.strerror or exc})") from None
    except ParseError as exc:
        raise UsageError(f"saved run {p}: {exc}", fix="pass a file written by sparkctl bench --save") from None
    multi = isinstance(doc, dict) and is_replicas_doc(doc)
    if not isinstance(doc, dict) or not multi and (doc.get("schema") not in (SCHEMA, *OLD_SCHEMAS) or not isinstance(doc.get("workloads"), dict)):
        raise UsageError(f"saved run {p} is not a sparkctl bench run ({SCHEMA} or {MULTI_SCHEMA})",
                         fix="pass a file written by sparkctl bench --save")
    try:  # the table and --compare read these fields; a damaged file is bad input, not a crash
        for one in (doc["replicas"] if multi else [doc]):
            if multi and (not isinstance(one.get("replica"), int) or not isinstance(one.get("workloads"), dict)):
                raise TypeError("a replica's run has no replica number or no workloads")
            _, rows = table_rows(one)
            numbers = [v for r in rows for v in (*r.cells.values(), r.tokens_per_step, *(r.ttft or ()))]
            if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in numbers):
                raise TypeError("a measured value is not a number")
            render_compare(one, one)
        if multi:
            if not doc["replicas"]:
                raise ValueError("no replica")
            render_total(doc["total"])
            render_total_compare(doc["total"], doc["total"])
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, IndexError) as exc:
        raise UsageError(f"saved run {p} is damaged ({type(exc).__name__}: {str(exc)[:80]})",
                         fix="pass a file written by sparkctl bench --save") from None
    return doc


@dataclass
class Row:
    task: str
    cells: dict[int, float | None]  # concurrency -> C1 per-stream / Cn aggregate tok/s
    partial: dict[int, bool]
    tokens_per_step: float | None
    ttft: tuple[float, float] | None  # range of the levels' TTFT p50


def table_rows(doc: dict[str, Any]) -> tuple[list[int], list[Row]]:
    """The model card's table from a run document: concurrency columns and one row per task."""
    columns: list[int] = []
    rows: list[Row] = []
    for task, levels in doc.get("workloads", {}).items():
        cells: dict[int, float | None] = {}
        partial: dict[int, bool] = {}
        acc = drafts = 0.0
        p50s: list[float] = []
        for lv in levels:
            c = int(lv["concurrency"])
            if c not in columns:
                columns.append(c)
            cells[c] = lv["per_stream_tok_s"]["mean"] if c == 1 else lv["agg_tok_s"]
            partial[c] = bool(lv.get("interrupted") or lv.get("failed"))
            sd = lv.get("spec_decode")
            if sd and sd.get("drafts"):
                acc += sd["accepted"]
                drafts += sd["drafts"]
            if lv["ttft_s"]["p50"] is not None:
                p50s.append(lv["ttft_s"]["p50"])
        rows.append(Row(task, cells, partial, 1.0 + acc / drafts if drafts else None,
                        (min(p50s), max(p50s)) if p50s else None))
    return sorted(columns), rows


def _col_name(c: int) -> str:
    return "C1 per-stream" if c == 1 else f"C{c} agg"


def _f(value: float | None, nd: int = 1) -> str:
    return "—" if value is None else f"{value:.{nd}f}"


def _ttft(rng: tuple[float, float] | None) -> str:
    return "—" if rng is None else f"{rng[0]:.2f}–{rng[1]:.2f}"


def render_table(doc: dict[str, Any]) -> str:
    """The model card's table: task × C1 per-stream · Cn agg · accepted tok/step, plus TTFT."""
    columns, rows = table_rows(doc)
    head = ["Task", *(_col_name(c) for c in columns), "accepted tok/step", "TTFT p50 (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + "|"]
    for row in rows:
        cells = [_f(row.cells.get(c)) + ("*" if row.partial.get(c) and row.cells.get(c) is not None else "")
                 for c in columns]
        lines.append("| " + " | ".join([row.task, *cells, _f(row.tokens_per_step, 2), _ttft(row.ttft)]) + " |")
    lines.append("")
    lines.append("sparkctl's own figures, the model card's: tok/s per stream = (N − 1) ÷ (E2EL − TTFT) = 1 ÷ TPOT; "
                 "Cn agg = n × the mean per-stream rate (vLLM's output_throughput is below); accepted tok/step = "
                 "1 + accepted ÷ drafts (vLLM's spec_decode_acceptance_length).")
    ranges = [r.ttft for r in rows if r.ttft]
    if ranges and columns:
        lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
        lines.append(f"TTFT {lo:.2f}–{hi:.2f} s (p50 per level) across C{columns[0]}–C{columns[-1]}.")
    if any(any(r.partial.values()) for r in rows):
        lines.append("* some requests of that level failed or were interrupted: measured on those that finished.")
    return "\n".join(lines)


def _ms(lv: dict[str, Any], key: str) -> str:
    v = lv.get(key)
    if v is None and key.startswith("p") and lv.get(f"n_{key.split('_')[1]}"):
        return "n<" + str(benchmetrics.min_samples(float(key[1:key.index("_")])))  # too few samples for it
    return _f(v, 1)


def render_details(doc: dict[str, Any]) -> str:
    """Per level, vLLM's serving metrics as `vllm bench serve` defines them (ms), then sparkctl's own."""
    head = ["Task", "C", "ok/sent", "req/s", "output tok/s", "TTFT mean", "median", "p99", "TPOT mean", "median",
            "p99", "ITL median", "p99", "E2EL median", "p99", "tok/s/stream p50", "tok/step", "client CPU %"]
    lines = ["vLLM's metrics (`vllm bench serve`'s definitions; times in ms; n<K: fewer samples than that "
             "percentile needs):", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for task, levels in doc.get("workloads", {}).items():
        for lv in levels:
            sd = lv.get("spec_decode") or {}
            c = str(lv["concurrency"]) + (f" @{lv['request_rate']:g}/s" if lv.get("request_rate") else "")
            lines.append("| " + " | ".join([
                task, c, f"{lv['ok']}/{lv['requests']}", _f(lv.get("request_throughput"), 2),
                _f(lv.get("output_throughput", lv.get("throughput_tok_s"))),
                _ms(lv, "mean_ttft_ms"), _ms(lv, "median_ttft_ms"), _ms(lv, "p99_ttft_ms"),
                _ms(lv, "mean_tpot_ms"), _ms(lv, "median_tpot_ms"), _ms(lv, "p99_tpot_ms"),
                _ms(lv, "median_itl_ms"), _ms(lv, "p99_itl_ms"), _ms(lv, "median_e2el_ms"), _ms(lv, "p99_e2el_ms"),
                _f(lv["per_stream_tok_s"]["p50"]), _f(sd.get("tokens_per_step"), 2),
                _f(lv.get("client_cpu_pct"), 2)]) + " |")
    return "\n".join(lines)


def _pct(old: float | None, new: float | None) -> str:
    if old is None or new is None:
        return f"{_f(old)} → {_f(new)}"
    if old == 0:
        return f"{old:.1f} → {new:.1f}"
    return f"{old:.1f} → {new:.1f} ({(new - old) / old * 100:+.1f}%)"


def compare(doc: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Per task and column: the saved value, the new one and the % change."""
    cols_new, rows_new = table_rows(doc)
    cols_old, rows_old = table_rows(base)
    old = {r.task: r for r in rows_old}
    columns = sorted(set(cols_new) | set(cols_old))
    out: dict[str, Any] = {"base": {"url": base.get("url"), "started": base.get("started")}, "tasks": {}}
    for row in rows_new:
        o = old.get(row.task)
        cells: dict[str, Any] = {}
        for c in columns:
            a = o.cells.get(c) if o else None
            b = row.cells.get(c)
            cells[_col_name(c)] = {"old": a, "new": b, "change_pct": rounded((b - a) / a * 100, 2) if a and b is not None else None}
        a2 = o.tokens_per_step if o else None
        cells["accepted tok/step"] = {"old": rounded(a2, 4), "new": rounded(row.tokens_per_step, 4),
                                      "change_pct": rounded((row.tokens_per_step - a2) / a2 * 100, 2)
                                      if a2 and row.tokens_per_step is not None else None}
        ot = o.ttft if o else None
        cells["TTFT p50 (s)"] = {"old": list(ot) if ot else None, "new": list(row.ttft) if row.ttft else None,
                                 "change_pct": rounded((row.ttft[1] - ot[1]) / ot[1] * 100, 2)
                                 if ot and row.ttft and ot[1] else None}
        out["tasks"][row.task] = cells
    return out


def render_compare(doc: dict[str, Any], base: dict[str, Any]) -> str:
    """The table again, each cell as `saved → now (±x%)`; TTFT's % is that of the range's upper end."""
    cmp = compare(doc, base)
    tasks: dict[str, dict[str, Any]] = cmp["tasks"]
    if not tasks:
        return "(nothing to compare: this run measured no task)"
    names = list(next(iter(tasks.values())))
    lines = [f"Change against {base.get('url', '?')} ({base.get('started', '?')}):", "",
             "| " + " | ".join(["Task", *names]) + " |", "|" + "|".join(["---"] * (len(names) + 1)) + "|"]
    for task, cells in tasks.items():
        out: list[str] = []
        for name, cell in cells.items():
            o, n = cell["old"], cell["new"]
            if name.startswith("TTFT"):
                txt = f"{_ttft(tuple(o) if o else None)} → {_ttft(tuple(n) if n else None)}"
            elif name.startswith("accepted"):
                txt = f"{_f(o, 2)} → {_f(n, 2)}"
            else:
                out.append(_pct(o, n))
                continue
            if cell["change_pct"] is not None:
                txt += f" ({cell['change_pct']:+.1f}%)"
            out.append(txt)
        lines.append("| " + " | ".join([task, *out]) + " |")
    missing = [t for t in (r.task for r in table_rows(base)[1]) if t not in tasks]
    if missing:
        lines.append(f"(in the saved run only: {', '.join(missing)})")
    return "\n".join(lines)


def summarize_failures(doc: dict[str, Any]) -> list[str]:
    """One line per kind of failure: how many, and the first one in full."""
    f = doc.get("failures") or {}
    return [f"{k['count']} × {kind}: {k['first']}" for kind, k in (f.get("by_kind") or {}).items()]


def render_total(total: dict[str, Any]) -> str:
    """The cluster's table: a row per workload and level, the replicas' figures summed."""
    head = ["Task", "C per replica", "streams", "replicas", "ok/sent", "failed", "agg tok/s", "throughput tok/s",
            "TTFT p50 worst (s)"]
    lines = [f"Total over {total['replicas']} replicas, measured together level by level:", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    partial = False
    for task, rows in total.get("workloads", {}).items():
        for t in rows:
            mark = "*" if t["partial"] and t["agg_tok_s"] is not None else ""
            partial = partial or bool(mark)
            lines.append("| " + " | ".join([
                task, str(t["concurrency"]), str(t["streams"]), f"{t['replicas']}/{t['of']}", f"{t['ok']}/{t['requests']}",
                str(t["failed"]), _f(t["agg_tok_s"]) + mark, _f(t["throughput_tok_s"]), _f(t["ttft_p50_worst_s"], 3)]) + " |")
    lines.append("")
    lines.append("agg tok/s and throughput are the replicas' figures summed; TTFT is not summed: the worst "
                 "replica's p50.")
    if partial:
        lines.append("* a replica did not measure that level, or some of its requests failed or were interrupted.")
    return "\n".join(lines)


def compare_total(total: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Per task and level: the saved summed agg tok/s, the new one and the % change."""
    old = {(task, int(t["concurrency"])): t["agg_tok_s"] for task, rows in base.get("workloads", {}).items() for t in rows}
    out: dict[str, Any] = {}
    for task, rows in total.get("workloads", {}).items():
        cells: dict[str, Any] = {}
        for t in rows:
            a, b = old.get((task, int(t["concurrency"]))), t["agg_tok_s"]
            cells[f"C{t['concurrency']}"] = {"old": a, "new": b,
                                             "change_pct": rounded((b - a) / a * 100, 2) if a and b is not None else None}
        out[task] = cells
    return out


def render_total_compare(total: dict[str, Any], base: dict[str, Any]) -> str:
    cmp = compare_total(total, base)
    if not cmp:
        return "(nothing to compare: this run measured no task)"
    columns = list(dict.fromkeys(c for cells in cmp.values() for c in cells))
    lines = ["Change of the total (agg tok/s summed over the replicas):", "",
             "| " + " | ".join(["Task", *columns]) + " |", "|" + "|".join(["---"] * (len(columns) + 1)) + "|"]
    for task, cells in cmp.items():
        lines.append("| " + " | ".join([task, *(_pct(cells[c]["old"], cells[c]["new"]) if c in cells else "—"
                                                for c in columns)]) + " |")
    return "\n".join(lines)
