"""The README's quick start, pasted as it stands, takes the lab's four hosts from fresh (fabric ports cabled but
without addresses, nothing of setup's on them) to a serving model: every line exits 0, `deploy --yes` ends with
a real completion, and a second `setup` has nothing to change.

What differs from a new owner's Sparks is given in the environment, which wins over the env file the README
writes: the lab's checkpoint (MODEL), its recipe (RECIPE=lab: the stand-in engine, no GPU) and DROP_CACHES=0
(the lab's hosts share one page cache). NODES comes from the README's own file: the lab's hosts are spark1-4.
`./one-shot.sh` is this checkout's sparkctl; `setup --yes` writes into each host's own root (the lab's
SPARKCTL_SETUP_ROOT) and its netplan apply is the lab's stand-in over the real `netplan generate`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kit.lab import MODEL_PATH, Lab
from tests.lab.faults import fresh_fabric

pytestmark = pytest.mark.lab

ROOT = Path(__file__).resolve().parents[2]
LAB_KNOBS = {"MODEL": MODEL_PATH, "RECIPE": "lab", "DROP_CACHES": "0"}


def quick_start_block() -> str:
    """The first shell block under the README's "Quick start" heading."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Quick start"):]
    m = re.search(r"^```sh\n(.*?)^```", section, re.S | re.M)
    assert m, "the README's quick start has no ```sh block"
    return m.group(1)


@pytest.fixture
def workdir(lab: Lab, tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A folder standing for the user's checkout (`./one-shot.sh` runs this sparkctl) on a fresh lab; after the
    test, the service is taken down and the lab's fabric is as it was."""
    shim = tmp_path / "one-shot.sh"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m sparkctl "$@"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in lab.env().items() if k != "SPARKCTL_ENV_FILE"}
    env |= LAB_KNOBS | {"XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONPATH": str(ROOT / "launcher")}
    with fresh_fabric(lab):
        try:
            yield tmp_path, env
        finally:
            subprocess.run([sys.executable, "-m", "sparkctl", "down"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)


def test_the_readme_quick_start_serves_on_a_fresh_lab(workdir: tuple[Path, dict[str, str]]) -> None:
    cwd, env = workdir
    block = quick_start_block()
    assert "./one-shot.sh setup --yes" in block and "./one-shot.sh deploy --yes" in block
    script = "set -euo pipefail\n" + block
    r = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, input="y\n" * 8, capture_output=True,
                       text=True, timeout=1500)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    assert (cwd / "env" / "cluster.env").exists()
    assert "completion" in (r.stdout + r.stderr).lower()

    again = subprocess.run([sys.executable, "-m", "sparkctl", "--json", "setup"], cwd=cwd, env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["changes"] == [], "a second setup still has changes"
    status = subprocess.run([sys.executable, "-m", "sparkctl", "--json", "status"], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert status.returncode == 0, status.stdout[-2000:] + status.stderr[-2000:]
    assert os.path.exists(cwd / "env" / "cluster.env")
