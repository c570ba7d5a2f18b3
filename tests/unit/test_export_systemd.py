"""`export systemd` pins the recipe that ran, so a restart runs that recipe and no other.

A recipe given as a file (`--recipe ./tuned/lab.toml`, `RECIPE=./tuned/lab`) must not reach the unit as its
name (a restart would then run the shipped recipe of that name, with its own defaults) nor as a relative path
(systemd runs the unit in /). The install copies the recipe's bytes -- a file's, or a shipped one's, which
a later sparkctl may change -- to the node and points `--recipe` at that copy; `--print` names the file by its
absolute path. The SSH side is recorded here, then the recorded install scripts really run under `sh` in a
folder standing in for / (a fake `id` and `systemctl` on PATH): this machine's /etc is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster import RunResult
from sparkctl.orchestrate import export_systemd
from sparkctl.spec.recipes import load_recipe
from sparkctl.spec.systemd_unit import RECIPE_DIR, UNIT_DIR, unquote_exec
from tests.conftest import run_cli

TUNED_PORT = "8471"  # the file's recipe says 8471; the shipped `lab` says 8888


@dataclass
class Recorded:
    runs: list[tuple[list[str], bytes]] = field(default_factory=list)
    exit_code: int = 0


@pytest.fixture
def scene(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Recorded:
    """Settings for a 4-node cluster `u` in the environment, a tuned copy of the shipped `lab` recipe (same
    name, another PORT) at tuned/lab.toml and tuned/lab-noext, and a Cluster that records what it would run."""
    monkeypatch.chdir(tmp_path)
    for k in ("SPARKCTL_ENV_FILE", "TP", "DCP", "PORT", "RECIPE", "VLLM_API_KEY", "HF_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"NODES": "n1 n2 n3 n4", "MODEL": str(tmp_path / "model"), "CLUSTER_NAME": "u"}.items():
        monkeypatch.setenv(k, v)
    shipped = Path(load_recipe("lab").path).read_text()
    assert "\nPORT = 8888\n" in shipped
    (tmp_path / "tuned").mkdir()
    for name in ("lab.toml", "lab-noext"):
        (tmp_path / "tuned" / name).write_text(shipped.replace("\nPORT = 8888\n", f"\nPORT = {TUNED_PORT}\n"))
    rec = Recorded()

    class FakeNode:
        def run(self, argv: list[str], *, stdin: bytes = b"", timeout: float = 0) -> RunResult:
            rec.runs.append((list(argv), bytes(stdin)))
            return RunResult("", "", rec.exit_code, 0.1)

    class FakeCluster:
        def __init__(self, nodes: list[str], ssh_config: Any) -> None:
            self.nodes = nodes

        def __enter__(self) -> FakeCluster:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def node(self, name: str) -> FakeNode:
            assert name == "n1"
            return FakeNode()

    monkeypatch.setattr(export_systemd, "Cluster", FakeCluster)
    # The cluster lock the install takes is test_lock_scope.py's subject; here it takes nothing.
    monkeypatch.setattr(export_systemd, "lock_cluster", lambda *a, **k: contextlib.nullcontext())
    return rec


def _exec_start(unit: str) -> list[str]:
    line = next(ln for ln in unit.splitlines() if ln.startswith("ExecStart="))
    return unquote_exec(line.removeprefix("ExecStart="))


def _recipe_arg(unit: str) -> str:
    argv = _exec_start(unit)
    return argv[argv.index("--recipe") + 1]


def _sandbox(root: Path, uid: int = 0) -> dict[str, str]:
    """PATH with an `id` that says `uid` and a `systemctl` that logs its arguments."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {root}/systemctl.log\n')
    for f in ("id", "systemctl"):
        (bin_dir / f).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def _run_in(root: Path, runs: list[tuple[list[str], bytes]], uid: int = 0) -> list[int]:
    """Run the recorded install commands as the node would, every absolute /etc path moved under `root`."""
    env = _sandbox(root, uid)
    codes = []
    for argv, stdin in runs:
        assert argv[:2] == ["sh", "-c"]
        moved = [a.replace(RECIPE_DIR, f"{root}{RECIPE_DIR}").replace(UNIT_DIR, f"{root}{UNIT_DIR}") if i > 2 else a
                 for i, a in enumerate(argv)]
        codes.append(subprocess.run(moved, input=stdin, env=env, capture_output=True, timeout=30).returncode)
        if codes[-1]:
            break
    return codes


