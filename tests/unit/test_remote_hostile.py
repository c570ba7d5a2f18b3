"""Every value that reaches a node's shell is data, for every command -- proven by running it.

The nodes are local folders (tests/unit/localnodes.py): each command that sparkctl sends over "SSH"
runs here as sshd would run it (`sh -c COMMAND`, scripts on stdin), with a stateful `docker` stand-in.
Hypothesis builds MODEL (a real folder of that name), SERVED_MODEL_NAME, a STANDIN_* env value,
HF_TOKEN and a quoted VLLM_EXTRA_ARGS word from shell syntax, and runs the real CLI with all of them:
verify-model, check, build --dry-run, build, build --ship, up, status, logs, logs --rank, audit,
wait, lock status, down. For every example:
  - no canary file appears (absolute in this test's folder, or relative in any node's home or here);
  - no value is inside a script: no `sh -c SCRIPT` word and no script sent on stdin holds it;
  - accepted values arrive verbatim (the container's argv, its mount, its env file);
  - every field reaches every command it flows into; the counts are asserted (README quotes them).

A deliberate break (images.probe_argv putting MODEL into its script, lock's audit line spliced into
_AUDIT_APPEND, service's label into _INSPECT) makes this file fail: see the mutation notes in README.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from tests.conftest import write_model, write_serving
from tests.kit.local import free_port
from tests.unit.localnodes import LocalNodes, local_nodes

NODES = ["spark1", "spark2", "spark3", "spark4"]
TOKEN = uuid.uuid4().hex[:8]

# The canary: absolute (under the example's folder) and relative (wherever a shell runs: a node's home).
FRAGMENTS = ["$(touch {abs})", "`touch {abs}`", "; touch {abs}", "&& touch {abs}", "| touch {abs}",
             "> {abs}", "$(touch {rel})", "';touch {abs};'", '";touch {abs};"', "\\", "*", "?", "[ab]", "~",
             "$HOME", "${IFS}", " ", "ünï ☃", "-", "--", "#", "!", "%s", "{}", "=", ",", "$1", "\"$@\""]
plain = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=8)
hostile = st.lists(st.sampled_from(FRAGMENTS) | plain, min_size=1, max_size=4).map("".join)

# Field -> how the value is marked (a unique prefix, so "reached" cannot be a coincidence).
FIELDS = {"MODEL": "mdlQ", "SERVED_MODEL_NAME": "srvQ", "STANDIN_HOSTILE": "stdQ", "HF_TOKEN": f"hf_{TOKEN}",
          "VLLM_EXTRA_ARGS": "xtQ"}
COMMANDS: list[list[str]] = [["verify-model"], ["check"], ["build", "--dry-run"], ["build"], ["build", "--ship"],
                             ["up"], ["status"], ["logs", "--tail", "3"], ["logs", "--rank", "1", "-f"],
                             ["audit"], ["wait", "--timeout", "1"], ["lock", "status"], ["down"]]
# Which field each command carries to the nodes (asserted both ways: reached, and nothing else reached).
FLOWS = {
    "verify-model": {"MODEL"}, "check": {"MODEL"}, "build --dry-run": {"MODEL"}, "build": {"MODEL"},
    "build --ship": {"MODEL"}, "status": {"MODEL"},  # status reads the checkpoint on the head (config hash)
    "up": {"MODEL", "SERVED_MODEL_NAME", "STANDIN_HOSTILE", "HF_TOKEN", "VLLM_EXTRA_ARGS"},
}
REACHED: collections.Counter[tuple[str, str]] = collections.Counter()  # (command, field) -> examples
ACCEPTED = collections.Counter[str]()
TIMES: collections.Counter[str] = collections.Counter()
EXAMPLES = 6  # generated examples, plus the explicit ones
MIN_REACHED = 6  # accepted examples at least; in each, every (command, field) pair of FLOWS carries it


def _run(argv: list[str], capsys: Any) -> tuple[int, str, str]:
    from sparkctl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def _script_words(command: str) -> list[str]:
    """The script text of an `sh -c SCRIPT ...` command (after any `env K=V`)."""
    words = shlex.split(command)  # every command must split back: it was shlex-joined
    while words and words[0] == "env":
        words = words[1:]
        while words and "=" in words[0] and not words[0].startswith("-"):
            words = words[1:]
    return [words[i + 1] for i in range(len(words) - 1) if words[i] == "-c" and i >= 1 and words[i - 1] == "sh"]


def _stdin_is_script(command: str) -> bool:
    words = shlex.split(command)
    return words[:2] == ["sh", "-s"] or words[:2] == ["python3", "-"]


def _carries(nodes: LocalNodes, start: int, value: str) -> bool:
    for sent in nodes.sent[start:]:
        stdin = sent.stdin.decode("utf-8", "replace")
        if value in stdin or any(value in w for w in shlex.split(sent.command) if not sent.command.startswith("<")):
            return True
    return False


def _no_value_in_scripts(nodes: LocalNodes, values: dict[str, str]) -> None:
    for sent in nodes.sent:
        if sent.command.startswith("<sftp"):
            continue
        for script in _script_words(sent.command):
            for field, value in values.items():
                assert value not in script, f"{field}'s value is inside a script: {sent.command[:300]}"
        if _stdin_is_script(sent.command):
            stdin = sent.stdin.decode("utf-8", "replace")
            for field, value in values.items():
                assert value not in stdin, f"{field}'s value is inside the script sent to `{sent.command[:80]}`"


def _canaries(root: Path, nodes: LocalNodes | None, cwd: Path) -> list[str]:
    places = [root / f"canary-{TOKEN}", cwd / f"rel-{TOKEN}"]
    if nodes is not None:
        places += [nodes.home(n) / f"rel-{TOKEN}" for n in NODES]
        places += [nodes.home(n) / ".sparkctl" / "t" / f"rel-{TOKEN}" for n in NODES]
    return [str(p) for p in places if p.exists()]


def _one_example(monkeypatch: pytest.MonkeyPatch, capsys: Any, raw: dict[str, str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="sparkctl-hostile-"))
    abs_canary, rel_canary = root / f"canary-{TOKEN}", f"rel-{TOKEN}"
    values = {f: FIELDS[f] + v.replace("{abs}", str(abs_canary)).replace("{rel}", rel_canary) for f, v in raw.items()}
    model_name = values["MODEL"].replace("/", "_").replace("\x00", "")[:200]
    values["MODEL"] = model_name
    model = root / "models" / model_name
    write_model(model, 1_000_000, 2)
    write_serving(model)
    extra = f"--chat-template={values['VLLM_EXTRA_ARGS']}"
    env = {"NODES": " ".join(NODES), "MODEL": str(model), "RECIPE": "lab", "CLUSTER_NAME": "t",
           "FABRIC_SUBNET": "10.232.0.0/24", "PORT": str(free_port()), "SERVED_MODEL_NAME": values["SERVED_MODEL_NAME"],
           "STANDIN_HOSTILE": values["STANDIN_HOSTILE"], "HF_TOKEN": values["HF_TOKEN"],
           "VLLM_EXTRA_ARGS": shlex.quote(extra)}
    cwd = root / "cwd"
    cwd.mkdir()
    with monkeypatch.context() as mp:
        mp.chdir(cwd)
        for k in ("SPARKCTL_ENV_FILE", "TP", "DCP", "VLLM_API_KEY"):
            mp.delenv(k, raising=False)
        for k, v in env.items():
            mp.setenv(k, v)
        with local_nodes(mp, root / "lab", NODES) as nodes:
            code, _, err = _run(["config"], capsys)
            if code != 0:  # refused up front: one error line, and every command refuses before any SSH
                assert code == 2 and "Traceback" not in err and len([ln for ln in err.splitlines()
                                                                      if ln.startswith("error:")]) == 1, err
                for argv in COMMANDS:
                    assert _run(argv, capsys)[0] == 2, argv
                assert nodes.sent == []
                assert _canaries(root, nodes, cwd) == []
                return
            ACCEPTED["all"] += 1
            stored = {f: v.strip() for f, v in values.items()}
            stored["VLLM_EXTRA_ARGS"] = extra  # one quoted word: kept whole, spaces included
            for argv in COMMANDS:
                name = " ".join(a for a in argv if a.startswith(("-", "")) and not a.isdigit()
                                and a not in ("--tail", "--rank", "--timeout"))
                name = {"logs -f": "logs --rank -f"}.get(name, name)
                start = len(nodes.sent)
                t0 = time.monotonic()
                code, out, err = _run(argv, capsys)
                TIMES[name] += time.monotonic() - t0
                assert "Traceback" not in out + err and "internal error" not in err, (argv, err)
                assert code in (0, 1), (argv, code, err)
                for f, v in stored.items():
                    if v and _carries(nodes, start, v if f != "MODEL" else str(model)):
                        REACHED[(name, f)] += 1
                        assert f in FLOWS.get(name, set()), f"{name} carried {f} to a node"
                if name == "up":
                    assert code == 0, err
                    _arrived_verbatim(nodes, model, stored)
            assert _canaries(root, nodes, cwd) == [], "a value ran as code"
            _no_value_in_scripts(nodes, {f: v for f, v in stored.items() if v and f != "MODEL"} |
                                 {"MODEL": str(model)})


def _arrived_verbatim(nodes: LocalNodes, model: Path, stored: dict[str, str]) -> None:
    # the service's ranks (build's version probes, `run --rm --entrypoint python3`, are not the service)
    runs = [c["argv"] for c in nodes.docker_calls() if c["argv"][:1] == ["run"] and "--rm" not in c["argv"]]
    assert len(runs) == len(NODES)
    for argv in runs:
        assert argv[argv.index("--served-model-name") + 1] == stored["SERVED_MODEL_NAME"]
        assert stored["VLLM_EXTRA_ARGS"] in argv
        assert str(model) in argv  # `vllm serve MODEL`
        assert not any(stored["HF_TOKEN"] in w for w in argv), "a secret on a command line"
    for rank, n in enumerate(NODES):
        text = (nodes.home(n) / ".sparkctl" / "t" / f"rank{rank}.env").read_text()
        assert f"\nSTANDIN_HOSTILE={stored['STANDIN_HOSTILE']}\n" in "\n" + text
        assert f"\nHF_TOKEN={stored['HF_TOKEN']}\n" in "\n" + text


EXPLICIT = {f: "$(touch {abs}) `touch {abs}`; touch {rel} && x | y > {abs} '\" * ${IFS}" for f in FIELDS}


def test_hostile_values_reach_every_command_as_data(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    REACHED.clear()
    ACCEPTED.clear()

    @settings(max_examples=EXAMPLES, phases=[Phase.explicit, Phase.generate])  # no shrinking: slow
    @given(raw=st.fixed_dictionaries({f: hostile for f in FIELDS}))
    @example(raw=EXPLICIT)
    @example(raw={**EXPLICIT, "MODEL": "$(touch {rel})"})
    def examples(raw: dict[str, str]) -> None:
        _one_example(monkeypatch, capsys, raw)

    examples()
    counts = {f"{c} <- {f}": REACHED[(c, f)] for c, fs in FLOWS.items() for f in sorted(fs)}
    print(json.dumps({"accepted_examples": ACCEPTED["all"], "reached": counts, "seconds": TIMES}, indent=1))
    # README: "each value reached each command it flows into in all [accepted] examples"
    assert ACCEPTED["all"] >= MIN_REACHED, ACCEPTED
    missing = {k: v for k, v in counts.items() if v != ACCEPTED["all"]}
    assert not missing, f"these commands saw a hostile value in fewer than all {ACCEPTED['all']} accepted " \
                        f"examples: {missing}"


@pytest.mark.parametrize("nodes_value", ["spark1;touch x", "$(id)", "spark1 `id`", "-oProxyCommand=x", "a b"])
def test_a_hostile_node_alias_is_refused_before_any_connection(monkeypatch: pytest.MonkeyPatch, capsys: Any,
                                                                tmp_path: Path, nodes_value: str) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NODES", f"{nodes_value} spark2 spark3 spark4")
    monkeypatch.setenv("MODEL", str(write_model(tmp_path / "m", 1_000_000, 2)))
    monkeypatch.setenv("RECIPE", "lab")
    with local_nodes(monkeypatch, tmp_path / "lab", NODES) as nodes:
        for argv in COMMANDS:
            code, out, err = _run(argv, capsys)
            assert code == 2 and "Traceback" not in err, (argv, err)
        assert nodes.sent == []
    assert not os.path.exists(tmp_path / "x")
