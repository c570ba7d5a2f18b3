"""DROP_CACHES: the real drop script, run here with `id` and `sudo` stand-ins on PATH (so
this machine's page cache is never dropped): through `sudo -n` writing only drop_caches, or said and
audited and the start refused when sparkctl has no right to; never forced."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sparkctl.cluster import Results, RunResult
from sparkctl.errors import CheckFailed
from sparkctl.remote import service
from sparkctl.spec.settings import load_settings


class Node:
    def __init__(self, tmp: Path, sudo_ok: bool) -> None:
        self.name = "spark1"
        self.tmp = tmp
        self.audit: list[str] = []
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        stubs = {
            "id": "echo 1000",
            "sync": "exit 0",
            "sudo": f'printf "%s " "$@" > {tmp}/sudo-args; cat > {tmp}/sudo-stdin; exit {0 if sudo_ok else 1}',
        }
        for name, body in stubs.items():
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / name).chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def run(self, argv: list[str], *, timeout: float | None = None, stdin: bytes | None = None) -> Any:
        if argv[3] == "sparkctl-audit":
            self.audit += argv[5:]
            return RunResult("", "", 0, 0.0)
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30)
        self.rc = r.returncode
        return RunResult(r.stdout, r.stderr, r.returncode, 0.0)


class Cluster:
    def __init__(self, node: Node) -> None:
        self.nodes = {node.name: node}
        self.connected = list(self.nodes)

    def run_all(self, fn: Any, nodes: list[str]) -> Results[Any]:
        return Results({n: fn(self.nodes[n]) for n in nodes})


_LAST: dict[str, Node] = {}


def _drop(tmp: Path, sudo_ok: bool) -> tuple[Node, list[str]]:
    node = Node(tmp, sudo_ok)
    _LAST["node"] = node
    said: list[str] = []
    s = load_settings(environ={"NODES": "spark1", "TP": "1", "DCP": "1", "MODEL": "/models/x", "DROP_CACHES": "1"})
    service.drop_caches(Cluster(node), s, ["spark1"], said.append)  # type: ignore[arg-type]
    return node, said


def test_dropped_through_sudo_n_writing_only_that_file_and_audited(tmp_path: Path) -> None:
    node, said = _drop(tmp_path, sudo_ok=True)
    assert (tmp_path / "sudo-args").read_text().split() == ["-n", "tee", "/proc/sys/vm/drop_caches"]
    assert (tmp_path / "sudo-stdin").read_text().strip() == "3"
    assert len(said) == 1 and said[0].startswith("dropped the page cache on spark1 (sudo)")
    (line,) = node.audit
    assert json.loads(line)["action"] == "drop-caches" and "sudo" in json.loads(line)["detail"]


def test_without_root_or_sudo_it_refuses_the_start_audited_not_forced(tmp_path: Path) -> None:
    with pytest.raises(CheckFailed) as exc:
        _drop(tmp_path, sudo_ok=False)
    assert "could not be dropped on spark1" in exc.value.message
    assert service.DROP_CACHES_SUDOERS in (exc.value.fix or "")
    node = _LAST["node"]
    assert node.rc == 4
    (line,) = node.audit
    assert json.loads(line)["action"] == "drop-caches-refused" and "sudo -n" in json.loads(line)["detail"]


def test_parse_dropped() -> None:
    assert service.parse_dropped("x\ndropped root 100 300\n") == service.Dropped("root", 200 * 1024)
    assert service.parse_dropped("dropped sudo 300 100") == service.Dropped("sudo", 0)
    for bad in ("", "dropped maybe 1 2", "dropped root 1\n", "dropped root 1 2\nmore"):
        assert service.parse_dropped(bad) is None


def test_the_knob_is_auto_by_default_and_takes_only_auto_1_0() -> None:
    """auto (unset): on for unified-memory nodes only (memory.drop_caches_on, tested in test_memory_wait)."""
    s = load_settings(environ={"NODES": "spark1", "TP": "1", "DCP": "1", "MODEL": "/models/x"})
    assert s.get("DROP_CACHES", "auto") == "auto"
    with pytest.raises(Exception, match="DROP_CACHES"):
        load_settings(environ={"NODES": "spark1", "TP": "1", "DCP": "1", "MODEL": "/models/x", "DROP_CACHES": "yes"})
