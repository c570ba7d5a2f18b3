"""`export systemd` pins the recipe that ran, so a restart runs that recipe and no other.

A recipe given as a file (`--recipe ./tuned/lab.toml`, `RECIPE=./tuned/lab`) must not reach the unit as its
name (a restart would then run the shipped recipe of that name, with its own defaults) nor as a relative path
(systemd runs the unit in /). The install copies the recipe's bytes -- a file's, or a shipped one's, which
a later sparkctl may change -- and the env file's to the node and points `--recipe` and `--env-file` at those
copies; `--print` prints that same unit. No path of this machine reaches the unit (the venv's sparkctl, the
env file, the ssh config): it runs on the head. The SSH side is recorded here, then the recorded install scripts really run under `sh` in a
folder standing in for / (a fake `id` and `systemctl` on PATH): this machine's /etc is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster import RunResult
from sparkctl.orchestrate import export_systemd
from sparkctl.spec.recipes import load_recipe
from sparkctl.spec.systemd_unit import RECIPE_DIR, SEARCH_PATH, UNIT_DIR, unquote_exec
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
    for k in ("SPARKCTL_ENV_FILE", "SPARKCTL_SSH_CONFIG", "TP", "DCP", "PORT", "RECIPE", "VLLM_API_KEY", "HF_TOKEN"):
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


def _sandbox(root: Path, uid: int = 0, sparkctl: bool = True) -> dict[str, str]:
    """PATH with an `id` that says `uid` and a `systemctl` that logs its arguments; `root/sbin` stands in for
    systemd's search path, with a `sparkctl` in it unless told otherwise."""
    bin_dir, sbin = root / "bin", root / "sbin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    sbin.mkdir(parents=True, exist_ok=True)
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {root}/systemctl.log\n')
    stubs = [bin_dir / "id", bin_dir / "systemctl"]
    if sparkctl:
        (sbin / "sparkctl").write_text("#!/bin/sh\nexit 0\n")
        stubs.append(sbin / "sparkctl")
    for f in stubs:
        f.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def _run_in(root: Path, runs: list[tuple[list[str], bytes]], uid: int = 0, sparkctl: bool = True) -> list[int]:
    """Run the recorded install commands as the node would, every absolute /etc path moved under `root`
    and systemd's search path for the unit's program replaced by `root/sbin`."""
    env = _sandbox(root, uid, sparkctl)
    codes = []
    for argv, stdin in runs:
        assert argv[:2] == ["sh", "-c"]
        moved = [a.replace(RECIPE_DIR, f"{root}{RECIPE_DIR}").replace(UNIT_DIR, f"{root}{UNIT_DIR}") if i > 2 else a
                 for i, a in enumerate(argv)]
        moved = [str(root / "sbin") if a == SEARCH_PATH else a for a in moved]
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


