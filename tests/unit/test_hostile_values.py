"""Hostile knob values, offline: each is refused with one clear UsageError or travels as exactly one
argv word / one env line, and every remote command line splits back into exactly the argv it came from.

(The lab proves the same on real SSH and Docker: tests/lab/test_hostile_lab.py.)
"""

from __future__ import annotations

import collections
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkctl.cluster import remote_command
from sparkctl.errors import UsageError
from sparkctl.spec.builders import docker_run_argv, env_file_text, open_api_warning, rank_specs
from sparkctl.spec.planner import make_plan, read_checkpoint
from sparkctl.spec.settings import REDACTED, load_settings, parse_vllm_extra_args

PINS = {f"RANK{r}_{k}": v for r in range(4) for k, v in
        (("FABRIC_IP", f"10.0.0.{r + 1}"), ("CX7_IF", "enp1s0f0np0"), ("CX7_IB", "rocep1s0f0"), ("GID_INDEX", "3"))}
NODES = "spark1 spark2 spark3 spark4"
HOSTILE = ["; touch /tmp/CANARY", "&& touch /tmp/CANARY", "$(touch /tmp/CANARY)", "`touch /tmp/CANARY`",
           "' \" \\", "*", "?[a]", "a b", "ünï ☃", "-x", "--port 1", "\n", "\x00", "x\ty", "$HOME", "|| id",
           "> /tmp/CANARY", "\\$(id)"]
hostile = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=40),
                    st.lists(st.sampled_from(HOSTILE), min_size=1, max_size=3).map("".join))
SLOW_OK = settings(max_examples=80, deadline=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def model(tmp_path: Path) -> Path:
    from tests.conftest import write_model

    return write_model(tmp_path / "m", 1_000_000_000, 2)


def _load(model: Path, extra: dict[str, str]) -> Any:
    return load_settings(cli={}, environ={"NODES": NODES, "MODEL": str(model), **PINS,
                                          "CONTAINER_ENV_PREFIXES": "STANDIN_", **extra})


def _argvs(s: Any, model: Path) -> list[list[str]]:
    plan = make_plan(s, read_checkpoint(model))
    specs = rank_specs(s, plan, [s.rank_pins(r) for r in range(4)])
    return [docker_run_argv(s, spec, "h") for spec in specs], specs  # type: ignore[return-value]


def _one_line_error(exc: UsageError, key: str) -> None:
    """One line that names the key (the fix, if any, is separate)."""
    assert len(exc.message.splitlines()) == 1 and exc.message.strip(), exc.message
    assert key in exc.message, exc.message


def _through_a_real_shell(command: str) -> list[str]:
    """What a POSIX shell (this machine's sh, as sshd would run it) makes of `command`: its argv."""
    r = subprocess.run(["sh", "-c", "printf '%s\\0' " + command], capture_output=True, timeout=30, check=True)
    return r.stdout.decode("utf-8", "surrogateescape").split("\0")[:-1]


KEYS = ["SERVED_MODEL_NAME", "STANDIN_HOSTILE", "HF_TOKEN", "VLLM_EXTRA_ARGS"]
PER_KEY = 40  # derandomized (tests/conftest.py's profile): the same 40 values per key on every run
MIN_ACCEPTED = 10  # of them, how many at least must be accepted and so travel (the rest are refused)


@pytest.mark.parametrize("key", KEYS)
def test_a_hostile_value_is_refused_or_travels_as_one_word(clean_env: Any, model: Path, key: str) -> None:
    """Each key gets its own PER_KEY examples (a sampled key could starve one); the outcome counts are
    asserted, so that "travels as one word" is proven on accepted values, not only on refusals."""
    outcome: collections.Counter[str] = collections.Counter()

    # Raw shell syntax is mostly refused as VLLM_EXTRA_ARGS (a word must be a --long-flag or its
    # value), so that key also gets it as a flag's quoted value: the form that must travel verbatim.
    values = hostile | hostile.map(lambda v: "--chat-template " + shlex.quote(v)) if key == "VLLM_EXTRA_ARGS" \
        else hostile

    @settings(SLOW_OK, max_examples=PER_KEY)
    @given(value=values)
    def examples(value: str) -> None:
        outcome[_one_value(model, key, value)] += 1

    examples()
    print(f"{key}: {dict(outcome)}")
    assert sum(outcome.values()) == PER_KEY and outcome["accepted"] >= MIN_ACCEPTED, dict(outcome)


def _one_value(model: Path, key: str, value: str) -> str:
    if key == "HF_TOKEN":  # distinctive, so that finding it in an argv word means it leaked
        value = "hf_Zq9xK" + value
    try:
        s = _load(model, {key: value})
        argvs, specs = _argvs(s, model)
        env_files = [(len(spec.env), env_file_text(spec.env)) for spec in specs]
    except UsageError as exc:
        _one_line_error(exc, key)
        if key == "HF_TOKEN":
            assert "hf_Zq9xK" not in str(exc)
        return "refused"
    stored = value.strip()
    for argv in argvs:
        # What crosses SSH is remote_command(argv): the real shell must split it back into exactly argv.
        assert _through_a_real_shell(remote_command(argv)) == argv
        if key == "SERVED_MODEL_NAME":
            i = argv.index("--served-model-name")
            assert argv[i + 1] == stored
        if key == "VLLM_EXTRA_ARGS" and stored:
            words = shlex.split(stored)  # the referee: POSIX word splitting, nothing expanded
            tail = argv[len(argv) - len(words) - (1 if "--headless" in argv else 0):][:len(words)]
            assert tail == words
        if key == "HF_TOKEN" and stored:
            assert not any(stored in word for word in argv), "a secret on a command line"
    if key == "STANDIN_HOSTILE" or (key == "HF_TOKEN" and stored):
        for entries, text in env_files:
            # docker --env-file splits lines at \n only: one line per variable, this one verbatim
            assert f"\n{key}={stored}\n" in "\n" + text and text.count("\n") == entries
    return "accepted"


@pytest.mark.parametrize(("text", "expected"), [
    ("--max-num-seqs 8", ["--max-num-seqs", "8"]),
    ("--chat-template '/t/a b.jinja' --seed=-1", ["--chat-template", "/t/a b.jinja", "--seed=-1"]),
    ("--chat-template '$(touch /tmp/c)' --tool-call-parser `id`';'", ["--chat-template", "$(touch /tmp/c)",
                                                                       "--tool-call-parser", "`id`;"]),
    ("--enforce-eager", ["--enforce-eager"]),
])
def test_extra_args_are_words_never_code(text: str, expected: list[str]) -> None:
    assert parse_vllm_extra_args(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("8 --max-num-seqs", "each value must follow a --flag"),
    ("-tp 2", "full --long-names"),
    ("--Max-Num-Seqs 2", "full --long-names"),
    ("--seed -1", "full --long-names"),
    ("--port 9", "sparkctl sets --port from PORT"),
    ("--max-model 9", "vLLM takes it as --max-model-len"),
    ("--api-key sk-1", "VLLM_API_KEY"),
    ("--api-k=sk-1", "VLLM_API_KEY"),
    ("--chat-template 'unclosed", "cannot be split"),
    ("-- x", "full --long-names"),
])
def test_extra_args_rules(clean_env: Any, model: Path, text: str, expected: str) -> None:
    with pytest.raises(UsageError) as exc:
        _load(model, {"VLLM_EXTRA_ARGS": text})
    assert expected in exc.value.message and "VLLM_EXTRA_ARGS" in exc.value.message
    assert len(exc.value.message.splitlines()) == 1


