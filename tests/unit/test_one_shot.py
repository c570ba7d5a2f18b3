"""one-shot.sh's bootstrap installs what the verb needs and no more, and its help lists sparkctl's commands.

The script runs for real (bash), offline, against a stand-in venv (SPARKCTL_VENV): its `python` logs the pip
commands it is given and its `sparkctl` says what it was asked. The stamp (pyproject.toml's hash, then the
extras installed) decides: a production command installs `.` alone, demo and `lab` the lab's extra, test every
extra; a venv that has more satisfies less, and one that lacks an extra gets it with what it had.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "one-shot.sh"
ALL = "lab,llama-benchy,test"


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    v = tmp_path / "venv"
    (v / "bin").mkdir(parents=True)
    (v / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/pip.log\n')
    (v / "bin" / "sparkctl").write_text('#!/bin/sh\nif [ "$1" = --help ]; then echo "Usage: sparkctl [OPTIONS] '
                                        'COMMAND [ARGS]..."; echo "  check  Preflight every node"; exit 0; fi\n'
                                        'echo "sparkctl stub: $*"\n')
    for f in ("python", "sparkctl"):
        (v / "bin" / f).chmod(0o755)
    return v


def one_shot(venv: Path, *args: str, source: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "SPARKCTL_VENV": str(venv), "PYTHON": sys.executable, "HOME": str(venv)}
    argv = ["bash", "-c", f"source {SCRIPT}; {source}"] if source else ["bash", str(SCRIPT), *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=venv)


def installs(venv: Path) -> list[str]:
    """The `pip install -e` of every bootstrap so far (the spec installed), then forgets them."""
    log = venv.parent / "pip.log"
    lines = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return [ln.split(" -e ", 1)[1] for ln in lines if " -e " in ln]


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    """Whether the process is gone (killed, and reaped by init once its parent exited) within the time."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def stamp(venv: Path) -> list[str]:
    return (venv / ".sparkctl-stamp").read_text().splitlines()


def test_a_sparkctl_command_installs_sparkctl_alone_and_runs(venv: Path) -> None:
    r = one_shot(venv, "status", "--json")
    assert r.returncode == 0 and r.stdout == "sparkctl stub: status --json\n", r.stderr
    assert installs(venv) == [str(ROOT)]  # `.`: no extra
    assert stamp(venv)[1:] in ([], [""])
    assert one_shot(venv, "status").returncode == 0 and installs(venv) == []  # stamped: nothing again


def test_each_verb_gets_its_extras_and_a_fuller_venv_satisfies_a_lesser_one(venv: Path) -> None:
    assert one_shot(venv, "lab", "status").returncode == 0
    assert installs(venv) == [f"{ROOT}[lab]"] and stamp(venv)[1] == "lab"
    assert one_shot(venv, "status").returncode == 0 and installs(venv) == []  # lab has what status needs
    r = one_shot(venv, source="bootstrap $(extras_for test)")  # what `./one-shot.sh test` bootstraps
    assert r.returncode == 0, r.stderr
    assert installs(venv) == [f"{ROOT}[{ALL}]"] and stamp(venv)[1] == "lab llama-benchy test"
    for verb in ("demo", "lab", "status"):
        assert one_shot(venv, source=f"bootstrap $(extras_for {verb})").returncode == 0
    assert one_shot(venv, "bench", "--tool", "llama-benchy").returncode == 0
    assert installs(venv) == []


def test_an_extra_the_venv_lacks_is_added_to_what_it_has(venv: Path) -> None:
    assert one_shot(venv, "lab", "status").returncode == 0 and installs(venv) == [f"{ROOT}[lab]"]
    assert one_shot(venv, "bench", "--tool", "llama-benchy").returncode == 0
    assert installs(venv) == [f"{ROOT}[lab,llama-benchy]"]
    assert one_shot(venv, "bench").returncode == 0 and installs(venv) == []


def test_a_changed_pyproject_reinstalls_what_the_venv_had(venv: Path) -> None:
    (venv / ".sparkctl-stamp").write_text("0000000000000000\nlab\n")
    assert one_shot(venv, "status").returncode == 0
    assert installs(venv) == [f"{ROOT}[lab]"] and stamp(venv)[0] != "0000000000000000"


def test_a_stamp_from_before_extras_were_chosen_stands_for_every_extra(venv: Path) -> None:
    digest = subprocess.run(["sh", "-c", f"sha256sum < {ROOT}/pyproject.toml | cut -c1-16"], capture_output=True,
                            text=True, check=True).stdout.strip()
    (venv / ".sparkctl-stamp").write_text(digest + "\n")  # that bootstrap installed [test,lab,llama-benchy]
    assert one_shot(venv, source="bootstrap $(extras_for test)").returncode == 0
    assert one_shot(venv, "lab", "status").returncode == 0 and installs(venv) == []


@pytest.mark.parametrize(("args", "code"), [(["--help"], 0), (["-h"], 0), (["help"], 0), ([], 2)])
def test_help_shows_the_scripts_verbs_then_sparkctls_commands(venv: Path, args: list[str], code: int) -> None:
    r = one_shot(venv, *args)
    assert r.returncode == code, r.stderr
    out = r.stdout
    assert "./one-shot.sh demo" in out and "./one-shot.sh test" in out
    assert out.index("./one-shot.sh test") < out.index("Usage: sparkctl [OPTIONS] COMMAND")
    assert "check  Preflight every node" in out and "set -euo" not in out
    assert installs(venv) == [str(ROOT)]  # the help made the venv sparkctl's commands need, no more


def test_the_exit_trap_of_the_venv_builds_keeps_a_green_run_green(venv: Path, tmp_path: Path) -> None:
    """The trap that ends the background venv builds runs under `set -e` when the test run ends: builds that
    finished long ago (kill fails on them) must leave the exit status 0, one still running is killed, and the
    folder of their logs is removed either way."""
    logs = tmp_path / "builds"
    logs.mkdir()
    r = one_shot(venv, source=f"sleep 0 & done=$!; wait $done; sleep 30 & running=$!; echo $running; "
                              f"trap \"end_builds '{logs}' $done $running\" EXIT; true")
    assert r.returncode == 0, r.stderr
    assert not logs.exists()
    running = int(r.stdout.split()[0])
    assert wait_gone(running), "the build still running was not killed"
    r = one_shot(venv, source=f"trap \"end_builds '{logs}'\" EXIT; false")  # SKIP_*: no build; a red run stays red
    assert r.returncode == 1
