"""bench/mutation.py's own logic, without cosmic-ray: which mutants it skips as equivalent by
construction (inside annotations Python never evaluates) and how --check-floors judges a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

_SPEC = importlib.util.spec_from_file_location("mutation_tool", Path(__file__).parents[2] / "bench" / "mutation.py")
assert _SPEC and _SPEC.loader
mutation: Any = importlib.util.module_from_spec(_SPEC)
sys.modules["mutation_tool"] = mutation  # its dataclasses look their module up
_SPEC.loader.exec_module(mutation)


def _inside(spans: list[Any], line: int, col: int, end: int) -> bool:
    return any(a <= (line, col) and (line, end) <= b for a, b in spans)


def test_only_annotations_python_never_evaluates_are_skipped(tmp_path: Path) -> None:
    src = ("from __future__ import annotations\n"
           "def f(a: int | None, *, b: str | None = None) -> list[int] | None:\n"
           "    x: int | str = a | 1\n"
           "    return [a | 2]\n")
    (tmp_path / "m.py").write_text(src)
    spans = mutation._annotation_spans(tmp_path / "m.py")
    line2 = src.splitlines()[1]
    for bar in [i for i, c in enumerate(line2) if c == "|"]:
        assert _inside(spans, 2, bar, bar + 1)  # every `|` of line 2 is in an annotation
    line3 = src.splitlines()[2]
    assert _inside(spans, 3, line3.index("|"), line3.index("|") + 1)  # `x: int | str`
    assert not _inside(spans, 3, line3.rindex("|"), line3.rindex("|") + 1)  # `a | 1`: code
    assert not _inside(spans, 4, 12, 13)  # `a | 2`: code
    # evaluated annotations: nothing skipped
    (tmp_path / "n.py").write_text(src.replace("from __future__ import annotations\n", ""))
    assert mutation._annotation_spans(tmp_path / "n.py") == []
    (tmp_path / "p.py").write_text(src + "import typing\ntyping.get_type_hints(f)\n")
    assert mutation._annotation_spans(tmp_path / "p.py") == []


@pytest.mark.parametrize(("killed", "survived", "pending", "ok"), [
    (49, 1, 0, True), (48, 2, 0, False), (49, 1, 3, False)])
def test_a_module_below_its_floor_or_not_run_to_its_end_fails_the_gate(killed: int, survived: int, pending: int,
                                                                       ok: bool) -> None:
    r = mutation.Result("systemd_unit")
    r.outcomes.update(killed=killed, survived=survived, pending=pending)
    assert mutation.MODULES["systemd_unit"].floor == 98.0
    assert mutation.floors_met([r]) is ok
    assert mutation.floors_met([mutation.Result("lock")]) is False  # no floor yet: not judged


@pytest.mark.parametrize(("module", "killed", "survived", "ok"), [
    ("memory", 133, 3, True), ("memory", 132, 4, False), ("nic_pins", 130, 5, True), ("nic_pins", 129, 6, False)])
def test_a_floor_is_the_score_as_printed_so_the_same_run_again_meets_it(module: str, killed: int, survived: int,
                                                                         ok: bool) -> None:
    """A floor is written as the run printed its score, to one decimal (memory: 133 of 136 = 97.79..., printed and
    set as 97.8): the same result again meets it; one more survivor does not."""
    r = mutation.Result(module)
    r.outcomes.update(killed=killed, survived=survived, pending=0)
    assert mutation.floors_met([r]) is ok
