"""A wrong NCCL pin on one rank fails `up` + `wait` naming that rank (the stand-in checks NCCL_IB_HCA and
NCCL_IB_GID_INDEX against the host's infiniband tree, as NCCL does).

The wrong pin comes in the way it does in the field: a recipe that pins NCCL for every rank in its
[container.env] (which wins over the per-rank pins `up` discovers), on a cluster where one rank differs:
spark3 carries its fabric address on the second port (rocep1s0f1), spark2's RoCE v2 entry is index 5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkctl.spec.resources import recipes_dir
from tests.kit.lab import Lab
from tests.lab.test_lifecycle_lab import clean, sk  # noqa: F401 - the fixture, and the CLI runner

pytestmark = pytest.mark.lab


NODES = ["spark1", "spark2", "spark3", "spark4"]


@pytest.mark.parametrize(("pin", "rank", "nccl_says"), [
    ('NCCL_IB_HCA = "rocep1s0f0"', 2, "Last error: NET/IB"),
    ('NCCL_IB_GID_INDEX = "3"', 1, "Last error: NET/IB : ibv_modify_qp failed with 110"),
])
def test_a_wrong_nccl_pin_fails_up_and_wait_naming_the_rank(clean: Lab, tmp_path: Path, pin: str, rank: int,  # noqa: F811
                                                            nccl_says: str) -> None:
    lab = clean
    text = (recipes_dir() / "lab.toml").read_text()
    assert "[container.env]\n" in text
    recipe = tmp_path / "lab-pinned.toml"
    recipe.write_text(text.replace("[container.env]\n", f"[container.env]\n{pin}\n"))
    env = {"RECIPE": str(recipe)}
    # `check` sees it first: the recipe's pin wins over what it discovers on that one rank
    checked = sk(lab, "--json", "check", env=env, timeout=300)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    found = {f["node"]: f for f in json.loads(checked.stdout)["findings"] if f["check"] == "pin-env"}
    assert sorted(found) == NODES, found
    assert [n for n in NODES if found[n]["status"] == "fail"] == [NODES[rank]], found
    assert pin.split(" = ")[0] in found[NODES[rank]]["fix"], found[NODES[rank]]
    up = sk(lab, "up", env=env)
    out = up.stdout + up.stderr
    if up.returncode == 0:  # the rank died after up's look at the containers: wait must see it
        wait = sk(lab, "wait", "--timeout", "60", env=env)
        assert wait.returncode == 1, wait.stdout + wait.stderr
        out = wait.stdout + wait.stderr
    else:
        assert up.returncode == 1
    blamed = [r for r, n in enumerate(NODES) if f"rank {r} ({n}) exited" in out or f"rank {r} on {n} died" in out]
    assert blamed == [rank], out
    assert nccl_says in out and "DistBackendError" in out, out
