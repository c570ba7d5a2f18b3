"""The installed wheel carries its templates, images and recipes, and works from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True, capture_output=True, timeout=120,
    )
    (whl,) = out.glob("sparkctl_launcher-*.whl")
    return whl


def test_wheel_contains_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "sparkctl/_data/templates/env.tp4.j2" in names
    assert "sparkctl/recipes/glm53-exl3-tp4.toml" in names
    assert "sparkctl/recipes/lab.toml" in names
    assert "sparkctl/data/vllm-serve-flags.json" in names  # VLLM_EXTRA_ARGS and the stand-in read it
    assert any(n.startswith("sparkctl/_data/images/") for n in names)


def _shipped(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def test_wheel_holds_every_file_of_the_package_and_its_data(wheel: Path) -> None:
    """Everything the code loads beside itself (probes, recipes and layouts, data/*.json, the lab's Dockerfiles
    and scripts, templates, images) is in the wheel that `pip install .`, `pipx install .` or `uv tool install .`
    builds from the repository: every file under launcher/sparkctl/ at its place, templates/ and images/ under
    sparkctl/_data/."""
    names = set(zipfile.ZipFile(wheel).namelist())
    pkg = ROOT / "launcher" / "sparkctl"
    want = {f"sparkctl/{p.relative_to(pkg).as_posix()}" for p in _shipped(pkg)}
    for top in ("templates", "images"):
        want |= {f"sparkctl/_data/{top}/{p.relative_to(ROOT / top).as_posix()}" for p in _shipped(ROOT / top)}
    assert {n for n in want if n.rpartition("/")[2] not in (".gitignore",)} - names == set()
    for kind in ("probes/node_facts.sh", "probes/ckpt_scan.py", "recipes/layouts/tiny.json", "data/recipe.schema.json",
                 "data/events.schema.json", "lab/ckpt_serving/Dockerfile.keys3", "lab/nvidia_smi_help_query.txt"):
        assert f"sparkctl/{kind}" in names, kind


def test_installed_wheel_renders_from_another_directory(wheel: Path, tmp_path: Path, model_308: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=120)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(target),  # the wheel first; dependencies come from this interpreter's site-packages
        "NODES": "spark1 spark2 spark3 spark4",
        "MODEL": str(model_308),
        "VLLM_EXTRA_ARGS": "--max-num-seqs 8",  # checked against the wheel's vLLM flag table
        **{f"RANK{r}_{k}": v for r in range(4) for k, v in
           {"FABRIC_IP": f"192.168.100.{r + 1}", "CX7_IF": "enp1s0f0np0", "CX7_IB": "rocep1s0f0",
            "GID_INDEX": "3"}.items()},
    }
    code = "import sys; from sparkctl.cli import main; main(sys.argv[1:])"
    for args in (["plan"], ["config"], ["render", "--out", "out/env.tp4"]):
        r = subprocess.run([sys.executable, "-c", code, *args], cwd=elsewhere, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    import sparkctl.spec.resources as res

    r = subprocess.run([sys.executable, "-c", "import sparkctl.spec.resources as r; print(r.data_dir('templates'))"],
                       cwd=elsewhere, env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().startswith(str(target)), r.stdout
    assert res.data_dir("templates").is_dir()
    assert (elsewhere / "out" / "env.tp4").stat().st_mode & 0o777 == 0o600
