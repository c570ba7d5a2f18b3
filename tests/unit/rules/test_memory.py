"""memory.py's pure rules at their edges (what its mutation run, bench/mutation.py, showed untested).

Each test here was seen red on the one mutant it names in docs/mutations.md (issue-32m)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from sparkctl.facts import node_facts as F
from sparkctl.rules import memory

ROOT = Path(__file__).resolve().parents[3]
GB10 = F.parse_nvidia_smi_query("NVIDIA GB10, 580.95.05, [N/A], 12.1, 1\n")
CID = "ab" * 32


@pytest.mark.parametrize("setting", ["0", "no", "false", "off", "yes", "2", "10"])
def test_drop_caches_is_on_only_for_1_or_auto(setting: str) -> None:
    """DROP_CACHES other than 1 / auto never drops the page cache, on unified memory or not."""
    assert memory.drop_caches_on(setting, True) is False
    assert memory.drop_caches_on(setting, False) is False
    assert memory.drop_caches_on(" AUTO ", True) is True and memory.drop_caches_on("", True) is True


def _facts(free: int | None, available: int | None, cache: int | None) -> F.NodeFacts:
    m = F.MemInfo(total_bytes=10**12, available_bytes=available, free_bytes=free, cache_bytes=cache)
    return F.NodeFacts(meminfo=m, gpus=GB10, gpu_apps=[])


def test_memory_that_fits_exactly_is_back_and_one_byte_short_is_not() -> None:
    need = memory.NodeMemory(1000, unified=True, drop_caches=True)
    assert memory.not_back(_facts(600, None, 400), need) is None
    assert memory.not_back(_facts(600, None, 399), need)
    # no MemFree: MemAvailable stands in; neither: nothing is free
    assert memory.not_back(_facts(None, 1000, 0), need) is None
    assert memory.not_back(_facts(None, None, 1000), need) is None
    assert memory.not_back(_facts(None, None, 999), need)
    # no cache figure: none counts
    assert memory.not_back(_facts(1000, None, None), need) is None
    assert memory.not_back(_facts(999, None, None), need)


def test_describe_puts_the_largest_first_and_unsized_last() -> None:
    apps = [F.GpuApp(1, "a", 1), F.GpuApp(2, "b", None), F.GpuApp(3, "c", 3)]
    assert re.findall(r"pid (\d)", memory.describe(apps)) == ["3", "1", "2"]


def test_the_fix_names_each_holder_the_way_it_is_freed() -> None:
    """Another cluster's container: its `sparkctl down`, never `docker stop`; an unnamed container: its
    12-character ID; a bare process: its pid; no `stop pid` step when every one is in a container."""
    other = F.GpuApp(1, "a", 1, container_id="cd" * 32, container_cluster="prod")
    unnamed = F.GpuApp(2, "b", 1, container_id=CID)
    bare = F.GpuApp(3, "c", 1)
    fix = memory.foreign_fix("n1", [other, unnamed])
    assert "CLUSTER_NAME=prod" in fix and f"`docker stop {CID[:12]}` on n1" in fix
    assert fix.count("docker stop") == 1 and "stop pid" not in fix
    fix = memory.foreign_fix("n1", [bare, unnamed])
    assert "stop pid 3 on n1" in fix and "stop pid 2" not in fix and fix.count("docker stop") == 1
    assert memory.where(unnamed) == f", container {CID[:12]}"


def test_node_memory_is_immutable() -> None:
    m = memory.NodeMemory(1, True, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.drop_caches = False  # type: ignore[misc]


def test_the_wait_default_is_the_one_the_env_example_documents() -> None:
    text = (ROOT / "env/env.tp4.example").read_text()
    assert f"#MEMORY_WAIT_S={memory.DEFAULT_WAIT_S:g}\n" in text


def test_the_fix_quotes_what_a_node_named(tmp_path: Path) -> None:
    """A container's name and its cluster label come from the node: the commands the fix names are pasted into
    a shell, so each value is one quoted word there and runs nothing."""
    import shlex
    import subprocess

    canary = tmp_path / "canary"
    for tool in ("docker", "sparkctl"):  # stand-ins that do nothing: only the shell's reading is tested
        (tmp_path / tool).write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / tool).chmod(0o755)
    other = F.GpuApp(1, "a", 1, container_id="cd" * 32, container_cluster=f"p $(touch {canary})")
    named = F.GpuApp(2, "b", 1, container_id=CID, container_name=f"t;touch {canary}")
    fix = memory.foreign_fix("n1", [other, named])
    commands = re.findall(r"`([^`]+)`", fix)
    for cmd in commands:
        subprocess.run(["sh", "-c", cmd], env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True, timeout=10,
                       check=False)
    assert not canary.exists(), fix
    assert sorted(shlex.split(c) for c in commands) == [
        [f"CLUSTER_NAME=p $(touch {canary})", "sparkctl", "down"], ["docker", "stop", f"t;touch {canary}"]], fix
