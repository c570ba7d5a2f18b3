"""The env file a user runs with is input, never output: `render`, `check` and `up` leave it byte for byte
(env/env.tp4 named by --env-file or SPARKCTL_ENV_FILE, by another spelling of its path, through a
symlink, or as a hard link), and the env.tp4 they write carries every key the loaded settings set but no
secret's value. Local nodes (tests/unit/localnodes.py) run every command `check` and `up` send."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dotenv import dotenv_values

from tests.conftest import run_cli as run
from tests.unit.localnodes import LocalNodes, served_scene

NODES = ["spark1", "spark2", "spark3", "spark4"]
KEY = "sk-SECRETenvTp4q9"
HF = "hf_SECRETenvTp4z1"
# What a user keeps in the file besides what the renderer writes: secrets, passthrough overrides, knobs.
USER_LINES = (
    "# my cluster\n"
    f"VLLM_API_KEY={KEY}\n"
    f"HF_TOKEN={HF}\n"
    'CONTAINER_ENV_PREFIXES="STANDIN_ NCCL_"\n'
    "NCCL_IB_TIMEOUT=22\n"
    "NCCL_DEBUG=INFO\n"
    "WATCH_MAX_RESTARTS=7\n"
    "ARGV_JUDGE_TIMEOUT_S=90\n"
)


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalNodes]:
    with served_scene(monkeypatch, tmp_path, NODES, {}) as ln:
        yield ln


def _rendered_once(capsys: Any) -> bytes:
    """env/env.tp4 as `check` writes it (the pins it found on the nodes), then the user's own lines added:
    the file a user who followed the README's `--env-file env/env.tp4` keeps."""
    code, _, err = run(["check", "--render"], capsys)  # some checks fail on local nodes: --render writes it
    assert code in (0, 1) and "wrote env/env.tp4" in _, err
    path = Path("env/env.tp4")
    data = path.read_bytes() + USER_LINES.encode()
    path.write_bytes(data)
    return data


CASES = [
    *((["render"], how) for how in ("--env-file", "SPARKCTL_ENV_FILE", "another spelling", "symlink", "hard link")),
    (["check", "--render"], "--env-file"), (["check", "--render"], "hard link"),
    (["up"], "SPARKCTL_ENV_FILE"), (["up"], "symlink"),
]


@pytest.mark.parametrize(("argv", "how"), CASES, ids=[f"{a[0]}-{h.replace(' ', '-')}" for a, h in CASES])
def test_the_loaded_env_file_is_never_rewritten(nodes: LocalNodes, capsys: Any, monkeypatch: pytest.MonkeyPatch,
                                                argv: list[str], how: str) -> None:
    before = _rendered_once(capsys)
    tp4 = Path("env/env.tp4")
    loaded = tp4
    if how in ("symlink", "hard link"):  # the user's file is elsewhere; env/env.tp4 is another name of it
        loaded = Path("mine.env")
        tp4.rename(loaded)
        (tp4.symlink_to(loaded.resolve()) if how == "symlink" else os.link(loaded, tp4))
    name = {"another spelling": "./env/../env/env.tp4"}.get(how, str(loaded))
    if how == "SPARKCTL_ENV_FILE":
        monkeypatch.setenv("SPARKCTL_ENV_FILE", name)
        glob: list[str] = []
    else:
        glob = ["--env-file", name]
    code, out, err = run([*glob, *argv], capsys)
    assert code == 0 or (code == 1 and argv[0] == "check"), err
    assert loaded.read_bytes() == before, f"{argv} rewrote the env file it read"
    assert tp4.read_bytes() == before
    assert "it is the env file" in err and str(tp4) in err  # said, not silent
    assert "--render writes it anyway" not in out  # and nothing says otherwise
    if argv == ["up"]:  # and the service got the key the file holds
        assert f"VLLM_API_KEY={KEY}" in (nodes.home("spark1") / ".sparkctl" / "t" / "rank0.env").read_text()
    assert KEY not in out + err and HF not in out + err


