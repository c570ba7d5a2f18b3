"""The serving image's own vLLM judges the argv before any rank starts, on the real engine:
the lab's image holds vLLM 0.32.0, sparkctl's flag table is 0.33's. Recipe lab-vllm, spark1 + spark3 (the kit
in tests/lab/realengine.py).
"""

from __future__ import annotations

import json

import pytest

from tests.kit.lab import Lab
from tests.lab.realengine import fresh, rank_containers, sk

pytestmark = pytest.mark.realengine_lab


def test_check_judges_every_ranks_argv_with_the_images_own_vllm(real: dict[str, str]) -> None:
    fresh(real)
    r = sk(real, "--json", "check", timeout=600)
    rows = [f for f in json.loads(r.stdout)["findings"] if f["check"] == "argv"]
    assert r.returncode == 0 and len(rows) == 2 and all(f["status"] == "ok" for f in rows), (rows, r.stderr[-2000:])
    assert all("0.32.0" in f["short"] + f["reason"] for f in rows), rows


def test_up_with_a_flag_only_0_33_knows_is_refused_in_0_32s_words_and_starts_nothing(real: dict[str, str],
                                                                                     lab: Lab) -> None:
    """`--disable-log-requests` passes sparkctl's own (0.33) flag table; the image's 0.32 refuses it."""
    fresh(real)
    r = sk(real, "up", extra={"VLLM_EXTRA_ARGS": "--disable-log-requests"}, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "nothing was started" in out and "unrecognized arguments: --disable-log-requests" in out, out
    assert "spark1" in out and "spark3" in out, out
    assert rank_containers(lab) == {"spark1": "", "spark3": ""}