@pytest.mark.parametrize("given", ["tuned/lab.toml", "./tuned/lab-noext"])
def test_a_recipe_file_is_installed_beside_the_unit_and_the_unit_runs_that_copy(
        scene: Recorded, capsys: Any, tmp_path: Path, given: str) -> None:
    code, out, err = run_cli(["--recipe", given, "--json", "export", "systemd"], capsys)
    assert code == 0, err
    (recipe_argv, recipe_in), (unit_argv, unit_in) = scene.runs
    unit = unit_in.decode()
    copy = _recipe_arg(unit)
    assert copy.startswith(f"{RECIPE_DIR}/u/recipe-") and copy.endswith(".toml"), copy
    assert copy in recipe_argv and copy in unit_argv and json.loads(out)["recipe"] == copy
    assert recipe_in == (tmp_path / given).read_bytes()  # the bytes of the file that ran, not the shipped lab
    # The scripts, for real: the copy (0600 in a 0700 folder), then the unit, then systemctl.
    root = tmp_path / "node"
    assert _run_in(root, scene.runs) == [0, 0]
    installed = Path(f"{root}{copy}")
    assert installed.read_bytes() == recipe_in
    assert stat.S_IMODE(installed.stat().st_mode) == 0o600
    assert stat.S_IMODE(installed.parent.stat().st_mode) == 0o700
    assert Path(f"{root}{UNIT_DIR}/sparkctl-watch-u.service").read_text() == unit
    assert (root / "systemctl.log").read_text().splitlines() == ["daemon-reload",
                                                                "enable --now -- sparkctl-watch-u.service"]
    # What a restart runs: the copy's recipe, with the file's PORT.
    recipe = load_recipe(str(installed))
    assert recipe.name == "lab" and str(recipe.defaults["PORT"]) == TUNED_PORT


def test_a_shipped_recipe_is_pinned_by_its_content_too(scene: Recorded, capsys: Any, tmp_path: Path) -> None:
    """A later sparkctl may change the shipped recipe: the unit runs the bytes that ran today."""
    code, _, err = run_cli(["--recipe", "lab", "export", "systemd"], capsys)
    assert code == 0, err
    (_, recipe_in), (_, unit_in) = scene.runs
    assert recipe_in == Path(load_recipe("lab").path).read_bytes()
    assert _recipe_arg(unit_in.decode()).startswith(f"{RECIPE_DIR}/u/recipe-")


def test_installing_another_recipe_leaves_the_running_units_copy_until_the_unit_is_replaced(
        scene: Recorded, capsys: Any, tmp_path: Path) -> None:
    root = tmp_path / "node"
    assert run_cli(["--recipe", "lab", "export", "systemd"], capsys)[0] == 0
    assert _run_in(root, scene.runs) == [0, 0]
    old = Path(f"{root}{_recipe_arg(scene.runs[1][1].decode())}")
    scene.runs.clear()
    assert run_cli(["--recipe", "tuned/lab.toml", "export", "systemd"], capsys)[0] == 0
    new = Path(f"{root}{_recipe_arg(scene.runs[1][1].decode())}")
    assert new != old
    assert _run_in(root, scene.runs[:1]) == [0]  # the copy is written, the unit not yet: the old copy stays
    assert old.exists() and new.exists()
    assert _run_in(root, scene.runs[1:]) == [0]
    assert not old.exists() and sorted(p.name for p in new.parent.iterdir()) == [new.name]


def test_not_root_writes_nothing_and_says_so(scene: Recorded, capsys: Any, tmp_path: Path) -> None:
    assert run_cli(["--recipe", "tuned/lab.toml", "export", "systemd"], capsys)[0] == 0
    root = tmp_path / "node"
    assert _run_in(root, scene.runs, uid=1000) == [4]
    assert not (root / "etc").exists()
    scene.runs.clear()
    scene.exit_code = 4
    code, _, err = run_cli(["--recipe", "tuned/lab.toml", "export", "systemd"], capsys)
    assert code == 1 and "needs root on n1" in err and len(scene.runs) == 1, err


@pytest.mark.parametrize("given", ["tuned/lab.toml", "./tuned/lab-noext"])
def test_print_names_a_recipe_file_by_its_absolute_path(scene: Recorded, capsys: Any, tmp_path: Path,
                                                        given: str) -> None:
    code, out, err = run_cli(["--recipe", given, "export", "systemd", "--print"], capsys)
    assert code == 0, err
    assert _recipe_arg(out) == str((tmp_path / given).resolve())
    assert scene.runs == []


def test_print_names_a_shipped_recipe_by_name(scene: Recorded, capsys: Any) -> None:
    code, out, err = run_cli(["--recipe", "lab", "export", "systemd", "--print"], capsys)
    assert code == 0, err
    assert _recipe_arg(out) == "lab"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_installed_unit(scene: Recorded, capsys: Any, tmp_path: Path) -> None:
    assert run_cli(["--recipe", "./tuned/lab-noext", "export", "systemd"], capsys)[0] == 0
    path = tmp_path / "sparkctl-watch-u.service"
    path.write_bytes(scene.runs[1][1])
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if "sparkctl-watch-u" in ln]
    assert not complaints, r.stdout + r.stderr
