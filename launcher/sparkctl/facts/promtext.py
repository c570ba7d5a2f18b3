"""The Prometheus text exposition format (0.0.4: what vLLM's /metrics serves), parsed in one place for every
reader: `status`'s summary (orchestrate.status.metrics_summary), `bench`'s spec-decode counters
(loadgen.wire.spec_counters) and bench/bench_accuracy.py.

The head's answer is untrusted: a line that is not a sample is skipped, never an error; a line costs time
linear in its length (one forward scan, no backtracking), and a reader may cap the lines it reads.
prometheus_client's own parser (`text_string_to_metric_families`) is the referee: on a real vLLM capture
(tests/fixtures/vllm-cpu/metrics.prom) and on generated text the two give the same samples
(tests/unit/facts/test_promtext.py). Where the referee raises for the whole text, this parser keeps the lines
it can read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_LABEL_VALUE = re.compile(r'"((?:[^"\\]|\\.)*)"', re.S)  # disjoint alternatives: linear
_SPACE = re.compile(r"[ \t]*")
_ESCAPE = re.compile(r'\\[\\n"]')  # the format's three escapes; any other backslash stays as it is
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str, max_lines: int | None = None) -> list[Sample]:
    """Every sample of `text` (HELP/TYPE comments, blank and unreadable lines skipped), in order; only
    the first `max_lines` lines are read when given."""
    return list(samples(text, max_lines))


def samples(text: str, max_lines: int | None = None) -> Iterator[Sample]:
    lines = text.split("\n") if max_lines is None else text.split("\n", max_lines)[:max_lines]
    for line in lines:
        s = parse_line(line)
        if s is not None:
            yield s


def parse_line(line: str) -> Sample | None:
    """One line -> its sample, or None (a comment, a blank line, or not a sample)."""
    line = line.strip()
    if not line or line[0] == "#":
        return None
    m = _NAME.match(line)
    if m is None:
        return None
    name, i = m.group(), m.end()
    labels: dict[str, str] = {}
    if i < len(line) and line[i] == "{":
        got = _labels(line, i + 1)
        if got is None:
            return None
        labels, i = got
    if i >= len(line) or line[i] not in " \t":
        return None
    rest = line[i:].lstrip()
    sep = " " if " " in rest else "\t"  # as prometheus_client splits: value, then [timestamp]
    parts = [p.strip() for p in rest.split(sep) if p.strip()]
    if not parts:
        return None
    value = _number(parts[0])
    if value is None or (len(parts) > 1 and _number(parts[-1]) is None):
        return None
    return Sample(name, labels, value)


def _labels(line: str, i: int) -> tuple[dict[str, str], int] | None:
    """The label set from just after '{': the labels and the index after '}', or None when damaged."""
    labels: dict[str, str] = {}
    n = len(line)
    i = _SPACE.match(line, i).end()  # type: ignore[union-attr]  # matches the empty string
    while i < n and line[i] != "}":
        m = _LABEL_NAME.match(line, i)
        if m is None:
            return None
        key = m.group()
        i = _SPACE.match(line, m.end()).end()  # type: ignore[union-attr]
        if i >= n or line[i] != "=":
            return None
        i = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
        v = _LABEL_VALUE.match(line, i)
        if v is None or key in labels:
            return None
        labels[key] = _ESCAPE.sub(lambda e: _UNESCAPED[e.group()], v.group(1))
        i = _SPACE.match(line, v.end()).end()  # type: ignore[union-attr]
        if i < n and line[i] == ",":
            i = _SPACE.match(line, i + 1).end()  # type: ignore[union-attr]
        elif i < n and line[i] != "}":
            return None
    if i >= n:
        return None
    return labels, i + 1


def _number(text: str) -> float | None:
    """A sample's value or timestamp: Go's float syntax as Python reads it (NaN, +Inf, 1e3), no '_'."""
    if "_" in text:
        return None
    try:
        return float(text)
    except (ValueError, OverflowError):
        return None


def total(found: Iterable[Sample], name: str, model: str | None = None) -> float | None:
    """The sum of a metric over its label sets (engines, ranks); only `model`'s series (label
    model_name) when it has any; None when the metric is absent."""
    series = [s for s in found if s.name == name]
    if model is not None and any(s.labels.get("model_name") == model for s in series):
        series = [s for s in series if s.labels.get("model_name") == model]
    return sum(s.value for s in series) if series else None
