"""Hostile values never execute, on real SSH and Docker.

Hypothesis builds node aliases, model paths, served names, env values (STANDIN_* passthrough, HF_TOKEN)
and extra vLLM args out of shell syntax — spaces, quotes, newlines, `;`, `&&`, `$(touch CANARY)`,
backticks, globs, non-ASCII — and runs the real CLI with them. For every value:
  - no canary file appears: not in this machine's /tmp (the lab hosts share it), not in any host's home
    (the remote shell's working directory), not in the CLI's working directory, not inside a container;
  - the value is either refused with exit 2 and one clear line, or it works as data: it shows up verbatim
    where it belongs (`config --json`, `render --json`, the container's argv or environment);
  - no traceback, no "internal error", never exit 1 for input sparkctl refuses.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sparkctl.lab.state import HostPaths
from sparkctl.spec.settings import parse_vllm_extra_args
from tests.kit.lab import Lab

pytestmark = pytest.mark.lab

NODES = ["spark1", "spark2", "spark3", "spark4"]
CLUSTER = {"CLUSTER_NAME": "hostile", "PORT": "18901", "MASTER_PORT": "39511"}
TOKEN = uuid.uuid4().hex[:10]
CANARY = f"/tmp/sparkctl-canary-{TOKEN}"
REL_CANARY = f"sparkctl-canary-rel-{TOKEN}"  # relative: lands in whatever directory a shell runs in

FRAGMENTS = [f"$(touch {CANARY})", f"`touch {CANARY}`", f"; touch {CANARY}", f"&& touch {CANARY}",
             f"| touch {CANARY}", f"\ntouch {CANARY}\n", f"> {CANARY}", f"$(touch {REL_CANARY})",
             f"';touch {CANARY};'", f'";touch {CANARY};"', "\\", "*", "?", "[ab]", "~", "$HOME", "${IFS}", " ",
             "ünï ☃ 名前", "\t", "-", "--", "#", "!", "%s", "{}", "=", ","]
# What can reach the process environment: no NUL, no lone surrogates.
plain = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
hostile = st.lists(st.sampled_from(FRAGMENTS) | plain, min_size=1, max_size=4).map("".join)
# The same without control characters: values sparkctl accepts, so every example runs the commands.
printable = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=12)
accepted = st.lists(st.sampled_from([f for f in FRAGMENTS if "\n" not in f and "\t" not in f]) | printable,
                    min_size=1, max_size=4).map("".join)

# Every example runs real commands: a modest count, and no shrinking (a failure prints its example as is).
LAB_SETTINGS = settings(max_examples=30, deadline=None, phases=[Phase.explicit, Phase.generate],
                        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def pins(lab: Lab) -> dict[str, str]:
    return lab.pin_knobs(NODES)


def sk(lab: Lab, cwd: Path, *args: str, env: dict[str, str] | None = None,
       timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {**lab.env(), "NODES": " ".join(NODES), **CLUSTER, **(env or {})}
    return subprocess.run([sys.executable, "-m", "sparkctl", *args], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def canaries(lab: Lab, cwd: Path) -> list[str]:
    places = [Path(CANARY), cwd / REL_CANARY, Path.cwd() / REL_CANARY]
    for n in lab.names:
        home = HostPaths.of(n, lab.root).home
        places += [home / REL_CANARY, home / ".sparkctl" / CLUSTER["CLUSTER_NAME"] / REL_CANARY]
    return [str(p) for p in places if p.exists()]


def assert_clean_outcome(r: subprocess.CompletedProcess[str], ok: tuple[int, ...] = (0, 2)) -> None:
    text = r.stdout + r.stderr
    assert "Traceback" not in text and "internal error" not in text, text
    assert r.returncode in ok, f"exit {r.returncode}\n{text}"
    if r.returncode == 2:
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, r.stderr  # one clear line (a `fix:` line may follow it)


@pytest.fixture
def work(chain: Lab, tmp_path: Path) -> Iterator[tuple[Lab, Path]]:
    lab = chain
    sk(lab, tmp_path, "down", timeout=60)
    try:
        yield lab, tmp_path
    finally:
        sk(lab, tmp_path, "lock", "--force-unlock", timeout=30)
        sk(lab, tmp_path, "down", timeout=60)
        Path(CANARY).unlink(missing_ok=True)


# ------------------------------------------------------------------------- offline commands + check


KEYS = ["NODES", "MODEL", "SERVED_MODEL_NAME", "STANDIN_HOSTILE", "HF_TOKEN", "VLLM_EXTRA_ARGS",
        "VLLM_EXTRA_ARGS_QUOTED"]


PER_KEY = 5  # examples per key (every key gets its own: a sampled key could miss one)


@pytest.mark.parametrize("key", KEYS)
def test_hostile_values_in_config_plan_render_check(work: tuple[Lab, Path], key: str) -> None:
    ran: dict[str, int] = {}

    @settings(LAB_SETTINGS, max_examples=PER_KEY)
    @given(value=hostile)
    def examples(value: str) -> None:
        _config_plan_render_check(work, key, value, ran)

    examples()
    assert ran.get("config", 0) == PER_KEY and ran.get("check", 0) == PER_KEY, ran


def _config_plan_render_check(work: tuple[Lab, Path], key: str, value: str, ran: dict[str, int]) -> None:
    lab, cwd = work
    env = pins(lab)
    knob = "VLLM_EXTRA_ARGS" if key.startswith("VLLM") else key
    if key == "NODES":
        env["NODES"] = f"spark1 {value} spark3 spark4"
    elif key == "MODEL":
        env["MODEL"] = "/models/" + value
    elif key == "VLLM_EXTRA_ARGS_QUOTED":  # the value as one quoted word: it must arrive as exactly that word
        env["VLLM_EXTRA_ARGS"] = shlex.quote(f"--chat-template={value}")
    else:
        env[key] = value
    stored = env[knob].strip()  # sparkctl trims surrounding whitespace of every value

    config = sk(lab, cwd, "--json", "config", env=env)
    ran["config"] = ran.get("config", 0) + 1
    assert_clean_outcome(config)
    if config.returncode == 0:
        shown = json.loads(config.stdout)["settings"][knob]["value"]
        if key == "HF_TOKEN":
            assert shown == ("[REDACTED]" if stored else "")
        elif key == "NODES":
            assert shown == stored.split()
        else:
            assert shown == stored
    elif key == "VLLM_EXTRA_ARGS_QUOTED":  # one quoted word is refused only for control characters
        assert any(ord(c) < 32 or ord(c) == 127 for c in value), config.stderr

    # The other commands load the same settings: refused the same way, or run with the value as data.
    plan = sk(lab, cwd, "--json", "plan", env=env)
    assert_clean_outcome(plan, (0, 2) if config.returncode == 0 else (2,))
    render = sk(lab, cwd, "--json", "render", "--out", str(cwd / "env.tp4"), env=env)
    assert_clean_outcome(render, (0, 2) if config.returncode == 0 else (2,))
    if render.returncode == 0:
        for r in json.loads(render.stdout)["ranks"]:
            argv = r["docker_argv"]
            if key == "SERVED_MODEL_NAME":
                assert argv[argv.index("--served-model-name") + 1] == stored
            if key == "VLLM_EXTRA_ARGS_QUOTED":
                assert f"--chat-template={value}" in argv
            if key == "VLLM_EXTRA_ARGS" and stored:
                words = parse_vllm_extra_args(stored)
                assert argv[argv.index("--trust-remote-code") + 1:][:len(words)] == words
            if key == "STANDIN_HOSTILE":
                assert r["env"]["STANDIN_HOSTILE"] == stored
            if key == "HF_TOKEN" and stored:
                assert r["env"]["HF_TOKEN"] == "[REDACTED]"
                assert not any(stored in w for w in argv) or len(stored) < 4
    # check talks to every node; a model path that is not there is a failed check (exit 1), not a crash.
    check = sk(lab, cwd, "check", env=env)
    ran["check"] = ran.get("check", 0) + 1
    assert_clean_outcome(check, (0, 1, 2) if key in ("MODEL", "NODES") and config.returncode == 0 else
                         (0, 2) if config.returncode == 0 else (2,))
    assert canaries(lab, cwd) == []


# ------------------------------------------------------------------------------ up, wait, inspect


def container_view(lab: Lab, node: str, name: str) -> dict[str, Any]:
    r = lab.docker(node, "inspect", name)
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)[0]
    return doc


LIFECYCLE_EXAMPLES = 8


def test_accepted_hostile_values_run_as_data(work: tuple[Lab, Path]) -> None:
    """Values sparkctl accepts (no control characters), so that every example reaches up, wait,
    status and down; the count is asserted."""
    ran: dict[str, int] = {}

    @settings(LAB_SETTINGS, max_examples=LIFECYCLE_EXAMPLES)
    @given(served=accepted.map(lambda v: f"srv {v}"),  # a served name may not start with '-'
           standin=accepted, token=accepted.map(lambda v: f"hf_{TOKEN}{v}"), arg=accepted)
    def examples(served: str, standin: str, token: str, arg: str) -> None:
        _run_as_data(work, served, standin, token, arg, ran)

    examples()
    assert ran == dict.fromkeys(("up", "wait", "status", "down"), LIFECYCLE_EXAMPLES), ran


def _run_as_data(work: tuple[Lab, Path], served: str, standin: str, token: str, arg: str,
                 ran: dict[str, int]) -> None:
    lab, cwd = work
    env = {"SERVED_MODEL_NAME": served, "STANDIN_HOSTILE": standin, "HF_TOKEN": token,
           "VLLM_EXTRA_ARGS": shlex.quote(f"--chat-template={arg}")}
    config = sk(lab, cwd, "config", env=env)
    assert_clean_outcome(config)
    if config.returncode != 0:  # refused up front: up refuses the same way, and starts nothing
        up = sk(lab, cwd, "up", env=env)
        assert_clean_outcome(up, (2,))
        assert canaries(lab, cwd) == []
        return
    up = sk(lab, cwd, "up", env=env)
    assert_clean_outcome(up, (0,))
    ran["up"] = ran.get("up", 0) + 1
    try:
        wait = sk(lab, cwd, "wait", "--timeout", "60", env=env)
        assert_clean_outcome(wait, (0,))
        ran["wait"] = ran.get("wait", 0) + 1
        for rank, node in enumerate(NODES):
            c = container_view(lab, node, f"sparkctl-hostile-rank{rank}")
            args, cenv = c["Args"], c["Config"]["Env"]
            assert args[args.index("--served-model-name") + 1] == served.strip()
            assert f"--chat-template={arg}" in args
            assert f"STANDIN_HOSTILE={standin.strip()}" in cenv
            if token.strip():
                assert f"HF_TOKEN={token.strip()}" in cenv
                assert not any(token.strip() in a for a in [*args, c["Path"]])
            probe = lab.docker(node, "exec", c["Id"], "sh", "-c",
                               f"ls {shlex.quote(CANARY)} {shlex.quote(REL_CANARY)} /root/{REL_CANARY} 2>/dev/null; true")
            assert probe.stdout.strip() == "", f"canary inside {node}'s container: {probe.stdout}"
        status = sk(lab, cwd, "--json", "status", env=env)
        assert_clean_outcome(status, (0,))
        assert served.strip() in json.loads(status.stdout)["head"]["models"]
        ran["status"] = ran.get("status", 0) + 1
    finally:
        down = sk(lab, cwd, "down", env=env)
        assert_clean_outcome(down, (0,))
        ran["down"] = ran.get("down", 0) + 1
    assert canaries(lab, cwd) == []


def test_a_hostile_model_path_that_exists_is_served_as_data(work: tuple[Lab, Path]) -> None:
    """A model folder whose name is shell syntax, at the same path on every host (they share /tmp)."""
    lab, cwd = work
    holder = Path(f"/tmp/sparkctl-hostile-{TOKEN}")
    model = holder / f"m $(touch {REL_CANARY}) `touch {REL_CANARY}`; ü* '&&x"
    holder.mkdir()
    model.symlink_to("/models/lab")  # each host resolves it to its own /models/lab
    try:
        env = {"MODEL": str(model)}
        # every command that passes MODEL into a remote script: the checkpoint scan, the chain probe
        for args in (("--json", "plan"), ("check",), ("verify-model",), ("build", "--dry-run")):
            r = sk(lab, cwd, *args, env=env)
            assert_clean_outcome(r, (0,))
            assert canaries(lab, cwd) == [], args
        up = sk(lab, cwd, "up", env=env)
        assert_clean_outcome(up, (0,))
        wait = sk(lab, cwd, "wait", "--timeout", "60", env=env)
        assert_clean_outcome(wait, (0,))
        c = container_view(lab, "spark2", "sparkctl-hostile-rank1")
        assert c["Args"][1] == str(model)
        assert any(m.get("Destination") == str(model) and m.get("RW") is False for m in c["Mounts"])
    finally:
        sk(lab, cwd, "down", env={"MODEL": str(model)}, timeout=60)
        model.unlink(missing_ok=True)
        holder.rmdir()
    assert canaries(lab, cwd) == []