def test_extra_args_follow_the_recipes_and_precede_headless(clean_env: Any, model: Path) -> None:
    s = _load(model, {"VLLM_EXTRA_ARGS": "--max-num-seqs 8 --chat-template '/t/a b'"})
    argvs, _ = _argvs(s, model)
    assert argvs[0][-4:] == ["--max-num-seqs", "8", "--chat-template", "/t/a b"]
    assert argvs[1][-5:] == ["--max-num-seqs", "8", "--chat-template", "/t/a b", "--headless"]


@pytest.mark.parametrize(("environ", "expected"), [
    ({"SERVED_MODEL_NAME": "--port"}, "must not start with '-'"),
    ({"MODEL": '/models/a"b'}, "docker --mount cannot bind"),
    ({"HF_TOKEN": "hf_sec\nret"}, "HF_TOKEN (from environment) must not contain a newline or NUL (value not shown)"),
    ({"SERVED_MODEL_NAME": "a\nb"}, "SERVED_MODEL_NAME='a\\nb' (from environment) must not contain control"),
])
def test_refusals_name_the_key_on_one_line(clean_env: Any, model: Path, environ: dict[str, str],
                                           expected: str) -> None:
    with pytest.raises(UsageError) as exc:
        _load(model, environ)
    assert expected in exc.value.message
    assert len(exc.value.message.splitlines()) == 1, exc.value.message
    assert "hf_sec" not in str(exc.value)


def test_a_secret_is_never_in_a_validation_error_about_another_key(clean_env: Any, model: Path) -> None:
    with pytest.raises(UsageError) as exc:
        _load(model, {"HF_TOKEN": "hf_topsecret", "VLLM_API_KEY": "sk-topsecret", "TP": "3"})
    assert "topsecret" not in str(exc.value)
    s = _load(model, {"HF_TOKEN": "hf_topsecret"})
    assert s.describe("HF_TOKEN") == f"HF_TOKEN={REDACTED} (from environment)"


def test_open_api_warning(clean_env: Any, model: Path) -> None:
    assert "without an API key" in (open_api_warning(_load(model, {})) or "")
    assert open_api_warning(_load(model, {"VLLM_API_KEY": "k"})) is None
    assert open_api_warning(_load(model, {"VLLM_EXTRA_ARGS": "--host 127.0.0.1"})) is None
    assert open_api_warning(_load(model, {"VLLM_EXTRA_ARGS": "--host=10.0.0.1"})) is not None