def test_env_tp4_carries_every_key_that_was_set_but_no_secret(nodes: LocalNodes, capsys: Any) -> None:
    Path("mine.env").write_bytes(_rendered_once(capsys))
    code, _, err = run(["--env-file", "mine.env", "render", "--out", "out.tp4"], capsys)
    assert code == 0, err
    text = Path("out.tp4").read_text()
    got = dotenv_values(stream=io.StringIO(text))
    assert got["NCCL_IB_TIMEOUT"] == "22" and got["NCCL_DEBUG"] == "INFO"
    assert got["CONTAINER_ENV_PREFIXES"] == "STANDIN_ NCCL_"
    assert got["WATCH_MAX_RESTARTS"] == "7" and got["ARGV_JUDGE_TIMEOUT_S"] == "90"
    assert got["DROP_CACHES"] == "0" and got["MEMORY_WAIT_S"] == "0"  # set in the environment (localnodes)
    assert KEY not in text and HF not in text and "VLLM_API_KEY" not in got and "HF_TOKEN" not in got
    assert "left out here: HF_TOKEN, VLLM_API_KEY." in text  # named, for whoever loads it again
    # reloaded (with the secrets given another way), it renders the same service: the same config hash
    code, out1, _ = run(["--env-file", "mine.env", "--json", "render", "--out", "a.tp4"], capsys)
    Path("b.env").write_text(text + f"VLLM_API_KEY={KEY}\nHF_TOKEN={HF}\n")
    code2, out2, err2 = run(["--env-file", "b.env", "--json", "render", "--out", "b.tp4"], capsys)
    assert code == code2 == 0, err2
    assert json.loads(out1)["config_hash"] == json.loads(out2)["config_hash"]


# Key names: a key is A-Z, 0-9 and '_' (not starting with a digit), so no key can start a new line in a file
# sparkctl writes (a rank's env file, env.tp4, the systemd unit).
BAD_KEYS = ["NCCL_X\nLD_PRELOAD", "NCCL_A B", "NCCL_X=Y", "nccl_lower", "NCCL_É", "9NCCL",
            "NCCL_$(id)", "RANK0_FABRIC_IP\n"]


def _quoted(key: str) -> str:
    return "'" + key.replace("\\", "\\\\").replace("'", "\\'") + "'"


@pytest.mark.parametrize("key", BAD_KEYS)
def test_an_env_file_key_that_is_not_a_name_is_refused_naming_the_file_and_key(clean_env: dict[str, str],
                                                                               capsys: Any, key: str) -> None:
    from dotenv import dotenv_values as read

    Path("x.env").write_text(f'NODES="a b c d"\nMODEL=/m\nCONTAINER_ENV_PREFIXES=NCCL_\n{_quoted(key)}=/tmp/evil.so\n')
    assert key in read("x.env")  # python-dotenv does read it as that key
    for argv in (["config"], ["render"], ["up"]):
        code, out, err = run(["--env-file", "x.env", *argv], capsys)
        assert code == 2, (argv, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "env file x.env" in lines[0] and repr(key) in lines[0], err
        assert "/tmp/evil.so" not in out + err


def test_a_key_that_is_not_a_name_never_reaches_a_rank_env_file(clean_env: dict[str, str]) -> None:
    from sparkctl.errors import UsageError
    from sparkctl.spec.builders import env_file_text
    from sparkctl.spec.settings import known_key, load_settings

    # the environment's odd keys are not sparkctl's: never known, never passed on
    s = load_settings(environ={"NODES": "a b c d", "MODEL": "/m", "CONTAINER_ENV_PREFIXES": "NCCL_",
                               "NCCL_X\nLD_PRELOAD": "/tmp/evil.so", "NCCL_OK": "1"})
    assert s.passthrough_env() == {"NCCL_OK": "1"}
    assert not known_key("RANK0_FABRIC_IP\n") and not known_key("SKIP_X\n") and known_key("SKIP_X")
    # and the writer refuses one whatever hands it over
    for key in ("NCCL_X\nLD_PRELOAD", "NCCL_X\rLD_PRELOAD", "A B", "A=B", ""):
        with pytest.raises(UsageError):
            env_file_text({key: "1"})
    assert env_file_text({"NCCL_OK": "1", "lower_ok": "2"}) == "NCCL_OK=1\nlower_ok=2\n"


def test_a_recipe_container_env_key_that_is_not_a_name_is_refused(clean_env: dict[str, str], tmp_path: Path) -> None:
    from sparkctl.errors import UsageError
    from sparkctl.spec.recipes import load_recipe

    shipped = Path(load_recipe("lab").path).read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(shipped.replace("[container.env]\n", '[container.env]\n"A\\nLD_PRELOAD" = "x"\n'))
    with pytest.raises(UsageError) as exc:
        load_recipe(str(bad))
    assert "'A\\nLD_PRELOAD'" in exc.value.message and "\n" not in exc.value.message


@pytest.mark.parametrize("line", ['VLLM_API_KEY="sk-unclosed', "VLLM_API_KEY 'sk-x'", "VLLM_API_KEY = 'sk-x' junk"])
def test_a_line_python_dotenv_cannot_parse_is_refused_not_dropped(clean_env: dict[str, str], capsys: Any,
                                                                   line: str) -> None:
    Path("x.env").write_text(f'NODES="a b c d"\nMODEL=/m\n{line}\nTP=4\n')
    code, out, err = run(["--env-file", "x.env", "config"], capsys)
    assert code == 2, err  # before: the line was dropped with python-dotenv's log line, and the key unset
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "env file x.env line 3" in lines[0] and "sk-" not in err, err