def _with_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cluster's settings in an env file (PORT in it), and this machine's ssh config in the environment."""
    env_file = tmp_path / "conf" / "cluster.env"
    env_file.parent.mkdir()
    env_file.write_text("PORT=8472\n")
    (tmp_path / "my_ssh_config").write_text("Host n1\n")
    monkeypatch.setenv("SPARKCTL_SSH_CONFIG", str(tmp_path / "my_ssh_config"))
    return env_file


@pytest.mark.parametrize("given", ["lab", "tuned/lab.toml", "./tuned/lab-noext"])
def test_print_shows_the_unit_the_install_writes_and_no_path_of_this_machine(
        scene: Recorded, capsys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str) -> None:
    env_file = _with_env_file(tmp_path, monkeypatch)
    argv = ["--env-file", str(env_file), "--recipe", given, "export", "systemd"]
    code, printed, err = run_cli([*argv, "--print"], capsys)
    assert code == 0, err
    assert scene.runs == []
    assert run_cli(argv, capsys)[0] == 0
    assert scene.runs[-1][1].decode() == printed  # --print is exactly what the install writes
    # MODEL is the same path on every node (the scene's is under tmp_path): every other line is the head's
    body = "\n".join(ln for ln in printed.splitlines() if not ln.startswith(("#", 'Environment="MODEL=')))
    assert str(tmp_path) not in body and sys.executable not in body and "my_ssh_config" not in body, body
    assert "SPARKCTL_SSH_CONFIG" not in body
    exec_argv = _exec_start(printed)
    assert exec_argv[0] == "sparkctl" and exec_argv[-1] == "watch"
    assert exec_argv[exec_argv.index("--env-file") + 1].startswith(f"{RECIPE_DIR}/u/cluster-")
    assert _recipe_arg(printed).startswith(f"{RECIPE_DIR}/u/recipe-")
    # the comment tells a person who installs it by hand which local file goes where
    assert f"<- {env_file}" in printed and f"<- {(tmp_path / given).resolve() if given != 'lab' else ''}" in printed


def test_the_env_file_is_installed_beside_the_unit_and_the_unit_reads_that_copy(
        scene: Recorded, capsys: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = _with_env_file(tmp_path, monkeypatch)
    code, out, err = run_cli(["--env-file", str(env_file), "--json", "export", "systemd"], capsys)
    assert code == 0, err
    (_, recipe_in), (env_argv, env_in), (_, unit_in) = scene.runs
    unit = unit_in.decode()
    argv = _exec_start(unit)
    copy = argv[argv.index("--env-file") + 1]
    assert copy in env_argv and env_in == env_file.read_bytes() and copy in json.loads(out)["files"]
    root = tmp_path / "node"
    assert _run_in(root, scene.runs) == [0, 0, 0]
    installed = Path(f"{root}{copy}")
    assert installed.read_bytes() == env_file.read_bytes()
    assert stat.S_IMODE(installed.stat().st_mode) == 0o600
    # another env file replaces the copy once its unit is installed; the recipe's copy stays
    env_file.write_text("PORT=8473\n")
    scene.runs.clear()
    assert run_cli(["--env-file", str(env_file), "export", "systemd"], capsys)[0] == 0
    assert _run_in(root, scene.runs) == [0, 0, 0]
    new = _exec_start(scene.runs[-1][1].decode())
    assert sorted(p.name for p in installed.parent.iterdir()) == sorted(
        Path(new[new.index(k) + 1]).name for k in ("--env-file", "--recipe"))


def test_a_head_without_sparkctl_is_refused_before_anything_is_written(
        scene: Recorded, capsys: Any, tmp_path: Path) -> None:
    assert run_cli(["export", "systemd"], capsys)[0] == 0
    root = tmp_path / "node"
    assert _run_in(root, scene.runs, sparkctl=False) == [6]
    assert not (root / "etc").exists()
    scene.runs.clear()
    scene.exit_code = 6
    code, _, err = run_cli(["export", "systemd"], capsys)
    assert code == 1 and "n1 has no sparkctl" in err and "--sparkctl PATH" in err and len(scene.runs) == 1, err


def test_sparkctl_and_the_heads_ssh_config_are_paths_on_the_head(scene: Recorded, capsys: Any, tmp_path: Path) -> None:
    code, out, err = run_cli(["export", "systemd", "--print", "--sparkctl", "/opt/sk/bin/sparkctl",
                              "--head-ssh-config", "/root/.ssh/cluster_config"], capsys)
    assert code == 0, err
    assert _exec_start(out)[0] == "/opt/sk/bin/sparkctl"
    assert 'Environment="SPARKCTL_SSH_CONFIG=/root/.ssh/cluster_config"' in out
    assert run_cli(["export", "systemd", "--sparkctl", "/opt/sk/bin/sparkctl"], capsys)[0] == 0
    root = tmp_path / "node"
    assert _run_in(root, scene.runs) == [6]  # that path is not on the (sandboxed) node
    code, _, err = run_cli(["export", "systemd", "--print", "--sparkctl", "venv/bin/sparkctl"], capsys)
    assert code == 2 and "absolute path" in err, err


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_the_installed_unit(scene: Recorded, capsys: Any, tmp_path: Path) -> None:
    # systemd-analyze checks that the program exists here: one that does stands in for the head's sparkctl
    assert run_cli(["--recipe", "./tuned/lab-noext", "export", "systemd", "--sparkctl", sys.executable],
                   capsys)[0] == 0
    path = tmp_path / "sparkctl-watch-u.service"
    path.write_bytes(scene.runs[1][1])
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"})
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if "sparkctl-watch-u" in ln]
    assert not complaints, r.stdout + r.stderr
