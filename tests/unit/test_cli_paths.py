"""Command paths nothing else tested: `plan --node-memory` and `lab down --purge`.

`lab down --purge` is tested here up to the cache it drops: the lab's image cache has one fixed place
(/var/cache/sparkctl-lab, shared by everyone on the machine), so the real purge is not run by tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_cli as run
from tests.conftest import write_model

GB = 1_000_000_000


@pytest.fixture
def lab_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.chdir(tmp_path)
    for k in ("SPARKCTL_ENV_FILE", "TP", "DCP", "NODE_MEMORY_BYTES"):
        monkeypatch.delenv(k, raising=False)
    model = write_model(tmp_path / "m", 40 * GB, 4)
    monkeypatch.setenv("NODES", "spark1 spark2 spark3 spark4")
    monkeypatch.setenv("MODEL", str(model))
    monkeypatch.setenv("RECIPE", "lab")
    return model


def test_plan_node_memory_decides_the_fit(lab_model: Path, capsys: Any) -> None:
    code, out, err = run(["--json", "plan", "--local"], capsys)
    assert code == 0, err
    default = json.loads(out)["plan"]
    assert default["fits"] is True and default["node_memory_bytes"] == 128 * GB  # the recipe's NODE_MEMORY_BYTES
    code, out, err = run(["--json", "plan", "--local", "--node-memory", str(20 * GB)], capsys)
    assert code == 1, out
    assert "does not fit" in err and "9.8 GB short" in err
    small = json.loads(out)["plan"]  # --json still prints the plan that was refused
    assert small["fits"] is False and small["node_memory_bytes"] == 20 * GB
    code, out, err = run(["--json", "plan", "--local", "--node-memory", str(1000 * GB)], capsys)
    plan = json.loads(out)["plan"]
    assert code == 0 and plan["node_memory_bytes"] == 1000 * GB
    assert plan["kv_cache_memory_bytes"] == default["kv_cache_memory_bytes"]  # the KV cache is explicit, not a share
    code, _, err = run(["plan", "--local", "--node-memory", "lots"], capsys)
    assert code == 2 and "Traceback" not in err


def test_lab_down_purge_reaches_the_cache_and_only_with_purge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              capsys: Any) -> None:
    from sparkctl.lab import image, manage

    seen: list[bool] = []
    monkeypatch.setattr(manage, "down", lambda purge=False: seen.append(purge))
    assert run(["lab", "down"], capsys)[0] == 0
    assert run(["lab", "down", "--purge"], capsys)[0] == 0
    assert seen == [False, True]

    cache = tmp_path / "cache"
    (cache / "sub").mkdir(parents=True)
    (cache / "base-bookworm.tar").write_bytes(b"x")
    neighbour = tmp_path / "keep.tar"
    neighbour.write_bytes(b"y")
    monkeypatch.setattr(image, "CACHE_DIR", cache)
    image.purge_cache()
    assert not cache.exists() and neighbour.exists()
    image.purge_cache()  # nothing there: still fine
