"""`sparkctl render` as a user runs it (the CLI, offline, MODEL on this machine): env.tp4 written 0600,
every rank's exact `docker run`, secrets redacted, and a prebuilt recipe without IMAGE refused."""

from __future__ import annotations

import json
import shlex
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import prebuilt_recipe, write_model
from tests.conftest import run_cli as run

NODES = "spark1 spark2 spark3 spark4"
PINS = {f"RANK{r}_{k}": v for r in range(4) for k, v in (
    ("FABRIC_IP", f"10.232.0.{r + 11}"), ("CX7_IF", "enp1s0f0np0"), ("CX7_IB", "rocep1s0f0"), ("GID_INDEX", "3"))}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.chdir(tmp_path)
    model = write_model(tmp_path / "model", 1_000_000, 2)
    for k in ("SPARKCTL_ENV_FILE", "IMAGE", "VLLM_API_KEY", "HF_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"NODES": NODES, "MODEL": str(model), "RECIPE": "lab", "VLLM_API_KEY": "sk-render-secret",
                 **PINS}.items():
        monkeypatch.setenv(k, v)
    return model


def test_render_writes_env_tp4_private_and_prints_every_ranks_command(env: Path, capsys: Any) -> None:
    code, out, err = run(["render", "--print-env"], capsys)
    assert code == 0, err
    target = Path("env/env.tp4")
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert "sk-render-secret" not in out + err + target.read_text()
    commands = [ln for ln in out.splitlines() if ln.startswith("docker run")]
    assert len(commands) == 4 and [f"# rank {r} on spark{r + 1}" in out for r in range(4)] == [True] * 4
    for r, line in enumerate(commands):
        argv = shlex.split(line)
        image = argv.index("sparkctl-lab/chain:keys3")
        assert argv[image - 2: image] == ["--entrypoint", "vllm"] and argv[image + 1: image + 3] == ["serve", str(env)]
        assert f"sparkctl.rank={r}" in argv
    assert "# rank 0 on spark1 (head)" in out and "(worker)" in out
    assert target.read_text() in out  # --print-env prints the file itself


def test_render_json_redacts_secrets_and_matches_the_file(env: Path, capsys: Any) -> None:
    code, out, err = run(["--json", "render", "--out", "custom.tp4"], capsys)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["env_tp4"] == "custom.tp4" and Path("custom.tp4").exists()
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    assert all(r["env"]["VLLM_API_KEY"] == "[REDACTED]" for r in doc["ranks"])
    assert "sk-render-secret" not in out


def test_render_of_a_prebuilt_recipe_needs_image(env: Path, capsys: Any, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RECIPE", str(prebuilt_recipe(tmp_path)))
    code, _, err = run(["render"], capsys)
    assert code == 2 and "IMAGE is not set: recipe lab-prebuilt runs a prebuilt image" in err
    assert not Path("env/env.tp4").exists()  # nothing half-written
    ref = "registry.example/serve@sha256:" + "e" * 64
    monkeypatch.setenv("IMAGE", ref)
    code, out, err = run(["render"], capsys)
    assert code == 0, err
    assert all(f"--entrypoint vllm {ref} serve" in ln for ln in out.splitlines() if ln.startswith("docker run"))
