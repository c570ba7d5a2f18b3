"""promtext, the one Prometheus text parser (`status`, `bench`, bench/bench_accuracy.py), judged by
prometheus_client's own parser: on real vLLM /metrics captures, on generated exposition text, and on
damaged text (it never misreads a line: what it reads, prometheus_client reads the same way; what
prometheus_client refuses, it skips)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from sparkctl.facts import promtext
from sparkctl.facts.engine_lines import GENERATION_TOKENS, NUM_REQUESTS_RUNNING
from sparkctl.loadgen.wire import spec_counters
from sparkctl.orchestrate.status import metrics_summary

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vllm-cpu"
CAPTURES = ["metrics.prom", "metrics-ngram.prom"]


def _key(name: str, labels: dict[str, str], value: float) -> tuple[str, tuple[tuple[str, str], ...], float | str]:
    return name, tuple(sorted(labels.items())), "nan" if math.isnan(value) else float(value)


def mine(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float | str]]:
    return [_key(s.name, s.labels, s.value) for s in promtext.parse(text)]


def theirs(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float | str]]:
    return [_key(s.name, s.labels, float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_real_vllm_capture_reads_as_prometheus_client_reads_it(capture: str) -> None:
    text = (FIXTURES / capture).read_text()
    got = mine(text)
    assert len(got) > 300 and got == theirs(text)


def test_status_and_bench_read_the_real_names_and_values() -> None:
    text = (FIXTURES / "metrics-ngram.prom").read_text()
    ref = {n: v for n, _, v in theirs(text)}
    summary = metrics_summary(text)
    assert summary["generation_tokens"] == ref[GENERATION_TOKENS] > 0
    assert summary["requests_running"] == ref[NUM_REQUESTS_RUNNING]
    spec = spec_counters(promtext.parse(text), "lab")  # vLLM's real counter names (engine_lines)
    assert spec is not None and (spec.drafts, spec.draft_tokens, spec.accepted) == (0.0, 0.0, 0.0)
    assert spec_counters(promtext.parse((FIXTURES / "metrics.prom").read_text())) is None  # no spec decoding


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,15}", fullmatch=True)
label_names = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,8}", fullmatch=True)
values = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-2**62, 2**62).map(str),
                   st.sampled_from(["NaN", "+Inf", "-Inf", "1e3", "-0.5", "0"]))


help_texts = st.text(st.characters(blacklist_characters="\n"), max_size=20)


@st.composite
def exposition_line(draw: st.DrawFn) -> str:
    name = draw(names)
    kind = draw(st.sampled_from(["sample", "sample", "sample", "help", "type"]))
    if kind == "help":
        return f"# HELP {name} {draw(help_texts)}"
    if kind == "type":
        return f"# TYPE {name} {draw(st.sampled_from(['gauge', 'untyped']))}"
    labels = draw(st.dictionaries(label_names, st.text(max_size=12), max_size=4))
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    trailing = "," if labels and draw(st.booleans()) else ""
    sep = draw(st.sampled_from([" ", "\t"]))
    stamp = f" {draw(st.integers(0, 2**50))}" if draw(st.booleans()) else ""
    return f"{name}{'{' + body + trailing + '}' if labels or draw(st.booleans()) else ''}{sep}{draw(values)}{stamp}"


@settings(max_examples=300, deadline=None)
@given(st.lists(exposition_line(), max_size=12))
def test_generated_exposition_reads_as_prometheus_client_reads_it(lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    assert mine(text) == theirs(text)


def _referee_line(line: str) -> list[tuple[str, tuple[tuple[str, str], ...], float | str]] | None:
    try:
        return theirs(line + "\n")
    except Exception:  # noqa: BLE001 - prometheus_client raises ValueError, and more, on damaged lines
        return None


REAL = (FIXTURES / "metrics-ngram.prom").read_text().split("\n")
RUNNING = next(line for line in REAL if line.startswith(NUM_REQUESTS_RUNNING + "{"))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(REAL), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3), st.text(max_size=3)), max_size=4))
@example(RUNNING, [(RUNNING.index("="), 1, "")])  # a label without its '='
@example(RUNNING, [(len(RUNNING) - 3, 3, "1_0")])  # a value with '_' (Python's float reads it; the format does not)
@example(RUNNING, [(RUNNING.index("}"), 1, "")])  # the label set never closed
def test_a_damaged_line_is_never_misread(line: str, cuts: list[tuple[int, int, str]]) -> None:
    for at, drop, insert in cuts:  # damage: characters dropped and others inserted, anywhere
        at = min(at, len(line))
        line = line[:at] + insert + line[at + drop:]
    got = mine(line)
    ref = _referee_line(line)
    if ref is None:
        assert got == [], f"prometheus_client refuses {line!r}, promtext read {got}"
    else:
        assert got in ([], ref), f"{line!r}: promtext {got}, prometheus_client {ref}"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_text_is_read_without_error(text: str) -> None:
    for s in promtext.parse(text):
        assert isinstance(s.name, str) and isinstance(s.value, float)


def test_the_line_cap_reads_no_further() -> None:
    assert len(promtext.parse("a 1\n" * 50, max_lines=20)) == 20
    assert promtext.parse('a{x="1"} 2\nb{x="\\\\n\\"q"} 3 17', max_lines=None) == [
        promtext.Sample("a", {"x": "1"}, 2.0), promtext.Sample("b", {"x": '\\n"q'}, 3.0)]
