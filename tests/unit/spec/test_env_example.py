"""env/env.tp4.example stays complete: every knob appears, documented, and the file loads."""

from __future__ import annotations

import re
from pathlib import Path

from sparkctl.spec.settings import KNOBS, load_settings

EXAMPLE = Path(__file__).resolve().parents[3] / "env" / "env.tp4.example"


def test_every_knob_is_in_the_example():
    text = EXAMPLE.read_text()
    present = set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", text, flags=re.M))
    missing = sorted(set(KNOBS) - present - {"RECIPE"} | ({"RECIPE"} - present))
    assert not missing, f"env.tp4.example lacks: {missing}"


def test_example_loads_without_warnings(clean_env, tmp_path):
    s = load_settings(env_file=str(EXAMPLE), cli={}, environ={})
    assert s.warnings == []
    assert s.getint("TP") == 4 and s.nodes == ["spark1", "spark2", "spark3", "spark4"]
