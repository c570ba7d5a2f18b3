"""The node facts' declarations (sparkctl.facts.node_facts.NodeFacts): the probe's facts() is generated from
them and stays so, every section has its declaration, and a fact added with one declaration reaches
the probe, its arguments and NodeFacts. Plus docker_parse's smaller parsers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from sparkctl.facts import docker_parse as D
from sparkctl.facts import node_facts as f
from sparkctl.facts.node_facts import NodeFacts, fact
from sparkctl.facts.parsing import ParseError, guard

NONCE = "0123456789abcdef"


def _script() -> str:
    return f.PROBE.read_text()


def _run_sections(script: str) -> list[str]:
    """The section names the probe's facts() runs, in order."""
    body = script.split("\nfacts() {\n", 1)[1].split("\n}\n", 1)[0]
    return re.findall(r"\bsection ([a-z0-9-]+) ", body)


def test_the_probes_facts_are_generated_from_the_declarations() -> None:
    assert f.probe_script_text() == _script(), (
        "node_facts.sh's generated part differs from NodeFacts' declarations: run "
        "`PYTHONPATH=launcher python -m sparkctl.facts.node_facts` and commit the script"
    )


def test_every_section_has_one_declaration_and_every_declaration_a_section() -> None:
    runs = [x.section for _, x in f.declared() if x.sh is not None]
    assert len(runs) == len(set(runs)), "two declarations run the same section"
    alternatives = [a.section for a in f.ALTERNATIVES]
    assert _run_sections(_script()) == [*runs[: runs.index("docker-version")], *alternatives,
                                        *runs[runs.index("docker-version"):]]  # fmt: skip
    for attr, x in f.declared():  # a fact that runs nothing reads a section another one runs
        assert x.sh is not None or x.section in runs, attr
        assert callable(x.parser), attr
    for a in f.ALTERNATIVES:
        assert set(a.replaces) <= set(runs) and set(a.replaces) == set(f._ALT_FIELDS)
    # NodeFacts is the declarations plus its problems, nothing else
    assert [x.name for x in fields(NodeFacts)] == [a for a, _ in f.declared()] + ["problems"]


def test_every_helper_a_declaration_calls_is_defined_in_the_probe() -> None:
    script = _script()
    for attr, x in f.declared():
        if x.sh is None:
            continue
        word = x.sh.removeprefix("$T ").split()[0]
        assert re.search(rf"^{re.escape(word)}\(\) {{", script, re.M) or shutil.which(word) or word in (
            "ulimit", "nvidia-smi", "docker", "ss", "ip"), f"{attr}: {word} is neither a helper nor a command"


def test_switches_are_what_probe_args_and_node_facts_from_probe_take() -> None:
    assert f.switches() == {"banner": True, "listening": True, "docker": True, "model": False}
    assert f.probe_args(cluster="c", docker=False, banner=False, listening=False) == [
        "cluster=c", "banner=no", "listening=no", "docker=no"]  # fmt: skip
    with pytest.raises(TypeError, match="bannr"):
        f.probe_args(bannr=False)
    with pytest.raises(TypeError, match="expect_gpu"):
        f.node_facts_from_probe("", NONCE, expect_gpu=False)


# ------------------------------------------------------------- a fact added with one declaration


@guard
def parse_uptime(text: str) -> float:
    """/proc/uptime: 'SECONDS IDLE'."""
    return float(text.split()[0])


@dataclass
class WithUptime(NodeFacts):
    """NodeFacts plus one fact, declared as a new fact is: this one line is all it takes."""

    uptime_s: float | None = fact("uptime", parse_uptime, "read_file /proc/uptime", switch="uptime")


def test_a_declared_fact_reaches_probe_args_the_probe_and_node_facts() -> None:
    assert f.switches(WithUptime)["uptime"] is True
    assert "uptime=no" in f.probe_args(cluster="c", kind=WithUptime, uptime=False)
    assert "uptime=no" not in f.probe_args(cluster="c", kind=WithUptime)
    assert "    on uptime && section uptime read_file /proc/uptime\n}\n" in f.probe_body(WithUptime)
    text = f"@@sparkctl {NONCE} begin uptime\n12.5 40.0\n@@sparkctl {NONCE} end uptime 0\n"
    got = f.node_facts_from_probe(text, NONCE, kind=WithUptime)
    assert isinstance(got, WithUptime) and got.uptime_s == 12.5 and "uptime" not in got.problems
    assert "uptime" in f.node_facts_from_probe("", NONCE, kind=WithUptime).problems  # asked, not there
    not_asked = f.node_facts_from_probe("", NONCE, kind=WithUptime, expect_uptime=False)
    assert "uptime" not in not_asked.problems and "meminfo" in not_asked.problems


@pytest.mark.skipif(not shutil.which("sh") or not Path("/proc/uptime").exists(), reason="needs sh and /proc")
@pytest.mark.parametrize("off", [False, True])
def test_a_declared_fact_runs_in_the_generated_probe(tmp_path: Path, off: bool) -> None:
    script = f.probe_script_text(WithUptime)
    args = f.probe_args(cluster="c", docker=False, kind=WithUptime, **({"uptime": False} if off else {}))
    env = dict(os.environ, SPARKCTL_SYSFS_ROOT=str(tmp_path / "none"))
    r = subprocess.run(["sh", "-s", "--", NONCE, *args], input=script.encode(), capture_output=True,
                       env=env, timeout=60, cwd=tmp_path)  # fmt: skip
    got = f.node_facts_from_probe(r.stdout.decode(), NONCE, r.stderr.decode(), kind=WithUptime,
                                  expect_docker=False, expect_uptime=not off)  # fmt: skip
    assert got.meminfo is not None  # the declared facts still run beside it
    if off:
        assert got.uptime_s is None and "uptime" not in got.problems
        assert "begin uptime" not in r.stdout.decode()
    else:
        assert got.uptime_s is not None and got.uptime_s > 0, got.problems


# ------------------------------------------------------------------------------- docker_parse


def test_container_inspect_errors_say_what_docker_printed() -> None:
    assert D.parse_container_inspect("") == []
    with pytest.raises(ParseError, match=r"^docker inspect printed something that is not JSON \(Expecting value\)$"):
        D.parse_container_inspect("nope")
    with pytest.raises(ParseError, match="^docker inspect did not print a list$"):
        D.parse_container_inspect("{}")
    with pytest.raises(ParseError, match="nested too deeply"):
        D.parse_container_inspect("[" * 100000)
    (c,) = D.parse_container_inspect('[{"Id": "abc", "Name": "/n", "State": {"Running": true}}, 3]')
    assert (c.id, c.name, c.running) == ("abc", "n", True)


@pytest.mark.parametrize("text, want", [
    ("sha256:" + "a" * 64 + "\n", "a" * 64), ("\n", None), ("<no value>\n", None), ("sha256:xyz", None),
])  # fmt: skip
def test_content_hash_label(text: str, want: str | None) -> None:
    assert D.parse_content_hash(text) == want


def test_format_value() -> None:
    assert D.parse_format_value("sha256:ab\n") == "sha256:ab"
    assert D.parse_format_value(" \n") is None
